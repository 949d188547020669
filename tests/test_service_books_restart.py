"""The service's books in their default database (a SQLite file in the head node's home),
with one replica holding them: idempotent creates, the whole app deleted and started again
(everything reloads, running sandboxes adopted), what no node holds any more shown as lost,
and ``ray-sandbox serve --reconcile`` finding and deleting orphans. Real Serve, real Ray,
real sandboxes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.fx_books import Deployed, deploy, running, teardown, until
from tests.fx_service import TOKENS

BUSYBOX = "ray-sandbox/busybox"
SMALL = {"image": BUSYBOX, "cpu": 0.1, "memory": "64Mi"}


@pytest.fixture(scope="module")
def svc(ray_cluster) -> Iterator[Deployed]:
    d = None
    try:
        d = deploy(quotas=("bob:sandboxes=1,cpu=1,memory=1Gi",))
        yield d
    finally:
        teardown(d)


def error(r, status: int, code: str | None = None) -> str:
    assert r.status_code == status, r.text
    if code is not None:
        assert r.json()["error"]["code"] == code, r.text
    return r.json()["error"]["message"]


def test_a_retried_create_with_its_client_token_makes_one_sandbox(svc: Deployed):
    import ray_sandbox
    from ray_sandbox.client import SandboxClient

    with svc.client() as c, svc.client("bob") as bob:
        body = {**SMALL, "labels": {"suite": "token"}, "client_token": "retry-1"}
        first = c.post("/sandboxes", json=body)
        assert first.status_code == 202, first.text
        sid = first.json()["sandbox_id"]
        again = c.post("/sandboxes", json=body)  # while the first is still being made
        assert (again.status_code, again.json()["sandbox_id"]) == (202, sid), again.text
        # six at once with one token (within max_pending_creates): one sandbox
        burst = {**SMALL, "labels": {"suite": "burst"}, "client_token": "burst-1"}
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda _: c.post("/sandboxes", json=burst), range(6)))
        assert {r.status_code for r in answers} == {202}, [r.text for r in answers]
        ids = {r.json()["sandbox_id"] for r in answers}
        assert len(ids) == 1, ids
        # the same token with another body is a conflict; another tenant's is its own
        msg = error(c.post("/sandboxes", json={**body, "cpu": 0.2}), 409, "conflict")
        assert "client_token" in msg
        theirs = bob.post("/sandboxes", json=body)
        assert theirs.status_code == 202 and theirs.json()["sandbox_id"] != sid, theirs.text
        for x, cl in ((sid, c), (ids.pop(), c), (theirs.json()["sandbox_id"], bob)):
            assert running(cl, x)["status"] == "running"
        assert len(ray_sandbox.list({"suite": "burst"})) == 1
        assert c.post("/sandboxes", json=body).json()["sandbox_id"] == sid  # and once made
        # a token not a printable word is refused
        error(c.post("/sandboxes", json={**SMALL, "client_token": "a b"}), 400)
    # the clients send one of their own, or the caller's
    with SandboxClient(svc.url, TOKENS["alice"]) as cl:
        a = cl.create(BUSYBOX, cpu=0.1, memory="64Mi", client_token="client-1")
        b = cl.create(BUSYBOX, cpu=0.1, memory="64Mi", client_token="client-1")
        plain = cl.create(BUSYBOX, cpu=0.1, memory="64Mi")
        assert a.sandbox_id == b.sandbox_id != plain.sandbox_id
    with svc.client() as c, svc.client("bob") as bob:
        for x in (sid, *(r.json()["sandbox_id"] for r in answers[:1])):
            assert c.delete(f"/sandboxes/{x}").status_code == 200
        assert bob.delete(f"/sandboxes/{theirs.json()['sandbox_id']}").status_code == 200
        # within its life the token still names the sandbox it made, deleted or not
        assert c.post("/sandboxes", json=body).json()["sandbox_id"] == sid
        error(c.get(f"/sandboxes/{sid}"), 404)


def test_the_whole_app_deleted_and_started_again_forgets_nothing(svc: Deployed):
    with svc.client() as c, svc.client("bob") as bob:
        sid = c.post("/sandboxes", json={**SMALL, "labels": {"suite": "reload"}}).json()[
            "sandbox_id"]
        assert running(c, sid)["status"] == "running"
        r = c.post(f"/sandboxes/{sid}/execs", params={"wait_seconds": 30},
                   json={"command": "echo before"})
        assert r.status_code == 200, r.text
        eid = r.json()["exec_id"]
        failed = c.post("/sandboxes", json={**SMALL, "image": "ray-sandbox/no-such-image"})
        fid = failed.json()["sandbox_id"]
        assert running(c, fid)["status"] == "error"
        c.put(f"/sandboxes/{sid}/files", params={"path": "/tmp/state"}, content=b"kept")
        snap = c.post(f"/sandboxes/{sid}/snapshot").json()["snapshot_id"]
        image = c.post(f"/sandboxes/{sid}/filesystem-image").json()["image"]
        assert c.post("/volumes", json={"name": "keep", "size": "16Mi"}).status_code == 201
        held = bob.post("/sandboxes", json=SMALL).json()["sandbox_id"]  # bob's quota: 1
        assert running(bob, held)["status"] == "running"
        tok = c.post("/sandboxes", json={**SMALL, "client_token": "kept-token"}).json()[
            "sandbox_id"]

    svc.redeploy()

    with svc.client() as c, svc.client("bob") as bob:
        info = c.get(f"/sandboxes/{sid}").json()
        assert (info["status"], info["labels"]) == ("running", {"suite": "reload"}), info
        got = c.get(f"/sandboxes/{sid}/execs/{eid}").json()
        assert (got["status"], got["stdout"]) == ("completed", "before\n"), got
        info = c.get(f"/sandboxes/{fid}").json()
        assert info["status"] == "error" and "image" in info["reason"].lower(), info
        assert c.get("/snapshots").json() == {"snapshots": [snap]}
        copy = c.post(f"/snapshots/{snap}/restore", json={"count": 1}).json()["sandboxes"][0]
        got = c.get(f"/sandboxes/{copy}/files", params={"path": "/tmp/state"})
        assert got.content == b"kept", got.text
        assert c.get("/filesystem-images").json() == {"images": [image]}
        made = c.post("/sandboxes", json={**SMALL, "image": image}).json()["sandbox_id"]
        assert running(c, made)["status"] == "running"
        assert [v["name"] for v in c.get("/volumes").json()["volumes"]] == ["keep"]
        error(bob.post("/sandboxes", json=SMALL), 429, "quota_exceeded")  # still charged
        assert c.post("/sandboxes", json={**SMALL, "client_token": "kept-token"}).json()[
            "sandbox_id"] == tok
        for x in (sid, fid, copy, made, tok):
            assert c.delete(f"/sandboxes/{x}").status_code == 200
        assert bob.delete(f"/sandboxes/{held}").status_code == 200
        assert c.delete(f"/snapshots/{snap}").status_code == 200
        assert c.delete(f"/filesystem-images/{image.rpartition('/')[2]}").status_code == 200
        assert c.delete("/volumes/keep").status_code == 200


def test_what_no_node_holds_any_more_is_shown_lost_and_forgotten_by_delete(svc: Deployed):
    import ray

    import ray_sandbox
    from ray_sandbox.runtime.snapshot import Snapshot
    from ray_sandbox.service._bounds import FS_IMAGE, SNAPSHOT
    from ray_sandbox.service._volumes import prefix

    with svc.client() as c:
        sid = c.post("/sandboxes", json=SMALL).json()["sandbox_id"]
        assert running(c, sid)["status"] == "running"
        snap = c.post(f"/sandboxes/{sid}/snapshot").json()["snapshot_id"]
        image = c.post(f"/sandboxes/{sid}/filesystem-image").json()["image"]
        assert c.post("/volumes", json={"name": "gone", "size": "16Mi"}).status_code == 201
    # behind the service's back, as a dead node would: the sandbox, its files, the volume
    books = svc.books()
    kept_snap = asyncio.run(books.kept.kept(SNAPSHOT, "alice", snap))
    kept_image = asyncio.run(books.kept.kept(FS_IMAGE, "alice", image.rpartition("/")[2]))
    books.close()
    ray.get(ray_sandbox.get(sid).terminate.remote(), timeout=120)
    ray_sandbox.delete_snapshot(Snapshot.model_validate(kept_snap["snapshot"]))
    ray_sandbox.delete_filesystem_image(kept_image["ref"])
    ray_sandbox.delete_volume(prefix("alice") + "gone")

    svc.redeploy()

    with svc.client() as c:
        info = c.get(f"/sandboxes/{sid}").json()
        assert info["status"] == "terminated" and info["reason"].startswith("lost:"), info
        assert [s["status"] for s in c.get("/sandboxes").json()["sandboxes"]
                if s["sandbox_id"] == sid] == ["terminated"]
        assert "lost" in error(c.post(f"/sandboxes/{sid}/execs", json={"command": "true"}), 409)
        # the node check runs in the background after the replica starts
        listed = until(lambda: (r := c.get("/snapshots").json()).get("lost") and r)
        assert listed == {"snapshots": [], "lost": [snap]}
        assert "lost" in error(c.post(f"/snapshots/{snap}/restore", json={}), 404)
        assert c.get("/filesystem-images").json() == {"images": [], "lost": [image]}
        assert "lost" in error(c.post("/sandboxes", json={**SMALL, "image": image}), 400)
        assert c.get("/volumes").json() == {"volumes": [], "lost": ["gone"]}
        # DELETE forgets each
        assert c.delete(f"/sandboxes/{sid}").status_code == 200
        error(c.get(f"/sandboxes/{sid}"), 404)
        assert c.delete(f"/snapshots/{snap}").status_code == 200
        assert c.delete(f"/filesystem-images/{image.rpartition('/')[2]}").status_code == 200
        assert c.delete("/volumes/gone").status_code == 200
        assert c.get("/snapshots").json() == {"snapshots": []}
        assert c.get("/filesystem-images").json() == {"images": []}
        assert c.get("/volumes").json() == {"volumes": []}


def _report(result) -> dict:
    assert result.exit_code == 0, result.output
    text = result.stdout
    return json.JSONDecoder().raw_decode(text[text.index("{"):])[0]


def test_reconcile_reports_orphans_and_deletes_them_after_a_grace(svc: Deployed):
    import ray
    from typer.testing import CliRunner

    import ray_sandbox
    from ray_sandbox.cli import app
    from ray_sandbox.service._bounds import FS_IMAGE
    from ray_sandbox.service._entry import TENANT_LABEL
    from ray_sandbox.service._inventory import collect
    from ray_sandbox.service._volumes import prefix

    with svc.client() as c:
        sid = c.post("/sandboxes", json=SMALL).json()["sandbox_id"]
        assert running(c, sid)["status"] == "running"
    h = ray_sandbox.get(sid)
    # a sandbox of a tenant the service does not serve (its token was taken away)
    ghost = ray_sandbox.create(BUSYBOX, cpu=0.1, memory="64Mi", lifetime="detached",
                               labels={TENANT_LABEL: "ghost"})
    # a snapshot of a tenant's sandbox that no book keeps
    snap = ray.get(h.snapshot.remote(), timeout=120)
    # an image whose take began and was never kept: what a crash between the two leaves
    books = svc.books()
    asyncio.run(books.kept.take_started("take-1", FS_IMAGE, "alice", h.sandbox_id))
    books.close()
    taken = ray.get(h.snapshot_filesystem.remote(), timeout=300)
    # a volume of no tenant, and an image made through the Ray layer (not the service's)
    ray_sandbox.create_volume(prefix("ghost") + "x", "16Mi")
    plain = ray_sandbox.create(BUSYBOX, cpu=0.1, memory="64Mi")
    foreign = ray.get(plain.snapshot_filesystem.remote(), timeout=300)
    env = {"RAY_SANDBOX_API_TOKENS": ",".join(f"{t}={v}" for t, v in TOKENS.items())}
    try:
        report = _report(CliRunner().invoke(app, ["serve", "--reconcile"], env=env))
        orphans = report["orphans"]
        assert [x["id"] for x in orphans["sandboxes"]] == [ghost.sandbox_id]
        assert [x["id"] for x in orphans["snapshots"]] == [snap.snapshot_id]
        assert [x["ref"] for x in orphans["filesystem_images"]] == [taken]
        assert [x["id"] for x in orphans["volumes"]] == [prefix("ghost") + "x"]
        assert [x["ref"] for x in report["foreign"]["filesystem_images"]] == [foreign]
        assert not any("action" in x for found in orphans.values() for x in found)
        assert report["lost"]["sandboxes"] == [] and report["rows"]["sandboxes"] >= 1

        report = _report(CliRunner().invoke(app, ["serve", "--reconcile", "--delete-after",
                                                  "0"], env=env))
        assert {x.get("action") for found in report["orphans"].values() for x in found} == {
            "deleted"}, report["orphans"]
        assert ray_sandbox.list({TENANT_LABEL: "ghost"}) == []
        held = collect(TENANT_LABEL)["nodes"]
        assert not any(s["id"] == snap.snapshot_id for n in held.values() for s in n["snapshots"])
        images = {i["ref"] for n in held.values() for i in n["fs_images"]}
        assert taken not in images and foreign in images  # the Ray layer's is left alone
        assert prefix("ghost") + "x" not in {v.name for v in ray_sandbox.list_volumes()}
        again = _report(CliRunner().invoke(app, ["serve", "--reconcile"], env=env))
        assert not any(again["orphans"].values()), again["orphans"]
        # the service's own were never touched
        with svc.client() as c:
            assert c.get(f"/sandboxes/{sid}").json()["status"] == "running"
    finally:
        ray_sandbox.delete_filesystem_image(foreign)
        ray.get(plain.terminate.remote(), timeout=120)
        with svc.client() as c:
            assert c.delete(f"/sandboxes/{sid}").status_code == 200


def test_the_books_row_counts_and_step_times_reach_the_metrics(svc: Deployed,
                                                              ray_metrics_port):
    import time
    import urllib.request

    with svc.client() as c:  # a step or two, so the sweep has run and steps were timed
        assert c.get("/snapshots").status_code == 200
    want = ("ray_sandbox_service_books_rows", "ray_sandbox_service_books_seconds")
    deadline, text = time.monotonic() + 90, ""
    while time.monotonic() < deadline and not all(w in text for w in want):
        time.sleep(1)
        try:
            url = f"http://127.0.0.1:{ray_metrics_port}/metrics"
            text = urllib.request.urlopen(url, timeout=5).read().decode()
        except OSError:
            continue
    assert all(w in text for w in want), [w for w in want if w not in text]
    assert 'table="sandboxes"' in text and 'op="kept_list"' in text
