"""The HTTP service with two Serve replicas behind Serve's real proxy: every answer is the same
whichever replica gives it (issue 21). Each response names its replica
(``x-ray-sandbox-replica``), so a test repeats an idempotent request until the other replica
answers, and shows what one replica did is seen by the other."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.fx_service import Service, wait_replicas

SERVICE_REPLICAS = 2
# bob may hold three sandboxes of 0.25 CPU: a fourth is over, whichever replica it reaches
SERVICE_QUOTAS = ("bob:sandboxes=3,cpu=1,memory=1Gi",)
BUSYBOX = "ray-sandbox/busybox"
REPLICA = "x-ray-sandbox-replica"
TRIES = 60  # requests until the other replica answers; routing is random, 2^-60 to miss


def body(**more) -> dict:
    return {"image": BUSYBOX, "cpu": 0.25, "memory": "128Mi", **more}


def on_other(c: httpx.Client, replica: str, method: str, path: str,
             **kw) -> httpx.Response:
    """``method path`` (idempotent) until a replica other than ``replica`` answers."""
    for _ in range(TRIES):
        r = c.request(method, path, **kw)
        if r.headers[REPLICA] != replica:
            return r
    pytest.fail(f"only replica {replica} answered {method} {path}")


def on_each(c: httpx.Client, method: str, path: str, **kw) -> dict[str, httpx.Response]:
    """``method path`` (idempotent) until both replicas answered; replica -> its answer."""
    seen: dict[str, httpx.Response] = {}
    for _ in range(TRIES):
        r = c.request(method, path, **kw)
        seen[r.headers[REPLICA]] = r
        if len(seen) == 2:
            return seen
    pytest.fail(f"only {set(seen)} answered {method} {path}")


def error(r: httpx.Response, status: int, code: str | None = None) -> None:
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) == {"code", "message"}
    if code is not None:
        assert r.json()["error"]["code"] == code, r.text


def running(c: httpx.Client, sid: str, limit: float = 120) -> None:
    deadline = time.monotonic() + limit
    while (s := c.get(f"/sandboxes/{sid}", params={"wait_seconds": 5}).json()["status"]) \
            == "pending":
        assert time.monotonic() < deadline
    assert s == "running", s


def ndjson(r: httpx.Response) -> Iterator[dict]:
    for raw in r.iter_lines():
        if raw and (line := json.loads(raw))["type"] != "keepalive":
            yield line


def test_execs_creates_and_streams_are_seen_from_the_other_replica(service: Service):
    with service.client() as c, service.client("bob") as bob:
        r = c.post("/sandboxes", json=body(labels={"suite": "replicas"}))
        assert r.status_code == 202, r.text
        sid, maker = r.json()["sandbox_id"], r.headers[REPLICA]
        # in flight on one replica: pending on the other (listed there too), then running
        seen = on_other(c, maker, "GET", f"/sandboxes/{sid}")
        assert seen.status_code == 200 and seen.json()["status"] == "pending", seen.text
        listed = on_other(c, maker, "GET", "/sandboxes", params={"label": "suite=replicas"})
        assert [(s["sandbox_id"], s["status"]) for s in listed.json()["sandboxes"]] in (
            [(sid, "pending")], [(sid, "running")])
        other = seen.headers[REPLICA]
        deadline = time.monotonic() + 120
        while (info := c.get(f"/sandboxes/{sid}", params={"wait_seconds": 5})).json()[
                "status"] == "pending" or info.headers[REPLICA] != other:
            assert time.monotonic() < deadline, info.text
        assert info.json()["status"] == "running", info.text

        # an exec started on one replica is polled to its end on the other
        r = c.post(f"/sandboxes/{sid}/execs", json={"command": "sleep 1; echo across"})
        assert r.status_code == 202, r.text
        eid, runner = r.json()["exec_id"], r.headers[REPLICA]
        first = on_other(c, runner, "GET", f"/sandboxes/{sid}/execs/{eid}")
        assert first.status_code == 200 and first.json()["status"] in ("running", "completed")
        deadline = time.monotonic() + 60
        while (done := on_other(c, runner, "GET", f"/sandboxes/{sid}/execs/{eid}",
                                params={"wait_seconds": 5})).json()["status"] == "running":
            assert time.monotonic() < deadline
        assert (done.json()["status"], done.json()["stdout"]) == ("completed", "across\n")
        # another tenant sees neither the sandbox nor its exec, on either replica
        for r in on_each(bob, "GET", f"/sandboxes/{sid}/execs/{eid}").values():
            error(r, 404, "not_found")
        for r in on_each(c, "GET", f"/sandboxes/{sid}/execs/{'0' * 16}").values():
            error(r, 404, "not_found")

        # a streamed exec read by one replica is signalled through the other
        script = "trap 'echo got-usr1' USR1; echo ready; while true; do sleep 0.2; done"
        with c.stream("POST", f"/sandboxes/{sid}/execs/stream",
                      json={"command": ["sh", "-c", script]}) as r:
            reader = r.headers[REPLICA]
            lines = ndjson(r)
            xid = next(lines)["exec_id"]
            assert next(lines)["data"] == "ready\n"
            sig = on_other(c, reader, "POST", f"/sandboxes/{sid}/execs/{xid}/signal",
                           json={"signal": 10})
            assert sig.status_code == 200, sig.text
            assert next(x for x in lines if x["type"] == "stdout")["data"] == "got-usr1\n"
            error(on_other(bob, reader, "POST", f"/sandboxes/{sid}/execs/{xid}/signal",
                           json={"signal": 9}), 404)
            # a plain exec cannot be cancelled, whichever replica is asked
            error(on_other(c, runner, "DELETE", f"/sandboxes/{sid}/execs/{eid}"), 409)
        # ... and cancelled through the other: a cancel is no probe, so each try is a stream
        for _ in range(8):
            with c.stream("POST", f"/sandboxes/{sid}/execs/stream",
                          json={"command": ["sh", "-c", script]}) as r:
                reader, lines = r.headers[REPLICA], ndjson(r)
                xid = next(lines)["exec_id"]
                assert next(lines)["data"] == "ready\n"
                cancel = c.delete(f"/sandboxes/{sid}/execs/{xid}")
                assert cancel.status_code == 200, cancel.text
                last = list(lines)[-1]
            assert last["type"] == "exit" and last["exit_code"] in (143, 137), last
            if cancel.headers[REPLICA] != reader:
                break
        else:
            pytest.fail("eight cancels all reached the replica reading the stream")

        assert c.delete(f"/sandboxes/{sid}").status_code == 200
        for r in on_each(c, "GET", f"/sandboxes/{sid}").values():
            error(r, 404, "not_found")


def test_the_quota_holds_across_replicas(service: Service):
    """Bob's quota is 3: four creates at once, spread over both replicas, get one 429."""
    with service.client("bob") as bob:
        for _ in range(5):  # until the creates reached both replicas
            with ThreadPoolExecutor(4) as pool:
                answers = list(pool.map(lambda _: bob.post("/sandboxes", json=body()),
                                        range(4)))
            made = [(r.json()["sandbox_id"], r.headers[REPLICA]) for r in answers
                    if r.status_code == 202]
            refused = [r for r in answers if r.status_code != 202]
            assert len(made) == 3 and len(refused) == 1, [r.text for r in answers]
            error(refused[0], 429, "quota_exceeded")
            spread = {r.headers[REPLICA] for r in answers}
            # still over on either replica while all three are held
            for r in on_each(bob, "POST", "/sandboxes", json=body()).values():
                error(r, 429, "quota_exceeded")
            # deleted through the replica that did not make them (some still pending)
            for sid, maker in made:
                assert on_other(bob, maker, "DELETE", f"/sandboxes/{sid}").status_code == 200
            if len(spread) == 2:
                break
        else:
            pytest.fail("five rounds of four creates all reached one replica")
        # the deletes, through either replica, gave the quota back
        again = [bob.post("/sandboxes", json=body()) for _ in range(3)]
        assert [r.status_code for r in again] == [202] * 3, [r.text for r in again]
        for r in again:
            assert bob.delete(f"/sandboxes/{r.json()['sandbox_id']}").status_code == 200


