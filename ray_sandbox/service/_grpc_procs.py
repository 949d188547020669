"""Processes as Modal's client sees them (a command of ``sb.exec``, or a sandbox's
entrypoint): started on the sandbox's host (the handle's ``spawn``), their output pumped
into per-stream buffers addressed by offset (the client reads lazily, once per stream, and
reconnects at the offset it reached), stdin written at the client's offset (a retried write
is not written twice), killed at its timeout by this side (the client's own timeout only
stops its waiting), and its exit kept for the client's ``wait``/``poll``.

Bounds: what no reader has reached is kept up to ``modal_output_bytes`` per stream (past it
the pump stops reading and the host's own buffer takes over, then drops and marks the
result truncated); stdin in flight per process is one write at a time of at most
``modal_stdin_bytes``; a read stream with no output for ``modal_stream_idle_seconds`` ends
with DEADLINE_EXCEEDED, which the client answers by reading again at its offset. No
``modal_proto`` here: the handlers (``_grpc_router``) turn these into messages.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio

from ..runtime.errors import SandboxError, SandboxNotFoundError, SandboxStateError
from ..runtime.results import ExecResult
from ..runtime.verbs import SpawnRequest
from . import _errors

log = logging.getLogger(__name__)

READ_WAIT = 0.5  # one read on the host waits this long for output before the exit is asked
FIRST_WAIT = 0.05  # the first call waits this long for the exit: a short command is one call
KEEP_BEHIND = 1 << 20  # bytes kept before the furthest read offset, for a reconnect's retry
KILLED = 137


class Output:
    """One stream's bytes (stdout or stderr), by offset from the start. Readers wait on new
    data; what every reader is well past is let go."""

    def __init__(self, cap: int) -> None:
        self._data = bytearray()
        self._base = 0  # the offset of _data[0]
        self._read_to = 0  # the furthest offset a reader reached
        self._cap = cap
        self._changed = asyncio.Event()
        self.eof = False

    @property
    def end(self) -> int:
        return self._base + len(self._data)

    def append(self, data: bytes) -> None:
        if data:
            self._data += data
            self._wake()

    def close(self) -> None:
        self.eof = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    @property
    def full(self) -> bool:
        """More unread than the cap: the pump waits for a reader."""
        return self.end - self._read_to > self._cap

    async def room(self) -> None:
        while self.full and not self.eof:
            await self._changed.wait()

    async def read(self, offset: int, idle: float,
                   chunk: int = 1 << 20) -> AsyncIterator[tuple[int, bytes]]:
        """``(start offset, bytes)`` from ``offset`` until the end of the stream; never an
        empty chunk (the client refuses one). An offset already let go starts at the oldest
        byte kept (the reader sees where from)."""
        offset = max(offset, self._base)
        while True:
            if offset < self.end:
                start = offset - self._base
                data = bytes(self._data[start:start + chunk])
                offset += len(data)
                self._reached(offset)
                yield offset - len(data), data
                continue
            if self.eof:
                return
            # TimeoutError past ``idle`` without new output: the caller ends the stream
            await asyncio.wait_for(self._changed.wait(), idle)

    def _reached(self, offset: int) -> None:
        if offset > self._read_to:
            self._read_to = offset
            self._wake()  # the pump may be waiting for room
        drop = self._read_to - KEEP_BEHIND - self._base
        if drop > 0:
            del self._data[:drop]
            self._base += drop


Call = Callable[[Any], Awaitable[Any]]


class Proc:
    """A process started through ``handle.spawn``; ``pump()`` runs it to its end."""

    def __init__(self, handle: Any, call: Call, *, out_cap: int, stdin_cap: int,
                 pipe_out: bool = True, pipe_err: bool = True) -> None:
        self.handle = handle
        self._call = call
        self.key: str | None = None
        self.stdout = Output(out_cap)
        self.stderr = Output(out_cap)
        self._pipe = (pipe_out, pipe_err)
        self._stdin_cap = stdin_cap
        self._stdin_lock = asyncio.Lock()
        self.stdin_offset = 0
        self.stdin_closed = False
        self.result: ExecResult | None = None
        self.failed: str | None = None  # the host lost it: why
        self.done = asyncio.Event()
        self.finished_at: float | None = None
        self.task: asyncio.Task[None] | None = None
        self.watcher: asyncio.Task[None] | None = None  # what waits for its end, if any

    @property
    def exit_code(self) -> int | None:
        if self.result is not None:
            return self.result.exit_code
        return KILLED if self.failed is not None else None

    async def start(self, request: SpawnRequest, deadline: float | None) -> None:
        """Spawn it (raises the host's error, e.g. no such command); then pump it in a
        task of its own, which kills it at ``deadline`` (monotonic)."""
        self.key, _pid = await self._call(self.handle.spawn.remote(request))
        self.task = asyncio.ensure_future(self._pump(deadline))

    async def _pump(self, deadline: float | None) -> None:
        proc = self.handle.process
        killed = False
        try:
            # most commands are short: one call gets the exit and all the output of one that
            # ends within FIRST_WAIT (its first output is that much later for a long one)
            res = await self._call(proc.remote(self.key, "wait", FIRST_WAIT))
            if res is not None:
                self._keep(res.stdout_bytes, res.stderr_bytes)
                self.result = res
                return
            while True:
                await asyncio.gather(self.stdout.room(), self.stderr.room())
                out, err = await self._call(proc.remote(self.key, "read_both", READ_WAIT))
                self._keep(out, err)
                if out or err:
                    continue
                if deadline is not None and not killed and time.monotonic() > deadline:
                    killed = True  # its exit follows (137), as for Modal's killed command
                    await self._call(proc.remote(self.key, "kill", 9))
                res = await self._call(proc.remote(self.key, "wait", 0))
                if res is not None:
                    self._keep(res.stdout_bytes, res.stderr_bytes)
                    self.result = res
                    return
        except SandboxError as exc:
            self.failed = exc.message
        except asyncio.CancelledError:
            self.failed = "cancelled"
            raise
        except Exception as exc:  # a host gone: the process is gone with it
            self.failed = f"{type(exc).__name__}: {exc}"
        finally:
            self.stdout.close()
            self.stderr.close()
            self.finished_at = time.monotonic()
            self.done.set()
            with anyio.CancelScope(shield=True):
                await self._close()

    def _keep(self, out: bytes, err: bytes) -> None:
        if self._pipe[0]:
            self.stdout.append(out)
        if self._pipe[1]:
            self.stderr.append(err)

    async def _close(self) -> None:
        if self.key is None:
            return
        try:
            await self._call(self.handle.process.remote(self.key, "close"))
        except Exception as exc:  # the sandbox (and the process with it) is gone
            log.debug("closing process %s: %s", self.key, exc)

    async def write_stdin(self, offset: int, data: bytes, eof: bool) -> None:
        """Write ``data`` at ``offset`` of its stdin (bytes before what was written are a
        retry, and skipped), then EOF if asked; a gap, or a write over the bound, is a
        refusal (409, 413)."""
        if len(data) > self._stdin_cap:
            raise _errors.refusal(413, f"one stdin write of {len(data)} bytes; at most "
                                       f"{self._stdin_cap} (modal_stdin_bytes)")
        async with self._stdin_lock:
            if offset > self.stdin_offset:
                raise _gap(offset, self.stdin_offset)
            data = data[self.stdin_offset - offset:]
            if self.done.is_set():  # it exited and its pump closed it on the host: a write
                self.stdin_closed = True  # (or an EOF) after that is one to a closed pipe
            try:
                if data and not self.stdin_closed:
                    await self._call(self.handle.process.remote(self.key, "write_stdin", data))
                self.stdin_offset += len(data)
                if eof and not self.stdin_closed:
                    self.stdin_closed = True
                    await self._call(self.handle.process.remote(self.key, "close_stdin"))
            except SandboxStateError:
                self.stdin_closed = True  # it exited: its output and exit are still kept
            except SandboxNotFoundError:
                if not self.done.is_set():  # not our pump's close racing this write
                    raise
                self.stdin_closed = True

    async def kill(self) -> None:
        if self.key is not None and not self.done.is_set():
            try:
                await self._call(self.handle.process.remote(self.key, "kill", 9))
            except SandboxError:
                pass

    async def wait(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self.done.wait(), timeout)
        except TimeoutError:
            return False
        return True


class Finished(Proc):
    """A process that is its result already (the filesystem tools' answers)."""

    def __init__(self, *, out_cap: int, stdin_cap: int) -> None:
        super().__init__(None, _no_call, out_cap=out_cap, stdin_cap=stdin_cap)

    def finish(self, code: int, out: bytes = b"", err: bytes = b"") -> None:
        self.stdout.append(out)
        self.stderr.append(err)
        self.stdout.close()
        self.stderr.close()
        self.result = ExecResult(exit_code=code, stdout_bytes=out, stderr_bytes=err)
        self.finished_at = time.monotonic()
        self.done.set()


class Collecting(Finished):
    """A process whose stdin is collected (at most ``limit`` bytes) and handed to
    ``on_eof`` at its end: the filesystem tools' WriteFile."""

    def __init__(self, limit: int, on_eof: Callable[[bytes], Awaitable[tuple[int, bytes]]],
                 **kw: Any) -> None:
        super().__init__(**kw)
        self._limit = limit
        self._buf = bytearray()
        self._on_eof = on_eof

    async def write_stdin(self, offset: int, data: bytes, eof: bool) -> None:
        async with self._stdin_lock:
            if offset > self.stdin_offset:
                raise _gap(offset, self.stdin_offset)
            data = data[self.stdin_offset - offset:]
            if self.stdin_closed:
                return
            if len(self._buf) + len(data) > self._limit:
                self.stdin_closed = True
                self.finish(1, err=fs_error("FileTooLarge", f"more than {self._limit} bytes "
                                             "(the service's max_file_bytes)"))
                return
            self._buf += data
            self.stdin_offset += len(data)
            if eof:
                self.stdin_closed = True
                code, err = await self._on_eof(bytes(self._buf))
                self._buf.clear()
                self.finish(code, err=err)


def fs_error(kind: str, message: str) -> bytes:
    """The filesystem tools' error, as the client parses it from stderr."""
    return json.dumps({"error_kind": kind, "message": message}).encode()


async def _no_call(_: Any) -> Any:
    raise AssertionError("a finished process calls no host")


def _gap(offset: int, have: int) -> Exception:
    return _errors.refusal(409, f"stdin written at offset {offset}, but only {have} bytes "
                                "arrived")
