"""Host-side client of the in-sandbox agent.

Each call checks a connection out of a small pool (one connection = one handler process in
the sandbox), runs one request on it and puts it back. A long-lived :class:`AgentProcess`
owns its connection until it is closed. Every failure is a :class:`SandboxError` subclass.
"""

from __future__ import annotations

import errno as errno_
import math
import os
import posixpath
import select
import socket
import stat
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, TypeVar

from ..errors import (
    ConfigError,
    ExecError,
    SandboxDiedError,
    SandboxError,
    SandboxFileError,
    SandboxFileExistsError,
    SandboxFileNotFoundError,
    SandboxIsADirectoryError,
    SandboxNotADirectoryError,
    SandboxPermissionError,
    SandboxStateError,
    UnsafePathError,
)
from ..results import ExecResult, FileInfo, FileType, OutputChunk
from . import protocol as p

DEFAULT_MAX_OUTPUT = 16 * 1024 * 1024  # per stream, when exec()/spawn() get None
HUNG_MARGIN = 10.0  # seconds past a command's timeout before the agent counts as hung
CONNECT_TIMEOUT = 5.0
PING_TIMEOUT = 5.0
UPLOAD_CHUNK = p.FRAME_MAX
READ_CHUNK = 256 * 1024
_STDIN_INLINE = 64 * 1024  # stdin up to this rides with the request; more goes from a thread
# A file/control reply may take this long per frame. Code in the sandbox can SIGSTOP the
# agent's handlers (PID 1 is not protected from signals in gVisor): never wait forever.
IDLE_TIMEOUT = 60.0


def _idle_deadline() -> float:
    return time.monotonic() + IDLE_TIMEOUT

T = TypeVar("T")
PathArg = str | bytes | os.PathLike
StrOrBytes = str | bytes

_FILE_ERRORS: dict[int, type[SandboxFileError]] = {
    errno_.ENOENT: SandboxFileNotFoundError,
    errno_.EISDIR: SandboxIsADirectoryError,
    errno_.ENOTDIR: SandboxNotADirectoryError,
    errno_.EEXIST: SandboxFileExistsError,
    errno_.EACCES: SandboxPermissionError,
    errno_.EPERM: SandboxPermissionError,
}


