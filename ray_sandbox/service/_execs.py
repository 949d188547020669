"""The execs a replica runs in tenants' sandboxes: plain ones, whose results go to the books
(``_books_execs``) where every replica finds them; streamed ones (``_streams``), whose
process keys go there so a signal landing on another replica reaches them; and terminals
(``_pty``). A replica bounds its own: ``direct_exec_threads`` threads for plain execs run
through the node-local channel, ``max_streams`` streams and terminals."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import anyio
import anyio.to_thread

from ..runtime.errors import SandboxError
from ..runtime.results import ExecResult
from ..runtime.verbs import ExecRequest
from . import _errors, _pty, _streams
from ._config import ServiceConfig
from ._entry import Entry, Exec
from ._models import ExecInfo
from ._state import Shared


class SandboxExecs:
    """One replica's execs, streams and terminals in the tenants' sandboxes (each entry
    holds its own: ``Entry.execs``, ``Entry.streams``)."""

    def __init__(self, config: ServiceConfig, state: Shared,
                 report: Callable[..., asyncio.Task[Any]], call: Callable[[Any], Any]) -> None:
        self._config = config
        self._state = state
        self._report = report  # a step of the books nobody waits for (shutdown does)
        self._call = call  # a host call's result, bounded
        self._direct = 0  # execs running in threads through handle.run
        self._direct_threads = anyio.CapacityLimiter(max(1, config.direct_exec_threads))
        self._streaming = 0

    async def start_exec(self, entry: Entry, request: ExecRequest) -> Exec:
        """Start a command; its result is kept among the sandbox's last
        ``max_execs_per_sandbox`` in the books (the oldest finished one is evicted, never a
        running one), where every replica finds it; this replica keeps it until then."""
        if len(entry.execs) >= self._config.max_execs_per_sandbox:
            done = next((k for k, x in entry.execs.items() if x.future.done()), None)
            if done is None:
                raise _errors.refusal(429, f"{len(entry.execs)} execs are running in this "
                                           "sandbox, its limit; wait for one to finish")
            del entry.execs[done]
        request = capped(request, self._config)
        exec_id = secrets.token_hex(8)
        reason = await self._state("exec_started", entry.tenant, entry.api_id, exec_id,
                                   request.timeout)
        if reason is not None:
            raise _errors.refusal(429, reason)
        if self._direct < self._config.direct_exec_threads:
            self._direct += 1  # here, not in the task: a task cancelled unstarted never runs
            future: asyncio.Future[ExecResult] = asyncio.ensure_future(
                self._run_direct(entry.handle, request))
            future.add_done_callback(self._direct_done)
        else:  # every thread busy: no waiting for one, the actor call costs ~2 ms more
            future = asyncio.wrap_future(entry.handle.exec.remote(request).future())
        ex = Exec(exec_id, future)
        ex.future.add_done_callback(_consume)
        ex.future.add_done_callback(partial(self._finished, entry, ex))
        entry.execs[ex.exec_id] = ex
        return ex

    def _finished(self, entry: Entry, ex: Exec, _: asyncio.Future[ExecResult]) -> None:
        """Its result goes to the books; once there, they answer for it (this replica
        forgets it), so an eviction there holds for every replica."""
        ex.reported = self._report("exec_finished", entry.api_id, ex.exec_id,
                                   exec_info(ex).model_dump(mode="json"))

        def forget(task: asyncio.Task[Any]) -> None:
            if not task.cancelled() and task.exception() is None:
                entry.execs.pop(ex.exec_id, None)

        ex.reported.add_done_callback(forget)

    async def _run_direct(self, handle: Any, request: ExecRequest) -> ExecResult:
        """``handle.run`` in a thread: the node-local channel when the sandbox is on this
        replica's node (``actor/channel.py``), else the actor call, blocking. Not abandoned
        when cancelled (a DELETE cancels and does not wait): the thread and its count are
        given back only when the command ends (its timeout, or the sandbox's deletion), so
        their number stays bounded."""
        return await anyio.to_thread.run_sync(partial(handle.run, request),
                                              limiter=self._direct_threads)

    def _direct_done(self, _: asyncio.Future[ExecResult]) -> None:
        self._direct -= 1

    async def exec_info(self, entry: Entry, exec_id: str, wait: float = 0.0) -> ExecInfo:
        """From this replica's own future while it runs the exec (and until the books have
        its result), else from the books."""
        wait = min(wait, self._config.max_wait_seconds)
        ex = entry.execs.get(exec_id)
        if ex is not None:
            if not ex.future.done() and wait > 0:
                await asyncio.wait([ex.future], timeout=wait)
            if ex.reported is not None and not ex.reported.done():
                # finished here only once the books say so too, as with a create
                await asyncio.wait([ex.reported], timeout=self._config.state_timeout)
            return exec_info(ex)
        found = await self._state("exec_record", entry.tenant, entry.api_id, exec_id, wait,
                                  wait=wait)
        if found is None:
            raise _errors.refusal(404, f"no exec {exec_id!r} in this sandbox (results are "
                                       f"kept for its last {self._config.max_execs_per_sandbox})")
        return ExecInfo.model_validate(found)

    def _take_stream(self) -> None:
        """One of the ``max_streams`` streamed execs and terminals; 429 when none is left."""
        if self._streaming >= self._config.max_streams:
            raise _errors.refusal(429, f"{self._streaming} streamed execs and terminals are "
                                       "running, the service's limit; try again later")
        self._streaming += 1

    async def terminal(self, ws: Any, entry: Entry, command: str, rows: int,
                       cols: int) -> None:
        """An interactive terminal on the WebSocket ``ws`` (``_pty``), counted as a stream
        here and, in the books, as one of its tenant's running execs."""
        key = f"pty-{secrets.token_hex(8)}"
        reason = await self._state("stream_started", entry.tenant, entry.api_id, key, key)
        if reason is not None:
            await ws.accept()
            await ws.close(code=4429, reason=reason[:120])
            return
        try:
            self._take_stream()
        except BaseException:
            self._report("stream_ended", entry.api_id, key)
            raise
        try:
            await _pty.session(ws, entry.handle, self._call, command, rows, cols,
                               self._config.max_exec_timeout)
        finally:
            self._streaming -= 1
            self._report("stream_ended", entry.api_id, key)

    async def stream_exec(self, entry: Entry,
                          request: ExecRequest) -> AsyncIterator[bytes]:
        """Start a streamed exec; returns its NDJSON lines (``_streams``). Its process key
        goes to the books, so a signal or cancel landing on another replica reaches it."""
        self._take_stream()
        request = capped(request, self._config)
        try:
            stream = await _streams.start(entry.handle, self._call, request)
        except BaseException:
            self._streaming -= 1
            raise
        try:
            reason = await self._state("stream_started", entry.tenant, entry.api_id,
                                       stream.exec_id, stream.key)
            if reason is not None:
                raise _errors.refusal(429, reason)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await _streams.close(stream, self._call)
            self._streaming -= 1
            raise
        entry.streams[stream.exec_id] = stream
        assert request.timeout is not None  # capped sets it
        return self._stream_lines(entry, stream, request.timeout)

    async def _stream_lines(self, entry: Entry, stream: _streams.Stream,
                            limit: float) -> AsyncIterator[bytes]:
        try:
            async for line in _streams.lines(stream, self._call, limit,
                                             self._config.stream_keepalive_seconds):
                yield line
        finally:
            entry.streams.pop(stream.exec_id, None)
            self._streaming -= 1
            self._report("stream_ended", entry.api_id, stream.exec_id)

    async def signal_exec(self, entry: Entry, exec_id: str, signal: int | None) -> None:
        """Send ``signal`` to a streamed exec, or cancel it (None: SIGTERM, then SIGKILL);
        one another replica reads is reached through the sandbox's handle by its key."""
        stream = entry.streams.get(exec_id)
        if stream is None:
            key = None if exec_id in entry.execs else await self._state(
                "stream_key", entry.tenant, entry.api_id, exec_id)
            if key is None:
                if exec_id in entry.execs or await self._state(
                        "exec_record", entry.tenant, entry.api_id, exec_id) is not None:
                    raise _errors.refusal(409, "only a streamed exec (POST .../execs/stream) "
                                               "can be signalled or cancelled")
                raise _errors.refusal(404, f"no running streamed exec {exec_id!r}")
            stream = _streams.Stream(exec_id, key, entry.handle)
        if signal is None:
            await _streams.cancel(stream, self._call)
        else:
            await self._call(entry.handle.process.remote(stream.key, "kill", signal))


