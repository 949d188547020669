"""Tenants are not operators (issue 31): on a real service over a real Ray cluster with real
sandboxes, two tenants. Every option a hostile tenant set is held to its tenant policy (a 400
naming the field and the rule, or the operator's value), one tenant's flood leaves the other
served, and malformed requests are refused at the boundary without storing anything that
breaks a later read. The rules themselves, one by one: tests/unit/test_tenant_policy.py."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ray_sandbox.service._policy import TenantPolicy
from tests.fx_service import TOKENS, Service, wait_exec, wait_running

BUSYBOX = "ray-sandbox/busybox"
SERVICE_QUOTAS = ("bob:sandboxes=4,cpu=2,memory=2Gi",)
HANG = socket.socket()  # a "registry" that accepts and never answers: creates wait on it
HANG.bind(("127.0.0.1", 0))
HANG.listen(64)
HANG_REGISTRY = f"127.0.0.1:{HANG.getsockname()[1]}"
SERVICE_SETTINGS = {
    "policies": {"*": TenantPolicy(disk_default="32Mi", disk_max="64Mi",
                                   registries=[HANG_REGISTRY])},
    "max_ongoing_requests": 16, "max_requests_per_tenant": 8, "max_long_polls_per_tenant": 4,
    "max_pending_creates": 2, "max_running_execs_per_tenant": 6,
    "max_result_bytes_per_tenant": 256 << 10, "max_execs_per_sandbox": 4,
    "port_host_suffix": "ports.test",  # reached with a Host header: no DNS needed
}


def create(c: httpx.Client, **body) -> str:
    r = c.post("/sandboxes", json={"image": BUSYBOX, "cpu": 0.1, "memory": "64Mi", **body})
    assert r.status_code == 202, r.text
    sid = r.json()["sandbox_id"]
    info = wait_running(c, sid)
    assert info["status"] == "running", info
    return sid


def refusal(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    return r.json()["error"]["message"]


def run(c: httpx.Client, sid: str, command: str, **body) -> dict:
    r = c.post(f"/sandboxes/{sid}/execs", json={"command": command, **body})
    assert r.status_code == 202, r.text
    return wait_exec(c, sid, r.json()["exec_id"])


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("body,field", [
    ({"network": "public", "egress": {"allow_cidrs": ["0.0.0.0/0"]}}, "egress"),
    ({"network": "sandbox", "egress": {"allow_cidrs": ["127.0.0.1/32"]}}, "egress"),
    ({"rootless": True}, "rootless"),
    ({"pids_limit": None}, "pids_limit"),
    ({"pids_limit": 4194304}, "pids_limit"),
    ({"disk": "1Ti"}, "disk"),
    ({"disk": "unlimited"}, "disk"),
    ({"network": "public", "dns": ["127.0.0.1"]}, "dns"),
    ({"capabilities": ["CAP_SYS_ADMIN", "CAP_NET_ADMIN", "CAP_SYS_MODULE"]}, "capabilities"),
    ({"directfs": False}, "directfs"),
    ({"network": "host"}, "network"),
])
def test_an_operators_option_is_a_400_naming_the_field(service: Service, body, field):
    with service.client() as c:
        msg = refusal(c.post("/sandboxes", json={"image": BUSYBOX, **body}), 400)
        assert msg.startswith(f"{field}:") and "tenant policy" in msg, msg
        assert c.get("/sandboxes").json()["sandboxes"] == []  # nothing was made


def test_a_registry_on_the_nodes_side_is_refused_alike_whatever_listens(service: Service):
    """The node pulled from any loopback port as root, and the error told an open port from
    a closed one: a port scanner. Now both are one refusal, before any connection."""
    with socket.socket() as listening, service.client() as c:
        listening.bind(("127.0.0.1", 0))
        listening.listen(1)
        answers = {refusal(c.post("/sandboxes", json={"image": f"127.0.0.1:{port}/x"}), 400)
                   .replace(str(port), "PORT")
                   for port in (listening.getsockname()[1], closed_port())}
        assert len(answers) == 1 and "tenants may not pull from" in answers.pop()
        refusal(c.post("/sandboxes", json={"image": "localhost:5000/x"}), 400)


@pytest.mark.parametrize("body,where", [({"readonly": True, "workdir": "/w"}, "/w"),
                                        ({"readonly": False}, "/var/x")])
def test_a_tenants_writes_to_the_node_disk_are_capped(service: Service, body, where):
    """disk= left out (or readonly with a workdir) gets the policy's default cap (32 MiB
    here): 300 MiB were written to the node before."""
    with service.client() as c:
        sid = create(c, **body)
        done = run(c, sid, f"mkdir -p {where} && dd if=/dev/zero of={where}/fill bs=1M "
                           "count=48", timeout_seconds=60)
        assert done["exit_code"] != 0 and "No space left" in done["stderr"], done
        c.delete(f"/sandboxes/{sid}")


def test_one_tenants_long_polls_leave_the_other_served(service: Service):
    """60 long polls of one tenant against max_ongoing_requests=48 made the other's GET time
    out: each tenant now holds at most its share of a replica (16 here, 4 long polls)."""
    with service.client() as c, service.client("bob") as b:
        sid = create(c)
        slow = c.post(f"/sandboxes/{sid}/execs", json={"command": "sleep 20"}).json()

        def poll(i: int) -> int:
            with service.client() as own:  # half spell the key %-encoded: the same key
                key = "wait_seconds" if i % 2 else "wait%5Fseconds"
                return own.get(f"/sandboxes/{sid}/execs/{slow['exec_id']}?{key}=5").status_code

        with ThreadPoolExecutor(20) as pool:
            polls = pool.map(poll, range(20))
            time.sleep(0.5)  # the polls are in (each waits 5 s): the other tenant is served
            r = b.get("/sandboxes", timeout=4)
            assert r.status_code == 200, r.text
            codes = sorted(polls)
        assert codes.count(429) >= 16 - 4 and codes.count(200) >= 1, codes
        c.delete(f"/sandboxes/{sid}")


def test_creates_waiting_on_a_pull_hold_neither_the_threads_nor_the_other_tenant(
        service: Service):
    """Creates waiting (here on a registry that never answers) held the create threads, and
    the other tenant's GET timed out. Now a tenant has at most max_pending_creates (2)."""
    held = []
    stop = threading.Event()

    def accept() -> None:  # keep the connections open and silent
        HANG.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(HANG.accept()[0])
            except OSError:
                pass

    threading.Thread(target=accept, daemon=True).start()
    try:
        with service.client() as c, service.client("bob") as b:
            body = {"image": f"{HANG_REGISTRY}/never:1", "cpu": 0.1, "memory": "64Mi"}

            def post(_: int) -> httpx.Response:
                with service.client() as own:
                    return own.post("/sandboxes", json=body)

            with ThreadPoolExecutor(12) as pool:  # at once: all of them passed the check
                answers = list(pool.map(post, range(12)))
            ids = [r.json()["sandbox_id"] for r in answers if r.status_code == 202]
            assert len(ids) == 2, [r.status_code for r in answers]
            msg = refusal(next(r for r in answers if r.status_code != 202), 429)
            assert "max_pending_creates" in msg
            assert b.get("/sandboxes", timeout=5).status_code == 200
            sid = create(b)  # the other tenant's create does not wait behind them
            b.delete(f"/sandboxes/{sid}")
    finally:
        stop.set()
        HANG.close()  # nothing listens there any more...
        for s in held:
            s.close()  # ...and the pulls fail now, and the creates with them
    with service.client() as c:
        for sid in ids:
            assert wait_running(c, sid)["status"] == "error"
            c.delete(f"/sandboxes/{sid}")


