"""The egress proxy of one sandbox: credential injection outside gVisor.

(~740 lines: one connection's state machine with its bounds, the policy it re-reads, its
audit and metrics; what it parses off the wire is ``http1.py``, its CA ``ca.py``.)

It runs in the sandbox's network helper (``dns.py``), in a thread of its own with an asyncio
loop, when the sandbox was created with ``EgressPolicy.inject``. The helper answers the
sandbox's lookups of an injecting domain with the proxy's address, so the sandbox's HTTPS
connections to those names (and only those) arrive here (docs/network.md, "Credential
injection"). For each connection it:

1. reads the TLS ClientHello without consuming it and takes the server name (SNI); no name,
   or a name outside ``allow_domains``, is closed;
2. for a name no rule injects into (a rule removed since the lookup), relays the bytes
   untouched to the name's own address: nothing is decrypted;
3. otherwise terminates TLS with a certificate for the name from the sandbox's own CA
   (``ca.py``), and for every HTTP/1.1 request on the connection: checks that the Host
   header names the same host and that the request is an origin-form request (no CONNECT,
   no absolute URL, no TRACE), re-reads the policy and the secret, sets the rule's headers
   (replacing any the sandbox sent), and forwards it over its own TLS connection to the
   name, verified against the node's trust store, at an address it resolved itself and
   checked against the sandbox's egress tiers (deny, never, private), like the nft table
   does for the sandbox. Responses come back unchanged, except that any secret value used
   in the request is masked (same length, so framing holds) where it appears verbatim.
   Redirects are the client's to follow: a new connection to another name is not injected.

Bounds (the helper runs as root outside the sandbox's cgroups): at most ``MAX_CONNS``
connections at once and ``ACCEPT_RATE`` new ones per second (more are closed at once), 64 KiB
per request or response head, deadlines for every wait, bodies streamed in 64 KiB pieces
whatever their size. One audit line per injected request (``audit_path``: sandbox, domain,
method, status, header names; never a value) and Prometheus counters in a textfile
(``metrics_path``) for node_exporter's textfile collector.

Standard library and ``ca.py`` (cryptography); the helper imports this module only when its
sandbox injects.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import json
import os
import re
import socket
import ssl
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from .. import secrets
from ..errors import ProxyRefusal
from . import http1, policy
from .ca import Issuer
from .http1 import (
    Headers,
    Masker,
    client_hello_sni,
    error_response,
    framing,
    parse_head,
    values,
    wants_close,
)

T = TypeVar("T")

MAX_CONNS = 128  # connections of the sandbox through its proxy at once
ACCEPT_RATE, ACCEPT_BURST = 100.0, 200.0  # new connections per second, and the burst
HELLO_TIMEOUT = 10.0  # for the ClientHello to arrive
HANDSHAKE_TIMEOUT = 10.0  # each TLS handshake (the sandbox's, the upstream's)
CONNECT_TIMEOUT = 10.0  # TCP connect to one upstream address
HEAD_TIMEOUT = 30.0  # for the first request's head
KEEPALIVE_TIMEOUT = 60.0  # between requests on one connection
RESPONSE_TIMEOUT = 600.0  # for the response's head (a model may think for minutes)
IDLE_TIMEOUT = 300.0  # no byte in a direction that is waiting for one
MAX_LIFETIME = 4 * 3600.0  # of one connection
MAX_HEAD = 64 << 10  # of a request or response head, of a chunk-size line, of trailers
CHUNK = 64 << 10
MAX_LEAVES = 256  # certificates kept (one per name)
MAX_RESOLVED = 256  # names whose addresses are kept for their TTL (at most 30 s)
RESOLVE_TTL = 30.0
MAX_LABELSETS = 512  # distinct metric series; more go to domain="other"
AUDIT_MAX = 64 << 20  # bytes of the audit file before it is rotated to .1
METRICS_EVERY = 1.0
_STATUS_RE = re.compile(rb"^HTTP/1\.[01] ([1-5][0-9][0-9])(?: .*)?$", re.S)
_REFUSED_METHODS = {b"CONNECT", b"TRACE", b"TRACK"}


# --- the policy, as the runtime wrote it ------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    domain: str
    headers: tuple[tuple[str, str], ...]
    secret: str | None


@dataclass(frozen=True)
class Policy:
    """What egress.json says (``network/_lifecycle.py`` writes it at attach and set_egress)."""

    allow_domains: tuple[str, ...] = ()
    rules: tuple[Rule, ...] = ()
    nets: Mapping[str, tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]] = \
        field(default_factory=dict)
    private_domains: bool = True

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Policy:
        rules = tuple(Rule(r["domain"], tuple(r["headers"].items()), r.get("secret"))
                      for r in raw.get("inject", ()))
        sets = raw.get("sets", {})
        nets = {name: tuple(ipaddress.ip_network(c) for c in cidrs)
                for name, cidrs in sets.get("cidrs", {}).items()}
        return cls(tuple(raw.get("allow_domains", ())), rules, nets,
                   bool(sets.get("private_domains", True)))

    def rule_for(self, host: str) -> Rule | None:
        """The most specific rule matching ``host``: itself, else the longest wildcard."""
        best = None
        for r in self.rules:
            if policy.domain_allowed(host, (r.domain,)) and (
                    best is None or not r.domain.startswith("*.")
                    or (best.domain.startswith("*.") and len(r.domain) > len(best.domain))):
                best = r
        return best

    def allowed(self, host: str) -> bool:
        return policy.domain_allowed(host, self.allow_domains)

    def address_ok(self, addr: str) -> bool:
        """Whether the sandbox's table would accept a connection to ``addr``, an answer for
        an allowed name: deny wins, allow_cidrs open, the never tier (loopback, link-local,
        the node's addresses, ...) stays closed, the private tier too unless
        private_domains (``policy._egress_rules``)."""
        ip = ipaddress.ip_address(addr)
        v = str(ip.version)

        def within(name: str) -> bool:
            return any(ip in n for n in self.nets.get(name + v, ()))

        if within("deny"):
            return False
        if within("allow"):
            return True
        if within("never"):
            return False
        return self.private_domains or not within("private")


class Rules:
    """The current :class:`Policy`: the file is looked at on every request (a stat), so a
    ``set_egress`` that returned applies to the next request, whatever the helper's
    SIGHUP is doing."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._key: tuple[int, int] | None = None
        self._policy = Policy()
        self._lock = threading.Lock()

    def current(self) -> Policy:
        try:
            st = os.stat(self.path)
        except OSError:
            return self._policy
        key = (st.st_ino, st.st_mtime_ns)
        with self._lock:
            if key != self._key:
                try:
                    self._policy = Policy.parse(json.loads(self.path.read_bytes()))
                    self._key = key
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    _log(f"cannot read the policy {self.path}: {exc}")
            return self._policy


# --- audit and metrics -------------------------------------------------------------------------


class Books:
    """The audit file and the Prometheus textfile of one sandbox's proxy."""

    def __init__(self, sandbox_id: str, audit_path: Path | None,
                 metrics_path: Path | None) -> None:
        self.sandbox_id = sandbox_id
        self.audit_path = audit_path
        self.metrics_path = metrics_path
        self.counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self.active = 0
        self._dirty = False
        self._lock = threading.Lock()

    def audit(self, domain: str, method: str, status: int | str, headers: Sequence[str]) -> None:
        if self.audit_path is None:
            return
        line = json.dumps({"time": round(time.time(), 3), "sandbox": self.sandbox_id,
                           "domain": domain, "method": method, "status": status,
                           "headers": sorted(headers)}) + "\n"
        try:
            with open(self.audit_path, "ab") as f:
                fcntl.flock(f, fcntl.LOCK_EX)  # other sandboxes' proxies append too
                try:
                    if f.tell() > AUDIT_MAX:
                        os.replace(self.audit_path, str(self.audit_path) + ".1")
                        with open(self.audit_path, "ab") as fresh:
                            fresh.write(line.encode())
                    else:
                        f.write(line.encode())
                finally:
                    fcntl.flock(f, fcntl.LOCK_UN)
        except OSError as exc:
            _log(f"cannot write the audit line: {exc}")

    def count(self, name: str, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            if key not in self.counters and len(self.counters) >= MAX_LABELSETS:
                key = (name, tuple(sorted({**labels, "domain": "other"}.items())))
            self.counters[key] = self.counters.get(key, 0) + 1
            self._dirty = True

    def gauge(self, delta: int) -> None:
        with self._lock:
            self.active += delta
            self._dirty = True

    def text(self) -> str:
        helps = {
            "ray_sandbox_inject_requests_total": "HTTPS requests the egress proxy forwarded "
                                                 "with injected headers, by upstream status",
            "ray_sandbox_inject_refused_total": "connections or requests the egress proxy "
                                                "refused, by reason",
            "ray_sandbox_inject_connections_total": "connections the egress proxy accepted, "
                                                    "by kind (inject, passthrough)",
        }
        sid = _label(self.sandbox_id)
        out = []
        with self._lock:
            for name, doc in helps.items():
                out += [f"# HELP {name} {doc}", f"# TYPE {name} counter"]
                for (n, labels), v in sorted(self.counters.items()):
                    if n == name:
                        lab = ",".join([f'sandbox="{sid}"'] +
                                       [f'{k}="{_label(x)}"' for k, x in labels])
                        out.append(f"{name}{{{lab}}} {v:g}")
            out += ["# HELP ray_sandbox_inject_active_connections connections open through "
                    "the egress proxy", "# TYPE ray_sandbox_inject_active_connections gauge",
                    f'ray_sandbox_inject_active_connections{{sandbox="{sid}"}} {self.active}']
            self._dirty = False
        return "\n".join(out) + "\n"

    def flush(self, force: bool = False) -> None:
        if self.metrics_path is None or not (self._dirty or force):
            return
        tmp = self.metrics_path.with_name(f".{self.metrics_path.name}.tmp")
        try:
            tmp.write_text(self.text())
            os.replace(tmp, self.metrics_path)
        except OSError as exc:
            _log(f"cannot write the metrics: {exc}")


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


# --- the proxy ---------------------------------------------------------------------------------


Resolver = Callable[[str], list[str]]  # a name -> its addresses (blocking; run in a pool)
Upstream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class Proxy:
    """One sandbox's proxy; :meth:`run` serves forever on the inherited listening socket."""

    def __init__(self, cfg: Mapping[str, Any], resolver: Resolver) -> None:
        self.state_dir = Path(cfg["state_dir"])
        self.sandbox_id: str = cfg["sandbox_id"]
        self.listen = socket.socket(fileno=cfg["proxy_fd"])
        self.peer: str | None = cfg.get("peer")  # the only client address (sandbox mode)
        self.store = Path(cfg["store_dir"])
        self.rules = Rules(Path(cfg["policy_path"]))
        self.books = Books(self.sandbox_id, _path(cfg.get("audit_path")),
                           _path(cfg.get("metrics_path")))
        self.issuer = Issuer(self.state_dir)
        self._key_file = self.state_dir / "inject-leaf-key.pem"
        fd = os.open(self._key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                     0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.issuer.leaf_key_pem)
        self.upstream_ctx = ssl.create_default_context(cafile=cfg.get("upstream_ca") or None)
        self.upstream_ctx.set_alpn_protocols(["http/1.1"])
        self._leaves: OrderedDict[str, tuple[ssl.SSLContext, float]] = OrderedDict()
        self._resolved: OrderedDict[str, tuple[list[str], float]] = OrderedDict()
        self._resolver = resolver
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="rsb-inject-dns")
        self._tokens = ACCEPT_BURST
        self._refilled = time.monotonic()
        self._tasks: set[asyncio.Task[None]] = set()

    # -- serving --

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.listen.setblocking(False)
        self.books.flush(force=True)
        loop.call_later(METRICS_EVERY, self._tick, loop)
        while True:
            try:
                conn, addr = await loop.sock_accept(self.listen)
            except OSError as exc:  # EMFILE and the like: wait instead of spinning
                _log(f"accept failed: {exc}")
                await asyncio.sleep(0.1)
                continue
            if not self._admit(addr):
                conn.close()
                continue
            task = asyncio.ensure_future(self._serve(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self.books.flush()
        loop.call_later(METRICS_EVERY, self._tick, loop)

    def _admit(self, addr: Any) -> bool:
        if self.peer is not None and addr[0] != self.peer:
            self.books.count("ray_sandbox_inject_refused_total", reason="peer")
            return False
        now = time.monotonic()
        self._tokens = min(ACCEPT_BURST, self._tokens + (now - self._refilled) * ACCEPT_RATE)
        self._refilled = now
        if self.books.active >= MAX_CONNS or self._tokens < 1:
            self.books.count("ray_sandbox_inject_refused_total", reason="limit")
            return False
        self._tokens -= 1
        return True

    async def _serve(self, conn: socket.socket) -> None:
        self.books.gauge(+1)
        client = _Client(conn)
        try:
            await asyncio.wait_for(self._connection(client), MAX_LIFETIME)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ssl.SSLError,
                asyncio.LimitOverrunError, ProxyRefusal, ValueError):
            pass
        except Exception as exc:  # one connection's bug must not stop the proxy
            _log(f"connection failed: {type(exc).__name__}: {exc}")
        finally:
            client.close()
            self.books.gauge(-1)

    async def _connection(self, client: _Client) -> None:
        loop = asyncio.get_running_loop()
        try:
            host = await _peek_sni(loop, client.sock, loop.time() + HELLO_TIMEOUT)
        except (ValueError, ConnectionError):
            host = None
        pol = self.rules.current()
        if host is None or not pol.allowed(host):
            self.books.count("ray_sandbox_inject_refused_total", reason="name")
            return
        if pol.rule_for(host) is None:  # no longer injected: relay without decrypting
            self.books.count("ray_sandbox_inject_connections_total", kind="passthrough")
            await self._passthrough(loop, client, host, pol)
            return
        self.books.count("ray_sandbox_inject_connections_total", kind="inject")
        reader, writer = await client.stream(loop, self._context_for(host))
        upstream: list[Upstream] = []  # made at the first request, kept for the next ones
        try:
            first = True
            while await self._exchange(host, reader, writer, upstream, first):
                first = False
        finally:
            writer.close()
            for _, uwriter in upstream:
                uwriter.close()

    async def _passthrough(self, loop: asyncio.AbstractEventLoop, client: _Client,
                           host: str, pol: Policy) -> None:
        reader, writer = await client.stream(loop, None)
        try:
            ureader, uwriter = await self._connect(host, pol, tls=False)
        except ProxyRefusal:
            self.books.count("ray_sandbox_inject_refused_total", reason="upstream")
            writer.close()
            return
        try:
            await asyncio.gather(_pipe(reader, uwriter), _pipe(ureader, writer))
        finally:
            writer.close()
            uwriter.close()

    # -- one request --

    async def _exchange(self, host: str, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter, upstream: list[Upstream],
                        first: bool) -> bool:
        """Relay one request and its response; returns whether the connection stays open.
        The upstream connection is made at the first request into ``upstream``."""
        try:
            raw = await _timed(reader.readuntil(b"\r\n\r\n"),
                               HEAD_TIMEOUT if first else KEEPALIVE_TIMEOUT)
        except asyncio.IncompleteReadError:
            return False  # the client is done
        except asyncio.LimitOverrunError:
            await self._refuse(writer, host, "?", ProxyRefusal(431, "Request Header Fields Too "
                                                            "Large", "request head too large"))
            return False
        method = "?"
        try:
            start, headers = parse_head(raw)
            method_b, target, version = http1.request_line(start)
            method = method_b.decode("ascii")
            pol = self.rules.current()
            _check_request(host, method_b, target, headers, pol)
            rule = pol.rule_for(host)
            injected, used = self._headers_of(rule) if rule else ({}, [])
            body = framing(headers, request=True)
            head = http1.rewrite(start, headers, injected)
            if not upstream:
                upstream.append(await self._connect(host, pol, tls=True))
        except ProxyRefusal as exc:
            await self._refuse(writer, host, method, exc)
            return False
        ureader, uwriter = upstream[0]
        uwriter.write(head)
        sending = asyncio.ensure_future(_relay_body(reader, uwriter, body, None))
        # a body the proxy refuses half-way (a bad chunk) ends the exchange: no upstream
        # waits for the rest while the response side waits for the upstream
        sending.add_done_callback(partial(_abort_on_failure, uwriter))
        masker = Masker([v.encode() for v in used])
        final: list[int] = []  # the response's status, once its head came
        try:
            status, close = await self._response(ureader, writer, method_b, masker, final)
        except BaseException:
            sending.cancel()
            raise
        finally:
            if injected:  # also when the client went away while the body was relayed
                got = final[0] if final else "failed"
                self.books.audit(host, method, got, list(injected))
                self.books.count("ray_sandbox_inject_requests_total", domain=host,
                                 status=str(got))
        if close:
            sending.cancel()
            return False
        await _timed(sending, IDLE_TIMEOUT)
        return not wants_close(headers, version)

    def _headers_of(self, rule: Rule) -> tuple[dict[str, str], list[str]]:
        """The rule's headers, rendered from its secret as it is now; 502 if it is gone."""
        vals: Mapping[str, str] = {}
        if rule.secret is not None:
            found = secrets.read(self.store, rule.secret)
            if found is None:
                raise ProxyRefusal(502, "Bad Gateway", f"secret {rule.secret!r} is not available "
                                "on this node (deleted, or never stored)")
            vals = found
        out = {}
        for name, template in rule.headers:
            try:
                out[name] = secrets.render(template, vals)
            except KeyError as exc:
                raise ProxyRefusal(502, "Bad Gateway", f"secret {rule.secret!r} has no key "
                                f"{exc.args[0]}") from None
        used = [vals[k] for _, t in rule.headers for k in secrets.placeholders(t)]
        return out, used

    async def _response(self, ureader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        method: bytes, masker: Masker, final: list[int]) -> tuple[int, bool]:
        while True:
            try:
                raw = await _timed(ureader.readuntil(b"\r\n\r\n"), RESPONSE_TIMEOUT)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                writer.write(masker.flush() + error_response(
                    502, "Bad Gateway", "the upstream sent no valid response head"))
                await writer.drain()
                return 502, True
            start, headers = parse_head(raw)
            m = _STATUS_RE.match(start)
            if m is None:
                raise ProxyRefusal(502, "Bad Gateway", "bad status line from the upstream")
            status = int(m.group(1))
            writer.write(masker.feed(raw))
            if 100 <= status < 200 and status != 101:
                continue  # 100 Continue and the like: the final response follows
            final.append(status)
            if status == 101:  # never asked for (Upgrade is refused): nothing to relay
                raise ProxyRefusal(502, "Bad Gateway", "the upstream switched protocols")
            kind, length = ("none", 0) if method == b"HEAD" or status in (204, 304) else \
                framing(headers, request=False)
            await _relay_body(ureader, writer, (kind, length), masker)
            writer.write(masker.flush())
            await writer.drain()
            return status, kind == "close" or wants_close(headers, start[:8])

    async def _refuse(self, writer: asyncio.StreamWriter, host: str, method: str,
                      exc: ProxyRefusal) -> None:
        self.books.count("ray_sandbox_inject_refused_total", reason=str(exc.status))
        rule = self.rules.current().rule_for(host)
        if rule is not None:
            self.books.audit(host, method, exc.status, [n for n, _ in rule.headers])
        with contextlib.suppress(OSError, ssl.SSLError, asyncio.TimeoutError):
            writer.write(error_response(exc.status, exc.reason, str(exc)))
            await _timed(writer.drain(), HANDSHAKE_TIMEOUT)

    # -- upstream --

    async def _connect(self, host: str, pol: Policy, *, tls: bool) -> Upstream:
        """A connection to ``host``:443 at an address resolved here and allowed by the
        sandbox's tiers (never one the sandbox named), TLS verified against ``host``."""
        addrs = [a for a in await self._resolve(host) if pol.address_ok(a)]
        if not addrs:
            raise ProxyRefusal(502, "Bad Gateway", f"{host} has no address this sandbox may reach")
        last: Exception | None = None
        for addr in addrs[:4]:
            try:
                return await _timed(asyncio.open_connection(
                    addr, 443, limit=MAX_HEAD, ssl=self.upstream_ctx if tls else None,
                    server_hostname=host if tls else None,
                    ssl_handshake_timeout=HANDSHAKE_TIMEOUT if tls else None),
                    CONNECT_TIMEOUT + HANDSHAKE_TIMEOUT)
            except (TimeoutError, OSError, ssl.SSLError) as exc:
                last = exc
        raise ProxyRefusal(502, "Bad Gateway", f"cannot reach {host}: {last}")

    async def _resolve(self, host: str) -> list[str]:
        now = time.monotonic()
        hit = self._resolved.get(host)
        if hit and hit[1] > now:
            return hit[0]
        loop = asyncio.get_running_loop()
        addrs = await loop.run_in_executor(self._pool, self._resolver, host)
        self._resolved[host] = (addrs, now + RESOLVE_TTL)
        self._resolved.move_to_end(host)
        while len(self._resolved) > MAX_RESOLVED:
            self._resolved.popitem(last=False)
        return addrs

    def _context_for(self, host: str) -> ssl.SSLContext:
        hit = self._leaves.get(host)
        if hit and hit[1] > time.time() + 3600:
            self._leaves.move_to_end(host)
            return hit[0]
        chain, until = self.issuer.leaf(host)
        tmp = self.state_dir / "inject-leaf.pem"
        tmp.write_bytes(chain)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_alpn_protocols(["http/1.1"])
        ctx.load_cert_chain(tmp, self._key_file)
        self._leaves[host] = (ctx, until)
        while len(self._leaves) > MAX_LEAVES:
            self._leaves.popitem(last=False)
        return ctx


# --- helpers -----------------------------------------------------------------------------------


def _path(value: str | None) -> Path | None:
    return Path(value) if value else None


def _log(message: str) -> None:
    print(f"inject: {message}", file=sys.stderr, flush=True)


async def _timed(aw: Awaitable[T], seconds: float) -> T:
    return await asyncio.wait_for(aw, seconds)


async def _peek_sni(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                    deadline: float) -> str | None:
    """The SNI of the ClientHello waiting on ``sock``, read without consuming it."""
    last = -1
    while True:
        fut: asyncio.Future[None] = loop.create_future()
        loop.add_reader(sock.fileno(), _settle, fut)
        try:
            await asyncio.wait_for(fut, max(0.0, deadline - loop.time()))
        finally:
            loop.remove_reader(sock.fileno())
        data = sock.recv(16384 + 5, socket.MSG_PEEK)
        if not data:
            raise ConnectionError("closed before a ClientHello")
        complete, host = client_hello_sni(data)
        if complete:
            return host
        if len(data) == last:  # the rest has not arrived: readiness stays set meanwhile
            await asyncio.sleep(0.005)
        last = len(data)


def _abort_on_failure(writer: asyncio.StreamWriter, task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        writer.transport.abort()


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class _Client:
    """An accepted connection: a bare socket until :meth:`stream` hands it to a transport,
    which from then on owns (and closes) it. Closing the socket under a transport would
    leave the loop's selector holding a number the next accept may reuse."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.writer: asyncio.StreamWriter | None = None

    async def stream(self, loop: asyncio.AbstractEventLoop, ctx: ssl.SSLContext | None
                     ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader = asyncio.StreamReader(limit=MAX_HEAD)
        protocol = asyncio.StreamReaderProtocol(reader)
        transport, _ = await loop.connect_accepted_socket(
            lambda: protocol, self.sock, ssl=ctx,
            ssl_handshake_timeout=HANDSHAKE_TIMEOUT if ctx is not None else None)
        self.writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        return reader, self.writer

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        else:
            self.sock.close()


def _check_request(host: str, method: bytes, target: bytes, headers: Headers,
                   pol: Policy) -> None:
    if method in _REFUSED_METHODS:
        raise ProxyRefusal(405, "Method Not Allowed", f"{method.decode()} is not relayed")
    if not (target.startswith(b"/") or (target == b"*" and method == b"OPTIONS")):
        raise ProxyRefusal(400, "Bad Request", "only origin-form requests (a path) are relayed")
    hosts = values(headers, "host")
    if len(hosts) != 1:
        raise ProxyRefusal(400, "Bad Request", "exactly one Host header is needed")
    named = hosts[0].decode("ascii", "replace").lower().rstrip(".")
    if named.endswith(":443"):
        named = named[:-4].rstrip(".")
    if named != host:
        raise ProxyRefusal(421, "Misdirected Request", f"Host {named!r} is not the TLS name")
    if values(headers, "upgrade"):
        raise ProxyRefusal(501, "Not Implemented", "protocol upgrades (WebSocket) are not "
                        "relayed where headers are injected")
    if not pol.allowed(host):
        raise ProxyRefusal(403, "Forbidden", f"{host} is no longer allowed")


async def _relay_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      body: tuple[str, int], masker: Masker | None) -> None:
    kind, length = body

    def out(data: bytes) -> None:
        writer.write(masker.feed(data) if masker is not None else data)

    if kind == "none":
        return
    if kind == "length":
        await _relay_exact(reader, writer, length, out)
    elif kind == "chunked":
        while True:
            line = await _timed(reader.readuntil(b"\r\n"), IDLE_TIMEOUT)
            size = line.split(b";", 1)[0].strip()
            if not size or len(size) > 16 or any(c not in b"0123456789abcdefABCDEF"
                                                 for c in size):
                raise ProxyRefusal(400, "Bad Request", "bad chunk size")
            out(line)
            if int(size, 16) == 0:
                trailers = 0
                while (t := await _timed(reader.readuntil(b"\r\n"), IDLE_TIMEOUT)) != b"\r\n":
                    trailers += len(t)
                    if trailers > MAX_HEAD:
                        raise ProxyRefusal(400, "Bad Request", "trailers too large")
                    out(t)
                out(t)
                break
            await _relay_exact(reader, writer, int(size, 16), out)
            crlf = await _timed(reader.readexactly(2), IDLE_TIMEOUT)
            if crlf != b"\r\n":
                raise ProxyRefusal(400, "Bad Request", "chunk without its CRLF")
            out(crlf)
    else:  # until the upstream closes
        while data := await _timed(reader.read(CHUNK), IDLE_TIMEOUT):
            out(data)
            await _timed(writer.drain(), IDLE_TIMEOUT)
    await _timed(writer.drain(), IDLE_TIMEOUT)


async def _relay_exact(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int,
                       out: Callable[[bytes], None]) -> None:
    while n > 0:
        data = await _timed(reader.read(min(CHUNK, n)), IDLE_TIMEOUT)
        if not data:
            raise asyncio.IncompleteReadError(b"", n)
        n -= len(data)
        out(data)
        await _timed(writer.drain(), IDLE_TIMEOUT)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Bytes from ``reader`` to ``writer`` until EOF (then half-close) or a quiet
    IDLE_TIMEOUT."""
    try:
        while data := await _timed(reader.read(CHUNK), IDLE_TIMEOUT):
            writer.write(data)
            await _timed(writer.drain(), IDLE_TIMEOUT)
        if writer.can_write_eof():
            writer.write_eof()
    except (TimeoutError, OSError):
        writer.close()


def start(cfg: Mapping[str, Any], resolver: Resolver) -> threading.Thread:
    """Run the proxy in a daemon thread with a loop of its own; a loop that failed (a bug:
    every connection's errors are its own) is logged and started again, so the names the
    helper steers here are never left without a listener that accepts."""
    proxy = Proxy(cfg, resolver)

    def serve() -> None:
        while True:
            try:
                asyncio.run(proxy.run())
            except Exception as exc:
                _log(f"the proxy's loop failed, restarting it: {type(exc).__name__}: {exc}")
                time.sleep(1.0)

    thread = threading.Thread(target=serve, name="rsb-inject", daemon=True)
    thread.start()
    return thread
