"""SandboxMCPServer: the MCP tools, each running in the calling session's own sandbox."""

from __future__ import annotations

import posixpath
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, closing, contextmanager
from typing import Annotated, TypeVar

import anyio
import anyio.to_thread
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import Field

from ..runtime import FileType, SandboxRuntime
from ..runtime.errors import SandboxDiedError, SandboxError
from ._config import MCPServerConfig
from ._results import (
    CommandResult,
    DirEntry,
    DirListing,
    FileContent,
    FileWritten,
    PythonRunResult,
    SessionEnded,
    file_text,
)
from ._sessions import SessionError, Sessions

T = TypeVar("T")

SESSION_HEADER = "mcp-session-id"


def http_scope(session_id: str) -> str:
    """The scope of a streamable-HTTP protocol session."""
    return f"http:{session_id}"


SessionArg = Annotated[
    str | None,
    Field(description="The `session` handle from an earlier result. Only needed by clients "
          "without an MCP session (2026-07-28 protocol over HTTP); others may omit it."),
]
TimeoutArg = Annotated[
    float | None, Field(description="seconds; omitted = the server's default, capped at its max")
]
PathArg = Annotated[str, Field(description="absolute, or relative to the working directory")]


def _scope(ctx: Context) -> str | None:
    """The caller's session scope. Without HTTP headers (stdio, in-process) the connection is
    the lifespan, which serves exactly one client; over HTTP it is the protocol session, and
    a 2026-07-28 request, which has none, gets None."""
    headers = ctx.headers
    if headers is None:
        return ctx.request_context.lifespan_context
    session_id = headers.get(SESSION_HEADER)
    return http_scope(session_id) if session_id else None


@contextmanager
def _as_tool_errors() -> Iterator[None]:
    """Failures the model should read (bad path, limits) become tool errors."""
    try:
        yield
    except SessionError as exc:
        raise ToolError(str(exc)) from exc
    except SandboxError as exc:
        raise ToolError(exc.message) from exc  # without the sandbox id and argv of str()


