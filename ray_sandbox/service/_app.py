"""The HTTP app: routes under ``/api/v1`` over :class:`Sandboxes`, behind one guard that
authenticates, bounds request bodies and writes the audit line."""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any
from urllib.parse import parse_qsl

from fastapi import FastAPI, Query, Request, Response, WebSocket
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..runtime.volumes import VolumeInfo
from . import _archives, _errors, _ports
from ._bounds import FS_IMAGE, SNAPSHOT
from ._config import ServiceConfig
from ._kept import FS_IMAGE_SCHEME
from ._models import (
    Copies,
    Created,
    CreateExec,
    CreateLink,
    CreateSandbox,
    CreateVolume,
    Deleted,
    ExecCreated,
    ExecInfo,
    LinkInfo,
    PortUrl,
    SandboxInfo,
    SandboxList,
    Signal,
    check_path,
)
from ._sandboxes import Sandboxes
from ._secrets import PutSecret, TenantSecrets
from ._state import connect

PREFIX = "/api/v1"
PUBLIC = frozenset({f"{PREFIX}/health", f"{PREFIX}/openapi.json"})
PORTS = f"{PREFIX}/ports/"  # authorized by the signed token in the path (_ports.py)
PORT_HOSTS = f"{PREFIX}/port-hosts/"  # a port's host form, routed here by its Host header
MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# which replica answered: the same answers come from any of them, this tells them apart
REPLICA_HEADER = b"x-ray-sandbox-replica"
RAY_CALLERS = "(ray callers)"  # whose share port URLs signed for Ray callers count against

# Route parameters live here: the routes' annotations are strings resolved in this module.
Wait = Annotated[float, Query(ge=0, description="long-poll seconds (capped by the service)")]
Path = Annotated[str, Query(description="absolute path inside the sandbox")]

audit_log = logging.getLogger("ray_sandbox.service.audit")


def authenticate(tokens: dict[str, bytes], header: str) -> str | None:
    """The tenant whose token ``Authorization: Bearer <token>`` carries, or None. Every
    token is compared, in constant time: neither the answer's timing nor its order tells
    how much of a guess was right or which tenant came close."""
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    given_b = given.strip().encode()
    found = None
    for tenant, token in tokens.items():
        if hmac.compare_digest(given_b, token) and found is None:
            found = tenant
    return found


