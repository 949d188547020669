"""One agent client per sandbox, and the warm interpreters (``run_python`` contexts) that
run over it, for the sandboxes one runtime talks to. Thread-safe."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from .agent.client import AgentClient
from .agent.pyrepl import PythonContext


class Connections:
    def __init__(self, io_timeout: float) -> None:
        self.io_timeout = io_timeout
        self._lock = threading.Lock()
        self._clients: dict[str, AgentClient] = {}
        self._pythons: dict[tuple[str, str], PythonContext] = {}

    def get(self, sandbox_id: str, socket: Path,
            exists: Callable[[], bool]) -> AgentClient | None:
        """The sandbox's client, made on first use (clients connect lazily); None if
        ``exists()`` says the sandbox was deleted while its client was being made. A delete
        closes the client it finds: one made after that would stay here for good."""
        with self._lock:
            client = self._clients.get(sandbox_id)
        if client is not None:
            return client
        client = AgentClient(socket, sandbox_id=sandbox_id, io_timeout=self.io_timeout)
        with self._lock:
            client = self._clients.setdefault(sandbox_id, client)
        if exists():
            return client
        self.close(sandbox_id)
        return None

    def peek(self, sandbox_id: str) -> AgentClient | None:
        """The sandbox's client if one was made (none: nothing has called into it yet)."""
        with self._lock:
            return self._clients.get(sandbox_id)

    def add(self, sandbox_id: str, client: AgentClient) -> None:
        with self._lock:
            self._clients[sandbox_id] = client

    def python(self, sandbox_id: str, context: str,
               start: Callable[[], PythonContext]) -> PythonContext:
        """The sandbox's interpreter for ``context``, started by ``start`` on first use."""
        with self._lock:
            ctx = self._pythons.get((sandbox_id, context))
        if ctx is not None:
            return ctx
        ctx = start()
        with self._lock:
            kept = self._pythons.setdefault((sandbox_id, context), ctx)
        if kept is not ctx:  # another call started one meanwhile: keep one interpreter
            ctx.kill()
        return kept

    def take_pythons(self, sandbox_id: str) -> list[PythonContext]:
        """Remove and return the sandbox's interpreters (the caller ends them)."""
        with self._lock:
            keys = [k for k in self._pythons if k[0] == sandbox_id]
            return [self._pythons.pop(k) for k in keys]

    def stop_pythons(self, sandbox_id: str) -> None:
        """Kill the sandbox's interpreters and wait for them. Before a checkpoint hold (a
        snapshot, a suspend): they cannot be reached after it (their connections go), so no
        copy carries one (a connection merely dropped while the hold file exists counts as
        "detach" to the agent)."""
        for ctx in self.take_pythons(sandbox_id):
            ctx.kill()

    def close(self, sandbox_id: str) -> None:
        """Close the sandbox's client; its interpreters go with their connections."""
        self.take_pythons(sandbox_id)
        with self._lock:
            client = self._clients.pop(sandbox_id, None)
        if client is not None:
            client.close()
