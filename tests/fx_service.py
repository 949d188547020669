"""Fixtures for the HTTP service: one real Serve app on the module's real local Ray cluster
(tests/fx_ray.py), two tenants, a small quota for one, bounds small enough to reach; Serve is
shut down and every sandbox it made deleted at teardown."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789"}
# bob may hold one sandbox of at most 1 CPU and 1 GiB
BOB_QUOTA = "bob:sandboxes=1,cpu=1,memory=1Gi"
LIMITS = {"max_body_bytes": 64 * 1024, "max_file_bytes": 1 << 20, "max_wait_seconds": 5.0,
          "max_execs_per_sandbox": 4, "max_output_bytes": 64 * 1024,
          "stream_keepalive_seconds": 1.0, "max_fs_images": 1}


@dataclass(frozen=True)
class Service:
    url: str  # .../api/v1
    audit_log: Path

    def client(self, tenant: str = "alice", **kw) -> httpx.Client:
        headers = {"Authorization": f"Bearer {TOKENS[tenant]}"} if tenant else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def service(request, ray_cluster, tmp_path_factory) -> Iterator[Service]:
    """The module's service; a module may set ``SERVICE_QUOTAS`` (quota specs),
    ``SERVICE_REPLICAS`` and ``SERVICE_SETTINGS`` (more ServiceConfig fields) of its own."""
    from ray_sandbox import service as svc

    audit = tmp_path_factory.mktemp("service") / "audit.log"
    tokens = ",".join(f"{t}={v}" for t, v in TOKENS.items())
    quotas = getattr(request.module, "SERVICE_QUOTAS", (BOB_QUOTA,))
    replicas = getattr(request.module, "SERVICE_REPLICAS", replicas_default())
    settings = {**LIMITS, **getattr(request.module, "SERVICE_SETTINGS", {})}
    config = svc.from_env({"RAY_SANDBOX_API_TOKENS": tokens}, quotas=quotas, audit_log=audit,
                          num_replicas=replicas, **settings)
    url = svc.start(config, "127.0.0.1", free_port())
    try:
        wait_healthy(url)
        wait_replicas(replicas)
        yield Service(url, audit)
    finally:
        _delete_service_sandboxes()
        _delete_tenants_kept(Service(url, audit))
        svc.stop()


def wait_healthy(url: str, alive: Callable[[], object] = lambda: None,
                 limit: float = 120) -> None:
    """Until ``url``/health answers 200 (bounded); ``alive()`` fails the wait early (e.g. a
    server process that exited)."""
    deadline = time.monotonic() + limit
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        alive()
        assert time.monotonic() < deadline, f"the service did not come up in {limit:g} s"
        time.sleep(0.2)


def replicas_default() -> int:
    """Replicas of a module's service unless it says: RAY_SANDBOX_TEST_SERVICE_REPLICAS=2
    runs the contract tests against two (docs/service.md, "Multiple replicas")."""
    return int(os.environ.get("RAY_SANDBOX_TEST_SERVICE_REPLICAS", "1"))


def replica_actors() -> list[dict]:
    """The service's Serve replicas (their named actors)."""
    import ray

    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::") and "SandboxService" in a["name"]]


def wait_replicas(n: int, limit: float = 120) -> None:
    """Until Serve reports ``n`` running replicas of the service (bounded)."""
    from ray import serve

    from ray_sandbox.service import APP_NAME

    deadline = time.monotonic() + limit
    while True:
        app = serve.status().applications.get(APP_NAME)
        deployment = app.deployments.get("SandboxService") if app else None
        running = deployment.replica_states.get("RUNNING", 0) if deployment else 0
        if running == n:
            return
        assert time.monotonic() < deadline, f"{running} of {n} replicas ran in {limit:g} s"
        time.sleep(0.2)


def _delete_service_sandboxes() -> None:
    import ray

    import ray_sandbox
    from ray_sandbox.service._entry import TENANT_LABEL

    for tenant in TOKENS:
        handles = ray_sandbox.list({TENANT_LABEL: tenant})
        ray.get([h.terminate.remote() for h in handles], timeout=120)


def _delete_tenants_kept(service: Service) -> None:
    """What the module's tenants kept and never deleted (filesystem images, snapshots), deleted
    as a tenant does: the node's image store outlives the module's home."""
    for tenant in TOKENS:
        with service.client(tenant) as c:
            for kind, key in (("filesystem-images", "images"), ("snapshots", "snapshots")):
                listed = c.get(f"/{kind}")
                if listed.status_code != 200:
                    continue
                for item in listed.json().get(key, []):
                    c.delete(f"/{kind}/{str(item).rpartition('/')[2]}")


def poll(c: httpx.Client, path: str, pending: str, limit: float = 120) -> dict:
    """Long-poll ``path`` until its status is no longer ``pending`` (bounded)."""
    deadline = time.monotonic() + limit
    while True:
        r = c.get(path, params={"wait_seconds": 5})
        assert r.status_code == 200, r.text
        if r.json()["status"] != pending or time.monotonic() > deadline:
            return r.json()


def wait_running(c: httpx.Client, sandbox_id: str) -> dict:
    return poll(c, f"/sandboxes/{sandbox_id}", "pending")


def wait_exec(c: httpx.Client, sandbox_id: str, exec_id: str) -> dict:
    return poll(c, f"/sandboxes/{sandbox_id}/execs/{exec_id}", "running")