class Guard:
    """Outermost: 401 before anything is read, 413 past the body limit (the declared length
    or the bytes that arrive), one audit line per mutating call."""

    def __init__(self, app: ASGIApp, config: ServiceConfig, replica: str,
                 owner_of: Callable[[str], str | None] = lambda _: None) -> None:
        self._app = app
        self._owners = owner_of  # sandbox id -> whose share its port's host form counts
        self._replica = (REPLICA_HEADER, replica.encode())
        self._config = config
        self._tokens = {t: s.get_secret_value().encode() for t, s in config.tokens.items()}
        self._inflight: dict[str, int] = {}  # tenant -> requests in flight (this replica)
        self._polls: dict[str, int] = {}  # tenant -> long polls waiting
        if config.audit_log is not None:
            handler = logging.FileHandler(config.audit_log)
            handler.setFormatter(logging.Formatter("%(message)s"))
            audit_log.addHandler(handler)
            audit_log.setLevel(logging.INFO)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
            return
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        raw_headers = scope.get("headers") or ()
        size = sum(len(k) + len(v) for k, v in raw_headers)
        if len(raw_headers) > self._config.max_headers or size > self._config.max_header_bytes:
            await _refuse(send, 431, f"{len(raw_headers)} headers of {size} bytes; at most "
                                     f"{self._config.max_headers} of "
                                     f"{self._config.max_header_bytes} bytes in all")
            return
        headers = Headers(scope=scope)
        name = _ports.port_host(self._config, headers.get("host", ""))
        if name is not None:  # <label>.<suffix>: a port's own origin, whatever the path
            scope = {**scope, "path": f"{PORT_HOSTS}{name}{scope['path']}",
                     "raw_path": f"{PORT_HOSTS}{name}".encode() + scope.get("raw_path", b"")}
        tenant = None
        if scope["path"] not in PUBLIC and not scope["path"].startswith((PORTS, PORT_HOSTS)):
            tenant = authenticate(self._tokens, headers.get("authorization", ""))
            if tenant is None:
                await _refuse(send, 401, "send Authorization: Bearer <token> with a valid "
                                         "token")
                return
        scope.setdefault("state", {})["tenant"] = tenant
        payer = tenant if tenant is not None else self._port_payer(scope["path"])
        if payer is None and name is not None:  # whose the sandbox is, once a request told
            payer = self._owner_of(name)
        share = self._share(payer, scope)
        if isinstance(share, str):
            await _refuse(send, 429, share)
            return
        try:
            await self._bounded(scope, receive, send, tenant, headers)
        finally:
            self._release(payer, share)

    def _port_payer(self, path: str) -> str | None:
        """Whose share a request to a port URL counts against: the tenant its token names
        (or every Ray caller's together); None for a URL that is no port URL or does not
        verify (the route refuses it)."""
        parts = path[len(PORTS):].split("/", 3) if path.startswith(PORTS) else []
        if len(parts) < 3 or not parts[1].isdigit():
            return None
        try:
            claims = _ports.claims_for(self._config, parts[0], int(parts[1]), parts[2])
        except _errors.HTTPException:
            return None
        return str(claims.get("tenant", RAY_CALLERS))

    def _owner_of(self, name: str) -> str | None:
        """Whose share a request to a port's host form counts against, once known."""
        try:
            sandbox_id, _ = _ports.label_for(self._config, name)
        except _errors.HTTPException:
            return None  # the route refuses it
        return self._owners(sandbox_id) or RAY_CALLERS

    def _share(self, tenant: str | None, scope: Scope) -> bool | str:
        """Count the request against its tenant's share of this replica: whether it is a
        long poll, or why it is refused (one tenant's flood must not starve the others)."""
        if tenant is None:
            return False
        query = scope.get("query_string", b"").decode("latin-1")
        waits = any(k == "wait_seconds" and v.strip() not in ("", "0", "0.0")
                    for k, v in parse_qsl(query, keep_blank_values=True))
        if self._inflight.get(tenant, 0) >= self._config.max_requests_per_tenant:
            return (f"{self._inflight[tenant]} requests of this tenant are in flight, its "
                    "limit (max_requests_per_tenant)")
        if waits and self._polls.get(tenant, 0) >= self._config.max_long_polls_per_tenant:
            return (f"{self._polls[tenant]} long polls of this tenant are waiting, its limit "
                    "(max_long_polls_per_tenant); poll with wait_seconds=0 or wait")
        self._inflight[tenant] = self._inflight.get(tenant, 0) + 1
        if waits:
            self._polls[tenant] = self._polls.get(tenant, 0) + 1
        return waits

    def _release(self, tenant: str | None, share: bool | str) -> None:
        if tenant is None or isinstance(share, str):
            return
        for counts, counted in ((self._inflight, True), (self._polls, share)):
            if counted:
                counts[tenant] -= 1
                if not counts[tenant]:
                    del counts[tenant]

    async def _bounded(self, scope: Scope, receive: Receive, send: Send, tenant: str | None,
                       headers: Headers) -> None:
        raw = scope["path"].endswith(("/files", "/archive")) or \
            scope["path"].startswith((PORTS, PORT_HOSTS))
        limit = self._config.max_file_bytes if raw else self._config.max_body_bytes
        try:
            declared = int(headers.get("content-length", "0"))
        except ValueError:
            declared = -1
        if declared < 0 or declared > limit:
            await _refuse(send, 413 if declared > limit else 400,
                          f"the body is over the limit of {limit} bytes" if declared > limit
                          else "bad Content-Length")
            return
        status = 0
        received = 0

        async def bounded_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:  # chunked, or more than it declared
                raise _errors.refusal(413, f"the body is over the limit of {limit} bytes")
            return message

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()),
                                                  self._replica]}
            await send(message)

        t0 = time.monotonic()
        try:
            await self._app(scope, bounded_receive, watch)
        finally:
            if scope["method"] in MUTATING:
                audit_log.info(json.dumps({
                    "time": round(time.time(), 3), "tenant": tenant, "method": scope["method"],
                    "path": scope["path"], "query": scope.get("query_string", b"").decode(
                        "latin-1")[:512], "status": status,
                    "ms": round((time.monotonic() - t0) * 1000, 1)}))


    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A terminal: the same bearer token (sent as a header), and an audit line on open."""
        tenant = authenticate(self._tokens, Headers(scope=scope).get("authorization", ""))
        audit_log.info(json.dumps({"time": round(time.time(), 3), "tenant": tenant,
                                   "method": "WEBSOCKET", "path": scope["path"],
                                   "status": 101 if tenant else 401}))
        if tenant is None:
            # accepted, then closed with 4401: a refusal before accepting is an HTTP 403
            await receive()  # websocket.connect
            await send({"type": "websocket.accept"})
            await send({"type": "websocket.close", "code": 4401, "reason": "unauthorized"})
            return
        scope.setdefault("state", {})["tenant"] = tenant
        share = self._share(tenant, scope)
        if isinstance(share, str):  # a terminal holds a request of its tenant's share
            await receive()
            await send({"type": "websocket.accept"})
            await send({"type": "websocket.close", "code": 4429, "reason": share[:120]})
            return
        try:
            await self._app(scope, receive, send)
        finally:
            self._release(tenant, share)


async def _refuse(send: Send, status: int, message: str) -> None:
    payload = json.dumps(_errors.body(_errors.CODES[status], message)).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(payload)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="ray-sandbox"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def build_app(config: ServiceConfig, sandboxes: Sandboxes | None = None) -> Any:
    """The ASGI app of one replica over ``sandboxes`` (by default with books of its own:
    one replica): the routes of each resource, behind the guard."""
    sandboxes = sandboxes or Sandboxes(config, connect(config, None))
    proxy = _ports.Proxy(config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await sandboxes.shutdown()  # a replica stopping lets its creates in flight finish
        await proxy.close()

    app = FastAPI(title="ray_sandbox", version="1", openapi_url=f"{PREFIX}/openapi.json",
                  docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.sandboxes = sandboxes
    app.state.proxy = proxy
    _errors.install(app)

    @app.get(f"{PREFIX}/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    for routes in (_sandbox_routes, _exec_routes, _file_routes, _port_routes, _link_routes,
                   _kept_routes, _volume_routes, _secret_routes, _terminal_routes):
        routes(app, sandboxes, config)
    return Guard(app, config, sandboxes.replica, sandboxes.liveness.port_payer)


def tenant(request: Request) -> str:
    return request.state.tenant


def _sandbox_routes(app: FastAPI, sandboxes: Sandboxes, config: ServiceConfig) -> None:
    """Create, list, look at and delete the tenant's sandboxes."""
    secrets = TenantSecrets()

    @app.post(f"{PREFIX}/sandboxes", status_code=202)
    async def create_sandbox(request: Request, body: CreateSandbox) -> Created:
        # a rule's secret, named as the tenant knows it, becomes the tenant's own
        entry = await sandboxes.create(tenant(request),
                                       await secrets.scoped(tenant(request), body))
        return Created(sandbox_id=entry.api_id)

    @app.get(f"{PREFIX}/sandboxes")
    async def list_sandboxes(
        request: Request,
        label: Annotated[list[str], Query(description="k=v, all must match")] = [],  # noqa: B006
    ) -> SandboxList:
        wanted = {}
        for item in label:
            k, eq, v = item.partition("=")
            if not eq or not k:
                raise _errors.refusal(400, f"label filters are k=v, got {item!r}")
            wanted[k] = v
        return SandboxList(sandboxes=await sandboxes.list(tenant(request), wanted))

    @app.get(f"{PREFIX}/sandboxes/{{sandbox_id}}")
    async def get_sandbox(request: Request, sandbox_id: str,
                          wait_seconds: Wait = 0.0) -> SandboxInfo:
        entry = await sandboxes.find(tenant(request), sandbox_id)
        return await sandboxes.info(entry, wait_seconds)

    @app.delete(f"{PREFIX}/sandboxes/{{sandbox_id}}")
    async def delete_sandbox(request: Request, sandbox_id: str) -> Deleted:
        await sandboxes.delete(tenant(request), sandbox_id)
        return Deleted(sandbox_id=sandbox_id)