def test_a_snapshot_taken_through_one_replica_is_restored_through_the_other(service: Service):
    with service.client() as c, service.client("bob") as bob:
        sid = c.post("/sandboxes", json=body()).json()["sandbox_id"]
        running(c, sid)
        c.put(f"/sandboxes/{sid}/files", params={"path": "/tmp/state"}, content=b"kept")
        r = c.post(f"/sandboxes/{sid}/snapshot")
        assert r.status_code == 201, r.text
        snap, taker = r.json()["snapshot_id"], r.headers[REPLICA]
        listed = on_other(c, taker, "GET", "/snapshots")
        assert listed.json() == {"snapshots": [snap]}
        for r in on_each(bob, "GET", "/snapshots").values():
            assert r.json() == {"snapshots": []}
        for r in on_each(bob, "POST", f"/snapshots/{snap}/restore", json={}).values():
            error(r, 404, "not_found")
        copies = []
        for _ in range(8):  # a restore is no probe: each try makes a copy, kept to delete
            r = c.post(f"/snapshots/{snap}/restore", json={"count": 1})
            assert r.status_code == 201, r.text
            copies += r.json()["sandboxes"]
            if r.headers[REPLICA] != taker:
                break
        else:
            pytest.fail("eight restores all reached the replica that took the snapshot")
        for copy in copies:
            got = on_other(c, r.headers[REPLICA], "GET", f"/sandboxes/{copy}/files",
                           params={"path": "/tmp/state"})
            assert got.content == b"kept", got.text
        assert on_other(c, taker, "DELETE", f"/snapshots/{snap}").status_code == 200
        for r in on_each(c, "GET", "/snapshots").values():
            assert r.json() == {"snapshots": []}
        for x in [sid, *copies]:
            assert c.delete(f"/sandboxes/{x}").status_code == 200