def test_running_execs_and_kept_results_are_per_tenant(service: Service):
    with service.client() as c, service.client("bob") as b:
        mine = [create(c) for _ in range(2)]
        theirs = create(b)
        first = b.post(f"/sandboxes/{theirs}/execs", json={"command": "echo kept"}).json()
        assert wait_exec(b, theirs, first["exec_id"])["status"] == "completed"
        # one tenant's running execs are bounded...
        for i in range(6):
            r = c.post(f"/sandboxes/{mine[i % 2]}/execs", json={"command": "sleep 30"})
            assert r.status_code == 202, r.text
        msg = refusal(c.post(f"/sandboxes/{mine[0]}/execs", json={"command": "true"}), 429)
        assert "max_running_execs_per_tenant" in msg, msg
        assert run(b, theirs, "echo served")["stdout"] == "served\n"  # the other is served
        for sid in mine:  # deleting ends them and frees the count
            c.delete(f"/sandboxes/{sid}")
        # ...and its output evicts only its own results: 16 x 64 KiB over a 256 KiB share
        sid = create(c)
        for _ in range(16):
            assert run(c, sid, "head -c 65536 /dev/zero | tr '\\0' x")["status"] == "completed"
        r = b.get(f"/sandboxes/{theirs}/execs/{first['exec_id']}")
        assert r.status_code == 200 and r.json()["stdout"] == "kept\n", r.text
        c.delete(f"/sandboxes/{sid}")
        b.delete(f"/sandboxes/{theirs}")