def _exec_routes(app: FastAPI, sandboxes: Sandboxes, config: ServiceConfig) -> None:
    """Commands: run (long-polled), stream, signal, cancel."""
    @app.post(f"{PREFIX}/sandboxes/{{sandbox_id}}/execs", status_code=202,
              response_model=ExecCreated, responses={200: {"model": ExecInfo}})
    async def create_exec(request: Request, sandbox_id: str, body: CreateExec,
                          wait_seconds: Wait = 0.0) -> ExecCreated | JSONResponse:
        """202 with the exec's id; with ``wait_seconds``, a command that ends within that
        time answers 200 with its result at once (one request instead of two)."""
        entry = await sandboxes.running(tenant(request), sandbox_id)
        ex = await sandboxes.execs.start_exec(entry, body)
        if wait_seconds:
            info = await sandboxes.execs.exec_info(entry, ex.exec_id, wait_seconds)
            if info.status != "running":
                return JSONResponse(info.model_dump(mode="json"), status_code=200)
        return ExecCreated(exec_id=ex.exec_id)

    @app.get(f"{PREFIX}/sandboxes/{{sandbox_id}}/execs/{{exec_id}}")
    async def get_exec(request: Request, sandbox_id: str, exec_id: str,
                       wait_seconds: Wait = 0.0) -> ExecInfo:
        entry = await sandboxes.running(tenant(request), sandbox_id)
        return await sandboxes.execs.exec_info(entry, exec_id, wait_seconds)

    @app.post(f"{PREFIX}/sandboxes/{{sandbox_id}}/execs/stream",
              responses={200: {"content": {"application/x-ndjson": {}}}})
    async def stream_exec(request: Request, sandbox_id: str, body: CreateExec) -> Response:
        """Output as NDJSON lines while the command runs (ray_sandbox/service/_streams.py)."""
        entry = await sandboxes.running(tenant(request), sandbox_id)
        lines = await sandboxes.execs.stream_exec(entry, body)
        return StreamingResponse(lines, media_type="application/x-ndjson")

    @app.delete(f"{PREFIX}/sandboxes/{{sandbox_id}}/execs/{{exec_id}}")
    async def cancel_exec(request: Request, sandbox_id: str, exec_id: str) -> dict[str, str]:
        """Cancel a streamed exec: SIGTERM, then SIGKILL after a grace period."""
        entry = await sandboxes.running(tenant(request), sandbox_id)
        await sandboxes.execs.signal_exec(entry, exec_id, None)
        return {"exec_id": exec_id, "status": "cancelled"}

    @app.post(f"{PREFIX}/sandboxes/{{sandbox_id}}/execs/{{exec_id}}/signal")
    async def signal_exec(request: Request, sandbox_id: str, exec_id: str,
                          body: Signal) -> dict[str, str]:
        entry = await sandboxes.running(tenant(request), sandbox_id)
        await sandboxes.execs.signal_exec(entry, exec_id, body.signal)
        return {"exec_id": exec_id, "status": "signalled"}