class _Conn:
    """One connection to an agent handler: framed, buffered reads with deadlines."""

    def __init__(self, sock: socket.socket, sandbox_id: str | None) -> None:
        self.sock = sock
        self.sandbox_id = sandbox_id
        self._buf = bytearray()
        self._pos = 0
        self._scratch = memoryview(bytearray(65536))
        self.closed = False

    def _died(self, why: str) -> SandboxDiedError:
        self.close()
        return SandboxDiedError(f"agent connection lost: {why}", sandbox_id=self.sandbox_id)

    def _set_deadline(self, deadline: float | None) -> None:
        # Past the deadline still take what is already buffered (a slow consumer of a
        # stream is not a hung agent): a zero timeout makes the receive non-blocking.
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.sock.settimeout(left)

    def send(self, data: bytes | bytearray | memoryview) -> None:
        """Sends everything; blocks while the agent applies backpressure."""
        try:
            self.sock.settimeout(None)
            self.sock.sendall(data)
        except OSError as exc:
            raise self._died(str(exc)) from None

    def send_frame(self, ftype: int, payload: bytes | memoryview) -> None:
        """Header and payload in one syscall when possible, without joining them."""
        hdr = p.HEADER.pack(len(payload), ftype)
        if len(payload) < 65536:
            self.send(hdr + bytes(payload))
            return
        try:
            self.sock.settimeout(None)
            sent = self.sock.sendmsg([hdr, payload])
            if sent < len(hdr):
                self.sock.sendall(hdr[sent:])
                sent = len(hdr)
            self.sock.sendall(memoryview(payload)[sent - len(hdr) :])
        except OSError as exc:
            raise self._died(str(exc)) from None

    def _recv_into(self, view: memoryview, deadline: float | None) -> int:
        try:
            self._set_deadline(deadline)
            n = self.sock.recv_into(view)
        except (TimeoutError, BlockingIOError):
            raise self._died("the agent did not answer in time") from None
        except OSError as exc:
            raise self._died(str(exc)) from None
        if n == 0:
            raise self._died("connection closed by the sandbox")
        return n

    def _read_exact(self, n: int, deadline: float | None) -> bytes | bytearray:
        avail = len(self._buf) - self._pos
        if avail < n and n - avail > 65536:  # large payload: receive in place
            out = bytearray(n)
            out[:avail] = self._buf[self._pos :]
            self._buf.clear()
            self._pos = 0
            view = memoryview(out)[avail:]
            while view:
                view = view[self._recv_into(view, deadline) :]
            return out
        while avail < n:
            if self._pos:
                del self._buf[: self._pos]
                self._pos = 0
            got = self._recv_into(self._scratch, deadline)
            self._buf += self._scratch[:got]
            avail = len(self._buf)
        out = bytes(self._buf[self._pos : self._pos + n])
        self._pos += n
        return out

    def read_frame(self, deadline: float | None) -> tuple[int, bytes | bytearray]:
        length, ftype = p.HEADER.unpack(self._read_exact(p.HEADER.size, deadline))
        if length > p.FRAME_MAX:
            self.close()
            raise SandboxError(f"agent sent a {length}-byte frame", sandbox_id=self.sandbox_id)
        return ftype, self._read_exact(length, deadline)

    def decode(self, parse: Callable[[bytes], T], payload: bytes) -> T:
        """Parses a payload; a malformed one means the peer is broken: drop it."""
        try:
            return parse(payload)
        except p.ProtocolError as exc:
            self.close()
            raise SandboxError(
                f"agent sent a malformed frame: {exc}", sandbox_id=self.sandbox_id
            ) from None

    def has_input(self) -> bool:
        """True if the peer sent something (even EOF) not yet read."""
        if self._pos < len(self._buf):
            return True
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        return bool(poller.poll(0))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()

    def abort(self) -> None:
        """Breaks the connection from any thread (the agent then kills the command tree)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _fsencode(value: StrOrBytes | os.PathLike, what: str, sandbox_id: str | None,
              error: type[SandboxError] = ConfigError) -> bytes:
    """Bytes for the wire; a str the file system encoding cannot carry (a lone surrogate
    outside surrogateescape's range) is a typed error, not a UnicodeEncodeError."""
    try:
        return os.fsencode(value)
    except UnicodeEncodeError:
        raise error(f"{what} cannot be encoded: {value!r}", sandbox_id=sandbox_id) from None


def _bytes_arg(value: StrOrBytes | os.PathLike, what: str, sandbox_id: str | None) -> bytes:
    raw = _fsencode(value, what, sandbox_id)
    if b"\0" in raw:
        raise ConfigError(f"{what} contains a NUL byte: {value!r}", sandbox_id=sandbox_id)
    return raw


def _sandbox_path(path: PathArg, sandbox_id: str | None = None) -> bytes:
    """An absolute, normalized path inside the sandbox as bytes (any byte but NUL)."""
    raw = _fsencode(path, "path", sandbox_id, UnsafePathError)
    if b"\0" in raw:
        raise UnsafePathError(f"path contains a NUL byte: {path!r}", sandbox_id=sandbox_id)
    if not raw.startswith(b"/"):
        raise UnsafePathError(
            f"path must be absolute inside the sandbox: {path!r}", sandbox_id=sandbox_id
        )
    norm = posixpath.normpath(raw)
    return b"/" + norm.lstrip(b"/")


def _exec_fields(
    argv: list[StrOrBytes],
    env: list[StrOrBytes] | None,
    cwd: PathArg | None,
    user: str | None,
    timeout: float | None,
    max_output_bytes: int | None,
    pty: tuple[int, int] | None,
    sandbox_id: str | None = None,
) -> bytes:
    def bad(message: str) -> ConfigError:
        return ConfigError(message, sandbox_id=sandbox_id)

    if isinstance(argv, str | bytes) or not argv:
        raise bad(f"argv must be a non-empty list, got {argv!r}")
    fields: list[p.Field] = [(p.Tag.ARG, _bytes_arg(a, "argument", sandbox_id)) for a in argv]
    if env is not None:
        fields.append((p.Tag.ENV_SET, 1))
        for item in env:
            raw = _bytes_arg(item, "environment entry", sandbox_id)
            if b"=" not in raw[1:]:
                raise bad(f"environment entry must be KEY=VALUE: {item!r}")
            fields.append((p.Tag.ENV, raw))
    if cwd is not None:
        fields.append((p.Tag.CWD, _bytes_arg(cwd, "cwd", sandbox_id)))
    if user:
        fields.append((p.Tag.USER, _bytes_arg(user, "user", sandbox_id)))
    if timeout is not None and timeout != math.inf:  # inf: no timeout
        if not (timeout > 0 and math.isfinite(timeout)):
            raise bad(f"timeout must be a positive number of seconds, got {timeout!r}")
        fields.append((p.Tag.TIMEOUT_MS, math.ceil(timeout * 1000)))
    if max_output_bytes is not None:
        if max_output_bytes < 0:
            raise bad(f"max_output_bytes must be >= 0, got {max_output_bytes}")
        fields.append((p.Tag.MAX_OUTPUT, max_output_bytes))
    if pty is not None:
        rows, cols = pty
        if not (0 < rows < 65536 and 0 < cols < 65536):
            raise bad(f"pty size must be (rows, cols) in 1..65535, got {pty!r}")
        fields += [(p.Tag.PTY_ROWS, rows), (p.Tag.PTY_COLS, cols)]
    payload = p.encode_fields(fields)
    if len(payload) > p.FRAME_MAX:
        raise bad(f"argv and env take {len(payload)} bytes, more than {p.FRAME_MAX}")
    return p.frame(p.Op.EXEC, payload)


def _result(ex: p.Exit, out: bytes, err: bytes) -> ExecResult:
    return ExecResult(
        exit_code=ex.exit_code,
        stdout_bytes=out,
        stderr_bytes=err,
        duration_seconds=ex.duration_us / 1e6,
        timed_out=ex.timed_out,
        truncated=ex.truncated,
        signal=ex.signal or None,
    )


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


def connect_agent_socket(path: str | os.PathLike[str]) -> socket.socket:
    """Connect to an agent's socket without following a symlink: the socket's directory is
    writable from inside the sandbox, and a symlink planted there must not point this (root)
    process at some other host socket. Connecting through ``/proc/self/fd`` also lifts the
    108-byte ``sun_path`` limit. Raises OSError."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = -1
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW)
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise OSError(errno_.ENOTSOCK, "not a socket (replaced from inside?)")
        sock.settimeout(CONNECT_TIMEOUT)
        sock.connect(f"/proc/self/fd/{fd}")
    except OSError:
        sock.close()
        raise
    finally:
        if fd >= 0:
            os.close(fd)
    return sock


class AgentClient:
    """Talks to one sandbox's agent over its unix socket. Thread-safe."""

    def __init__(
        self, socket_path: str | Path, *, sandbox_id: str | None = None, pool_size: int = 8
    ) -> None:
        self.socket_path = Path(socket_path)
        self.sandbox_id = sandbox_id
        self.pool_size = pool_size
        self._idle: list[_Conn] = []
        self._lock = threading.Lock()
        self._unheld = threading.Condition(self._lock)
        self._held = False
        self._closed = False
        self._busy: weakref.WeakSet[_Conn] = weakref.WeakSet()  # checked out
        self._connecting = 0
        self._procs: weakref.WeakSet[AgentProcess] = weakref.WeakSet()

    # -- connections ------------------------------------------------------------------

    def _connect(self) -> _Conn:
        try:
            sock = connect_agent_socket(self.socket_path)
        except OSError as exc:
            raise SandboxDiedError(
                f"cannot connect to the agent at {self.socket_path}: {exc}",
                sandbox_id=self.sandbox_id,
            ) from None
        return _Conn(sock, self.sandbox_id)

    def _wait_unheld(self) -> None:
        """Called with the lock held: waits out a :meth:`quiesce`."""
        self._unheld.wait_for(lambda: not self._held)
        if self._closed:
            raise SandboxStateError("agent client is closed", sandbox_id=self.sandbox_id)

    def _checkout(self) -> _Conn:
        with self._lock:
            self._wait_unheld()
            while self._idle:
                conn = self._idle.pop()
                # Else the handler died (EOF pending) or the connection is out of step.
                if not conn.closed and not conn.has_input():
                    self._busy.add(conn)
                    return conn
                conn.close()
        return self._connect_busy()

    def _connect_busy(self) -> _Conn:
        """A new connection, counted as busy from before it exists (for :meth:`quiesce`)."""
        with self._lock:
            self._wait_unheld()
            self._connecting += 1
        try:
            conn = self._connect()
            with self._lock:
                self._busy.add(conn)
            return conn
        finally:
            with self._lock:
                self._connecting -= 1

    def _checkin(self, conn: _Conn) -> None:
        with self._lock:
            self._busy.discard(conn)
            if not conn.closed and not self._closed and len(self._idle) < self.pool_size:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        """Closes idle connections; later calls raise :class:`SandboxStateError`."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    @contextmanager
    def quiesce(self, timeout: float) -> Iterator[None]:
        """Holds new calls and waits up to ``timeout`` s for running ones, so that the
        caller can drop every connection (:meth:`drop_connections`) and checkpoint the
        sandbox. Calls made meanwhile wait; they go on when the block ends."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._wait_unheld()
            self._held = True
        try:
            while self._running():
                if time.monotonic() > deadline:
                    raise SandboxStateError(
                        f"calls into the sandbox still running after {timeout:g}s",
                        sandbox_id=self.sandbox_id,
                    )
                time.sleep(0.002)
            yield
        finally:
            with self._lock:
                self._held = False
                self._unheld.notify_all()

    def _running(self) -> bool:
        with self._lock:
            return self._connecting > 0 or any(not c.closed for c in self._busy)

    def drop_connections(self) -> int:
        """Closes idle connections and detaches spawned processes (they keep running in the
        sandbox, see :meth:`AgentProcess.detach`); returns how many processes were detached.
        Only inside :meth:`quiesce`, after the agent was told to hold."""
        with self._lock:
            idle, self._idle = self._idle, []
            procs = [pr for pr in self._procs if not pr.done]
        for conn in idle:
            conn.close()
        for pr in procs:
            pr.detach()
        return len(procs)

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _unexpected(self, conn: _Conn, ftype: int) -> SandboxError:
        conn.close()
        return SandboxError(
            f"agent sent unexpected frame 0x{ftype:02x}", sandbox_id=self.sandbox_id
        )

    def _file_error(self, conn: _Conn, payload: bytes) -> SandboxFileError:
        code, message = conn.decode(p.parse_error, payload)
        exc = _FILE_ERRORS.get(code, SandboxFileError)(message, sandbox_id=self.sandbox_id)
        exc.errno = code
        return exc

    def _exec_error(self, conn: _Conn, payload: bytes) -> ExecError:
        code, message = conn.decode(p.parse_error, payload)
        return ExecError(f"{message} (errno {code})", sandbox_id=self.sandbox_id)

    # -- ping ---------------------------------------------------------------------------

    def ping(self, timeout: float = PING_TIMEOUT) -> str:
        """The agent's version string (compare with :func:`expected_version`)."""
        conn = self._checkout()
        conn.send(p.request(p.Op.PING))
        ftype, payload = conn.read_frame(time.monotonic() + timeout)
        if ftype != p.Reply.OK:
            raise self._unexpected(conn, ftype)
        version = conn.decode(p.parse_version, payload)
        self._checkin(conn)
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
        argv: list[StrOrBytes],
        *,
        env: list[StrOrBytes] | None = None,
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
        argv: list[StrOrBytes],
        *,
        env: list[StrOrBytes] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        timeout: float | None = None,
        stdin: bytes | None = None,
        max_output_bytes: int | None = None,
    ) -> Iterator[OutputChunk | ExecResult]:
        """Yields output chunks as they arrive, then the :class:`ExecResult` (whose byte
        fields are empty: the output was streamed). ``max_output_bytes=None`` is unlimited.
        Closing the iterator early kills the command."""
        req = _exec_fields(argv, env, cwd, user, timeout, max_output_bytes, None, self.sandbox_id)
        if timeout == math.inf:
            timeout = None
        deadline_after = timeout + HUNG_MARGIN if timeout is not None else None
        return self._exec_frames(req, stdin or b"", deadline_after)

    def _exec_frames(
        self, req: bytes, stdin: bytes, deadline_after: float | None
    ) -> Iterator[OutputChunk | ExecResult]:
        conn = self._checkout()
        released = False
        writer = None
        try:
            deadline = time.monotonic() + deadline_after if deadline_after is not None else None
            if len(stdin) <= _STDIN_INLINE:
                conn.send(req + b"".join(p.data_frames(stdin)) + p.CLOSE_FRAME)
            else:  # the command may answer before reading all of it: send from a thread
                conn.send(req)
                writer = threading.Thread(target=_send_stdin, args=(conn, stdin), daemon=True)
                writer.start()
            while True:
                ftype, payload = conn.read_frame(deadline)
                if ftype == p.Reply.STDOUT:
                    yield OutputChunk(stream="stdout", data=bytes(payload))
                elif ftype == p.Reply.STDERR:
                    yield OutputChunk(stream="stderr", data=bytes(payload))
                elif ftype in (p.Reply.EXIT, p.Reply.ERROR):
                    if writer:
                        writer.join()
                    ex = conn.decode(p.parse_exit, payload) if ftype == p.Reply.EXIT else None
                    # Release before yielding the result: the consumer may stop right there.
                    released = True
                    if ex is not None and ex.retire:
                        conn.close()
                    else:
                        self._checkin(conn)
                    if ex is None:
                        raise self._exec_error(conn, payload)
                    yield _result(ex, b"", b"")
                    return
                elif ftype != p.Reply.STARTED:
                    raise self._unexpected(conn, ftype)
        finally:
            if not released:
                conn.close()  # the agent kills the command tree when its client goes away

    def spawn(
        self,
        argv: list[StrOrBytes],
        *,
        env: list[StrOrBytes] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        pty: tuple[int, int] | None = None,
        max_buffer_bytes: int = DEFAULT_MAX_OUTPUT,
    ) -> AgentProcess:
        """Starts a long-lived process on a dedicated connection (see :class:`AgentProcess`)."""
        req = _exec_fields(argv, env, cwd, user, None, None, pty, self.sandbox_id)
        conn = self._connect_busy()  # a quiesce waits until it is an AgentProcess
        try:
            conn.send(req)
            ftype, payload = conn.read_frame(_idle_deadline())
            if ftype == p.Reply.ERROR:
                conn.close()
                raise self._exec_error(conn, payload)
            if ftype != p.Reply.STARTED:
                raise self._unexpected(conn, ftype)
            pid = conn.decode(p.parse_pid, payload)
            proc = AgentProcess(conn, pid, pty is not None, max_buffer_bytes)
        except BaseException:
            conn.close()
            raise
        with self._lock:
            self._busy.discard(conn)
            self._procs.add(proc)
        return proc

    # -- files --------------------------------------------------------------------------

    def _simple(self, op: p.Op, fields: list[p.Field]) -> None:
        conn = self._checkout()
        conn.send(p.request(op, fields))
        ftype, payload = conn.read_frame(_idle_deadline())
        if ftype == p.Reply.ERROR:
            exc = self._file_error(conn, payload)
            self._checkin(conn)
            raise exc
        if ftype != p.Reply.OK:
            raise self._unexpected(conn, ftype)
        self._checkin(conn)

    def _entries(self, op: p.Op, path: bytes) -> Iterator[p.Entry]:
        return self._stream(p.request(op, [(p.Tag.PATH, path)]), p.Reply.ENTRY,
                            lambda conn, payload: conn.decode(p.parse_entry, payload))

    def _stream(self, req: bytes, item: int,
                decode: Callable[[_Conn, bytes | bytearray], T]) -> Iterator[T]:
        """Send ``req``, then yield each ``item`` frame (decoded) until OK; ERROR raises."""
        conn = self._checkout()
        done = False
        try:
            conn.send(req)
            while True:
                ftype, payload = conn.read_frame(_idle_deadline())
                if ftype == item:
                    yield decode(conn, payload)
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
                self._checkin(conn)
            else:
                conn.close()

    def read_file(self, path: PathArg) -> bytes:
        return b"".join(self.iter_read(path))

    def iter_read(
        self,
        path: PathArg,
        chunk_size: int = READ_CHUNK,
        *,
        offset: int = 0,
        length: int | None = None,
    ) -> Iterator[bytes]:
        """Streams a file in chunks of at most ``chunk_size`` bytes (bounded memory)."""
        fields: list[p.Field] = [
            (p.Tag.PATH, _sandbox_path(path, self.sandbox_id)),
            (p.Tag.CHUNK, max(1, min(chunk_size, p.FRAME_MAX))),
            (p.Tag.OFFSET, offset),
        ]
        if length is not None:
            fields.append((p.Tag.LENGTH, length))
        # bytes or bytearray: both behave as bytes for every caller
        return self._stream(p.request(p.Op.READ, fields), p.Stream.DATA,
                            lambda conn, payload: payload)  # type: ignore[arg-type,return-value]

    def write_file(
        self,
        path: PathArg,
        data: bytes | bytearray | memoryview | Iterable[bytes] | BinaryIO,
        *,
        mode: int = 0o644,
        append: bool = False,
        parents: bool = True,
    ) -> None:
        """Writes a file. Unless appending, data goes to a temp file renamed over ``path``
        at the end, so readers never see half a file; ``mode`` applies to the new file."""
        fields: list[p.Field] = [
            (p.Tag.PATH, _sandbox_path(path, self.sandbox_id)),
            (p.Tag.MODE, mode & 0o7777),
            (p.Tag.APPEND, int(append)),
            (p.Tag.PARENTS, int(parents)),
        ]
        conn = self._checkout()
        done = False
        try:
            conn.send(p.request(p.Op.WRITE, fields))
            for chunk in _chunks(data):
                if conn.has_input():  # an early error: stop uploading
                    break
                conn.send_frame(p.Stream.DATA, chunk)
            conn.send(p.CLOSE_FRAME)
            ftype, payload = conn.read_frame(_idle_deadline())
            done = ftype in (p.Reply.OK, p.Reply.ERROR)
            if ftype == p.Reply.ERROR:
                raise self._file_error(conn, payload)
            if ftype != p.Reply.OK:
                raise self._unexpected(conn, ftype)
        finally:
            if done:
                self._checkin(conn)
            else:
                conn.close()

    def stat(self, path: PathArg, *, follow_symlinks: bool = False) -> FileInfo:
        raw = _sandbox_path(path, self.sandbox_id)
        conn = self._checkout()
        conn.send(p.request(p.Op.STAT, [(p.Tag.PATH, raw), (p.Tag.FOLLOW, int(follow_symlinks))]))
        ftype, payload = conn.read_frame(_idle_deadline())
        if ftype == p.Reply.ERROR:
            exc = self._file_error(conn, payload)
            self._checkin(conn)
            raise exc
        if ftype != p.Reply.ENTRY:
            raise self._unexpected(conn, ftype)
        entry = conn.decode(p.parse_entry, payload)
        self._checkin(conn)
        return _to_info(entry, raw)

    def exists(self, path: PathArg) -> bool:
        try:
            self.stat(path)
        except SandboxFileNotFoundError:
            return False
        return True

    def list_dir(self, path: PathArg) -> list[FileInfo]:
        """Entries of a directory (not recursive), sorted by name; ``path`` fields are
        absolute."""
        raw = _sandbox_path(path, self.sandbox_id)
        base = raw.rstrip(b"/")
        infos = [_to_info(e, base + b"/" + e.path) for e in self._entries(p.Op.LISTDIR, raw)]
        return sorted(infos, key=lambda i: os.fsencode(i.name))

    def walk(self, path: PathArg) -> Iterator[FileInfo]:
        """Every entry below ``path``, parents before children, symlinks not followed;
        ``FileInfo.path`` is relative to ``path``."""
        raw = _sandbox_path(path, self.sandbox_id)
        return (_to_info(e, e.path) for e in self._entries(p.Op.WALK, raw))

    def mkdir(self, path: PathArg, *, parents: bool = True, mode: int = 0o755) -> None:
        """Creates a directory; with ``parents`` missing parents too and an existing
        directory is fine (``mkdir -p``)."""
        raw = _sandbox_path(path, self.sandbox_id)
        self._simple(
            p.Op.MKDIR,
            [(p.Tag.PATH, raw), (p.Tag.MODE, mode & 0o7777), (p.Tag.PARENTS, int(parents))],
        )

    def remove(self, path: PathArg, *, recursive: bool = False) -> None:
        """Removes a file, symlink or empty directory; a whole tree with ``recursive``."""
        raw = _sandbox_path(path, self.sandbox_id)
        self._simple(p.Op.REMOVE, [(p.Tag.PATH, raw), (p.Tag.RECURSIVE, int(recursive))])

    def symlink(self, target: StrOrBytes, path: PathArg) -> None:
        """Creates ``path`` pointing at ``target`` (stored verbatim, may be relative)."""
        raw = _sandbox_path(path, self.sandbox_id)
        tgt = _bytes_arg(target, "symlink target", self.sandbox_id)
        self._simple(p.Op.SYMLINK, [(p.Tag.PATH, raw), (p.Tag.PATH2, tgt)])

    def chmod(self, path: PathArg, mode: int) -> None:
        raw = _sandbox_path(path, self.sandbox_id)
        self._simple(p.Op.CHMOD, [(p.Tag.PATH, raw), (p.Tag.MODE, mode & 0o7777)])

    def rename(self, src: PathArg, dst: PathArg) -> None:
        a = _sandbox_path(src, self.sandbox_id)
        b = _sandbox_path(dst, self.sandbox_id)
        self._simple(p.Op.RENAME, [(p.Tag.PATH, a), (p.Tag.PATH2, b)])