def test_malformed_requests_are_refused_at_the_boundary(service: Service):
    with service.client() as c:
        # a lone surrogate (JSON "\ud800") in a label: it was stored, and every later listing
        # of the tenant answered 500
        raw = '{"image": "' + BUSYBOX + '", "labels": {"k": "\\ud800"}}'
        r = c.post("/sandboxes", content=raw, headers={"content-type": "application/json"})
        assert r.status_code in (400, 422), r.text
        assert c.get("/sandboxes").status_code == 200
        sid = create(c)
        raw = '{"command": "cat", "stdin": "\\udc80"}'
        for path in ("execs", "execs/stream"):
            r = c.post(f"/sandboxes/{sid}/{path}", content=raw,
                       headers={"content-type": "application/json"})
            assert r.status_code in (400, 422), r.text
        r = c.get("/sandboxes", headers={"x-big": "a" * (200 << 10)})
        assert r.status_code == 431, r.text
        r = c.get("/sandboxes", headers=[(f"x-h{i}", "1") for i in range(3000)])
        assert r.status_code == 431, r.text
        assert run(c, sid, "echo fine")["stdout"] == "fine\n"  # and it keeps serving
        c.delete(f"/sandboxes/{sid}")


def test_port_url_traffic_counts_against_its_tenant(service: Service):
    """Requests to a port URL counted against no tenant: 60 to a port that never answers
    made the other tenant's GET time out. They are its tenant's requests now."""
    port = 18081
    with service.client() as c, service.client("bob") as b:
        sid = create(c, network="public", expose_ports=[port])
        # a listener that accepts and never answers
        r = c.post(f"/sandboxes/{sid}/execs", json={"command": f"nc -lk -p {port} >/dev/null"})
        assert r.status_code == 202, r.text
        url = c.post(f"/sandboxes/{sid}/ports/{port}/url", json={}).json()["url"]

        def hit(_: int) -> int:
            try:
                return httpx.get(url, timeout=8).status_code
            except httpx.TimeoutException:
                return 0

        with ThreadPoolExecutor(24) as pool:
            codes = pool.map(hit, range(24))
            time.sleep(0.5)  # the requests are in and hang: the other tenant is served
            assert b.get("/sandboxes", timeout=4).status_code == 200
            codes = sorted(codes)
        # bounded: past its share (8 in flight) the tenant's own requests are refused (how
        # many depends on how many of the others have ended; on a36ccb3 none was)
        assert 429 in codes, codes
        c.delete(f"/sandboxes/{sid}")


