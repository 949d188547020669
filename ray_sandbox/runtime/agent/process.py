"""A long-lived process in a sandbox (:meth:`AgentClient.spawn`), owning its connection."""

from __future__ import annotations

import threading

from ..errors import ConfigError, SandboxError, SandboxStateError
from ..results import ExecResult
from . import protocol as p
from .args import UPLOAD_CHUNK, check_bytes, check_int
from .conn import _Conn


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


class AgentProcess:
    """A process started with :meth:`AgentClient.spawn`, owning its connection.

    A background thread buffers output; at most ``max_buffer_bytes`` of undrained output
    per stream is kept (more is dropped and the result flagged ``truncated``), so the process
    never blocks on a slow reader. With a pty all output arrives on stdout. Closing the
    process (or losing the connection) kills its whole tree.
    """

    # what a remote caller may ask of it by name (the Ray host's ``process`` call)
    OPS = ("write_stdin", "close_stdin", "read", "read_stderr", "read_both", "wait", "kill",
           "resize", "close")

    def __init__(self, conn: _Conn, pid: int, pty: bool, max_buffer_bytes: int,
                 keeps_active: bool = True) -> None:
        self.pid = pid
        self.pty = pty
        # while it runs the sandbox is in use (idle_timeout_seconds); a warm interpreter
        # sets this only while it runs code
        self.keeps_active = keeps_active
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
                ftype, payload = self._conn.read_reply(None)
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
                        raise self._conn.violation(f"unexpected frame 0x{ftype:02x}")
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
            self._conn.send(data, deadline=None)  # backpressure: kill() cuts it

    def write_stdin(self, data: bytes) -> None:
        """Sends input; blocks while the process does not read (backpressure)."""
        for frame in p.data_frames(check_bytes(data, "data", self._conn.sandbox_id),
                                   UPLOAD_CHUNK):
            self._send(frame)

    def close_stdin(self) -> None:
        """EOF on stdin (with a pty: the EOF character, ^D)."""
        self._send(p.CLOSE_FRAME)

    def resize(self, rows: int, cols: int) -> None:
        if not self.pty:
            raise ConfigError("resize needs a process started with a pty")
        sid = self._conn.sandbox_id
        self._send(p.resize_frame(check_int(rows, "rows", sid, lo=1, hi=65535),
                                  check_int(cols, "cols", sid, lo=1, hi=65535)))

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
                self._conn.send(p.signal_frame(signal), deadline=None)
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

    def read_both(self, timeout: float | None = 0) -> tuple[bytes, bytes]:
        """Buffered (stdout, stderr), both drained; waits up to ``timeout`` seconds (None:
        until either has some or the process ends) while both are empty. One call streams
        both while the process runs."""
        with self._cond:
            if not self._out and not self._err and not self.done and \
                    (timeout is None or timeout > 0):
                self._cond.wait_for(lambda: bool(self._out or self._err) or self.done, timeout)
            out, err = bytes(self._out), bytes(self._err)
            self._out.clear()
            self._err.clear()
            return out, err

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
