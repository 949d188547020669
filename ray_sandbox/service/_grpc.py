"""The gRPC ingress that Modal's own client (``modal`` 1.6.x, unmodified) talks to: one
grpclib server per service, in the replica that binds ``modal_port``, serving both of the
client's services (the control plane ``modal.client.ModalClient`` and the sandbox's
``modal.task_command_router.TaskCommandRouter``) on that one port, over the replica's
:class:`Sandboxes` (docs/modal.md).

This module is the plumbing every RPC goes through: who calls (a tenant's token id and
secret on the control plane, a signed, expiring JWT naming one sandbox on the router), its
tenant's share (calls and streams in flight), a bounded read of each request message, the
audit line, and one mapping of every failure onto a gRPC status. An RPC with no handler is
UNIMPLEMENTED naming it; nothing is answered by a generic INTERNAL.

``modal_proto`` (the generated ``api_pb2``/``api_grpc``/``task_command_router_*`` modules of
the ``modal`` package: the ``[modal]`` extra) is imported only by the ``_grpc*`` modules.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import struct
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from grpclib import GRPCError, Status
from grpclib.const import Cardinality, Handler
from grpclib.server import Server, Stream
from modal_proto import api_grpc, task_command_router_grpc
from ray.exceptions import GetTimeoutError, RayActorError
from starlette.exceptions import HTTPException

from ..runtime.errors import SandboxError
from . import _errors, _signing
from ._config import ServiceConfig

log = logging.getLogger(__name__)
audit_log = logging.getLogger("ray_sandbox.service.audit")  # the HTTP ingress's audit log

CONTROL = "/modal.client.ModalClient/"
ROUTER = "/modal.task_command_router.TaskCommandRouter/"
JWT_HEADER = base64.urlsafe_b64encode(b'{"alg":"HS256","typ":"JWT"}').rstrip(b"=").decode()
JWT_TTL = 3600.0  # a JWT the service hands out (the router's, AuthTokenGet's) lasts this long
BIND_RETRY_S = 5.0  # a replica that could not bind the port tries again this often

# The HTTP statuses of the service's refusals and errors (``_errors``) as gRPC codes, so
# the client raises the matching ``modal.exception`` (NotFoundError, InvalidError, ...).
STATUS_OF_HTTP = {400: Status.INVALID_ARGUMENT, 401: Status.UNAUTHENTICATED,
                  404: Status.NOT_FOUND, 409: Status.FAILED_PRECONDITION,
                  413: Status.RESOURCE_EXHAUSTED, 429: Status.RESOURCE_EXHAUSTED,
                  431: Status.RESOURCE_EXHAUSTED, 502: Status.UNAVAILABLE,
                  503: Status.UNAVAILABLE, 504: Status.DEADLINE_EXCEEDED}

# Calls that change nothing: every other one is an audit line, as HTTP's mutating methods.
READ_ONLY = frozenset({
    "ClientHello", "AuthTokenGet", "EnvironmentGetOrCreate", "ImageJoinStreaming",
    "ImageFromId", "AppHeartbeat", "AppGetLogs", "VolumeHeartbeat", "SandboxGetTaskId",
    "SandboxGetTaskIdV2", "SandboxWait", "SandboxWaitV2", "SandboxGetTunnels",
    "SandboxGetTunnelsV2", "SandboxList", "SandboxListV2", "SandboxGetFromName",
    "SandboxGetFromNameV2", "SandboxGetCommandRouterAccess", "TaskGetCommandRouterAccess",
    "SandboxTagsGet", "SandboxTagsGetV2", "SandboxGetLogs", "TaskExecStdioRead",
    "TaskExecStdinWrite", "TaskExecStdinWriteStream", "TaskExecStdinStatus", "TaskExecPoll",
    "TaskExecWait", "SandboxStdioReadV2", "SandboxStdinWriteV2", "SandboxWaitUntilReady",
    "SandboxStdinWrite"})


# Unary calls that wait (long polls): counted with the streams, which are held as long
LONG_POLLS = frozenset({"SandboxWait", "SandboxWaitV2", "SandboxGetTaskId",
                        "SandboxGetTaskIdV2", "TaskExecWait", "SandboxWaitUntilReady",
                        "SandboxGetTunnels", "SandboxGetTunnelsV2"})


@dataclass(frozen=True)
class Call:
    """One RPC as a handler sees it: whose it is, and for the router the one sandbox its
    JWT names (an API id)."""

    name: str
    tenant: str
    stream: Stream
    sandbox: str | None = None  # router calls only

    def meta(self, key: str) -> str:
        md: Any = self.stream.metadata
        value = md.get(key) if md is not None else None
        return value if isinstance(value, str) else ""


def unimplemented(what: str) -> GRPCError:
    return GRPCError(Status.UNIMPLEMENTED, f"{what} is not supported by ray-sandbox's Modal "
                                           "API (docs/modal.md)")


def invalid(message: str) -> GRPCError:
    return GRPCError(Status.INVALID_ARGUMENT, message)


def not_found(message: str) -> GRPCError:
    return GRPCError(Status.NOT_FOUND, message)


MAX_PER_TENANT = 1024  # apps, secrets, ephemeral volumes kept per tenant (LRU)


def bounded_put(table: OrderedDict[str, Any], key: str, value: Any) -> None:
    """``table[key] = value``, the least recently put forgotten past ``MAX_PER_TENANT``."""
    table[key] = value
    table.move_to_end(key)
    while len(table) > MAX_PER_TENANT:
        table.popitem(last=False)


def hash_id(prefix: str, *parts: str) -> str:
    """A Modal-style id (``ap-…``, ``st-…``) that is the same for the same parts."""
    return f"{prefix}-" + hashlib.sha256("\0".join(parts).encode()).hexdigest()[:22]


def spawn(tasks: set[asyncio.Task[Any]], coro: Any) -> None:
    """Run ``coro`` in the background, held in ``tasks`` until it ends (a task nobody
    holds may be collected while it runs)."""
    task = asyncio.ensure_future(coro)
    tasks.add(task)
    task.add_done_callback(tasks.discard)


# --- the router's JWT ------------------------------------------------------------------------

def _jwt_key(config: ServiceConfig) -> bytes:
    # derived, so a port URL's token never verifies as a JWT and the other way round
    return hmac.new(config.signing_key.get_secret_value().encode(), b"modal-router-jwt",
                    hashlib.sha256).digest()


def make_jwt(config: ServiceConfig, claims: dict[str, Any], ttl: float) -> str:
    """A JWT the client can read the expiry of (``header.payload.mac``, base64url JSON with
    ``exp``): the client refreshes it before it expires, and once on UNAUTHENTICATED."""
    signed = _signing.sign(_jwt_key(config), {**claims, "exp": int(time.time() + ttl)})
    return f"{JWT_HEADER}.{signed}"


def read_jwt(config: ServiceConfig, token: str) -> dict[str, Any] | None:
    head, dot, rest = token.partition(".")
    if not dot or head != JWT_HEADER:
        return None
    claims, _ = _signing.verify(_jwt_key(config), rest, time.time())
    return claims


# --- serving -----------------------------------------------------------------------------------

class _Names:
    """Stands in for a service implementation while its generated ``__mapping__`` is read:
    every RPC name resolves (to None), so the table lists all of them."""

    def __getattr__(self, name: str) -> None:
        return None


async def recv(stream: Stream, limit: int) -> Any:
    """The next request message, refused with RESOURCE_EXHAUSTED past ``limit`` bytes
    before it is read: grpclib itself buffers a message of any declared length. This reads
    grpclib's own stream (``_stream``, ``_codec``, ``_recv_type``: grpclib is pinned below
    0.4.10 by ``modal``), as its ``recv_message`` does."""
    raw = stream._stream
    head = await raw.recv_data(5)
    if not head:
        return None
    if head[0]:
        raise GRPCError(Status.UNIMPLEMENTED, "compressed gRPC messages are not supported")
    size = struct.unpack(">I", head[1:])[0]
    if size > limit:
        raise GRPCError(Status.RESOURCE_EXHAUSTED, f"a message of {size} bytes; at most "
                                                   f"{limit} (modal_max_message_bytes)")
    data = await raw.recv_data(size)
    return stream._codec.decode(data, stream._recv_type)


class Shares:
    """Each tenant's share of the ingress: unary calls in flight
    (``max_requests_per_tenant``) and open streams and long polls
    (``modal_max_streams_per_tenant``); past either, RESOURCE_EXHAUSTED naming it."""

    def __init__(self, config: ServiceConfig) -> None:
        self._limits = {False: config.max_requests_per_tenant,
                        True: config.modal_max_streams_per_tenant}
        self._names = {False: "max_requests_per_tenant", True: "modal_max_streams_per_tenant"}
        self._held: dict[tuple[str, bool], int] = {}

    def take(self, tenant: str, streaming: bool) -> None:
        key = (tenant, streaming)
        held = self._held.get(key, 0)
        if held >= self._limits[streaming]:
            what = "streams" if streaming else "calls"
            raise GRPCError(Status.RESOURCE_EXHAUSTED,
                            f"{held} {what} of this tenant are open, its limit "
                            f"({self._names[streaming]}); wait for one to end")
        self._held[key] = held + 1

    def give(self, tenant: str, streaming: bool) -> None:
        key = (tenant, streaming)
        self._held[key] -= 1
        if not self._held[key]:
            del self._held[key]


def _declared(impls: Sequence[object], name: str) -> Callable[..., Any] | None:
    """The handler of RPC ``name``: the one object of ``impls`` that declares it (None if
    none does); two declaring it is a wiring error, found when the ingress is made."""
    found = [getattr(impl, name) for impl in impls if getattr(impl, name, None) is not None]
    if len(found) > 1:
        raise ValueError(f"RPC {name} has {len(found)} handlers")
    return found[0] if found else None


class Ingress:
    """Serves the handlers of ``control`` and ``router`` (for each service, the objects
    that declare its RPCs, one method per RPC name, each name in exactly one of them) on
    ``modal_port``; authentication, shares, bounds, audit and errors here."""

    def __init__(self, config: ServiceConfig, control: Sequence[object],
                 router: Sequence[object]) -> None:
        self._config = config
        self._tokens = {t: s.get_secret_value().encode() for t, s in config.tokens.items()}
        self._shares = Shares(config)
        self._server: Server | None = None
        self._binding: asyncio.Task[None] | None = None
        table: dict[str, Handler] = {}
        for base, impls, prefix in ((api_grpc.ModalClientBase, control, CONTROL),
                                    (task_command_router_grpc.TaskCommandRouterBase, router,
                                     ROUTER)):
            names: Any = _Names()  # stands in for an implementation (see _Names)
            for path, h in base.__mapping__(names).items():
                name = path.removeprefix(prefix)
                fn = _declared(impls, name)
                table[path] = h._replace(func=self._handler(name, prefix, h.cardinality, fn))
        self._table = table

    def __mapping__(self) -> dict[str, Handler]:
        return self._table

    # --- binding -------------------------------------------------------------------------------

    def start(self) -> None:
        """Bind ``modal_host:modal_port`` in the background of the running loop; a replica
        that finds it taken (another replica serves it) tries again every few seconds, so
        the port is served again by another replica when the one holding it stops."""
        self._binding = asyncio.get_running_loop().create_task(self._bind())

    async def _bind(self) -> None:
        warned = False
        while True:
            server = Server([self])
            try:
                await server.start(self._config.modal_host, self._config.modal_port,
                                   reuse_address=True)
            except OSError as exc:
                if not warned:
                    log.info("modal port %s:%s not bound here (%s); another replica serves "
                             "it, retrying every %g s", self._config.modal_host,
                             self._config.modal_port, exc.strerror, BIND_RETRY_S)
                    warned = True
                await asyncio.sleep(BIND_RETRY_S)
                continue
            self._server = server
            log.info("Modal's API served on %s:%s", self._config.modal_host,
                     self._config.modal_port)
            return

    @property
    def serving(self) -> bool:
        return self._server is not None

    def close(self) -> None:
        if self._binding is not None:
            self._binding.cancel()
        if self._server is not None:
            self._server.close()

    # --- one RPC -------------------------------------------------------------------------------

    def _handler(self, name: str, prefix: str, card: Cardinality,
                 fn: Callable[..., Any] | None) -> Callable[[Stream], Any]:
        streaming = card is not Cardinality.UNARY_UNARY or name in LONG_POLLS

        async def handle(stream: Stream) -> None:
            t0 = time.monotonic()
            tenant, sandbox = self._authenticate(stream, prefix)
            status = "OK"
            self._shares.take(tenant, streaming)
            try:
                call = Call(name, tenant, stream, sandbox)
                await self._run(call, card, fn)
            except GRPCError as exc:
                status = exc.status.name
                raise
            except BaseException as exc:
                grpc_error = _as_grpc(name, exc)
                if grpc_error is None:  # cancelled: the caller went away
                    status = "CANCELLED"
                    raise
                status = grpc_error.status.name
                raise grpc_error from None
            finally:
                self._shares.give(tenant, streaming)
                if name not in READ_ONLY:
                    audit_log.info(json.dumps({
                        "time": round(time.time(), 3), "tenant": tenant, "method": "GRPC",
                        "path": prefix + name, "status": status,
                        "ms": round((time.monotonic() - t0) * 1000, 1)}))

        return handle

    def _authenticate(self, stream: Stream, prefix: str) -> tuple[str, str | None]:
        md: Any = stream.metadata or {}
        if prefix == ROUTER:
            scheme, _, token = str(md.get("authorization", "")).partition(" ")
            claims = read_jwt(self._config, token.strip()) if scheme.lower() == "bearer" \
                else None
            if claims is None or claims.get("sub") not in self._tokens:
                raise GRPCError(Status.UNAUTHENTICATED, "the sandbox's access token is "
                                                        "missing, forged or expired")
            return claims["sub"], claims.get("sid")
        tenant = str(md.get("x-modal-token-id", ""))
        given = str(md.get("x-modal-token-secret", "")).encode()
        want = self._tokens.get(tenant)
        # compared in constant time whether the tenant exists or not
        ok = hmac.compare_digest(given, want if want is not None else b"\0" * 32)
        if want is None or not ok:
            raise GRPCError(Status.UNAUTHENTICATED, "MODAL_TOKEN_ID must name a tenant of "
                                                    "this service and MODAL_TOKEN_SECRET be "
                                                    "its token")
        return tenant, None

    async def _run(self, call: Call, card: Cardinality, fn: Callable[..., Any] | None) -> None:
        if fn is None:
            raise unimplemented(call.name)
        stream, limit = call.stream, self._config.modal_max_message_bytes
        first = await recv(stream, limit)
        if first is None:
            raise invalid(f"{call.name}: no request message")
        if card is Cardinality.UNARY_UNARY:
            await stream.send_message(await fn(call, first))
        elif card is Cardinality.UNARY_STREAM:
            async for item in fn(call, first):
                await stream.send_message(item)
        elif card is Cardinality.STREAM_UNARY:
            async def rest() -> AsyncIterator[Any]:
                while (msg := await recv(stream, limit)) is not None:
                    yield msg

            await stream.send_message(await fn(call, first, rest()))
        else:
            raise unimplemented(call.name)


def _as_grpc(name: str, exc: BaseException) -> GRPCError | None:
    """One mapping of a failure onto a gRPC status, with a message that names it."""
    if isinstance(exc, asyncio.CancelledError):
        return None
    if isinstance(exc, HTTPException):  # the service's refusals (``_errors.refusal``)
        return GRPCError(STATUS_OF_HTTP.get(exc.status_code, Status.FAILED_PRECONDITION),
                         str(exc.detail))
    if isinstance(exc, SandboxError):
        status = STATUS_OF_HTTP.get(_errors.status_of(exc), Status.FAILED_PRECONDITION)
        return GRPCError(status, f"{_errors.code_of(exc)}: {exc.message}")
    if isinstance(exc, asyncio.TimeoutError | GetTimeoutError | TimeoutError):
        return GRPCError(Status.DEADLINE_EXCEEDED, f"{name}: a call to the sandbox's host "
                                                   "did not answer in time")
    if isinstance(exc, RayActorError):
        return GRPCError(Status.UNAVAILABLE, f"{name}: the sandbox's host is unavailable "
                                             f"({type(exc).__name__})")
    log.exception("%s failed", name)
    return GRPCError(Status.INTERNAL, f"{name} failed: {type(exc).__name__}: {exc}"[:2000])

