"""A tenant's image is pulled where only public addresses are reachable, end to end: a real
service over a real Ray cluster, a tenant's create naming a registry at a public address
(HTTPS, tests/fx_pulls.py) whose auth realm is the node's loopback. The policy's check sees a
public registry and admits it; the node's pull, isolated, never reaches the loopback, and the
create fails with the registry's error. A create from a well-behaved public registry runs."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from ray_sandbox.runtime.errors import ImageNotFoundError
from ray_sandbox.runtime.images import ImageStore
from tests.fx_images import scratch_dir
from tests.fx_pulls import IMAGE, SECRET, Side, public_side, tls_material, trusted
from tests.fx_runtime import NODE_IMAGES
from tests.fx_service import Service, wait_exec, wait_running

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (netns, nft)")


@pytest.fixture(scope="module")
def side(registry: str, pushed_busybox: str) -> Iterator[Side]:
    with scratch_dir("rsbt-tls-") as root:
        ctx, ca = tls_material(root)
        with public_side(registry, tls=ctx) as s, trusted(ca, s.registries()):
            yield s


def forget(ref: str) -> None:
    """Untag what the node's store got from the test's registry (the image stays: it is
    ray-sandbox/busybox's)."""
    try:
        ImageStore(NODE_IMAGES).remove(ref)
    except ImageNotFoundError:
        pass


def test_a_tenants_pull_never_reaches_the_nodes_side(service: Service, side: Side):
    ref = f"{side.front('realm-loop')}/{IMAGE}"
    n = len(side.hits.seen)
    try:
        with service.client() as c:
            r = c.post("/sandboxes", json={"image": ref, "cpu": 0.1, "memory": "64Mi"})
            assert r.status_code == 202, r.text  # a public registry: the policy admits it
            info = wait_running(c, r.json()["sandbox_id"])
            c.delete(f"/sandboxes/{r.json()['sandbox_id']}")
        assert info["status"] != "running", info
        assert "connection refused" in str(info), info
        assert [h for h in side.hits.seen[n:] if h[0] == "realm-loop"]  # the way out works
        assert [h for h in side.hits.seen[n:] if h[0] == "node"] == []
        assert SECRET not in str(side.hits.seen[n:])
    finally:
        forget(ref)


def test_a_tenants_image_from_a_public_registry_runs(service: Service, side: Side):
    ref = f"{side.front('plain')}/{IMAGE}"
    n = len(side.hits.at("plain"))
    try:
        with service.client() as c:
            r = c.post("/sandboxes", json={"image": ref, "cpu": 0.1, "memory": "64Mi"})
            assert r.status_code == 202, r.text
            sid = r.json()["sandbox_id"]
            assert wait_running(c, sid)["status"] == "running"
            r = c.post(f"/sandboxes/{sid}/execs", json={"command": "echo hi"})
            assert wait_exec(c, sid, r.json()["exec_id"])["stdout"] == "hi\n"
            c.delete(f"/sandboxes/{sid}")
        assert side.hits.at("plain")[n:]  # pulled from the front, not found stored
    finally:
        forget(ref)