def _file_routes(app: FastAPI, sandboxes: Sandboxes, config: ServiceConfig) -> None:
    """Files and directories in and out (raw bodies, tar streams)."""
    @app.put(f"{PREFIX}/sandboxes/{{sandbox_id}}/files", status_code=204,
             openapi_extra={"requestBody": {"content": {"application/octet-stream": {}}}})
    async def put_file(request: Request, sandbox_id: str, path: Path) -> Response:
        where = _path(path)
        entry = await sandboxes.running(tenant(request), sandbox_id)
        data = await request.body()  # bounded by the guard
        await sandboxes.call(entry.handle.write_file.remote(where, data))
        return Response(status_code=204)

    @app.get(f"{PREFIX}/sandboxes/{{sandbox_id}}/files",
             responses={200: {"content": {"application/octet-stream": {}}}})
    async def get_file(request: Request, sandbox_id: str, path: Path) -> Response:
        where = _path(path)
        entry = await sandboxes.running(tenant(request), sandbox_id)
        data = await sandboxes.call(entry.handle.read_file.remote(
            where, max_bytes=config.max_file_bytes))
        return Response(data, media_type="application/octet-stream")

    @app.put(f"{PREFIX}/sandboxes/{{sandbox_id}}/archive", status_code=204,
             openapi_extra={"requestBody": {"content": {"application/x-tar": {}}}})
    async def put_archive(request: Request, sandbox_id: str, path: Path) -> Response:
        """Unpack a tar stream into the directory ``path`` (made if missing)."""
        where = _path(path)
        entry = await sandboxes.running(tenant(request), sandbox_id)
        await _archives.upload(entry.handle, sandboxes.call, where, await request.body())
        return Response(status_code=204)

    @app.get(f"{PREFIX}/sandboxes/{{sandbox_id}}/archive",
             responses={200: {"content": {"application/x-tar": {}}}})
    async def get_archive(request: Request, sandbox_id: str, path: Path) -> Response:
        """The directory ``path`` as a tar stream."""
        where = _path(path)
        entry = await sandboxes.running(tenant(request), sandbox_id)
        data = await _archives.download(entry.handle, sandboxes.call, where,
                                        config.max_file_bytes)
        return Response(data, media_type="application/x-tar")

