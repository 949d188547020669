"""Pulls that reach only public addresses (``pull_network="public"``): real skopeo against a
real registry behind a "public" front under the test's control, in a topology of the test's
own making::

    node's netns (127.0.0.1: a sink, 198.18.91.1: a sink)  --veth rsbt-p0/p1-->  rsbt-pull
                                                                   198.18.91.2: the fronts, DNS
                                                                   10.99.91.5: a sink (private)

The fronts pass requests to the registry of tests/fx_images.py (on the node's loopback), or
point skopeo elsewhere: an auth realm or a redirect to the node's loopback, its own address or
a private one. With the node's network skopeo goes there (the hole a review found); with
``pull_network="public"`` no sink sees a connection, the pull fails, and nothing of the pull's
namespace is left. Names the pull resolves through its own resolver get the same treatment.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ray_sandbox.runtime import SandboxRuntime, network
from ray_sandbox.runtime.config import SandboxConfig
from ray_sandbox.runtime.errors import RegistryUnreachableError, SandboxError
from ray_sandbox.runtime.images import ImageStore
from ray_sandbox.runtime.network import dns, ip
from ray_sandbox.runtime.network import netns as _netns
from tests.fx_images import assert_store_clean, scratch_dir
from tests.fx_runtime import leftovers

NS, NODE_END, FAR_END = "rsbt-pull", "rsbt-p0", "rsbt-p1"
NODE_SIDE, PUBLIC, PRIVATE = "198.18.91.1", "198.18.91.2", "10.99.91.5"
SECRET = "NODE-LOCAL-SECRET-42"
NAMES = {"good.rsbt.test": PUBLIC, "loop.rsbt.test": "127.0.0.1", "node.rsbt.test": NODE_SIDE,
         "inside.rsbt.test": PRIVATE}
IMAGE = "lab/busybox:latest"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (netns, nft)")


def pull_dirs() -> list[str]:
    from ray_sandbox.runtime.network import pull

    return pull.leftovers()


@dataclass
class Hits:
    """Requests each listener saw: (where, method, path, Authorization)."""

    seen: list[tuple[str, str, str, str | None]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, *hit: str | None) -> None:
        with self.lock:
            self.seen.append(hit)  # type: ignore[arg-type]

    def at(self, where: str) -> list[tuple[str, str, str, str | None]]:
        with self.lock:
            return [h for h in self.seen if h[0] == where]


def _proxy(handler: BaseHTTPRequestHandler, registry: str) -> None:
    """Pass the request to the real registry and its answer back."""
    host, port = registry.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.putrequest(handler.command, handler.path, skip_accept_encoding=True)
        for k, v in handler.headers.items():  # Accept comes several times
            if k.lower() != "host":
                conn.putheader(k, v)
        conn.endheaders()
        resp = conn.getresponse()
        body = resp.read()
    finally:
        conn.close()
    handler.send_response(resp.status)
    for k, v in resp.getheaders():
        if k.lower() not in ("transfer-encoding", "connection", "content-length"):
            handler.send_header(k, v)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(body)


def _answer(handler: BaseHTTPRequestHandler, status: int, body: bytes = b"",
            **headers: str) -> None:
    handler.send_response(status)
    for k, v in headers.items():
        handler.send_header(k.replace("_", "-"), v)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(body)


def handler_class(name: str, hits: Hits, registry: str, mode: str,
                  target: str = "") -> type[BaseHTTPRequestHandler]:
    """``mode``: plain (a proxy), realm (401 naming ``target`` as the token service until a
    bearer token comes), redirect (blobs 302 to ``target``), sink (a node-side service: a
    token for /token, the registry for the rest)."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            auth = self.headers.get("Authorization")
            hits.add(name, self.command, self.path, auth)
            if mode == "sink" and self.path.startswith("/token"):
                body = json.dumps({"Token": SECRET, "expires_in": 300}).encode()
                return _answer(self, 200, body, Content_Type="application/json")
            if mode == "realm" and not (auth or "").startswith("Bearer "):
                return _answer(self, 401, WWW_Authenticate=(
                    f'Bearer realm="http://{target}/token",service="rsbt",scope="x"'))
            if mode == "redirect" and "/blobs/" in self.path:
                return _answer(self, 302, Location=f"http://{target}{self.path}")
            _proxy(self, registry)

        do_HEAD = do_GET

    return Handler


