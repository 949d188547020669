"""The per-sandbox filtering DNS forwarder, and the few DNS message helpers it needs.

The sandbox's /etc/resolv.conf points here. The helper answers a name only if the egress policy
permits it (every name under ``default="allow"``, only ``allow_domains`` under ``"deny"``),
forwards it to the configured upstream resolvers, and, for allowlisted names, adds the returned
addresses to the sandbox's nft ``dyn`` set *before* answering, so the connection that follows the
lookup is already allowed. It runs in the upstream namespace (its own queries never pass the
sandbox's filter) while its listening sockets, bound by :func:`start`'s caller and inherited,
sit where the sandbox can reach them. Imports stay light: this is one process per sandbox.

For a sandbox created with ``EgressPolicy.inject`` it also runs the sandbox's egress proxy
(``inject.py``, in a thread): lookups of a name an inject rule covers are answered with the
proxy's address (A only; other types get an empty answer), so HTTPS to those names goes
through the proxy and nothing else does.

Run as ``python -m ray_sandbox.runtime.network.dns CONFIG.json --tag rsb-<tag>``; SIGHUP
re-reads the policy file, SIGTERM stops it.
"""

from __future__ import annotations

import ctypes
import ipaddress
import json
import os
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from queue import Full, Queue
from subprocess import Popen
from typing import Any

from .. import _proc
from ..errors import SandboxError
from . import netns as _netns
from . import nft, policy

DEFAULT_UPSTREAMS = ("1.1.1.1", "8.8.8.8")
MODULE = "ray_sandbox.runtime.network.dns"
A, AAAA = 1, 28
NOERROR, SERVFAIL, NXDOMAIN, REFUSED = 0, 2, 3, 5
_UPSTREAM_TIMEOUT = 2.0
# The helper runs as root outside every sandbox cgroup, so what a sandbox can make it spend is
# capped here: a fixed number of threads and queued queries, whatever the sandbox sends.
UDP_WORKERS = 8  # queries resolved at once (each may wait _UPSTREAM_TIMEOUT per upstream)
UDP_BACKLOG = 256  # queries waiting for a worker; more are dropped, as by a busy resolver
TCP_MAX_CONNS = 32  # open TCP connections, one thread each; more are closed at once
TCP_MAX_QUERIES = 64  # per connection, then it is closed
TCP_DEADLINE = 20.0  # seconds a TCP connection may stay open, however slowly it sends
MAX_THREADS = 3 + UDP_WORKERS + TCP_MAX_CONNS  # + main, the UDP reader, the TCP acceptor
# with the egress proxy: its loop and its 4 resolver threads
MAX_THREADS_INJECT = MAX_THREADS + 5
STEER_TTL = 10  # seconds a sandbox may keep the proxy's address for an injecting name


def resolv_conf(server: str) -> str:
    return f"nameserver {server}\noptions timeout:2 attempts:2\n"


# --- messages -------------------------------------------------------------------------------


def _name(msg: bytes, off: int) -> tuple[str, int]:
    """Decode a (possibly compressed) name at ``off``; returns it and the offset after it."""
    labels: list[str] = []
    end = None
    for _ in range(128):  # bounds pointer loops
        n = msg[off]
        if n & 0xC0 == 0xC0:
            end = off + 2 if end is None else end
            off = struct.unpack_from("!H", msg, off)[0] & 0x3FFF
            continue
        if n == 0:
            return ".".join(labels).lower(), (off + 1 if end is None else end)
        labels.append(msg[off + 1 : off + 1 + n].decode("ascii", "replace"))
        off += 1 + n
    raise ValueError("name too long")


def question(msg: bytes) -> tuple[str, int, int]:
    """(name, qtype, offset after the question) of a one-question message."""
    if len(msg) < 12 or struct.unpack_from("!H", msg, 4)[0] != 1:
        raise ValueError("not a single-question DNS message")
    name, off = _name(msg, 12)
    qtype = struct.unpack_from("!H", msg, off)[0]
    return name, qtype, off + 4


def addresses(msg: bytes) -> list[tuple[str, int]]:
    """(address, ttl) of every A/AAAA record in the answer section."""
    _, _, off = question(msg)
    out = []
    for _ in range(struct.unpack_from("!H", msg, 6)[0]):
        _, off = _name(msg, off)
        rtype, _cls, ttl, rdlen = struct.unpack_from("!HHIH", msg, off)
        off += 10
        data = msg[off : off + rdlen]
        if rtype == A and rdlen == 4:
            out.append((str(ipaddress.IPv4Address(data)), ttl))
        elif rtype == AAAA and rdlen == 16:
            out.append((str(ipaddress.IPv6Address(data)), ttl))
        off += rdlen
    return out


def query(name: str, qtype: int, qid: int = 0) -> bytes:
    """A recursive query for ``name``."""
    labels = b"".join(bytes([len(p)]) + p.encode("ascii") for p in name.split(".") if p)
    return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + labels + b"\0" + \
        struct.pack("!HH", qtype, 1)


