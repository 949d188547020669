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
        from ray_sandbox.service._bounds import Bounds
        from ray_sandbox.service._state import Books, db_spec

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
    from ray_sandbox.service._entry import TENANT_LABEL

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


def kill_the_state_actor_mid_load(d: Deployed, seconds: float = 12.0) -> None:
    """Snapshots, filesystem images, creates (bob's against a quota of 3) and execs run from
    threads while the state actor is killed (Ray restarts it; it reloads its books). After:
    no answer was a 500, every snapshot id and image name answered is listed, every create
    answered ends running or failed (none stays pending), bob holds at most 3 sandboxes."""
    import threading
    from collections import Counter

    import ray

    import ray_sandbox
    from ray_sandbox.service import APP_NAME
    from ray_sandbox.service._entry import TENANT_LABEL
    from ray_sandbox.service._state import NAMESPACE, actor_name

    small = {"image": "ray-sandbox/busybox", "cpu": 0.1, "memory": "64Mi"}
    with d.client() as c:
        base = c.post("/sandboxes", json=small).json()["sandbox_id"]
        assert running(c, base)["status"] == "running"
    statuses: Counter[int] = Counter()
    snaps: list[str] = []
    images: list[str] = []
    made: list[tuple[str, str]] = []  # (tenant, sandbox id)
    lock = threading.Lock()
    stop = threading.Event()

    def load(tenant: str, what: str) -> None:
        with d.client(tenant) as c:
            while not stop.is_set():
                try:
                    if what == "snapshot":
                        r = c.post(f"/sandboxes/{base}/snapshot")
                    elif what == "image":
                        r = c.post(f"/sandboxes/{base}/filesystem-image")
                    elif what == "exec":
                        r = c.post(f"/sandboxes/{base}/execs", params={"wait_seconds": 10},
                                   json={"command": "echo x"})
                    else:
                        r = c.post("/sandboxes", json=small)
                except httpx.TransportError:
                    continue
                with lock:
                    statuses[r.status_code] += 1
                    if r.status_code == 201 and what == "snapshot":
                        snaps.append(r.json()["snapshot_id"])
                    elif r.status_code == 201 and what == "image":
                        images.append(r.json()["image"])
                    elif r.status_code == 202 and what == "create":
                        made.append((tenant, r.json()["sandbox_id"]))
                if r.status_code in (429, 503) or what == "create":
                    time.sleep(0.5)

    threads = [threading.Thread(target=load, args=a) for a in (
        ("alice", "snapshot"), ("alice", "image"), ("alice", "exec"), ("bob", "create"),
        ("bob", "create"))]
    for t in threads:
        t.start()
    try:
        time.sleep(seconds / 3)
        ray.kill(ray.get_actor(actor_name(APP_NAME), namespace=NAMESPACE), no_restart=False)
        time.sleep(seconds)
    finally:
        stop.set()
        for t in threads:
            t.join(300)
    print(f"answers {dict(statuses)}: {len(snaps)} snapshots, {len(images)} images, "
          f"{len(made)} creates")
    assert 500 not in statuses and statuses[201] and statuses[503], statuses
    with d.client() as c, d.client("bob") as bob:
        until(lambda: c.get("/snapshots").status_code == 200)
        listed = until(lambda: (r := c.get("/snapshots")).status_code == 200 and r.json())
        assert set(snaps) <= set(listed["snapshots"]), (snaps, listed)
        got = until(lambda: (r := c.get("/filesystem-images")).status_code == 200 and r.json())
        assert set(images) <= set(got["images"]), (images, got)
        for tenant, sid in made:
            info = running(bob if tenant == "bob" else c, sid)
            assert info["status"] in ("running", "error"), info
        assert len(ray_sandbox.list({TENANT_LABEL: "bob"})) <= 3
        for _, sid in made:
            bob.delete(f"/sandboxes/{sid}")
        for snap in listed["snapshots"]:
            assert c.delete(f"/snapshots/{snap}").status_code == 200
        for image in got["images"]:
            assert c.delete(f"/filesystem-images/{image.rpartition('/')[2]}").status_code \
                == 200
        assert c.delete(f"/sandboxes/{base}").status_code == 200
