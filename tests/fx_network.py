"""Fixtures for the network tests: a fake internet in test namespaces, a busybox bundle and a
small runsc runner (raw runsc through the runtime's wrapper, one sandbox per ``with``).

Topology (all test objects are named ``rsbt-*``, never ``rsb-*``, so ``leftovers()`` stays
about the package)::

    sandbox netns --slirp4netns / veth+NAT--> rsbt-node  --veth-->  rsbt-inet
                                              (stands for the node:   web 198.18.1.1, web2 .1.2,
                                               198.18.0.1, a server    dns 198.18.1.53, metadata
                                               on its loopback)        169.254.169.254, private
                                                                       10.99.0.1, api .3.1 and
                                                                       other .3.2 (HTTPS, started
                                                                       by tests/fx_inject.py)
Traffic never leaves these namespaces (the node's own namespace is only used for loopback).
"""

from __future__ import annotations

import json
import secrets
import shutil
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ray_sandbox.runtime import _proc, _subreaper, bundle, network
from ray_sandbox.runtime.config import SandboxConfig
from ray_sandbox.runtime.errors import SandboxError
from ray_sandbox.runtime.network import dns, ip
from ray_sandbox.runtime.network import netns as _netns
from ray_sandbox.runtime.runsc import Runsc, RunscFlags

NODE, INET = "rsbt-node", "rsbt-inet"
NODE_ADDR, INET_ADDR = "198.18.0.1", "198.18.0.2"
WEB, WEB2, DNS_SERVER = "198.18.1.1", "198.18.1.2", "198.18.1.53"
METADATA, PRIVATE = "169.254.169.254", "10.99.0.1"
API, OTHER = "198.18.3.1", "198.18.3.2"  # HTTPS upstreams of the injection tests (their own)
NAMES = {"web.test": WEB, "web2.test": WEB2, "meta.test": METADATA, "private.test": PRIVATE,
         "api.test": API, "other.test": OTHER}
NODE_PORT = 8081  # a server on the fake node's loopback and its own address
BLOB = 64 << 20

FETCH_C = r"""
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
/* fetch IP PORT PATH: HTTP/1.0 GET, prints "<bytes> <seconds>"; 1 MiB reads, so a download
   measures the network path and not the syscall cost of a small-buffer client. */
int main(int argc, char **argv) {
    if (argc != 4) return 2;
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[2]))};
    if (inet_pton(AF_INET, argv[1], &sa.sin_addr) != 1) return 2;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) { perror("connect"); return 1; }
    char req[512];
    int n = snprintf(req, sizeof req, "GET %s HTTP/1.0\r\n\r\n", argv[3]);
    if (write(fd, req, n) != n) return 1;
    static char buf[1 << 20];
    long long total = 0;
    ssize_t r;
    while ((r = read(fd, buf, sizeof buf)) > 0) total += r;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("%lld %.6f\n", total, (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9);
    return r < 0;
}
"""


# --- servers ------------------------------------------------------------------------------


def _http_body(path: str, local: str, tag: str) -> bytes:
    if path == "/blob":
        return bytes(BLOB)
    return f"{tag} {local}\n".encode()


def _serve_http(sock: socket.socket, tag: str) -> None:
    def one(conn: socket.socket) -> None:
        with conn:
            req = b""
            while b"\r\n\r\n" not in req and (chunk := conn.recv(4096)):
                req += chunk
            parts = req.split(b" ")
            path = parts[1].decode() if len(parts) > 1 else "/"
            body = _http_body(path, conn.getsockname()[0], tag)
            with suppress(OSError):
                conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
                conn.sendall(body)

    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        threading.Thread(target=one, args=(conn,), daemon=True).start()


def _serve_dns(sock: socket.socket) -> None:
    while True:
        try:
            query, peer = sock.recvfrom(4096)
        except OSError:
            return
        if not query:
            return  # shut down
        name, _, _ = dns.question(query)
        addr = NAMES.get(name)
        answer = dns.reply(query, dns.NOERROR, [addr], ttl=30) if addr else dns.reply(
            query, dns.NXDOMAIN)
        sock.sendto(answer, peer)


def _listen(netns: str | None, addr: str, port: int, kind: int = socket.SOCK_STREAM):
    def make() -> socket.socket:
        s = socket.socket(socket.AF_INET, kind)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, port))
        if kind == socket.SOCK_STREAM:
            s.listen(128)
        return s

    return _netns.run_in(netns, make)


