"""A "public" side for image pull tests, in a topology of the test's own making::

    node's netns (127.0.0.1: a sink, 192.88.99.1: a sink)  --veth rsbt-p0/p1-->  rsbt-pull
                                                                   192.88.99.2: the fronts, DNS
                                                                   10.99.91.5: a sink (private)

The fronts pass requests to a real registry (tests/fx_images.py, on the node's loopback), or
point skopeo elsewhere: an auth realm or a redirect to the node's loopback, its own address or
a private one. Sinks stand for services on the node's side and record what reaches them.
The "public" /30 is a global block (192.88.99.0/24, the deprecated 6to4 relay anycast, which
carries no HTTP), routed to the test's namespace only while the side runs: the service refuses
tenants the benchmarking and documentation ranges, so a registry there would never reach a
pull. Everything is named ``rsbt-*`` (never ``rsb-*``), so ``network.leftovers()`` stays about
the package; the namespace and the veth are removed at exit.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from ray_sandbox.runtime import _proc
from ray_sandbox.runtime.network import dns, ip
from ray_sandbox.runtime.network import netns as _netns

NS, NODE_END, FAR_END = "rsbt-pull", "rsbt-p0", "rsbt-p1"
NODE_SIDE, PUBLIC, PRIVATE = "192.88.99.1", "192.88.99.2", "10.99.91.5"
SECRET = "NODE-LOCAL-SECRET-42"
NAMES = {"good.rsbt.test": PUBLIC, "loop.rsbt.test": "127.0.0.1", "node.rsbt.test": NODE_SIDE,
         "inside.rsbt.test": PRIVATE}
IMAGE = "lab/busybox:latest"

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
          servers: list[ThreadingHTTPServer], *, port: int = 0,
          tls: ssl.SSLContext | None = None) -> int:
    """An HTTP(S) server whose listening socket is in ``netns``; returns its port."""
    def make() -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, port))
        s.listen(64)
        return tls.wrap_socket(s, server_side=True) if tls else s

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
        """Every front, by address and by name (to reach over plain HTTP, or to trust)."""
        hosts = [PUBLIC, *NAMES]
        return [f"{h}:{p}" for h in hosts for p in (*self.ports.values(), self.hang)]


def tls_material(root: Path) -> tuple[ssl.SSLContext, Path]:
    """A CA and a server certificate for PUBLIC (and good.rsbt.test): the fronts' context
    and the CA's file."""
    def openssl(*args: str) -> None:
        _proc.run(["openssl", *args], timeout=60)

    ca, ca_key, key, csr, crt = (root / n for n in ("ca.crt", "ca.key", "srv.key", "srv.csr",
                                                   "srv.crt"))
    ext = root / "ext"
    ext.write_text(f"subjectAltName=IP:{PUBLIC},DNS:good.rsbt.test\n")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
            "/CN=rsbt-ca", "-keyout", str(ca_key), "-out", str(ca))
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={PUBLIC}", "-keyout",
            str(key), "-out", str(csr))
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
            "-CAcreateserial", "-days", "1", "-extfile", str(ext), "-out", str(crt))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(crt, key)
    return ctx, ca


CERTS_D = Path("/etc/containers/certs.d")


@contextmanager
def trusted(ca: Path, registries: list[str]) -> Iterator[None]:
    """skopeo trusts ``ca`` for ``registries`` (``certs.d/HOST:PORT/ca.crt``) until exit; the
    directories made are removed again."""
    made_root = not CERTS_D.exists()
    made = []
    try:
        for reg in registries:
            d = CERTS_D / reg
            d.mkdir(parents=True)
            made.append(d)
            (d / "ca.crt").write_bytes(ca.read_bytes())
        yield
    finally:
        for d in made:
            (d / "ca.crt").unlink(missing_ok=True)
            d.rmdir()
        if made_root and CERTS_D.exists():
            CERTS_D.rmdir()


@contextmanager
def public_side(registry: str, tls: ssl.SSLContext | None = None) -> Iterator[Side]:
    """The topology and its servers; with ``tls`` the fronts speak HTTPS (the sinks, which
    stand for the node's side, plain HTTP)."""
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
        serve(None, NODE_SIDE, sink, servers, port=ports["node"])
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
                                servers, tls=tls)
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


