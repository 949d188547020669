"""A service whose books outlive it: started like tests/fx_service.py (same tenants, the real
Serve proxy), but kept with its config so a test can take the whole app down and start it
again (``redeploy``), and can open its books beside it (``books()``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.fx_service import LIMITS, TOKENS, free_port, wait_healthy, wait_replicas


@dataclass
class Deployed:
    config: Any  # ServiceConfig
    port: int
    url: str = field(init=False)

    def __post_init__(self) -> None:
        self.url = f"http://127.0.0.1:{self.port}/api/v1"

    def client(self, tenant: str = "alice", **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kw,
                            headers={"Authorization": f"Bearer {TOKENS[tenant]}"})

    def start(self) -> None:
        from ray_sandbox import service as svc

        svc.start(self.config, "127.0.0.1", self.port)
        wait_healthy(self.url)
        wait_replicas(self.config.num_replicas)

    def redeploy(self) -> None:
        """The whole Serve app (and its state actor) deleted, Serve stopped, all started
        again: what a `ray-sandbox serve` restart does."""
        from ray_sandbox import service as svc

        svc.stop()
        self.start()

    def books(self) -> Any:
        """The app's books opened beside it (another holder of its database)."""
        from ray_sandbox.service._state import Books, Bounds, db_spec

        return Books(Bounds.of(self.config), db_spec(self.config), "ray-sandbox")


def deploy(quotas: tuple[str, ...] = (), replicas: int = 1, **settings: Any) -> Deployed:
    from ray_sandbox import service as svc

    tokens = ",".join(f"{t}={v}" for t, v in TOKENS.items())
    config = svc.from_env({"RAY_SANDBOX_API_TOKENS": tokens}, quotas=quotas,
                          num_replicas=replicas, **{**LIMITS, **settings})
    d = Deployed(config, free_port())
    d.start()
    return d


def teardown(d: Deployed | None) -> None:
    import ray

    import ray_sandbox
    from ray_sandbox import service as svc
    from ray_sandbox.service._sandboxes import TENANT_LABEL

    for tenant in (*TOKENS, "ghost"):
        handles = ray_sandbox.list({TENANT_LABEL: tenant})
        ray.get([h.terminate.remote() for h in handles], timeout=120)
    if d is not None:
        svc.stop()


def running(c: httpx.Client, sid: str, limit: float = 180) -> dict:
    deadline = time.monotonic() + limit
    while True:
        r = c.get(f"/sandboxes/{sid}", params={"wait_seconds": 5})
        assert r.status_code == 200, r.text
        if r.json()["status"] != "pending":
            return r.json()
        assert time.monotonic() < deadline, r.text


def until(fn: Any, limit: float = 120, every: float = 0.5) -> Any:
    """``fn()`` until it returns something true (bounded); what it returned."""
    deadline = time.monotonic() + limit
    while True:
        got = fn()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"not so within {limit:g} s: {fn}")
        time.sleep(every)