def _send_stdin(conn: _Conn, data: bytes) -> None:
    try:
        for pos in range(0, len(data), UPLOAD_CHUNK):
            conn.send_frame(p.Stream.DATA, memoryview(data)[pos : pos + UPLOAD_CHUNK])
        conn.send(p.CLOSE_FRAME)
    except SandboxError:
        pass  # the reading side reports the lost connection


def _chunks(
    data: bytes | bytearray | memoryview | Iterable[bytes] | BinaryIO,
) -> Iterator[bytes | memoryview]:
    if isinstance(data, bytes | bytearray | memoryview):
        view = memoryview(data)
        for pos in range(0, len(view), UPLOAD_CHUNK):
            yield view[pos : pos + UPLOAD_CHUNK]
    elif hasattr(data, "read"):
        while chunk := data.read(UPLOAD_CHUNK):  # type: ignore[union-attr]
            yield chunk
    else:
        for item in data:  # type: ignore[union-attr]
            view = memoryview(item)
            for pos in range(0, len(view), UPLOAD_CHUNK):
                yield view[pos : pos + UPLOAD_CHUNK]


class AgentProcess:
    """A process started with :meth:`AgentClient.spawn`, owning its connection.

    A background thread buffers output; at most ``max_buffer_bytes`` of undrained output
    per stream is kept (more is dropped and the result flagged ``truncated``), so the process
    never blocks on a slow reader. With a pty all output arrives on stdout. Closing the
    process (or losing the connection) kills its whole tree.
    """

    def __init__(self, conn: _Conn, pid: int, pty: bool, max_buffer_bytes: int) -> None:
        self.pid = pid
        self.pty = pty
        self._conn = conn
        self._limit = max_buffer_bytes
        self._out = bytearray()
        self._err = bytearray()
        self._dropped = False
        self._exit: p.Exit | None = None
        self._lost: SandboxError | None = None
        self._killed = False
        self._detached = False
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read_loop, daemon=True, name=f"agent-{pid}")
        self._reader.start()

    def _read_loop(self) -> None:
        try:
            while True:
                ftype, payload = self._conn.read_frame(None)
                with self._cond:
                    if ftype in (p.Reply.STDOUT, p.Reply.STDERR):
                        buf = self._out if ftype == p.Reply.STDOUT else self._err
                        room = self._limit - len(buf)
                        if room < len(payload):
                            self._dropped = True
                        buf += payload[: max(room, 0)]
                    elif ftype == p.Reply.EXIT:
                        self._exit = self._conn.decode(p.parse_exit, payload)
                        return
                    else:
                        raise SandboxError(f"agent sent unexpected frame 0x{ftype:02x}",
                                           sandbox_id=self._conn.sandbox_id)  # fmt: skip
                    self._cond.notify_all()
        except SandboxError as exc:
            with self._cond:
                self._lost = exc
        finally:
            with self._send_lock:
                self._conn.close()
            with self._cond:
                self._cond.notify_all()

    @property
    def done(self) -> bool:
        return self._exit is not None or self._lost is not None

    def _send(self, data: bytes) -> None:
        with self._send_lock:
            if self._conn.closed:
                raise SandboxStateError(f"process {self.pid} has exited",
                                        sandbox_id=self._conn.sandbox_id)  # fmt: skip
            self._conn.send(data)

    def write_stdin(self, data: bytes) -> None:
        """Sends input; blocks while the process does not read (backpressure)."""
        for frame in p.data_frames(data, UPLOAD_CHUNK):
            self._send(frame)

    def close_stdin(self) -> None:
        """EOF on stdin (with a pty: the EOF character, ^D)."""
        self._send(p.CLOSE_FRAME)

    def resize(self, rows: int, cols: int) -> None:
        if not self.pty:
            raise ConfigError("resize needs a process started with a pty")
        self._send(p.resize_frame(rows, cols))

    def kill(self, signal: int = 9) -> None:
        """Sends ``signal`` to the process group; SIGKILL kills the whole tree."""
        if self.done:
            return
        if signal == 9:
            self._killed = True
        if not self._send_lock.acquire(timeout=1.0):  # stdin is blocked: cut the connection
            self._killed = True
            self._conn.abort()
            return
        try:
            if not self._conn.closed:
                self._conn.send(p.signal_frame(signal))
        except SandboxError:
            pass
        finally:
            self._send_lock.release()

    def _drain(self, buf: bytearray, timeout: float | None) -> bytes:
        with self._cond:
            if not buf and not self.done and (timeout is None or timeout > 0):
                self._cond.wait_for(lambda: bool(buf) or self.done, timeout)
            data = bytes(buf)
            buf.clear()
            return data

    def read(self, timeout: float | None = 0) -> bytes:
        """Buffered stdout (with a pty: all output), drained; waits up to ``timeout``
        seconds (None: until some arrives or the process ends) if there is none."""
        return self._drain(self._out, timeout)

    def read_stderr(self, timeout: float | None = 0) -> bytes:
        return self._drain(self._err, timeout)

    def wait(self, timeout: float | None = None) -> ExecResult | None:
        """The result once the process exited (with the output not yet read), else None
        after ``timeout`` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.done, timeout):
                return None
            out, err = bytes(self._out), bytes(self._err)
            self._out.clear()
            self._err.clear()
            if self._exit is not None:
                ex = self._exit
                if self._dropped and not ex.truncated:
                    ex = p.Exit(**{**ex.__dict__, "truncated": True})
                return _result(ex, out, err)
            if self._killed:  # the connection was cut on purpose
                return ExecResult(exit_code=137, signal=9, stdout_bytes=out, stderr_bytes=err)
            if self._detached:
                raise SandboxStateError(
                    f"process {self.pid} was detached by a snapshot; it keeps running in the "
                    "sandbox but this handle no longer sees it",
                    sandbox_id=self._conn.sandbox_id,
                )
            assert self._lost is not None
            raise self._lost

    def detach(self) -> None:
        """Lets go of the process without killing it: the agent (told to hold for a
        checkpoint) keeps it running and drops its output. Output not yet read stays
        readable; :meth:`wait` then raises :class:`SandboxStateError`."""
        if self.done:
            return
        self._detached = True
        self._conn.abort()
        self._reader.join()

    def close(self) -> None:
        """Kills the process tree if still running and releases the connection."""
        if not self.done:
            self._killed = True
        self._conn.abort()
        self._reader.join()

    def __enter__(self) -> AgentProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