def _port_routes(app: FastAPI, sandboxes: Sandboxes, config: ServiceConfig) -> None:
    """Signed URLs to published ports, and the proxy behind them."""
    @app.post(f"{PREFIX}/sandboxes/{{sandbox_id}}/ports/{{port}}/url")
    async def port_url(request: Request, sandbox_id: str, port: int,
                       body: PortUrl) -> dict[str, Any]:
        """A URL to the sandbox's published ``port``, signed for it alone, expiring."""
        entry = await sandboxes.running(tenant(request), sandbox_id)
        base = (config.public_url or str(request.base_url).rstrip("/")) + PREFIX
        return _ports.port_url(config, base, entry, port, body.ttl_seconds)

    @app.api_route(f"{PREFIX}/ports/{{sandbox_id}}/{{port}}/{{token}}",
                   methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])
    @app.api_route(f"{PREFIX}/ports/{{sandbox_id}}/{{port}}/{{token}}/{{path:path}}",
                   methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])
    async def port_proxy(request: Request, sandbox_id: str, port: int, token: str,
                         path: str = "") -> Response:
        """The sandbox's published port, for whoever holds a valid URL (no bearer)."""
        claims = _ports.claims_for(config, sandbox_id, port, token)
        if "tenant" in claims:
            node = (await sandboxes.alive(claims["tenant"], sandbox_id)).handle.node_id
        else:  # signed for a Ray caller (_ports.ray_port_url)
            node = await sandboxes.liveness.ray_alive(sandbox_id, claims["node"])
        return await app.state.proxy.forward(request, node, port, path)

    @app.api_route(f"{PREFIX}/port-hosts/{{name}}",
                   methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])
    @app.api_route(f"{PREFIX}/port-hosts/{{name}}/{{path:path}}",
                   methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])
    async def port_host(request: Request, name: str, path: str = "") -> Response:
        """A published port at its own origin, ``<label>.<port_host_suffix>``: the guard
        routes requests by their Host here; the label is the grant, as the path's token."""
        sandbox_id, port = _ports.label_for(config, name)
        tenant, node = await sandboxes.liveness.port_owner(sandbox_id)
        if tenant is not None:
            node = (await sandboxes.alive(tenant, sandbox_id)).handle.node_id
        elif node is not None:
            node = await sandboxes.liveness.ray_alive(sandbox_id, node)
        return await app.state.proxy.forward(request, node, port, path)

