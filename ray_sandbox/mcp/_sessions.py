"""Sessions: one sandbox per MCP client session, created on its first tool call and deleted
when the session ends or idles out.

A session is found by, in order: the ``session`` handle a tool call passes (the pattern of the
2026-07-28 protocol, which has no protocol sessions), else the caller's *scope* (a stdio
connection, or an ``Mcp-Session-Id`` of a streamable-HTTP session), else a new session is made
and its handle returned to the caller.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import anyio.to_thread

from ..runtime import SandboxRuntime
from ..runtime.errors import SandboxError, SessionError
from ._config import MCPServerConfig

log = logging.getLogger(__name__)

OWNER_LABEL = {"ray-sandbox/owner": "mcp"}



@dataclass(eq=False)
class Session:
    handle: str
    scope: str | None
    sandbox_id: str | None = None
    last_used: float = field(default_factory=time.monotonic)
    busy: int = 0
    ended: bool = False
    lock: anyio.Lock = field(default_factory=anyio.Lock)


class Sessions:
    """The sessions of one server. Used from the event loop only; runtime calls, which block,
    run in worker threads."""

    def __init__(self, runtime: SandboxRuntime, config: MCPServerConfig) -> None:
        self._runtime = runtime
        self._config = config
        self._by_handle: dict[str, Session] = {}
        self._by_scope: dict[str, Session] = {}
        # scope (or, without one, session handle) -> its workspace volume (workspace_volume)
        self._workspaces: dict[str, str] = {}

    def _find(self, handle: str | None, scope: str | None) -> Session | None:
        if handle is not None:
            found = self._by_handle.get(handle)
            if found is None:
                raise SessionError(
                    f"unknown or ended session {handle!r}; omit `session` to start a new one"
                )
            return found
        return self._by_scope.get(scope) if scope is not None else None

    def _open(self, scope: str | None) -> Session:
        if len(self._by_handle) >= self._config.max_sessions:
            raise SessionError(
                f"the server already runs {len(self._by_handle)} sessions, its limit; "
                "end one (reset_sandbox, or close the client) or try again later"
            )
        session = Session(handle=secrets.token_urlsafe(16), scope=scope)
        self._by_handle[session.handle] = session
        if scope is not None:
            self._by_scope[scope] = session
        return session

    @asynccontextmanager
    async def use(self, handle: str | None, scope: str | None) -> AsyncIterator[tuple[str, str]]:
        """``(session handle, sandbox id)`` for one call; the sandbox is made on first use."""
        session = self._find(handle, scope) or self._open(scope)
        session.busy += 1
        try:
            async with session.lock:
                if session.ended:  # ended while this call waited for the lock
                    raise SessionError(f"session {session.handle!r} ended; call again")
                if session.sandbox_id is None:
                    volume = await self._workspace(session)
                    session.sandbox_id = await anyio.to_thread.run_sync(self._create, volume)
            yield session.handle, session.sandbox_id
        finally:
            session.busy -= 1
            session.last_used = time.monotonic()

    async def _workspace(self, session: Session) -> str | None:
        """The session's workspace volume, made on first use. It lives as long as the
        connection (scope), else the session. At most ``max_sessions`` exist: past that the
        oldest one whose connection has no session left is deleted first."""
        size = self._config.workspace_volume
        if size is None:
            return None
        key = session.scope or f"session:{session.handle}"
        if key in self._workspaces:
            return self._workspaces[key]
        if len(self._workspaces) >= self._config.max_sessions:
            live = set(self._by_scope) | {f"session:{h}" for h in self._by_handle}
            idle = next((k for k in self._workspaces if k not in live), None)
            if idle is None:
                raise SessionError(f"{len(self._workspaces)} workspaces exist, the server's "
                                   "limit; end a session or try again later")
            await self._drop_workspace(idle)
        name = f"mcp-ws-{secrets.token_hex(8)}"
        self._workspaces[key] = name  # before the await: a second call finds it
        try:
            await anyio.to_thread.run_sync(self._runtime.volumes.create, name, size)
        except BaseException:
            self._workspaces.pop(key, None)
            raise
        return name

    def _create(self, volume: str | None) -> str:
        cfg = self._config.sandbox
        extra: dict = {}
        if volume is not None:
            workdir = cfg.workdir or "/workspace"
            extra = {"volumes": {workdir: volume}, "workdir": workdir}
        return self._runtime.create(cfg, labels={**cfg.labels, **OWNER_LABEL}, **extra)

    async def end(self, handle: str | None, scope: str | None) -> str | None:
        """End the caller's session (its sandbox is deleted); returns its handle, or None when
        there is no such session (never made, or already ended)."""
        if handle is not None:
            session = self._by_handle.get(handle)
        else:
            session = self._by_scope.get(scope) if scope is not None else None
        if session is None:
            return None
        await self._end(session)
        return session.handle

    async def end_scope(self, scope: str) -> None:
        session = self._by_scope.get(scope)
        if session is not None:
            await self._end(session)
        await self._drop_workspace(scope)

    async def _drop_workspace(self, key: str) -> None:
        name = self._workspaces.pop(key, None)
        if name is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._delete_volume, name)

    def _delete_volume(self, name: str) -> None:
        try:
            self._runtime.volumes.delete(name)
        except SandboxError as exc:  # left for an operator: `ray-sandbox volume rm`
            log.warning("deleting workspace volume %s failed: %s", name, exc)

    async def _end(self, session: Session) -> None:
        # Forget it first, synchronously, so no new call can reach it.
        self._by_handle.pop(session.handle, None)
        if session.scope is not None and self._by_scope.get(session.scope) is session:
            del self._by_scope[session.scope]
        session.ended = True
        with anyio.CancelScope(shield=True):  # a cancelled caller must not leak the sandbox
            async with session.lock:
                if session.sandbox_id is not None:
                    await anyio.to_thread.run_sync(self._delete, session.sandbox_id)
                    session.sandbox_id = None
            if session.scope is None:  # a handle-only session's workspace ends with it
                await self._drop_workspace(f"session:{session.handle}")

    def _delete(self, sandbox_id: str) -> None:
        try:
            # wait: the server may be stopped by a signal right after, which would cut a
            # background teardown short (then only the node's next gc finishes it)
            self._runtime.delete(sandbox_id, wait=True)
        except SandboxError as exc:  # the runtime's gc removes whatever is left
            log.warning("deleting sandbox %s failed: %s", sandbox_id, exc)

    async def reap_idle(self) -> None:
        """End sessions without a call in flight for longer than the idle timeout."""
        cutoff = time.monotonic() - self._config.idle_timeout
        for session in list(self._by_handle.values()):
            if session.busy == 0 and session.last_used < cutoff:
                await self._end(session)

    async def reap_forever(self) -> None:
        period = min(60.0, max(0.5, self._config.idle_timeout / 4))
        while True:
            await anyio.sleep(period)
            await self.reap_idle()

    async def close(self) -> None:
        """End every session and delete every workspace volume."""
        for session in list(self._by_handle.values()):
            await self._end(session)
        for key in list(self._workspaces):
            await self._drop_workspace(key)
