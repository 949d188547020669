"""Host-side client of the in-sandbox agent.

(~650 lines and ~30 methods, one cohesive thing: one method per request the agent serves,
with its client-side bounds, and the rate budget of a streamed transfer, which spans a call
rather than one connection's frame; framing, argument checks, AgentProcess and the pool of
connections (with the checkpoint hold and the activity idle_timeout reads) live in conn.py,
args.py, process.py and pool.py. Splitting the requests would split one protocol's client
in two.)

Each call checks a connection out of a small pool (``pool.py``: one connection = one handler
process in the sandbox), runs one request on it and puts it back. A long-lived
:class:`AgentProcess` owns its connection until it is closed. Every failure is a
:class:`SandboxError` subclass.

The agent is untrusted (root in the sandbox can replace it): the client bounds every reply
itself (output per stream, bytes read, entries listed, frame sizes, see ``conn.py``) and puts
a deadline on every send and receive, whatever the agent claims or does.
"""

from __future__ import annotations

import errno as errno_
import os
import posixpath
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

from ..errors import (
    AgentTimeoutError,
    ConfigError,
    ExecError,
    FileTooLargeError,
    SandboxDiedError,
    SandboxError,
    SandboxFileError,
    SandboxFileExistsError,
    SandboxFileNotFoundError,
    SandboxIsADirectoryError,
    SandboxNotADirectoryError,
    SandboxPermissionError,
)
from ..results import ExecResult, FileInfo, FileType, OutputChunk
from . import protocol as p
from .args import (
    UPLOAD_CHUNK,
    PathArg,
    StrOrBytes,
    UploadData,
    bytes_arg,
    check_bytes,
    check_int,
    check_seconds,
    upload_chunks,
)
from .args import exec_fields as _exec_fields
from .args import sandbox_path as _sandbox_path
from .conn import Payload, _Conn
from .pool import ConnPool
from .process import AgentProcess as AgentProcess  # spawn() returns it: importable from here
from .process import _result

DEFAULT_MAX_OUTPUT = 16 * 1024 * 1024  # per stream, when exec()/spawn() get None
READ_MAX = 64 * 1024 * 1024  # read_file's default max_bytes: it holds the bytes in memory
LIST_MAX_ENTRIES = 1 << 17  # list_dir's default max_entries: it holds them all
READS_MAX_BYTES = 1 << 19  # a READS request (its paths): well inside a frame
HUNG_MARGIN = 10.0  # seconds past a command's timeout before the agent counts as hung
PING_TIMEOUT = 5.0
READ_CHUNK = 256 * 1024
_STDIN_INLINE = 64 * 1024  # stdin up to this rides with the request; more goes from a thread
# How long a file/control call waits for each frame to go out or come in (io_timeout). Code
# in the sandbox can SIGSTOP the agent's handlers (PID 1 is not protected from signals in
# gVisor): never wait forever.
IO_TIMEOUT = 60.0
# A streamed transfer (file data either way, directory entries) must move at this average
# rate, counted over the time spent waiting for the agent (not the caller's time between
# chunks), after io_timeout of grace: each frame buys its length / MIN_RATE more seconds. A
# deadline per frame alone let a hostile agent trickle a byte a minute, or drain an upload
# that slowly, and hold a host thread for good.
MIN_RATE = 64 * 1024

T = TypeVar("T")

_FILE_ERRORS: dict[int, type[SandboxFileError]] = {
    errno_.ENOENT: SandboxFileNotFoundError,
    errno_.EISDIR: SandboxIsADirectoryError,
    errno_.ENOTDIR: SandboxNotADirectoryError,
    errno_.EEXIST: SandboxFileExistsError,
    errno_.EACCES: SandboxPermissionError,
    errno_.EPERM: SandboxPermissionError,
}


def _to_info(entry: p.Entry, path: bytes) -> FileInfo:
    return FileInfo(
        path=os.fsdecode(path),
        name=os.fsdecode(posixpath.basename(path) or path),
        type=FileType(entry.type),
        size=entry.size,
        mode=entry.mode,
        uid=entry.uid,
        gid=entry.gid,
        mtime=entry.mtime_ns / 1e9,
        link_target=os.fsdecode(entry.link) if entry.link is not None else None,
    )