def serve(netns: str | None, addr: str, handler: type[BaseHTTPRequestHandler],
          servers: list[ThreadingHTTPServer]) -> int:
    """An HTTP server whose listening socket is in ``netns``; returns its port."""
    def make() -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, 0))
        s.listen(64)
        return s

    srv = ThreadingHTTPServer((addr, 0), handler, bind_and_activate=False)
    srv.daemon_threads = True
    srv.socket.close()
    srv.socket = _netns.run_in(netns, make)
    srv.server_address = srv.socket.getsockname()
    servers.append(srv)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv.server_address[1]


def _serve_dns(sock: socket.socket) -> None:
    while True:
        try:
            query, peer = sock.recvfrom(4096)
        except OSError:
            return
        if not query:
            return
        name, _, _ = dns.question(query)
        addr = NAMES.get(name)
        sock.sendto(dns.reply(query, dns.NOERROR, [addr], ttl=0) if addr else
                    dns.reply(query, dns.NXDOMAIN), peer)


@dataclass
class Side:
    """The "public" side: what listens where, and what each listener saw."""

    hits: Hits
    ports: dict[str, int]  # front or sink name -> port
    hang: int  # a front that accepts and never answers

    def front(self, name: str, host: str = PUBLIC) -> str:
        return f"{host}:{self.ports[name]}"

    def registries(self) -> list[str]:
        """Every front, by address and by name: plain HTTP (insecure) for skopeo."""
        hosts = [PUBLIC, *NAMES]
        return [f"{h}:{p}" for h in hosts for p in (*self.ports.values(), self.hang)]