def test_a_killed_state_actor_is_a_503_then_the_service_recovers(service: Service):
    """Last in the module: it kills the shared state actor (Ray restarts it, empty)."""
    import ray

    from ray_sandbox.service import APP_NAME
    from ray_sandbox.service._state import NAMESPACE, actor_name

    with service.client() as c:
        sid = c.post("/sandboxes", json=body()).json()["sandbox_id"]
        running(c, sid)
        ray.kill(ray.get_actor(actor_name(APP_NAME), namespace=NAMESPACE), no_restart=False)
        # no request hangs: each answers in bounded time, a 503 while the books are away
        statuses = set()
        deadline = time.monotonic() + 120
        while True:
            t0 = time.monotonic()
            r = c.post(f"/sandboxes/{sid}/execs", params={"wait_seconds": 5},
                       json={"command": "echo back"})
            assert time.monotonic() - t0 < 50, "a request hung on the missing state actor"
            statuses.add(r.status_code)
            if r.status_code == 503:
                error(r, 503, "unavailable")
            elif r.status_code == 200:
                break
            else:
                assert r.status_code == 202, r.text
                eid, runner = r.json()["exec_id"], r.headers[REPLICA]
                got = on_other(c, runner, "GET", f"/sandboxes/{sid}/execs/{eid}",
                               params={"wait_seconds": 5})
                if got.status_code == 200 and got.json()["status"] == "completed":
                    break
            assert time.monotonic() < deadline, statuses
        assert statuses <= {200, 202, 503}, statuses
        # the restarted books learn the tenant's sandboxes again: the quota still counts
        assert c.delete(f"/sandboxes/{sid}").status_code == 200
        wait_replicas(2)


def test_the_replica_count_is_an_option_of_the_config_and_the_command_line():
    from typer.testing import CliRunner

    from ray_sandbox.cli import app
    from ray_sandbox.runtime.errors import ConfigError
    from ray_sandbox.service import from_env

    env = {"RAY_SANDBOX_API_TOKEN": "a-token-0123456789"}
    assert from_env(env).num_replicas == 1
    assert from_env(env, num_replicas=3).num_replicas == 3
    with pytest.raises(ConfigError):
        from_env(env, num_replicas=0)
    refused = CliRunner().invoke(app, ["serve", "--replicas", "0"])
    assert refused.exit_code == 2 and "replicas" in refused.output