class SandboxMCPServer:
    """An MCP server whose tools run in per-session gVisor sandboxes of one runtime."""

    def __init__(self, config: MCPServerConfig, runtime: SandboxRuntime) -> None:
        self.config = config
        self.runtime = runtime
        self.sessions = Sessions(runtime, config)
        self._lifespans = 0
        self.mcp: MCPServer[str] = MCPServer(
            "ray-sandbox", instructions=self._instructions(), lifespan=self._lifespan,
            log_level="WARNING",
        )
        read_only = ToolAnnotations(read_only_hint=True)
        for tool, hints in (
            (self.run_python, None), (self.run_shell, None), (self.read_file, read_only),
            (self.write_file, None), (self.list_dir, read_only),
            (self.reset_sandbox, ToolAnnotations(destructive_hint=True)),
        ):
            self.mcp.add_tool(tool, annotations=hints)

    def _instructions(self) -> str:
        sb = self.config.sandbox
        memory = f"{sb.memory // 2**20} MiB" if sb.memory else "unlimited"
        return (
            f"Each client session gets its own isolated gVisor sandbox (image {sb.image}, "
            f"network '{sb.network}', cpu {sb.cpu or 'unlimited'}, memory {memory}), created "
            "on the first tool call. Files and Python state persist for the session; the "
            f"working directory is {sb.workdir or '/'}. A session idle for "
            f"{self.config.idle_timeout:g} s ends and its sandbox is deleted."
        )

    @asynccontextmanager
    async def _lifespan(self, _: MCPServer[str]) -> AsyncIterator[str]:
        """One lifespan per stdio/in-process connection (one per server over HTTP); its value
        is the scope of that connection's default session. When the last one ends, so does
        every session (over HTTP that is server shutdown)."""
        scope = f"connection:{uuid.uuid4().hex}"
        self._lifespans += 1
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.sessions.reap_forever)
            try:
                yield scope
            finally:
                tg.cancel_scope.cancel()
                self._lifespans -= 1
                if self._lifespans:
                    await self.sessions.end_scope(scope)
                else:
                    await self.sessions.close()

    async def _call(self, ctx: Context, session: str | None,
                    fn: Callable[[str], T]) -> tuple[str, T]:
        """Run ``fn(sandbox_id)`` in a worker thread in the caller's session."""
        with _as_tool_errors():
            async with self.sessions.use(session, _scope(ctx)) as (handle, sandbox_id):
                try:
                    return handle, await anyio.to_thread.run_sync(fn, sandbox_id)
                except SandboxDiedError as exc:
                    await self.sessions.end(handle, None)
                    raise ToolError(
                        f"{exc.message}; the session ended, the next call starts a fresh sandbox"
                    ) from exc

    def _path(self, path: str) -> str:
        return posixpath.normpath(posixpath.join(self.config.sandbox.workdir or "/", path))

    # --- tools ---------------------------------------------------------------------------------

    async def run_python(
        self, code: str, ctx: Context, timeout: TimeoutArg = None, session: SessionArg = None,
    ) -> PythonRunResult:
        """Run Python code in the session's persistent interpreter (variables and imports are
        kept between calls, like a notebook). The repr of a trailing expression is returned
        as `value`. A timeout returns what the code printed so far and restarts the
        interpreter, so its state is lost."""
        seconds = self.config.clamp_timeout(timeout)
        handle, res = await self._call(
            ctx, session, lambda sid: self.runtime.run_python(sid, code, timeout=seconds)
        )
        return PythonRunResult.of(handle, res, self.config.max_output_bytes, value=res.value)

    async def run_shell(
        self, command: str, ctx: Context, timeout: TimeoutArg = None, session: SessionArg = None,
    ) -> CommandResult:
        """Run a shell command (`/bin/sh -c`) in the session's sandbox, in the working
        directory. A non-zero exit code is a normal result."""
        seconds, limit = self.config.clamp_timeout(timeout), self.config.max_output_bytes
        handle, res = await self._call(ctx, session, lambda sid: self.runtime.exec(
            sid, command, timeout=seconds, max_output_bytes=limit))
        return CommandResult.of(handle, res, limit)

    async def read_file(self, path: PathArg, ctx: Context,
                        session: SessionArg = None) -> FileContent:
        """Read a file from the session's sandbox (UTF-8 text, else base64)."""
        target, limit = self._path(path), self.config.max_file_bytes

        def read(sid: str) -> tuple[bytes, int]:
            info = self.runtime.stat(sid, target)
            if info.type == FileType.DIRECTORY:
                raise ToolError(f"{target} is a directory; use list_dir")
            data = bytearray()
            with closing(self.runtime.iter_read(sid, target)) as chunks:
                for chunk in chunks:
                    data += chunk
                    if len(data) > limit:
                        break
            return bytes(data), max(info.size, len(data))

        handle, (data, size) = await self._call(ctx, session, read)
        content, encoding, cut = file_text(data, limit)
        return FileContent(session=handle, path=target, content=content, encoding=encoding,
                           size=size, truncated=cut)

    async def write_file(self, path: PathArg, content: str, ctx: Context,
                         session: SessionArg = None) -> FileWritten:
        """Write a UTF-8 text file in the session's sandbox (replacing it; missing parent
        directories are created)."""
        target, data = self._path(path), content.encode()
        handle, _ = await self._call(
            ctx, session, lambda sid: self.runtime.write_file(sid, target, data)
        )
        return FileWritten(session=handle, path=target, size=len(data))

    async def list_dir(self, ctx: Context, path: PathArg = ".",
                       session: SessionArg = None) -> DirListing:
        """List a directory in the session's sandbox (symlinks are not followed)."""
        target, limit = self._path(path), self.config.max_dir_entries
        handle, infos = await self._call(ctx, session,
                                         lambda sid: self.runtime.list_dir(sid, target))
        infos = sorted(infos, key=lambda i: i.name)
        return DirListing(session=handle, path=target,
                          entries=[DirEntry.of(i) for i in infos[:limit]],
                          truncated=len(infos) > limit)

    async def reset_sandbox(self, ctx: Context, session: SessionArg = None) -> SessionEnded:
        """End the session now: its sandbox, files and Python state are deleted. The next
        call starts a fresh sandbox in a new session."""
        handle = await self.sessions.end(session, _scope(ctx))
        return SessionEnded(session=handle, ended=handle is not None)