@contextmanager
def public_side(registry: str) -> Iterator[Side]:
    ip.netns_delete(NS)  # a previous run that was killed
    ip.link_delete(None, NODE_END)
    ip.netns_add(NS)
    servers: list[ThreadingHTTPServer] = []
    socks: list[socket.socket] = []
    try:
        ip.batch(None, [f"link add {NODE_END} type veth peer name {FAR_END} netns {NS}",
                        f"addr add {NODE_SIDE}/30 dev {NODE_END}", f"link set {NODE_END} up",
                        f"route add {PRIVATE}/32 via {PUBLIC}"])
        ip.batch(NS, ["link set lo up", f"addr add {PUBLIC}/30 dev {FAR_END}",
                      f"link set {FAR_END} up", f"addr add {PRIVATE}/32 dev lo"])
        hits = Hits()
        ports: dict[str, int] = {}
        # the node's side: its loopback and its own address, one port for both
        sink = handler_class("node", hits, registry, "sink")
        ports["node"] = serve(None, "127.0.0.1", sink, servers)
        node_addr = _netns.run_in(None, lambda: socket.socket())
        node_addr.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        node_addr.bind((NODE_SIDE, ports["node"]))
        node_addr.listen(64)
        srv = ThreadingHTTPServer((NODE_SIDE, 0), sink, bind_and_activate=False)
        srv.daemon_threads = True
        srv.socket.close()
        srv.socket = node_addr
        servers.append(srv)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        ports["private"] = serve(NS, PRIVATE, handler_class("private", hits, registry, "sink"),
                                 servers)
        ports["proxy"] = serve(NS, PUBLIC, handler_class("proxy", hits, registry, "sink"),
                               servers)
        loop, node, private = (f"127.0.0.1:{ports['node']}", f"{NODE_SIDE}:{ports['node']}",
                               f"{PRIVATE}:{ports['private']}")
        fronts = {"plain": ("plain", ""), "realm-loop": ("realm", loop),
                  "realm-node": ("realm", node), "redirect-loop": ("redirect", loop),
                  "redirect-private": ("redirect", private)}
        for name, (mode, target) in fronts.items():
            ports[name] = serve(NS, PUBLIC, handler_class(name, hits, registry, mode, target),
                                servers)
        resolver = _netns.run_in(NS, lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
        resolver.bind((PUBLIC, 53))
        socks.append(resolver)
        threading.Thread(target=_serve_dns, args=(resolver,), daemon=True).start()
        hang = _netns.run_in(NS, lambda: socket.socket())
        hang.bind((PUBLIC, 0))
        hang.listen(64)
        socks.append(hang)
        yield Side(hits, ports, hang.getsockname()[1])
    finally:
        for srv in servers:
            srv.shutdown()
            srv.server_close()
        for s in socks:
            with suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        ip.link_delete(None, NODE_END)
        ip.netns_delete(NS)


@pytest.fixture(scope="module")
def side(registry: str, pushed_busybox: str) -> Iterator[Side]:
    with public_side(registry) as s:
        yield s


@pytest.fixture
def pull_dns(side: Side, monkeypatch: pytest.MonkeyPatch) -> None:
    """Isolated pulls resolve through the test's resolver on the public side."""
    monkeypatch.setenv("RAY_SANDBOX_NET_PULL_DNS", PUBLIC)


@pytest.fixture
def no_leaks() -> Iterator[None]:
    """No namespace, table, helper process or lease of a pull is left (objects of other runs
    that existed before excepted), and no pull directory."""
    before = network.leftovers()
    yield
    left = {k: new for k, v in network.leftovers().items() if (new := set(v) - set(before[k]))}
    assert not left, f"network leftovers: {left}"
    assert pull_dirs() == [], pull_dirs()


@pytest.fixture
def store(side: Side) -> Iterator[ImageStore]:
    with scratch_dir("rsb-pull-store-") as root:
        yield ImageStore(root / "images", insecure_registries=side.registries())


def test_the_realm_reaches_the_nodes_loopback_from_the_nodes_network(side: Side,
                                                                      store: ImageStore):
    """The hole, shown on the node's network: the token service named by the realm is on
    the node's loopback, and what it answered went back to the tenant's registry."""
    n = len(side.hits.at("node"))
    store.get(f"{side.front('realm-loop')}/{IMAGE}")
    assert {h[2].split("?")[0] for h in side.hits.at("node")[n:]} == {"/token"}
    assert f"Bearer {SECRET}" in {h[3] for h in side.hits.at("realm-loop")}


@pytest.mark.parametrize("front", ["realm-loop", "realm-node"])
def test_an_isolated_pull_never_reaches_the_realm_on_the_nodes_side(
        side: Side, store: ImageStore, no_leaks: None, front: str):
    n = len(side.hits.seen)
    with pytest.raises(RegistryUnreachableError) as info:
        store.get(f"{side.front(front)}/{IMAGE}", network="public")
    assert "/token" in info.value.message and "connection refused" in info.value.message
    assert side.hits.at("node") == [h for h in side.hits.seen[:n] if h[0] == "node"]
    assert SECRET not in json.dumps(side.hits.seen[n:])
    assert side.hits.at(front)  # the front itself was reached: the path out works
    assert_store_clean(store)


@pytest.mark.parametrize("front,sink", [("redirect-loop", "node"),
                                        ("redirect-private", "private")])
def test_redirects_to_the_nodes_loopback_or_a_private_address(
        side: Side, store: ImageStore, front: str, sink: str):
    """On the node's network the blobs come from wherever the front sends them; an isolated
    pull is refused there and stores nothing."""
    n = len(side.hits.at(sink))
    store.get(f"{side.front(front)}/{IMAGE}")
    assert any("/blobs/" in h[2] for h in side.hits.at(sink)[n:])
    with scratch_dir("rsb-pull-store-") as root:
        isolated = ImageStore(root / "images", insecure_registries=side.registries())
        n = len(side.hits.at(sink))
        with pytest.raises(RegistryUnreachableError) as info:
            isolated.get(f"{side.front(front)}/{IMAGE}", network="public")
        assert "/blobs/" in info.value.message and "connection refused" in info.value.message
        assert side.hits.at(sink)[n:] == []
        assert_store_clean(isolated)


@pytest.mark.parametrize("name", ["loop.rsbt.test", "node.rsbt.test", "inside.rsbt.test"])
def test_a_name_that_resolves_to_the_nodes_side_reaches_nothing(
        side: Side, store: ImageStore, pull_dns: None, no_leaks: None, name: str):
    """Resolved at pull time (after any check of the reference), inside the namespace: an
    answer on the node's side or a private one opens nothing (DNS rebinding)."""
    port = side.ports["node"] if name != "inside.rsbt.test" else side.ports["private"]
    n = len(side.hits.seen)
    with pytest.raises(RegistryUnreachableError) as info:
        store.get(f"{name}:{port}/{IMAGE}", network="public")
    assert f"{NAMES[name]}:{port}: connect: connection refused" in info.value.message
    assert side.hits.seen[n:] == []


def test_an_isolated_pull_works_by_address_and_by_name(side: Side, store: ImageStore,
                                                       pull_dns: None, no_leaks: None):
    image = store.get(f"{side.front('plain')}/{IMAGE}", network="public")
    by_name = store.get(f"good.rsbt.test:{side.ports['plain']}/{IMAGE}", network="public")
    assert by_name.digest == image.digest
    assert Path(image.rootfs, "bin", "busybox").exists()


def test_an_isolated_pull_uses_no_proxy(side: Side, store: ImageStore, no_leaks: None,
                                        monkeypatch: pytest.MonkeyPatch):
    """A proxy connects for the pull wherever the proxy reaches, and the namespace would see
    only the proxy's address: an isolated pull goes without one."""
    for var in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.setenv(var, f"http://{side.front('proxy')}")
    ref = f"{side.front('plain')}/{IMAGE}"
    n = len(side.hits.at("proxy"))
    with suppress(SandboxError):
        store.get(ref)  # the node's network: through the proxy
    assert side.hits.at("proxy")[n:]
    with scratch_dir("rsb-pull-store-") as root:
        isolated = ImageStore(root / "images", insecure_registries=side.registries())
        n = len(side.hits.at("proxy"))
        isolated.get(ref, network="public")
        assert side.hits.at("proxy")[n:] == []


def test_a_stored_image_is_not_pulled_again(side: Side, store: ImageStore, no_leaks: None):
    """The cache answers whichever network pulled the image first: an isolated get of an
    image pulled on the node's network starts nothing and asks no registry."""
    ref = f"{side.front('plain')}/{IMAGE}"
    first = store.get(ref)
    n = len(side.hits.seen)
    assert store.get(ref, network="public").digest == first.digest
    assert side.hits.seen[n:] == []
    # another name of the same image is fetched (through the namespace) and finds it stored
    pinned = f"{side.front('plain')}/lab/busybox@{first.digest}"
    assert store.get(pinned, network="public").digest == first.digest
    assert len(store.list()) == 2 and {i.digest for i in store.list()} == {first.digest}


def test_a_sandbox_runs_from_an_isolated_pull(side: Side, tmp_path: Path, no_leaks: None):
    with scratch_dir("rsb-pull-store-") as root:
        images = ImageStore(root / "images", insecure_registries=side.registries())
        rt = SandboxRuntime(tmp_path / "home", images=images)
        try:
            sid = rt.create(SandboxConfig(image=f"{side.front('plain')}/{IMAGE}",
                                          pull_network="public", memory="64Mi", cpu=0.2))
            assert rt.exec(sid, ["echo", "hi"]).stdout == "hi\n"
            rt.delete(sid)
            with pytest.raises(SandboxError):  # and a tenant's realm trick fails the create
                rt.create(SandboxConfig(image=f"{side.front('realm-loop')}/{IMAGE}",
                                        pull_network="public", memory="64Mi"))
        finally:
            rt.close()
            rt.gc()
        assert leftovers(tmp_path / "home", store=images.root) == {}


PULLER = """
import sys
from ray_sandbox.runtime.images import ImageStore
ImageStore(sys.argv[1], insecure_registries=[sys.argv[2]]).get(
    sys.argv[2] + "/lab/x:1", network="public")
"""


def test_a_pull_whose_process_died_is_removed_by_gc(side: Side, tmp_path: Path,
                                                    no_leaks: None):
    """A process killed during an isolated pull leaves its namespace, helpers and skopeo;
    the next gc on the node (here a runtime's) removes them all."""
    before = set(network.leftovers()["netns"])
    hang = f"{PUBLIC}:{side.hang}"
    proc = subprocess.Popen([sys.executable, "-c", PULLER, str(tmp_path / "images"), hang],
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not pull_dirs() or set(network.leftovers()["netns"]) == before:
            assert proc.poll() is None and time.monotonic() < deadline, "no pull started"
            time.sleep(0.05)
        while not (skopeo := pulling(hang)):
            assert proc.poll() is None and time.monotonic() < deadline, "no skopeo started"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    assert pull_dirs() and pulling(hang) == skopeo  # all of it outlived the process
    rt = SandboxRuntime(tmp_path / "home")
    try:
        rt.gc()
    finally:
        rt.close()
    assert pulling(hang) == []


def pulling(registry: str) -> list[int]:
    """PIDs of the skopeo processes pulling from ``registry`` (zombies excepted)."""
    found = []
    for p in Path("/proc").iterdir():
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0")
            state = (p / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if argv and argv[0].endswith(b"skopeo") and state != "Z" and any(
                registry.encode() in a for a in argv):
            found.append(int(p.name))
    return sorted(found)
