"""The connections of one agent client: a small pool of them, the hold a checkpoint puts on
new calls, and the activity ``idle_timeout_seconds`` reads (``AgentClient.pool``).

One connection is one handler process in the sandbox. A call checks one out, runs one
request on it and checks it back in; a spawned :class:`AgentProcess` owns its connection
until it is closed. :meth:`ConnPool.quiesce` holds new calls and waits for running ones, so
that a checkpoint can drop every connection (:meth:`ConnPool.drop_connections`).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import SandboxDiedError, SandboxStateError
from .conn import _Conn, connect_agent_socket
from .process import AgentProcess


class ConnPool:
    """Connections to one agent, at most ``size`` kept idle. Thread-safe."""

    def __init__(self, socket_path: Path, sandbox_id: str | None, size: int) -> None:
        self.socket_path = socket_path
        self.sandbox_id = sandbox_id
        self.size = size
        self._idle: list[_Conn] = []
        self._lock = threading.Lock()
        self._unheld = threading.Condition(self._lock)
        self._held = False
        self._closed = False
        self._busy: weakref.WeakSet[_Conn] = weakref.WeakSet()  # checked out
        self._connecting = 0
        self._procs: weakref.WeakSet[AgentProcess] = weakref.WeakSet()
        self._last_active = time.monotonic()

    # -- activity (idle_timeout_seconds) ---------------------------------------------------

    def touch(self) -> None:
        """A call into the sandbox started or ended now."""
        self._last_active = time.monotonic()

    def idle_since(self) -> float | None:
        """When the last call into the sandbox started or ended (``time.monotonic``), or
        None while a call runs or a spawned process that keeps it active lives."""
        with self._lock:
            if self._connecting or any(not c.closed for c in self._busy) or \
                    any(p.keeps_active and not p.done for p in self._procs):
                return None
            return self._last_active

    # -- checkout ---------------------------------------------------------------------

    def _wait_unheld(self) -> None:
        """Called with the lock held: waits out a :meth:`quiesce`."""
        self._unheld.wait_for(lambda: not self._held)
        if self._closed:
            raise SandboxStateError("agent client is closed", sandbox_id=self.sandbox_id)

    def checkout(self) -> _Conn:
        """An idle connection, else a new one; counted busy until :meth:`checkin`."""
        with self._lock:
            self._wait_unheld()
            while self._idle:
                conn = self._idle.pop()
                # Else the handler died (EOF pending) or the connection is out of step.
                if not conn.closed and not conn.has_input():
                    self._busy.add(conn)
                    self.touch()
                    return conn
                conn.close()
        return self.connect_busy()

    def connect_busy(self) -> _Conn:
        """A new connection, counted as busy from before it exists (for :meth:`quiesce`)."""
        with self._lock:
            self._wait_unheld()
            self._connecting += 1
        try:
            try:
                sock = connect_agent_socket(self.socket_path)
            except OSError as exc:
                raise SandboxDiedError(
                    f"cannot connect to the agent at {self.socket_path}: {exc}",
                    sandbox_id=self.sandbox_id,
                ) from None
            conn = _Conn(sock, self.sandbox_id)
            with self._lock:
                self._busy.add(conn)
                self.touch()
            return conn
        finally:
            with self._lock:
                self._connecting -= 1

    def checkin(self, conn: _Conn) -> None:
        """A call is done with ``conn``: kept idle if it is fit and there is room."""
        with self._lock:
            self._busy.discard(conn)
            self.touch()
            if not conn.closed and not self._closed and len(self._idle) < self.size:
                self._idle.append(conn)
                return
        conn.close()

    def adopt(self, conn: _Conn, proc: AgentProcess) -> None:
        """``conn`` is now ``proc``'s own (a spawn): no longer a call's."""
        with self._lock:
            self._busy.discard(conn)
            self._procs.add(proc)

    def close(self) -> None:
        """Closes idle connections; later checkouts raise :class:`SandboxStateError`."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    # -- the hold of a checkpoint ------------------------------------------------------

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
