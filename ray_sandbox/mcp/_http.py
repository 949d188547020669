"""The streamable-HTTP app: the SDK's app behind a bearer-token check, ending a session's
sandbox when its client deletes the MCP session."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._server import SESSION_HEADER, SandboxMCPServer, http_scope
from ._sessions import Sessions


class BearerAuth:
    """Refuses every HTTP request without ``Authorization: Bearer <token>`` (401)."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self._app = app
        self._token = token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self._authorized(scope):
            await _send_401(send)
            return
        await self._app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        # Constant time: the comparison must not tell how much of a guess was right.
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), self._token
        )


async def _send_401(send: Send) -> None:
    body = b'{"error": "unauthorized: send Authorization: Bearer <token>"}'
    await send({
        "type": "http.response.start", "status": 401,
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b'Bearer realm="ray-sandbox"')],
    })
    await send({"type": "http.response.body", "body": body})


class EndSessionOnDelete:
    """When a client deletes its MCP session (``DELETE`` with ``Mcp-Session-Id``) and the SDK
    accepts it, the session's sandbox is deleted at once instead of at the idle timeout."""

    def __init__(self, app: ASGIApp, sessions: Sessions) -> None:
        self._app = app
        self._sessions = sessions

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "DELETE":
            await self._app(scope, receive, send)
            return
        session_id = Headers(scope=scope).get(SESSION_HEADER)
        status = 0

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        await self._app(scope, receive, watch)
        if session_id and 200 <= status < 300:
            await self._sessions.end_scope(http_scope(session_id))


def http_app(server: SandboxMCPServer) -> ASGIApp:
    cfg = server.config
    app: ASGIApp = server.mcp.streamable_http_app(
        streamable_http_path=cfg.path,
        host=cfg.host,
        session_idle_timeout=cfg.idle_timeout,  # the SDK's sessions idle out with ours
        max_sessions=cfg.max_sessions,
    )
    app = EndSessionOnDelete(app, server.sessions)
    if cfg.require_token:
        assert cfg.token is not None  # MCPServerConfig guarantees it
        app = BearerAuth(app, cfg.token.get_secret_value())
    return app