def test_terminals_count_among_a_tenants_running_execs(service: Service):
    """Terminals escaped every per-tenant bound: 8 of one tenant took every stream of the
    replica. They are its running execs now (6 here), and the other tenant is served."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    ws_url = service.url.replace("http://", "ws://")
    auth = {"Authorization": f"Bearer {TOKENS['alice']}"}
    with service.client() as c, service.client("bob") as b:
        sid = create(c)
        theirs = create(b)
        opened, refused_code = [], None
        try:
            for _ in range(8):
                ws = connect(f"{ws_url}/sandboxes/{sid}/pty", additional_headers=auth)
                try:
                    ws.send(b"echo up\n")
                    while b"up" not in ws.recv(timeout=30):
                        pass
                    opened.append(ws)
                except ConnectionClosed as exc:
                    refused_code = exc.rcvd.code if exc.rcvd else None
                    ws.close()
                    break
            assert len(opened) == 6 and refused_code == 4429, (len(opened), refused_code)
            assert run(b, theirs, "echo served")["stdout"] == "served\n"
        finally:
            for ws in opened:
                ws.close()
        c.delete(f"/sandboxes/{sid}")
        b.delete(f"/sandboxes/{theirs}")


def _get_when_up(url: str) -> httpx.Response:
    """GET ``url``, retried while the server inside the sandbox is still starting."""
    for _ in range(50):
        r = httpx.get(url, timeout=30)
        if r.status_code != 502:
            return r
        time.sleep(0.2)
    return r


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_app_that_redirects_to_an_absolute_path_works_at_its_own_origin(service: Service):
    """Port URLs were path prefixes, so an app answering ``302 Location: /tree`` (Jupyter)
    sent the browser out of the prefix. The host form, ``<label>.<port_host_suffix>``,
    gives the app its whole origin; the path form keeps working."""
    port = free_port()
    with service.client() as c:
        sid = create(c, network="public", expose_ports=[port], memory="64Mi")
        script = ("mkdir -p /srv/cgi-bin && echo -n tree > /srv/tree.html && "
                  "printf '#!/bin/sh\\necho Status: 302 Found\\necho Location: /tree.html"
                  "\\necho\\n' > /srv/cgi-bin/start && chmod +x /srv/cgi-bin/start && "
                  f"httpd -p {port} -h /srv")
        r = c.post(f"/sandboxes/{sid}/execs", json={"command": script})
        assert wait_exec(c, sid, r.json()["exec_id"])["exit_code"] == 0
        signed = c.post(f"/sandboxes/{sid}/ports/{port}/url", json={}).json()
        origin = httpx.URL(signed["host_url"])
        assert origin.host.endswith(".ports.test") and len(origin.host.split(".")[0]) <= 63
        # the service at its address, named by the Host header (a wildcard DNS name in use)
        at = httpx.URL(service.url).copy_with(path="/")
        host = {"host": f"{origin.host}:{origin.port}" if origin.port else origin.host}

        def get(path: str) -> httpx.Response:
            for _ in range(50):
                r = httpx.get(str(at.join(path)), headers=host, timeout=30)
                if r.status_code != 502:
                    return r
                time.sleep(0.2)
            return r

        first = get("/cgi-bin/start")
        assert (first.status_code, first.headers["location"]) == (302, "/tree.html")
        assert get(first.headers["location"]).text == "tree"  # the redirect stays in the app
        # a forged or foreign label opens nothing; the path form still works
        bad = origin.host.split(".")[0][:-2] + "aa"
        r = httpx.get(str(at.join("/tree.html")),
                      headers={"host": f"{bad}.ports.test:{origin.port}"}, timeout=30)
        assert r.status_code == 401, r.text
        assert _get_when_up(signed["url"] + "/tree.html").text == "tree"
        assert c.delete(f"/sandboxes/{sid}").status_code == 200