def _link_routes(app: FastAPI, sandboxes: Sandboxes, config: ServiceConfig) -> None:
    """Links between two sandboxes of one tenant."""
    @app.post(f"{PREFIX}/sandboxes/{{sandbox_id}}/links")
    async def link(request: Request, sandbox_id: str, body: CreateLink) -> LinkInfo:
        """Let this sandbox reach one port of another of the tenant's (docs/network.md)."""
        entry = await sandboxes.running(tenant(request), sandbox_id)
        return await sandboxes.link(entry, body.to, body.port)

    @app.delete(f"{PREFIX}/sandboxes/{{sandbox_id}}/links/{{to}}/{{port}}")
    async def unlink(request: Request, sandbox_id: str, to: str, port: int) -> dict[str, str]:
        entry = await sandboxes.running(tenant(request), sandbox_id)
        await sandboxes.unlink(entry, to, port)
        return {"to": to, "status": "unlinked"}

def _kept_routes(app: FastAPI, sandboxes: Sandboxes, config: ServiceConfig) -> None:
    """What a tenant keeps: snapshots and filesystem images, and copies."""
    def copies(body: Copies) -> int:
        if body.count > config.max_copies:
            raise _errors.refusal(400, f"at most {config.max_copies} copies at once")
        return body.count

    @app.post(f"{PREFIX}/sandboxes/{{sandbox_id}}/snapshot", status_code=201)
    async def snapshot(request: Request, sandbox_id: str) -> dict[str, str]:
        """Snapshot a running sandbox; it keeps running."""
        entry = await sandboxes.running(tenant(request), sandbox_id)
        return {"snapshot_id": await sandboxes.kept.snapshot(entry.tenant, entry.handle,
                                                            entry.source())}

    @app.post(f"{PREFIX}/sandboxes/{{sandbox_id}}/filesystem-image", status_code=201)
    async def filesystem_image(request: Request, sandbox_id: str) -> dict[str, str]:
        """The sandbox's files (not its processes) as an image only this tenant creates
        sandboxes from: ``{"image": "fs-image://<id>"}``, for ``POST /sandboxes``."""
        entry = await sandboxes.running(tenant(request), sandbox_id)
        return {"image": await sandboxes.kept.fs_image(entry.tenant, entry.handle)}

    @app.get(f"{PREFIX}/filesystem-images")
    async def list_filesystem_images(request: Request) -> dict[str, list[str]]:
        """The tenant's images; ``lost`` (only when there are): those no node holds any
        more (DELETE forgets them)."""
        found = await sandboxes.kept.listing(FS_IMAGE, tenant(request))
        return {"images": found["keys"], **({"lost": found["lost"]} if found["lost"] else {})}

    @app.delete(f"{PREFIX}/filesystem-images/{{image_id}}")
    async def delete_filesystem_image(request: Request, image_id: str) -> dict[str, str]:
        """Idempotent; 409 while a sandbox runs from it."""
        await sandboxes.kept.delete_fs_image(tenant(request), image_id)
        return {"image": FS_IMAGE_SCHEME + image_id, "status": "deleted"}

    @app.get(f"{PREFIX}/snapshots")
    async def list_snapshots(request: Request) -> dict[str, list[str]]:
        """The tenant's snapshots; ``lost`` (only when there are): those no node holds any
        more (DELETE forgets them)."""
        found = await sandboxes.kept.listing(SNAPSHOT, tenant(request))
        return {"snapshots": found["keys"],
                **({"lost": found["lost"]} if found["lost"] else {})}

    @app.delete(f"{PREFIX}/snapshots/{{snapshot_id}}")
    async def delete_snapshot(request: Request, snapshot_id: str) -> dict[str, str]:
        await sandboxes.kept.delete_snapshot(tenant(request), snapshot_id)
        return {"snapshot_id": snapshot_id, "status": "deleted"}

    @app.post(f"{PREFIX}/snapshots/{{snapshot_id}}/restore", status_code=201)
    async def restore(request: Request, snapshot_id: str, body: Copies) -> dict[str, list[str]]:
        """Running copies of the snapshot (all or none); each is a sandbox of the tenant."""
        ids = await sandboxes.restore(tenant(request), snapshot_id, copies(body))
        return {"sandboxes": ids}

    @app.post(f"{PREFIX}/sandboxes/{{sandbox_id}}/fork", status_code=201)
    async def fork(request: Request, sandbox_id: str, body: Copies) -> dict[str, list[str]]:
        """Running copies of a running sandbox (snapshot + restore)."""
        entry = await sandboxes.running(tenant(request), sandbox_id)
        return {"sandboxes": await sandboxes.fork(entry, copies(body))}