@dataclass
class Servers:
    sockets: list[socket.socket] = field(default_factory=list)

    def add(self, sock: socket.socket, target, *args) -> socket.socket:
        self.sockets.append(sock)
        threading.Thread(target=target, args=(sock, *args), daemon=True).start()
        return sock

    def close(self) -> None:
        for s in self.sockets:
            with suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


@dataclass(frozen=True)
class FakeInternet:
    node: str = NODE
    inet: str = INET


@contextmanager
def running_fake_internet() -> Iterator[FakeInternet]:
    """rsbt-node (the stand-in node) and rsbt-inet (the internet) with their servers."""
    for name in (NODE, INET):
        ip.netns_delete(name)  # a previous run that was killed
        ip.netns_add(name)
    servers = Servers()
    try:
        ip.batch(NODE, [
            "link set lo up",
            f"link add rsbt-n0 type veth peer name rsbt-i0 netns {INET}",
            f"addr add {NODE_ADDR}/30 dev rsbt-n0",
            "link set rsbt-n0 up",
            f"route add default via {INET_ADDR}",
        ])  # fmt: skip
        inet_addrs = [WEB, WEB2, DNS_SERVER, METADATA, PRIVATE, API, OTHER]
        ip.batch(INET, [
            "link set lo up", f"addr add {INET_ADDR}/30 dev rsbt-i0", "link set rsbt-i0 up",
            *(f"addr add {a}/32 dev lo" for a in inet_addrs),
        ])  # fmt: skip
        servers.add(_listen(INET, "0.0.0.0", 80), _serve_http, "inet")
        servers.add(_listen(INET, DNS_SERVER, 53, socket.SOCK_DGRAM), _serve_dns)
        servers.add(_listen(NODE, "0.0.0.0", NODE_PORT), _serve_http, "node")
        yield FakeInternet()
    finally:
        servers.close()
        for name in (NODE, INET):
            ip.netns_delete(name)


@contextmanager
def host_http() -> Iterator[int]:
    """An HTTP server on the node's own 127.0.0.1; yields its port."""
    servers = Servers()
    try:
        yield servers.add(_listen(None, "127.0.0.1", 0), _serve_http, "host").getsockname()[1]
    finally:
        servers.close()


@pytest.fixture(scope="session")
def fake_internet() -> Iterator[FakeInternet]:
    with running_fake_internet() as inet:
        yield inet


@pytest.fixture
def upstream(fake_internet: FakeInternet, monkeypatch: pytest.MonkeyPatch) -> FakeInternet:
    """Make rsbt-node the upstream of every sandbox network attached in the test."""
    monkeypatch.setenv("RAY_SANDBOX_NET_UPSTREAM", fake_internet.node)
    return fake_internet