class _Budget:
    """The waiting time a streamed transfer may still spend on the agent: ``io_timeout`` of
    grace, plus ``len / min_rate`` seconds per frame moved (:data:`MIN_RATE`)."""

    def __init__(self, client: AgentClient) -> None:
        self._client = client
        self._left = client.io_timeout
        self._t0 = 0.0

    def deadline(self) -> float:
        """The deadline of the next frame; AgentTimeoutError once the budget is spent."""
        if self._left <= 0:
            raise AgentTimeoutError(
                f"the agent moved data slower than {self._client.min_rate:g} bytes/s (a hung "
                "or hostile agent)", sandbox_id=self._client.sandbox_id)
        self._t0 = time.monotonic()
        return self._t0 + min(self._client.io_timeout, self._left)

    def spent(self, nbytes: int) -> None:
        """A frame of ``nbytes`` moved since :meth:`deadline`."""
        self._left += nbytes / self._client.min_rate - (time.monotonic() - self._t0)


def _mode(mode: object, sandbox_id: str | None) -> int:
    """Any st_mode is accepted: only the permission bits go over the wire."""
    return check_int(mode, "mode", sandbox_id) & 0o7777


class AgentClient:
    """Talks to one sandbox's agent over its unix socket. Thread-safe.

    ``io_timeout``: how long a file or control call waits for each frame to be taken or to
    arrive. ``hung_margin``: how long past its timeout an exec waits for the answer.
    ``min_rate``: the bytes/s a streamed reply must average (:data:`MIN_RATE`). Any of them
    exceeded is an :class:`AgentTimeoutError` and the connection is dropped."""

    def __init__(
        self, socket_path: str | Path, *, sandbox_id: str | None = None, pool_size: int = 8,
        io_timeout: float = IO_TIMEOUT, hung_margin: float = HUNG_MARGIN,
        min_rate: float = MIN_RATE,
    ) -> None:  # fmt: skip
        self.socket_path = Path(socket_path)
        self.sandbox_id = sandbox_id
        self.io_timeout = self._seconds(io_timeout, "io_timeout")
        self.hung_margin = self._seconds(hung_margin, "hung_margin")
        self.min_rate = min_rate
        # its connections, the hold of a checkpoint and the activity idleness reads
        self.pool = ConnPool(self.socket_path, sandbox_id, pool_size)

    def close(self) -> None:
        """Closes idle connections; later calls raise :class:`SandboxStateError`."""
        self.pool.close()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _seconds(self, value: object, what: str) -> float:
        seconds = check_seconds(value, what, self.sandbox_id)
        if seconds is None:
            raise ConfigError(f"{what} must be a finite number of seconds, got {value!r}",
                              sandbox_id=self.sandbox_id)  # fmt: skip
        return seconds

    def _io_deadline(self) -> float:
        return time.monotonic() + self.io_timeout

    def _unexpected(self, conn: _Conn, ftype: int) -> SandboxError:
        return conn.violation(f"unexpected frame 0x{ftype:02x}")

    def _file_error(self, conn: _Conn, payload: Payload) -> SandboxFileError:
        code, message = conn.decode(p.parse_error, payload)
        exc = _FILE_ERRORS.get(code, SandboxFileError)(message, sandbox_id=self.sandbox_id)
        exc.errno = code
        return exc

    def _exec_error(self, conn: _Conn, payload: Payload) -> ExecError:
        code, message = conn.decode(p.parse_error, payload)
        return ExecError(f"{message} (errno {code})", sandbox_id=self.sandbox_id)

    # -- ping ---------------------------------------------------------------------------

    def ping(self, timeout: float = PING_TIMEOUT) -> str:
        """The agent's version string (compare with :func:`expected_version`)."""
        deadline = time.monotonic() + self._seconds(timeout, "timeout")
        conn = self.pool.checkout()
        conn.send(p.request(p.Op.PING), deadline=deadline)
        ftype, payload = conn.read_reply(deadline)
        if ftype != p.Reply.OK:
            raise self._unexpected(conn, ftype)
        version = conn.decode(p.parse_version, payload)
        self.pool.checkin(conn)
        return version

    def wait_ready(self, timeout: float) -> str:
        """Pings until the agent answers (it may still be starting); returns its version."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.ping(timeout=max(0.05, deadline - time.monotonic()))
            except SandboxDiedError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.005)

    # -- exec ---------------------------------------------------------------------------

    def exec(
        self,
        argv: Sequence[StrOrBytes],
        *,
        env: Sequence[StrOrBytes] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
        max_output_bytes: int | None = None,
    ) -> ExecResult:
        """Runs a command to completion. Output beyond ``max_output_bytes`` per stream
        (default :data:`DEFAULT_MAX_OUTPUT`) is dropped and flagged ``truncated``."""
        limit = DEFAULT_MAX_OUTPUT if max_output_bytes is None else max_output_bytes
        out, err = bytearray(), bytearray()
        for item in self.exec_stream(
            argv, env=env, cwd=cwd, user=user, timeout=timeout, stdin=stdin,
            max_output_bytes=limit,
        ):  # fmt: skip
            if isinstance(item, ExecResult):
                return item.model_copy(update={"stdout_bytes": bytes(out),
                                               "stderr_bytes": bytes(err)})  # fmt: skip
            (out if item.stream == "stdout" else err).extend(item.data)
        raise SandboxError("exec stream ended without a result", sandbox_id=self.sandbox_id)

    def exec_stream(
        self,
        argv: Sequence[StrOrBytes],
        *,
        env: Sequence[StrOrBytes] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
        max_output_bytes: int | None = None,
    ) -> Iterator[OutputChunk | ExecResult]:
        """Yields output chunks as they arrive, then the :class:`ExecResult` (whose byte
        fields are empty: the output was streamed). ``max_output_bytes=None`` is unlimited.
        Closing the iterator early kills the command.

        The client enforces ``max_output_bytes`` itself: should the agent send more on a
        stream (only a broken or replaced agent does), the client keeps the first
        ``max_output_bytes``, drops the connection (the agent kills the command tree) and
        ends with ``truncated=True, exit_code=137, signal=9``."""
        req = _exec_fields(argv, env, cwd, user, timeout, max_output_bytes, None, self.sandbox_id)
        data = b"" if stdin is None else check_bytes(stdin, "stdin", self.sandbox_id)
        seconds = check_seconds(timeout, "timeout", self.sandbox_id)
        wait = seconds + self.hung_margin if seconds is not None else None
        return self._exec_frames(req, data, wait, max_output_bytes)

    def _exec_frames(
        self, req: bytes, stdin: bytes | bytearray | memoryview, wait: float | None,
        limit: int | None,
    ) -> Iterator[OutputChunk | ExecResult]:  # fmt: skip
        conn = self.pool.checkout()
        released = False
        writer = None
        try:
            start = time.monotonic()
            deadline = start + wait if wait is not None else None
            if len(stdin) <= _STDIN_INLINE:
                conn.send(req, *p.data_frames(stdin), p.CLOSE_FRAME, deadline=deadline)
            else:  # the command may answer before reading all of it: send from a thread
                conn.send(req, deadline=deadline)
                writer = threading.Thread(target=_send_stdin, args=(conn, stdin, deadline),
                                          daemon=True, name="agent-stdin")  # fmt: skip
                writer.start()
            started = False
            sizes: dict[int, int] = {p.Reply.STDOUT: 0, p.Reply.STDERR: 0}
            while True:
                ftype, payload = conn.read_reply(deadline)
                if ftype in sizes:
                    if not started:
                        raise conn.violation("output before STARTED")
                    stream = "stdout" if ftype == p.Reply.STDOUT else "stderr"
                    if limit is not None and sizes[ftype] + len(payload) > limit:
                        released = True
                        conn.close()  # stop reading: the agent kills the command tree
                        if keep := limit - sizes[ftype]:
                            yield OutputChunk(stream=stream, data=bytes(payload[:keep]))
                        yield ExecResult(exit_code=137, signal=9, truncated=True,
                                         duration_seconds=time.monotonic() - start)  # fmt: skip
                        return
                    sizes[ftype] += len(payload)
                    yield OutputChunk(stream=stream, data=bytes(payload))
                elif ftype in (p.Reply.EXIT, p.Reply.ERROR):
                    ex = conn.decode(p.parse_exit, payload) if ftype == p.Reply.EXIT else None
                    # Release before yielding the result: the consumer may stop right there.
                    released = True
                    if writer and writer.is_alive():
                        # The agent skips the rest of stdin up to CLOSE; one that does not
                        # must not keep this call waiting: cut the connection instead.
                        conn.close()
                    if writer:
                        writer.join()
                    if ex is not None and ex.retire:
                        conn.close()
                    else:
                        self.pool.checkin(conn)
                    if ex is None:
                        raise self._exec_error(conn, payload)
                    yield _result(ex, b"", b"")
                    return
                elif ftype == p.Reply.STARTED and not started:
                    started = True
                else:
                    raise self._unexpected(conn, ftype)
        finally:
            if not released:
                conn.close()  # the agent kills the command tree when its client goes away

    def spawn(
        self,
        argv: Sequence[StrOrBytes],
        *,
        env: Sequence[StrOrBytes] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        pty: tuple[int, int] | None = None,
        max_buffer_bytes: int = DEFAULT_MAX_OUTPUT,
        timeout: float | None = None,
        keeps_active: bool = True,
    ) -> AgentProcess:
        """Starts a long-lived process on a dedicated connection (see :class:`AgentProcess`).
        ``timeout``: the agent kills its whole tree after that many seconds (the result says
        ``timed_out``), whether or not anyone is reading; None: it runs until it ends."""
        req = _exec_fields(argv, env, cwd, user, timeout, None, pty, self.sandbox_id)
        check_int(max_buffer_bytes, "max_buffer_bytes", self.sandbox_id)
        conn = self.pool.connect_busy()  # a quiesce waits until it is an AgentProcess
        try:
            conn.send(req, deadline=self._io_deadline())
            ftype, payload = conn.read_reply(self._io_deadline())
            if ftype == p.Reply.ERROR:
                conn.close()
                raise self._exec_error(conn, payload)
            if ftype != p.Reply.STARTED:
                raise self._unexpected(conn, ftype)
            pid = conn.decode(p.parse_pid, payload)
            proc = AgentProcess(conn, pid, pty is not None, max_buffer_bytes, keeps_active)
        except BaseException:
            conn.close()
            raise
        self.pool.adopt(conn, proc)
        return proc

    # -- files --------------------------------------------------------------------------

    def _simple(self, op: p.Op, fields: list[p.Field]) -> None:
        conn = self.pool.checkout()
        conn.send(p.request(op, fields), deadline=self._io_deadline())
        ftype, payload = conn.read_reply(self._io_deadline())
        if ftype == p.Reply.ERROR:
            exc = self._file_error(conn, payload)
            self.pool.checkin(conn)
            raise exc
        if ftype != p.Reply.OK:
            raise self._unexpected(conn, ftype)
        self.pool.checkin(conn)

    def _stream(self, req: bytes, item: int, take: Callable[[_Conn, Payload], T],
                data_max: int = p.FRAME_MAX) -> Iterator[T]:  # fmt: skip
        """Send ``req``, then yield ``take(conn, payload)`` for each ``item`` frame until OK;
        ERROR raises. ``take`` decodes and enforces the call's bounds (it may raise)."""
        conn = self.pool.checkout()
        done = False
        budget = _Budget(self)
        try:
            conn.send(req, deadline=self._io_deadline())
            while True:
                ftype, payload = conn.read_reply(budget.deadline(), data_max)
                budget.spent(len(payload))
                if ftype == item:
                    yield take(conn, payload)
                elif ftype == p.Reply.OK:
                    done = True
                    return
                elif ftype == p.Reply.ERROR:
                    done = True
                    raise self._file_error(conn, payload)
                else:
                    raise self._unexpected(conn, ftype)
        finally:
            if done:
                self.pool.checkin(conn)
            else:
                conn.close()

    def _entries(self, op: p.Op, path: bytes, max_entries: int | None) -> Iterator[p.Entry]:
        if max_entries is not None:
            check_int(max_entries, "max_entries", self.sandbox_id)
        count = 0

        def take(conn: _Conn, payload: Payload) -> p.Entry:
            nonlocal count
            count += 1
            if max_entries is not None and count > max_entries:
                conn.close()
                raise SandboxFileError(
                    f"{os.fsdecode(path)} has more than max_entries={max_entries} entries",
                    sandbox_id=self.sandbox_id,
                )
            return conn.decode(p.parse_entry, payload)

        return self._stream(p.request(op, [(p.Tag.PATH, path)]), p.Reply.ENTRY, take)

    def read_file(self, path: PathArg, *, max_bytes: int | None = READ_MAX) -> bytes:
        """The whole file. More than ``max_bytes`` (default :data:`READ_MAX`, 64 MiB; None:
        no bound) raises :class:`FileTooLargeError` (see :meth:`iter_read`)."""
        return b"".join(self.iter_read(path, max_bytes=max_bytes))

    def iter_read(
        self,
        path: PathArg,
        chunk_size: int = READ_CHUNK,
        *,
        offset: int = 0,
        length: int | None = None,
        max_bytes: int | None = None,
    ) -> Iterator[bytes]:
        """Streams a file in chunks of at most ``chunk_size`` bytes (bounded memory). Once
        more than ``max_bytes`` (None: no bound) arrived it raises :class:`FileTooLargeError`,
        having yielded at most ``max_bytes``: the count is of bytes received, whatever size
        the sandbox claims (a sparse 8 GiB file costs it nothing)."""
        sid = self.sandbox_id
        chunk = min(check_int(chunk_size, "chunk_size", sid, lo=1), p.FRAME_MAX)
        fields: list[p.Field] = [
            (p.Tag.PATH, _sandbox_path(path, sid)),
            (p.Tag.CHUNK, chunk),
            (p.Tag.OFFSET, check_int(offset, "offset", sid)),
        ]
        if length is not None:
            fields.append((p.Tag.LENGTH, check_int(length, "length", sid)))
        if max_bytes is not None:
            check_int(max_bytes, "max_bytes", sid)
        got = 0

        def take(conn: _Conn, payload: Payload) -> bytes:
            nonlocal got
            got += len(payload)
            if length is not None and got > length:
                raise conn.violation(f"sent more than the {length} bytes asked for")
            if max_bytes is not None and got > max_bytes:
                conn.close()
                raise FileTooLargeError(f"{os.fsdecode(path)} is larger than "
                                        f"max_bytes={max_bytes}", sandbox_id=sid)  # fmt: skip
            return bytes(payload)  # a frame over 64 KiB arrives as a bytearray (one copy)

        return self._stream(p.request(p.Op.READ, fields), p.Stream.DATA, take, data_max=chunk)

    def read_files(self, items: Sequence[tuple[PathArg, int]], chunk_size: int = READ_CHUNK,
                   ) -> Iterator[tuple[int, bytes | None]]:  # fmt: skip
        """Several regular files in one request (READS): ``(i, data)`` for the ``i``-th
        item's bytes as they come, at most its length, then ``(i, None)`` when it ended
        (shorter where the file is shorter, or could not be read: not a regular file, links
        not followed). The request must fit one frame (:data:`READS_MAX_BYTES`)."""
        sid = self.sandbox_id
        chunk = min(check_int(chunk_size, "chunk_size", sid, lo=1), p.FRAME_MAX)
        fields: list[p.Field] = [(p.Tag.CHUNK, chunk)]
        lengths = []
        for path, length in items:
            lengths.append(check_int(length, "length", sid))
            fields += [(p.Tag.PATH, _sandbox_path(path, sid)), (p.Tag.LENGTH, lengths[-1])]
        req = p.request(p.Op.READS, fields)
        if len(req) > READS_MAX_BYTES:
            raise SandboxFileError(f"a READS request of {len(req)} bytes (at most "
                                   f"{READS_MAX_BYTES})", sandbox_id=sid)
        conn = self.pool.checkout()
        done = False
        budget = _Budget(self)
        i = got = 0
        try:
            conn.send(req, deadline=self._io_deadline())
            while True:
                ftype, payload = conn.read_reply(budget.deadline(), chunk)
                budget.spent(len(payload))
                if ftype == p.Stream.DATA and i < len(lengths):
                    got += len(payload)
                    if got > lengths[i]:
                        raise conn.violation(f"sent more than the {lengths[i]} bytes asked for")
                    yield i, bytes(payload)
                elif ftype == p.Reply.END and i < len(lengths):
                    sent, _ = conn.decode(p.parse_end, payload)
                    if sent != got:
                        raise conn.violation(f"ended a file of {got} bytes as {sent}")
                    yield i, None
                    i, got = i + 1, 0
                elif ftype == p.Reply.OK and i == len(lengths):
                    done = True
                    return
                elif ftype == p.Reply.ERROR:
                    done = True
                    raise self._file_error(conn, payload)
                else:
                    raise self._unexpected(conn, ftype)
        finally:
            if done:
                self.pool.checkin(conn)
            else:
                conn.close()

    def write_file(
        self,
        path: PathArg,
        data: UploadData,
        *,
        mode: int = 0o644,
        append: bool = False,
        parents: bool = True,
    ) -> None:
        """Writes a file. Unless appending, data goes to a temp file renamed over ``path``
        at the end, so readers never see half a file; ``mode`` applies to the new file.
        Each chunk must be taken by the agent within ``io_timeout``, and all of them at
        ``min_rate`` on average."""
        fields: list[p.Field] = [
            (p.Tag.PATH, _sandbox_path(path, self.sandbox_id)),
            (p.Tag.MODE, _mode(mode, self.sandbox_id)),
            (p.Tag.APPEND, int(append)),
            (p.Tag.PARENTS, int(parents)),
        ]
        chunks = upload_chunks(data, self.sandbox_id)
        conn = self.pool.checkout()
        done = False
        budget = _Budget(self)
        try:
            conn.send(p.request(p.Op.WRITE, fields), deadline=self._io_deadline())
            for chunk in chunks:  # the caller's time to make a chunk is not the agent's
                if conn.has_input():  # an early error: stop uploading
                    break
                conn.send_frame(p.Stream.DATA, chunk, budget.deadline())
                budget.spent(len(chunk))
            conn.send(p.CLOSE_FRAME, deadline=self._io_deadline())
            ftype, payload = conn.read_reply(self._io_deadline())
            done = ftype in (p.Reply.OK, p.Reply.ERROR)
            if ftype == p.Reply.ERROR:
                raise self._file_error(conn, payload)
            if ftype != p.Reply.OK:
                raise self._unexpected(conn, ftype)
        finally:
            if done:
                self.pool.checkin(conn)
            else:
                conn.close()  # mid-upload: the agent drops its temp file

    def stat(self, path: PathArg, *, follow_symlinks: bool = False) -> FileInfo:
        raw = _sandbox_path(path, self.sandbox_id)
        conn = self.pool.checkout()
        conn.send(p.request(p.Op.STAT, [(p.Tag.PATH, raw), (p.Tag.FOLLOW, int(follow_symlinks))]),
                  deadline=self._io_deadline())  # fmt: skip
        ftype, payload = conn.read_reply(self._io_deadline())
        if ftype == p.Reply.ERROR:
            exc = self._file_error(conn, payload)
            self.pool.checkin(conn)
            raise exc
        if ftype != p.Reply.ENTRY:
            raise self._unexpected(conn, ftype)
        entry = conn.decode(p.parse_entry, payload)
        self.pool.checkin(conn)
        return _to_info(entry, raw)

    def exists(self, path: PathArg) -> bool:
        try:
            self.stat(path)
        except SandboxFileNotFoundError:
            return False
        return True

    def list_dir(self, path: PathArg, *, max_entries: int | None = LIST_MAX_ENTRIES,
                 ) -> list[FileInfo]:  # fmt: skip
        """Entries of a directory (not recursive), sorted by name; ``path`` fields are
        absolute. More than ``max_entries`` (None: no bound) raises SandboxFileError."""
        raw = _sandbox_path(path, self.sandbox_id)
        base = raw.rstrip(b"/")
        infos = [_to_info(e, base + b"/" + e.path)
                 for e in self._entries(p.Op.LISTDIR, raw, max_entries)]  # fmt: skip
        return sorted(infos, key=lambda i: os.fsencode(i.name))

    def walk(self, path: PathArg, *, max_entries: int | None = None) -> Iterator[FileInfo]:
        """Every entry below ``path``, parents before children, symlinks not followed;
        ``FileInfo.path`` is relative to ``path``. More than ``max_entries`` (None: no
        bound, the consumer streams them) raises SandboxFileError."""
        raw = _sandbox_path(path, self.sandbox_id)
        return (_to_info(e, e.path) for e in self._entries(p.Op.WALK, raw, max_entries))

    def entries(self, path: PathArg, *, recursive: bool = False,
                max_entries: int | None = LIST_MAX_ENTRIES) -> Iterator[p.Entry]:
        """The raw stat records of a directory's entries (``Entry.path`` is the name) or,
        ``recursive``, of everything below it (``path`` relative, parents first, links not
        followed), with the inode, device and link count :meth:`walk` leaves out. As they
        come, in the directory's order; more than ``max_entries`` raises SandboxFileError."""
        raw = _sandbox_path(path, self.sandbox_id)
        return self._entries(p.Op.WALK if recursive else p.Op.LISTDIR, raw, max_entries)

    def mkdir(self, path: PathArg, *, parents: bool = True, mode: int = 0o755) -> None:
        """Creates a directory; with ``parents`` missing parents too and an existing
        directory is fine (``mkdir -p``)."""
        raw = _sandbox_path(path, self.sandbox_id)
        self._simple(
            p.Op.MKDIR,
            [(p.Tag.PATH, raw), (p.Tag.MODE, _mode(mode, self.sandbox_id)),
             (p.Tag.PARENTS, int(parents))],
        )

    def remove(self, path: PathArg, *, recursive: bool = False) -> None:
        """Removes a file, symlink or empty directory; a whole tree with ``recursive``."""
        raw = _sandbox_path(path, self.sandbox_id)
        self._simple(p.Op.REMOVE, [(p.Tag.PATH, raw), (p.Tag.RECURSIVE, int(recursive))])

    def symlink(self, target: StrOrBytes, path: PathArg) -> None:
        """Creates ``path`` pointing at ``target`` (stored verbatim, may be relative)."""
        raw = _sandbox_path(path, self.sandbox_id)
        tgt = bytes_arg(target, "symlink target", self.sandbox_id)
        self._simple(p.Op.SYMLINK, [(p.Tag.PATH, raw), (p.Tag.PATH2, tgt)])

    def chmod(self, path: PathArg, mode: int) -> None:
        raw = _sandbox_path(path, self.sandbox_id)
        self._simple(p.Op.CHMOD, [(p.Tag.PATH, raw), (p.Tag.MODE, _mode(mode, self.sandbox_id))])

    def rename(self, src: PathArg, dst: PathArg) -> None:
        a = _sandbox_path(src, self.sandbox_id)
        b = _sandbox_path(dst, self.sandbox_id)
        self._simple(p.Op.RENAME, [(p.Tag.PATH, a), (p.Tag.PATH2, b)])


def _send_stdin(conn: _Conn, data: bytes | bytearray | memoryview,
                deadline: float | None) -> None:  # fmt: skip
    try:
        for pos in range(0, len(data), UPLOAD_CHUNK):
            conn.send_frame(p.Stream.DATA, memoryview(data)[pos : pos + UPLOAD_CHUNK], deadline)
        conn.send(p.CLOSE_FRAME, deadline=deadline)
    except SandboxError:
        pass  # the reading side reports the lost connection (or its own deadline)