def reply(query: bytes, rcode: int, answers: Sequence[str] = (), ttl: int = 60) -> bytes:
    """A response to ``query`` carrying ``answers`` (addresses of the queried type)."""
    _, qtype, end = question(query)
    records = b""
    count = 0
    for a in answers:
        ip = ipaddress.ip_address(a)
        if (qtype, ip.version) in ((A, 4), (AAAA, 6)):
            rtype = A if ip.version == 4 else AAAA
            records += struct.pack("!HHHIH", 0xC00C, rtype, 1, ttl, len(ip.packed)) + ip.packed
            count += 1
    flags = 0x8180 | (struct.unpack_from("!H", query, 2)[0] & 0x0100) | rcode
    header = struct.pack("!HHHHHH", struct.unpack_from("!H", query)[0], flags, 1, count, 0, 0)
    return header + query[12:end] + records


# --- the helper -----------------------------------------------------------------------------


class Helper:
    """State of one running helper; :meth:`resolve` is the whole decision for one query."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.table: str = cfg["table"]
        self.nft_netns: str | None = cfg["nft_netns"]
        self.upstreams: list[str] = cfg["upstreams"]
        self.policy_path = Path(cfg["policy_path"])
        self.cache_path = Path(cfg["cache_path"])
        self.udp = socket.socket(fileno=cfg["udp_fd"])
        self.tcp = socket.socket(fileno=cfg["tcp_fd"])
        # the sandbox's published ports, held (never accepted from) while it lives
        self.held = [socket.socket(fileno=fd) for fd in cfg.get("held_fds", ())]
        self.lock = threading.Lock()
        self.cache: dict[str, tuple[str, float]] = {}  # address -> (name, expiry)
        self.domains: tuple[str, ...] = ()
        self.default = "allow"
        self.steer_to: str | None = cfg.get("inject", {}).get("steer_to")  # the proxy
        self.injecting: tuple[str, ...] = ()
        self.reload()

    def reload(self) -> None:
        """Re-read the policy; re-admit cached addresses of names that are still allowed (the
        policy update flushed the dyn sets)."""
        rules = json.loads(self.policy_path.read_text())
        with self.lock:
            self.domains = tuple(rules["allow_domains"])
            self.default = rules["default"]
            self.injecting = tuple(r["domain"] for r in rules.get("inject", ()))
            now = time.time()
            self.cache = {a: (n, exp) for a, (n, exp) in self.cache.items()
                          if exp > now and policy.domain_allowed(n, self.domains)}
            keep = {a: exp - now for a, (_, exp) in self.cache.items()}
        try:
            self._admit(keep)
        except SandboxError as exc:
            print(f"cannot re-admit cached addresses: {exc}", file=sys.stderr, flush=True)

    def permitted(self, name: str) -> bool:
        return self.default == "allow" or policy.domain_allowed(name, self.domains)

    def resolve(self, query: bytes) -> bytes | None:
        try:
            name, _, _ = question(query)
        except (ValueError, IndexError, struct.error):
            return None
        if not self.permitted(name):
            return reply(query, REFUSED)
        if self.steer_to and policy.domain_allowed(name, self.injecting):
            return reply(query, NOERROR, [self.steer_to], ttl=STEER_TTL)
        answer = self._forward(query)
        if answer is None:
            return reply(query, SERVFAIL)
        if policy.domain_allowed(name, self.domains):
            try:
                found = {a: policy.dns_timeout(ttl) for a, ttl in addresses(answer)}
            except (ValueError, IndexError, struct.error):
                return reply(query, SERVFAIL)
            try:
                self._admit(found)
            except SandboxError as exc:  # never hand out an address the sandbox cannot reach
                print(f"cannot admit {sorted(found)}: {exc}", file=sys.stderr, flush=True)
                return reply(query, SERVFAIL)
            with self.lock:
                exp = time.time()
                self.cache.update({a: (name, exp + t) for a, t in found.items()})
                self._save()
        return answer

    def lookup(self, name: str) -> list[str]:
        """``name``'s addresses from the upstream resolvers (IPv4 first), for the proxy:
        never the steered answer, never the node's resolver."""
        out: list[str] = []
        for qtype in (A, AAAA):
            if out:
                break
            answer = self._forward(query(name, qtype, int.from_bytes(os.urandom(2), "big")))
            try:
                out += [a for a, _ in addresses(answer)] if answer else []
            except (ValueError, IndexError, struct.error):
                continue
        return list(dict.fromkeys(out))

    def _admit(self, found: Mapping[str, float]) -> None:
        if found:
            nft.apply(self.nft_netns, "\n".join(policy.dyn_elements(self.table, found)) + "\n")

    def _save(self) -> None:
        tmp = self.cache_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.cache))
        os.replace(tmp, self.cache_path)

    def _forward(self, query: bytes) -> bytes | None:
        for server in self.upstreams:
            family = socket.AF_INET6 if ":" in server else socket.AF_INET
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.settimeout(_UPSTREAM_TIMEOUT)
                try:
                    s.sendto(query, (server, 53))
                    data = s.recv(65535)
                except OSError:
                    continue
            if data[:2] != query[:2]:
                continue
            if data[2] & 0x02:  # truncated: ask again over TCP
                data = self._forward_tcp(server, family, query) or data
            return data
        return None

    @staticmethod
    def _forward_tcp(server: str, family: int, query: bytes) -> bytes | None:
        deadline = time.monotonic() + _UPSTREAM_TIMEOUT
        try:
            with socket.create_connection((server, 53), timeout=_UPSTREAM_TIMEOUT) as s:
                s.sendall(struct.pack("!H", len(query)) + query)
                return _read_framed(s, deadline)
        except OSError:
            return None

    def serve_udp(self, queue: Queue[tuple[bytes, Any]]) -> None:
        while True:
            query, peer = self.udp.recvfrom(65535)
            try:
                queue.put_nowait((query, peer))
            except Full:
                pass  # a flood, or a slow upstream: the client retries or gives up

    def work_udp(self, queue: Queue[tuple[bytes, Any]]) -> None:
        while True:
            query, peer = queue.get()
            try:
                if (answer := self.resolve(query)) is not None:
                    self.udp.sendto(answer, peer)
            except OSError as exc:  # one failed query must not cost a worker
                print(f"cannot answer {peer}: {exc}", file=sys.stderr, flush=True)

    def serve_tcp(self) -> None:
        slots = threading.BoundedSemaphore(TCP_MAX_CONNS)
        while True:
            try:
                conn, _ = self.tcp.accept()
            except ConnectionAbortedError:  # the client reset it first: not a reason to stop
                continue
            if not slots.acquire(blocking=False):
                conn.close()
                continue
            threading.Thread(target=self._answer_tcp, args=(conn, slots), daemon=True).start()

    def _answer_tcp(self, conn: socket.socket, slots: threading.BoundedSemaphore) -> None:
        deadline = time.monotonic() + TCP_DEADLINE
        try:
            with conn:
                for _ in range(TCP_MAX_QUERIES):
                    query = _read_framed(conn, deadline)
                    if query is None or (answer := self.resolve(query)) is None:
                        return
                    conn.settimeout(_left(deadline))
                    conn.sendall(struct.pack("!H", len(answer)) + answer)
        except OSError:
            return
        finally:
            slots.release()


