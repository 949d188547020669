"""What runs on one node's host, and under which Ray reservation: each sandbox's placement
group (a block slot or its own), the job that owns it, the processes callers spawned in it,
and the creates in flight. One lock guards it all; the host actor, its boots and its watch
loop read and change it only through here."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..runtime.agent.client import AgentProcess
from ..runtime.errors import HostRetiringError, SandboxStateError
from . import metrics, names
from .blocks import Blocks
from .placement import remove_pg

REFILL_QUIET_S = 0.1  # the stock refills once creates paused this long (first commands run)


class Residents:
    """The sandboxes and processes of one host. Thread-safe."""

    def __init__(self, node_id: str, blocks: Blocks) -> None:
        self.node_id = node_id
        self._blocks = blocks
        self.lock = threading.Lock()
        self.pgs: dict[str, str] = {}  # sandbox id -> its reservation
        self.jobs: dict[str, str] = {}  # sandbox id -> owning job id (absent: detached)
        self.procs: dict[str, AgentProcess] = {}  # "<sandbox id>:<pid>" -> spawned process
        self.names: dict[str, str] = {}  # sandbox id -> the name it holds in the cluster
        self.actors: dict[str, str] = {}  # sandbox id -> the proxy actor it dies with
        self.inflight = 0
        self.last_create = 0.0  # when the last create ended (monotonic)
        self.closing = False
        self.retiring = False
        self.idle = threading.Condition(self.lock)

    def creating(self) -> bool:
        """Callers' creates, hand-outs from the stock included, or one ended less than
        ``REFILL_QUIET_S`` ago: a refill boot (~160 ms of CPU) started during a burst of
        hand-outs, or right after it, delayed them and the first commands their callers send
        (bursts of 8, p50 128 ms on 2 cores)."""
        with self.lock:
            return self.inflight > 0 or time.monotonic() - self.last_create < REFILL_QUIET_S

    def check_open(self) -> None:
        if self.retiring:  # the caller keeps its reservation and asks a fresh host
            raise HostRetiringError(f"the sandbox host on {self.node_id} is retiring")
        if self.closing:
            raise SandboxStateError(f"the sandbox host on {self.node_id} is shutting down")

    def release(self, pg_hex: str) -> None:
        """Free a sandbox's reservation: its block slot, or its own placement group."""
        if self._blocks.owns(pg_hex):
            self._blocks.give(pg_hex)
        else:
            remove_pg(pg_hex)

    def start(self, pg_hex: str, owner_job: str | None, start: Callable[[], str],
              name: str | None = None, owner_actor: str | None = None) -> str:
        """``start()`` a sandbox under the reservation ``pg_hex`` and adopt it. Counted in
        flight so a shutdown can wait for it; refused once shutting down. The reservation
        is released if the sandbox never comes up."""
        with self.lock:
            if self.closing and not self.retiring:  # a retiring host's caller keeps it
                self.release(pg_hex)
            self.check_open()
            self.inflight += 1
        try:
            sid = start()
            with self.lock:
                self.pgs[sid] = pg_hex
                if owner_job:
                    self.jobs[sid] = owner_job
                if name:
                    self.names[sid] = name
                if owner_actor:
                    self.actors[sid] = owner_actor
                n = len(self.pgs)
            metrics.set_live(self.node_id, n)
            return sid
        except BaseException:
            self.release(pg_hex)
            raise
        finally:
            with self.lock:
                self.inflight -= 1
                self.last_create = time.monotonic()
                self.idle.notify_all()

    def forget(self, sandbox_id: str, *, keep_name: bool = False) -> None:
        """A sandbox ended: its processes close, its reservation is given back and its
        name too (not while it is only suspended: it comes back under that name)."""
        with self.lock:
            pg_hex = self.pgs.pop(sandbox_id, None)
            self.jobs.pop(sandbox_id, None)
            name = self.names.pop(sandbox_id, None)
            self.actors.pop(sandbox_id, None)
            procs = [self.procs.pop(k) for k in list(self.procs) if k.startswith(sandbox_id)]
        for proc in procs:
            proc.close()
        if pg_hex:
            self.release(pg_hex)
        if name and not keep_name:
            names.release(name, sandbox_id)
        metrics.set_live(self.node_id, len(self.pgs))

    def close_when_idle(self, timeout: float) -> list[str]:
        """Refuse new creates, wait (bounded) for those in flight; the ids to delete."""
        with self.lock:
            self.closing = True
            self.idle.wait_for(lambda: self.inflight == 0, timeout=timeout)
            return list(self.pgs)

    def busy(self) -> bool:
        with self.lock:
            return bool(self.pgs or self.inflight or self.procs or self.closing)