def _secret_routes(app: FastAPI, sandboxes: Sandboxes, config: ServiceConfig) -> None:
    """The tenant's secrets for credential injection: stored on every node, never shown."""
    secrets = TenantSecrets()

    @app.put(f"{PREFIX}/secrets/{{name}}", status_code=204)
    async def put_secret(request: Request, name: str, body: PutSecret) -> Response:
        await secrets.put(tenant(request), name, body.values)
        return Response(status_code=204)

    @app.get(f"{PREFIX}/secrets")
    async def list_secrets(request: Request) -> dict[str, list[str]]:
        return {"secrets": await secrets.list(tenant(request))}

    @app.delete(f"{PREFIX}/secrets/{{name}}", status_code=204)
    async def delete_secret(request: Request, name: str) -> Response:
        await secrets.delete(tenant(request), name)
        return Response(status_code=204)


def _volume_routes(app: FastAPI, sandboxes: Sandboxes, config: ServiceConfig) -> None:
    """The tenant's named volumes."""
    @app.post(f"{PREFIX}/volumes", status_code=201)
    async def create_volume(request: Request, body: CreateVolume) -> VolumeInfo:
        return await sandboxes.volumes.create(tenant(request), body.name, body.size)

    @app.get(f"{PREFIX}/volumes")
    async def list_volumes(request: Request) -> dict[str, Any]:
        """The tenant's volumes; ``lost`` (only when there are): names of those whose node
        is gone (DELETE forgets them)."""
        live, lost = await sandboxes.volumes.listing(tenant(request))
        return {"volumes": [v.model_dump(mode="json") for v in live],
                **({"lost": lost} if lost else {})}

    @app.delete(f"{PREFIX}/volumes/{{name}}")
    async def delete_volume(request: Request, name: str) -> dict[str, str]:
        await sandboxes.volumes.delete(tenant(request), name)
        return {"name": name, "status": "deleted"}

def _terminal_routes(app: FastAPI, sandboxes: Sandboxes, config: ServiceConfig) -> None:
    """An interactive terminal over a WebSocket."""
    @app.websocket(f"{PREFIX}/sandboxes/{{sandbox_id}}/pty")
    async def pty(ws: WebSocket, sandbox_id: str, command: str = "/bin/sh",
                  rows: Annotated[int, Query(ge=1, le=1000)] = 24,
                  cols: Annotated[int, Query(ge=1, le=1000)] = 80) -> None:
        """An interactive terminal (ray_sandbox/service/_pty.py)."""
        try:
            entry = await sandboxes.running(ws.state.tenant, sandbox_id)
        except _errors.HTTPException as exc:  # 4404: not yours or no such sandbox (never 403)
            await ws.accept()
            await ws.close(code=4000 + exc.status_code, reason=str(exc.detail)[:120])
            return
        await sandboxes.execs.terminal(ws, entry, command, rows, cols)



def _path(path: str) -> str:
    try:
        return check_path(path)
    except ValueError as exc:
        raise _errors.refusal(400, str(exc)) from None