def _left(deadline: float) -> float:
    """Seconds until ``deadline`` as a socket timeout; raises TimeoutError once it passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def _read_framed(s: socket.socket, deadline: float) -> bytes | None:
    """One length-prefixed DNS message, read by ``deadline`` (a trickling peer gets no more
    time than a silent one); None at end of stream."""

    def exactly(n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            s.settimeout(_left(deadline))
            chunk = s.recv(n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf

    head = exactly(2)
    return exactly(struct.unpack("!H", head)[0]) if head else None


def start(
    *, tag: str, config: dict[str, Any], state_dir: Path, upstream: str | None,
    fds: Sequence[int],
) -> Popen[bytes]:
    """Start the helper for sandbox ``tag`` in netns ``upstream``, inheriting socket ``fds``."""
    path = state_dir / "dns.json"
    path.write_text(json.dumps(config))
    argv = [*_netns.enter(upstream), sys.executable, "-m", MODULE, str(path), "--tag", tag]
    # SIGHUP (policy reload) may come before the helper has installed its handler; blocked
    # across exec it stays pending until main() unblocks it, instead of killing the helper.
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        with open(state_dir / "dns.log", "ab") as log:
            return _proc.spawn(argv, stdout=log, stderr=log, pass_fds=fds)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


COMM = "rsb-dns"  # the helper's process name: runtime/_subreaper.py reaps it if orphaned
_PR_SET_NAME = 15


def main(argv: Sequence[str]) -> None:
    # A helper whose owner died is adopted by a subreaper that must know it may reap it:
    # its comm would otherwise be the interpreter's, which the subreaper leaves alone.
    ctypes.CDLL(None).prctl(_PR_SET_NAME, COMM.encode(), 0, 0, 0)
    cfg = json.loads(Path(argv[0]).read_text())
    helper = Helper(cfg)
    hup = threading.Event()
    signal.signal(signal.SIGHUP, lambda *_: hup.set())
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP, signal.SIGTERM})
    queue: Queue[tuple[bytes, Any]] = Queue(maxsize=UDP_BACKLOG)
    for _ in range(UDP_WORKERS):
        threading.Thread(target=helper.work_udp, args=(queue,), daemon=True).start()
    threading.Thread(target=helper.serve_udp, args=(queue,), daemon=True).start()
    threading.Thread(target=helper.serve_tcp, daemon=True).start()
    if cfg.get("inject"):
        from . import inject  # ssl, asyncio, cryptography: only where a sandbox injects

        inject.start(cfg["inject"], helper.lookup)
    while True:
        hup.wait()
        hup.clear()
        helper.reload()


if __name__ == "__main__":
    main(sys.argv[1:])
