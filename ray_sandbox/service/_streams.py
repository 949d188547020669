"""Streamed execs: a command started as a spawned process on its host, its output sent as
NDJSON lines while it runs, stopped by a signal, a ``DELETE``, the caller going away or its
timeout. A plain exec (``POST .../execs``) is one Ray call that cannot be interrupted; a
streamed one can.

Lines: ``{"type": "start", "exec_id"}``, then ``{"type": "stdout", "data"}`` and
``{"type": "stderr", "data"}`` as output arrives (``{"type": "keepalive"}`` after a silence),
then ``{"type": "exit", "exit_code", "stdout", "stderr", "timed_out", "signal",
"truncated"}`` with the output not streamed yet, or ``{"type": "error", "code",
"message"}``.
"""

from __future__ import annotations

import codecs
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio

from ..runtime.errors import SandboxError, SandboxStateError
from ..runtime.results import ExecResult
from ..runtime.verbs import CommandRequest, ExecRequest, SpawnRequest
from . import _errors

READ_WAIT = 0.5  # one read waits this long on the host for output before we check the exit
TERM_GRACE = 2.0  # a cancel sends SIGTERM, then SIGKILL after this long


@dataclass(eq=False)
class Stream:
    """A running streamed exec: the host's process key, and who may signal it."""

    exec_id: str
    key: str
    handle: Any


Call = Callable[[Any], Awaitable[Any]]


async def start(handle: Any, call: Call, request: ExecRequest) -> Stream:
    """Spawn the request's command (its stdin written, then closed); the caller's loop
    (``lines``) bounds it by the request's timeout."""
    spawn = SpawnRequest(**request.model_dump(include=set(CommandRequest.model_fields),
                                              exclude={"timeout"}))
    key, _pid = await call(handle.spawn.remote(spawn))
    stream = Stream(secrets.token_hex(8), key, handle)
    stdin = request.stdin
    try:
        if stdin:
            data = stdin.encode() if isinstance(stdin, str) else stdin
            await call(handle.process.remote(key, "write_stdin", data))
        await call(handle.process.remote(key, "close_stdin"))
    except SandboxStateError:
        pass  # it exited before reading its input; its output and exit are still kept
    except BaseException:
        await close(stream, call)
        raise
    return stream


async def lines(stream: Stream, call: Call, timeout: float,
                keepalive: float) -> AsyncIterator[bytes]:
    """The NDJSON lines of a streamed exec; the process is closed (its tree killed) however
    this ends: the exit, the timeout, an error, or the caller cancelling. A silent command
    still gets a line every ``keepalive`` seconds: proxies keep the stream open, and a caller
    that went away is noticed when the line cannot be written."""
    deadline = time.monotonic() + timeout
    proc = stream.handle.process
    timed_out = False
    # a character split between two reads is decoded whole (a decoder per stream)
    text = {name: codecs.getincrementaldecoder("utf-8")(errors="replace")
            for name in ("stdout", "stderr")}
    try:
        yield _line(type="start", exec_id=stream.exec_id)
        sent = time.monotonic()
        while True:
            out, err = await call(proc.remote(stream.key, "read_both", READ_WAIT))
            if out:
                yield _line(type="stdout", data=text["stdout"].decode(out))
            if err:
                yield _line(type="stderr", data=text["stderr"].decode(err))
            if out or err:
                sent = time.monotonic()
                continue
            if time.monotonic() - sent > keepalive:
                yield _line(type="keepalive")
                sent = time.monotonic()
            result = await call(proc.remote(stream.key, "wait", 0))
            if result is not None:
                for name, decoder in text.items():  # an incomplete character at the end
                    if rest := decoder.decode(b"", final=True):
                        yield _line(type=name, data=rest)
                yield _exit_line(result, timed_out)
                return
            if time.monotonic() > deadline and not timed_out:
                timed_out = True  # killed; its exit line follows from the loop
                await call(proc.remote(stream.key, "kill", 9))
    except SandboxError as exc:
        yield _line(type="error", code=_errors.code_of(exc), message=exc.message)
    finally:
        # a caller that went away cancelled us, and the process must still die: in this task
        # (asyncio.shield's inner task is held by nothing and may vanish) and shielded from
        # the cancellation, which anyio delivers again at every await in a cancelled scope
        with anyio.CancelScope(shield=True):
            await close(stream, call)


async def close(stream: Stream, call: Call) -> None:
    try:
        await call(stream.handle.process.remote(stream.key, "close"))
    except SandboxError:
        pass  # the sandbox is gone, and the process with it


async def cancel(stream: Stream, call: Call) -> None:
    """SIGTERM, then SIGKILL if it has not exited within TERM_GRACE seconds."""
    proc = stream.handle.process
    await call(proc.remote(stream.key, "kill", 15))
    if await call(proc.remote(stream.key, "wait", TERM_GRACE)) is None:
        await call(proc.remote(stream.key, "kill", 9))


def _exit_line(res: ExecResult, timed_out: bool) -> bytes:
    return _line(type="exit", exit_code=res.exit_code, stdout=res.stdout, stderr=res.stderr,
                 timed_out=timed_out or res.timed_out, signal=res.signal,
                 truncated=res.truncated, duration_seconds=res.duration_seconds)


def _line(**fields: Any) -> bytes:
    return json.dumps(fields).encode() + b"\n"
