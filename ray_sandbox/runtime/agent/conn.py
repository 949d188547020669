"""One connection to an agent handler: framing, bounds and deadlines.

Everything read here comes from inside a sandbox, where root can replace the agent with its
own server or freeze its handlers (docs/agent.md). So every frame's size is checked before
it is read, and every send and receive waits in ``poll`` against a deadline instead of
blocking: a hostile or stopped peer costs a typed error for that sandbox, never a hang,
unbounded memory or a raw ``struct.error``.
"""

from __future__ import annotations

import errno as errno_
import math
import os
import select
import socket
import stat
import time
from collections.abc import Callable
from typing import TypeVar

from ..errors import (
    AgentProtocolError,
    AgentTimeoutError,
    ProtocolError,
    SandboxDiedError,
    SandboxError,
)
from . import protocol as p

T = TypeVar("T")
Payload = bytes | bytearray
CONNECT_TIMEOUT = 5.0
# The agent's control replies are small (an ERROR message is at most 1 KiB, an ENTRY two
# paths of PATH_MAX); only output and file data use whole 1 MiB frames.
CONTROL_FRAME_MAX = 64 * 1024
_CONTROL = frozenset({p.Reply.OK, p.Reply.ERROR, p.Reply.STARTED, p.Reply.EXIT, p.Reply.ENTRY,
                      p.Reply.END})
# The agent never sends these empty, so a reply's frame count is bounded by its byte count.
_STREAM = frozenset({p.Reply.STDOUT, p.Reply.STDERR, p.Stream.DATA})
_POLL_MAX_MS = 2**31 - 1  # poll() takes a C int; longer waits loop


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


class _Conn:
    """One connection to an agent handler: framed, buffered, non-blocking I/O with deadlines.

    A deadline is a ``time.monotonic()`` value, or None to wait as long as it takes (a
    command without a timeout). The socket is non-blocking and waits are ``poll`` calls, so a
    reader thread and a writer thread never fight over a shared socket timeout."""

    def __init__(self, sock: socket.socket, sandbox_id: str | None) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.sandbox_id = sandbox_id
        self._buf = bytearray()
        self._pos = 0
        self._scratch = memoryview(bytearray(65536))
        self.closed = False
        self.failure: SandboxError | None = None

    # -- errors (each closes the connection: it is out of step or dead) --------------------

    def _fail(self, exc: SandboxError) -> SandboxError:
        """Closes the connection, remembering why: the other thread using it (a stdin writer
        beside the reader) then reports the same cause, not a bad file descriptor."""
        if self.failure is None:
            self.failure = exc
        else:
            exc = type(self.failure)(self.failure.message, sandbox_id=self.sandbox_id)
        self.close()
        return exc

    def _died(self, why: str) -> SandboxError:
        return self._fail(SandboxDiedError(f"agent connection lost: {why}",
                                           sandbox_id=self.sandbox_id))  # fmt: skip

    def _timed_out(self, what: str) -> SandboxError:
        return self._fail(AgentTimeoutError(
            f"the agent did not {what} before the deadline (hung, or its handler was "
            "stopped from inside the sandbox)",
            sandbox_id=self.sandbox_id,
        ))  # fmt: skip

    def violation(self, why: str) -> SandboxError:
        return self._fail(AgentProtocolError(f"agent broke the protocol: {why}",
                                             sandbox_id=self.sandbox_id))  # fmt: skip

    # -- waiting ----------------------------------------------------------------------------

    def _wait(self, events: int, deadline: float | None, what: str) -> None:
        """Returns once the socket is ready for ``events`` (or hung up, or closed by another
        thread: the next call then fails); raises AgentTimeoutError past ``deadline``."""
        poller = select.poll()
        try:
            poller.register(self.sock, events)
        except (OSError, ValueError):  # closed meanwhile by another thread
            raise self._died("connection closed") from None
        while True:
            if deadline is None:
                ms = _POLL_MAX_MS
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._timed_out(what)
                ms = min(_POLL_MAX_MS, math.ceil(left * 1000))
            if poller.poll(ms):
                return

    # -- sending ----------------------------------------------------------------------------

    def send(self, *parts: bytes | bytearray | memoryview, deadline: float | None) -> None:
        """Sends every part (in as few syscalls as the socket allows, without joining them);
        waits while the agent applies backpressure, up to ``deadline``."""
        views = [memoryview(part).cast("B") for part in parts if len(part)]
        while views:
            try:
                sent = self.sock.sendmsg(views)
            except BlockingIOError:
                self._wait(select.POLLOUT, deadline, "take the data sent")
                continue
            except OSError as exc:
                raise self._died(str(exc)) from None
            while sent:
                if sent >= len(views[0]):
                    sent -= len(views.pop(0))
                else:
                    views[0] = views[0][sent:]
                    sent = 0

    def send_frame(self, ftype: int, payload: bytes | bytearray | memoryview,
                   deadline: float | None) -> None:
        self.send(p.HEADER.pack(len(payload), ftype), payload, deadline=deadline)

    # -- receiving --------------------------------------------------------------------------

    def _recv_into(self, view: memoryview, deadline: float | None) -> int:
        # Past the deadline still take what already arrived (a slow consumer of a stream is
        # not a hung agent): the receive comes before the wait.
        while True:
            try:
                n = self.sock.recv_into(view)
            except BlockingIOError:
                self._wait(select.POLLIN, deadline, "answer")
                continue
            except OSError as exc:
                raise self._died(str(exc)) from None
            if n == 0:
                raise self._died("connection closed by the sandbox")
            return n

    def _read_exact(self, n: int, deadline: float | None) -> Payload:
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
        small = bytes(self._buf[self._pos : self._pos + n])
        self._pos += n
        return small

    def read_frame(self, deadline: float | None, limit: int = p.FRAME_MAX) -> tuple[int, Payload]:
        """Any frame of at most ``limit`` payload bytes (checked before it is read)."""
        length, ftype = p.HEADER.unpack(self._read_exact(p.HEADER.size, deadline))
        if length > limit:
            raise self.violation(f"a {length}-byte frame 0x{ftype:02x} (at most {limit})")
        return ftype, self._read_exact(length, deadline)

    def read_reply(self, deadline: float | None, data_max: int = p.FRAME_MAX,
                   ) -> tuple[int, Payload]:  # fmt: skip
        """A reply frame as the agent sends them: control frames of at most
        CONTROL_FRAME_MAX, output/data frames non-empty and of at most ``data_max``."""
        ftype, payload = self.read_frame(deadline, max(data_max, CONTROL_FRAME_MAX))
        if ftype in _CONTROL and len(payload) > CONTROL_FRAME_MAX:
            raise self.violation(f"a {len(payload)}-byte control frame 0x{ftype:02x}")
        if ftype in _STREAM and not 0 < len(payload) <= data_max:
            raise self.violation(f"a {len(payload)}-byte data frame (1..{data_max} allowed)")
        return ftype, payload

    def decode(self, parse: Callable[[Payload], T], payload: Payload) -> T:
        """Parses a payload; a malformed one means the peer is broken: drop it."""
        try:
            return parse(payload)
        except ProtocolError as exc:
            raise self.violation(f"malformed frame: {exc}") from None

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
            self.abort()  # wakes another thread waiting on it (a stdin writer, a reader)
            self.sock.close()

    def abort(self) -> None:
        """Breaks the connection from any thread (the agent then kills the command tree)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