@pytest.fixture
def net_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private RAY_SANDBOX_HOME, so node-wide network state of tests is their own."""
    home = tmp_path_factory.mktemp("rsbhome")
    monkeypatch.setenv("RAY_SANDBOX_HOME", str(home))
    return home


@pytest.fixture
def host_server() -> Iterator[int]:
    with host_http() as port:
        yield port


# --- sandboxes ------------------------------------------------------------------------------


def build_rootfs(root: Path) -> Path:
    """busybox rootfs (docs/platform.md, "A busybox rootfs") plus /bin/fetch, a static
    big-buffer HTTP client."""
    rootfs = root / "rootfs"
    for d in ("bin", "etc", "tmp", "proc", "dev", "sys", "root"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    busybox = shutil.which("busybox") or "/bin/busybox"
    shutil.copy(busybox, rootfs / "bin" / "busybox")
    applets = _proc.run([busybox, "--list"], timeout=10).stdout.decode().split()
    for applet in applets:
        if applet != "busybox":
            (rootfs / "bin" / applet).symlink_to("busybox")
    (rootfs / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (rootfs / "etc" / "group").write_text("root:x:0:\n")
    for f in ("resolv.conf", "hosts"):
        (rootfs / "etc" / f).write_text("")  # mount points
    (rootfs / "tmp").chmod(0o1777)
    src = root / "fetch.c"
    src.write_text(FETCH_C)
    _proc.run(["gcc", "-O2", "-static", "-o", str(rootfs / "bin" / "fetch"), str(src)],
              timeout=120)
    return rootfs


def oci_spec(rootfs: Path, att: network.NetworkAttachment, state_dir: Path) -> dict:
    mounts = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["ro"]},
        {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["mode=1777"]},
    ]
    (state_dir / "hosts").write_text(att.hosts)
    files = {"/etc/hosts": state_dir / "hosts"}
    if att.resolv_conf is not None:
        (state_dir / "resolv.conf").write_text(att.resolv_conf)
        files["/etc/resolv.conf"] = state_dir / "resolv.conf"
    mounts += [{"destination": d, "type": "bind", "source": str(s), "options": ["rbind", "ro"]}
               for d, s in files.items()]
    namespaces = [{"type": t} for t in ("pid", "ipc", "uts", "mount")]
    if att.netns_path:
        namespaces.append({"type": "network", "path": att.netns_path})
    elif att.runsc_network == "none":
        namespaces.append({"type": "network"})
    linux: dict = {"namespaces": namespaces}
    if att.netns_path and att.runsc_network == "host":  # "public": as build_spec does it
        userns, maps = bundle.identity_user_namespace()
        namespaces.append(userns.model_dump(exclude_none=True))
        linux["uidMappings"] = linux["gidMappings"] = [m.model_dump() for m in maps]
    return {
        "ociVersion": "1.0.2",
        "process": {"terminal": False, "user": {"uid": 0, "gid": 0}, "cwd": "/",
                    "args": ["/bin/sleep", "1000000"], "env": ["PATH=/bin"]},
        "root": {"path": str(rootfs), "readonly": True},
        "hostname": "sbx",
        "mounts": mounts,
        "linux": linux,
    }


@dataclass
class Box:
    runsc: Runsc
    sandbox_id: str
    attachment: network.NetworkAttachment
    state_dir: Path

    def sh(self, script: str, timeout: float = 20) -> _proc.Completed:
        return self.runsc.exec(self.sandbox_id, ["sh", "-c", script], timeout=timeout)

    def http(self, host: str, port: int = 80, path: str = "/") -> str:
        """Body of an HTTP GET (busybox nc; wget misbehaves in gVisor), '' if it failed."""
        done = self.sh(f"printf 'GET {path} HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {host} {port}")
        out = done.stdout.decode(errors="replace")
        return out.split("\r\n\r\n", 1)[1] if " 200 OK" in out else ""

    def lookup(self, name: str) -> str | None:
        """The address busybox nslookup gets for ``name`` through /etc/resolv.conf."""
        out = self.sh(f"nslookup {name}").stdout.decode(errors="replace")
        answer = out.split(name, 1)[-1] if "Name:" in out or name in out else ""
        for word in answer.split():
            if word.count(".") == 3 and word.replace(".", "").isdigit():
                return word
        return None

    def fetch(self, host: str, port: int = 80, path: str = "/blob") -> tuple[int, float]:
        done = self.sh(f"fetch {host} {port} {path}", timeout=120)
        nbytes, seconds = done.stdout.decode().split()
        return int(nbytes), float(seconds)


class Sandboxes:
    """Starts busybox sandboxes with a given network config, the way the runtime will."""

    def __init__(self, base: Path, rootfs: Path) -> None:
        self.base = base
        self.rootfs = rootfs
        self.runsc = Runsc(base / "runsc", platform="ptrace")

    @contextmanager
    def run(self, config: SandboxConfig) -> Iterator[Box]:
        sid = secrets.token_hex(16)
        state_dir = self.base / sid
        state_dir.mkdir(parents=True)
        att = network.attach(sid, config, state_dir)
        try:
            bundle = state_dir / "bundle"
            bundle.mkdir()
            spec = oci_spec(self.rootfs, att, state_dir)
            (bundle / "config.json").write_text(json.dumps(spec))
            flags = RunscFlags(network=att.runsc_network, overlay="none", platform="ptrace")
            self.runsc.run_detached(sid, bundle, flags, prefix=att.run_prefix,
                                    log_dir=state_dir)
            yield Box(self.runsc, sid, att, state_dir)
        finally:
            with suppress(SandboxError):
                self.runsc.delete(sid)
            network.detach(sid, state_dir)


@pytest.fixture(scope="session")
def busybox_rootfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("runsc") is None:
        pytest.skip("runsc is not installed")
    return build_rootfs(tmp_path_factory.mktemp("rsbt-rootfs"))


@pytest.fixture
def sandboxes(busybox_rootfs: Path, net_home: Path) -> Iterator[Sandboxes]:
    _subreaper.ensure()  # fast runsc delete (docs/platform.md, "Orphaned runsc processes")
    yield Sandboxes(net_home / "sandboxes", busybox_rootfs)


@pytest.fixture
def clean_network(net_home: Path) -> Iterator[None]:
    """Asserts the test left no namespace, link, table, process, mount or lease behind (objects
    that existed before it, e.g. of a concurrent run with another RAY_SANDBOX_HOME, excepted)."""
    before = network.leftovers()
    yield
    left = {k: new for k, v in network.leftovers().items() if (new := set(v) - set(before[k]))}
    assert not left, f"network leftovers: {left}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

