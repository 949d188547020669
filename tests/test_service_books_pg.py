"""Two replicas on two nodes sharing books kept in a real PostgreSQL (tests/fx_postgres.py):
what one replica did is seen through the other, a create retried with one client token on
both makes one sandbox, the state actor (not tied to a node: its database is not on one)
killed mid-load loses no promise, and the whole app deleted and started again reloads
everything from the database and adopts the running sandboxes."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.fx_books import Deployed, deploy, kill_the_state_actor_mid_load, running, teardown
from tests.fx_hostile import heavy
from tests.fx_postgres import postgres  # noqa: F401 - the fixture
from tests.fx_ray import homes_cluster
from tests.test_service_replicas import REPLICA, on_each, on_other

SMALL = {"image": "ray-sandbox/busybox", "cpu": 0.1, "memory": "64Mi"}


@pytest.fixture(scope="module")
def svc(postgres, tmp_path_factory, default_image,  # noqa: F811 - the fixture
        busybox_image) -> Iterator[Deployed]:
    homes = [tmp_path_factory.mktemp(f"rsb-books{i}") for i in range(2)]
    # Serve's proxy sends requests to a replica of its own node when it has one: off, so
    # that one proxy reaches both replicas
    with homes_cluster(homes, {"RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING": "0"}):
        d = None
        try:
            d = deploy(quotas=("bob:sandboxes=3,cpu=1,memory=1Gi",), replicas=2,
                       state_db=postgres.new_database(), max_replicas_per_node=1,
                       max_snapshots=64, max_fs_images=64)
            yield d
        finally:
            teardown(d)


def test_two_replicas_on_two_nodes_share_their_books_in_postgresql(svc: Deployed):
    import ray

    from ray_sandbox.service import APP_NAME
    from ray_sandbox.service._state import NAMESPACE, actor_name
    from tests.fx_service import replica_actors

    nodes = {ray.get(ray.get_actor(a["name"], namespace=a["namespace"]).__ray_call__.remote(
        lambda self: ray.get_runtime_context().get_node_id()), timeout=30)
        for a in replica_actors()}
    assert len(nodes) == 2, nodes  # one replica per node
    state = ray.get_actor(actor_name(APP_NAME), namespace=NAMESPACE)
    assert "postgresql" in ray.get(state.stats.remote(), timeout=30)["where"]
    with svc.client() as c:
        # one token, six requests spread over both replicas: one sandbox
        body = {**SMALL, "client_token": "both-replicas"}
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda _: c.post("/sandboxes", json=body), range(6)))
        assert {r.status_code for r in answers} == {202}, [r.text for r in answers]
        assert len({r.json()["sandbox_id"] for r in answers}) == 1
        sid = answers[0].json()["sandbox_id"]
        if len({r.headers[REPLICA] for r in answers}) < 2:
            r = on_other(c, answers[0].headers[REPLICA], "POST", "/sandboxes", json=body)
            assert r.json()["sandbox_id"] == sid
        assert running(c, sid)["status"] == "running"
        snap = c.post(f"/sandboxes/{sid}/snapshot")
        assert snap.status_code == 201, snap.text
        for r in on_each(c, "GET", "/snapshots").values():
            assert r.json() == {"snapshots": [snap.json()["snapshot_id"]]}
        r = on_other(c, snap.headers[REPLICA], "GET", f"/sandboxes/{sid}")
        assert r.json()["status"] == "running"
        assert c.delete(f"/snapshots/{snap.json()['snapshot_id']}").status_code == 200
        assert c.delete(f"/sandboxes/{sid}").status_code == 200


@heavy  # 19 s in CI; the SQLite twin runs by default
def test_the_state_actor_killed_mid_load_reloads_from_postgresql(svc: Deployed):
    kill_the_state_actor_mid_load(svc)


@heavy  # 12 s in CI; the SQLite twin runs by default
def test_the_whole_app_deleted_and_started_again_reloads_from_postgresql(svc: Deployed):
    with svc.client() as c, svc.client("bob") as bob:
        sid = c.post("/sandboxes", json={**SMALL, "labels": {"suite": "pg"}}).json()[
            "sandbox_id"]
        assert running(c, sid)["status"] == "running"
        r = c.post(f"/sandboxes/{sid}/execs", params={"wait_seconds": 30},
                   json={"command": "echo kept"})
        assert r.status_code == 200, r.text
        snap = c.post(f"/sandboxes/{sid}/snapshot").json()["snapshot_id"]
        held = [bob.post("/sandboxes", json=SMALL).json()["sandbox_id"] for _ in range(3)]
    svc.redeploy()
    with svc.client() as c, svc.client("bob") as bob:
        for got in on_each(c, "GET", f"/sandboxes/{sid}/execs/{r.json()['exec_id']}").values():
            assert got.json()["stdout"] == "kept\n", got.text
        assert c.get(f"/sandboxes/{sid}").json()["labels"] == {"suite": "pg"}
        assert c.get("/snapshots").json() == {"snapshots": [snap]}
        refused = bob.post("/sandboxes", json=SMALL)
        assert refused.status_code == 429, refused.text
        for x in held:
            running(bob, x)
            assert bob.delete(f"/sandboxes/{x}").status_code == 200
        assert c.delete(f"/snapshots/{snap}").status_code == 200
        assert c.delete(f"/sandboxes/{sid}").status_code == 200