def _consume(fut: asyncio.Future[Any]) -> None:
    # a result nobody polled must not log "exception was never retrieved"
    if not fut.cancelled():
        fut.exception()


def capped(request: ExecRequest, config: ServiceConfig) -> ExecRequest:
    """The request within the service's bounds (its exec timeout, its output kept)."""
    cap = config.max_exec_timeout
    return request.model_copy(update={
        "timeout": min(request.timeout or cap, cap),
        "max_output_bytes": min(request.max_output_bytes or config.max_output_bytes,
                                config.max_output_bytes)})


def exec_info(ex: Exec) -> ExecInfo:
    """An exec's state as the API shows it."""
    fut = ex.future
    if not fut.done():
        return ExecInfo(exec_id=ex.exec_id, status="running")
    if fut.cancelled():
        return ExecInfo(exec_id=ex.exec_id, status="failed",
                        error={"code": "cancelled", "message": "the sandbox was deleted"})
    exc = fut.exception()
    if exc is not None:
        code = _errors.code_of(exc) if isinstance(exc, SandboxError) else "unavailable"
        message = exc.message if isinstance(exc, SandboxError) else str(exc)
        return ExecInfo(exec_id=ex.exec_id, status="failed",
                        error={"code": code, "message": message[:2000]})
    res: ExecResult = fut.result()
    return ExecInfo(exec_id=ex.exec_id, status="timed_out" if res.timed_out else "completed",
                    exit_code=res.exit_code, stdout=res.stdout, stderr=res.stderr,
                    truncated=res.truncated, duration_seconds=res.duration_seconds)
