"""What runs on one node's host, and under which Ray reservation: each sandbox's placement
group (a block slot or its own), the job that owns it, the processes callers spawned in it,
the creates in flight, the sandboxes suspended here (what each needs to come back: its
reservation's shape, its owner) and those that came back on another node. One lock guards
it all; the host actor, its boots and its watch loop read and change it only through here.

Every call the host dispatches into a sandbox passes :meth:`Residents.enter`: a suspended
sandbox is resumed first (by one caller; the others wait for it), a sandbox being suspended
or resumed is waited for, and one that moved is named so the call is forwarded. A suspend
starts only while no call is inside (:meth:`Residents.begin_suspend`)."""

from __future__ import annotations

import contextlib
import copy
import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from ..runtime.agent.client import AgentProcess
from ..runtime.errors import HostRetiringError, SandboxError, SandboxStateError
from ..runtime.records import ID_RE
from . import metrics, names
from .blocks import Blocks
from .placement import remove_pg

TURN_WAIT_S = 300.0  # a call waiting for a suspend or resume (which bound their own steps)
_ASLEEP_MAX = 64 * 1024


@dataclass
class Asleep:
    """A sandbox suspended on this host: what it needs to come back."""

    bundle: dict[str, float]  # its Ray reservation's shape
    job: str | None = None  # the job it dies with (None: detached)
    name: str | None = None
    actor: str | None = None  # the proxy actor it dies with
    size_bytes: int = 0  # its checkpoint on disk
    since: float = 0.0  # time.time() of the suspend


class _Turn:
    """A suspend or resume under way; callers of the sandbox wait for it."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.done = threading.Event()
        self.error: BaseException | None = None

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
        self.asleep: dict[str, Asleep] = {}  # suspended here
        self.moved: dict[str, str] = {}  # sandbox id -> the node it was resumed on
        self._calls: dict[str, int] = {}  # calls inside each sandbox now
        self._turns: dict[str, _Turn] = {}  # suspends and resumes under way
        self._state_dir: Path | None = None

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

    def forget(self, sandbox_id: str) -> None:
        """A sandbox ended (running or suspended here): its processes close, its reservation
        is given back and its name too."""
        with self.lock:
            pg_hex = self.pgs.pop(sandbox_id, None)
            self.jobs.pop(sandbox_id, None)
            name = self.names.pop(sandbox_id, None)
            self.actors.pop(sandbox_id, None)
            procs = self._take_procs(sandbox_id)
            asleep = self.asleep.pop(sandbox_id, None)
            name = name or (asleep.name if asleep else None)
        self._unpersist(sandbox_id)
        for proc in procs:
            proc.close()
        if pg_hex:
            self.release(pg_hex)
        if name:
            names.release(name, sandbox_id)
        self._gauges()

    def _take_procs(self, sandbox_id: str) -> list[AgentProcess]:
        return [self.procs.pop(k) for k in list(self.procs)
                if k.startswith(sandbox_id + ":")]

    def _gauges(self) -> None:
        with self.lock:
            live, asleep = len(self.pgs), len(self.asleep)
            size = sum(a.size_bytes for a in self.asleep.values())
        metrics.set_live(self.node_id, live)
        metrics.set_suspended(self.node_id, asleep, size)

    # --- the gate every dispatched call passes ------------------------------------------

    def enter(self, sandbox_id: str, wake: Callable[[str], None] | None) -> str | None:
        """Admit a call into the sandbox. Returns the node it runs on now if it moved there
        (the caller forwards, and does not :meth:`leave`); else None, and the call is
        counted inside until :meth:`leave`. A suspended sandbox is resumed first by
        ``wake`` (one caller does; the others wait, and get its error if it fails); with
        ``wake=None`` it is not (status, delete). A suspend or resume under way is waited
        for (at most TURN_WAIT_S)."""
        deadline = time.monotonic() + TURN_WAIT_S
        while True:
            with self.lock:
                if (node := self.moved.get(sandbox_id)) is not None:
                    return node
                turn = self._turns.get(sandbox_id)
                mine = turn is None and wake is not None and sandbox_id in self.asleep
                if mine:
                    turn = self._turns[sandbox_id] = _Turn("resume")
                elif turn is None:
                    self._calls[sandbox_id] = self._calls.get(sandbox_id, 0) + 1
                    return None
            assert turn is not None
            if mine:
                assert wake is not None
                try:
                    wake(sandbox_id)
                except BaseException as exc:
                    turn.error = exc
                    raise
                finally:
                    self._end(sandbox_id, turn)
                continue
            if not turn.done.wait(max(0.0, deadline - time.monotonic())):
                raise SandboxStateError(f"the sandbox's {turn.kind} did not end within "
                                        f"{TURN_WAIT_S:g}s", sandbox_id=sandbox_id)
            if turn.kind == "resume" and isinstance(turn.error, SandboxError):
                raise copy.copy(turn.error)  # one attempt per burst of callers

    def leave(self, sandbox_id: str) -> None:
        with self.lock:
            n = self._calls.get(sandbox_id, 0) - 1
            if n > 0:
                self._calls[sandbox_id] = n
            else:
                self._calls.pop(sandbox_id, None)
                self.idle.notify_all()

    @contextlib.contextmanager
    def inside(self, sandbox_id: str, wake: Callable[[str], None] | None,
               ) -> Iterator[str | None]:
        """:meth:`enter` ... :meth:`leave` as a block; yields the node to forward to."""
        node = self.enter(sandbox_id, wake)
        try:
            yield node
        finally:
            if node is None:
                self.leave(sandbox_id)

    def begin_suspend(self, sandbox_id: str, wait: float) -> _Turn | None:
        """Start a suspend of a sandbox running here once no call is inside it (waiting at
        most ``wait`` seconds); None if it is not running here or stays in use. Calls that
        come meanwhile wait for the suspend (and then resume it)."""
        with self.lock:
            if not self.idle.wait_for(lambda: not self._calls.get(sandbox_id)
                                      and sandbox_id not in self._turns, timeout=wait):
                return None
            if sandbox_id not in self.pgs:
                return None
            turn = self._turns[sandbox_id] = _Turn("suspend")
            return turn

    def end_suspend(self, sandbox_id: str, turn: _Turn) -> None:
        self._end(sandbox_id, turn)

    def _end(self, sandbox_id: str, turn: _Turn) -> None:
        with self.lock:
            if self._turns.get(sandbox_id) is turn:
                del self._turns[sandbox_id]
            self.idle.notify_all()
        turn.done.set()

    def in_use(self, sandbox_id: str) -> bool:
        with self.lock:
            return bool(self._calls.get(sandbox_id)) or sandbox_id in self._turns

    # --- suspended here, resumed, moved ------------------------------------------------

    def fell_asleep(self, sandbox_id: str, bundle: Mapping[str, float], size_bytes: int,
                    since: float) -> None:
        """The sandbox is suspended: its reservation is given back, its processes' handles
        end, what it needs to come back is kept (and written down for a restarted host)."""
        with self.lock:
            pg_hex = self.pgs.pop(sandbox_id, None)
            asleep = Asleep(bundle=dict(bundle), job=self.jobs.pop(sandbox_id, None),
                            name=self.names.pop(sandbox_id, None),
                            actor=self.actors.pop(sandbox_id, None), size_bytes=size_bytes,
                            since=since)
            self.asleep[sandbox_id] = asleep
            procs = self._take_procs(sandbox_id)
        self._persist(sandbox_id, asleep)
        for proc in procs:
            proc.close()
        if pg_hex:
            self.release(pg_hex)
        self._gauges()

    def woke(self, sandbox_id: str, pg_hex: str) -> None:
        """The suspended sandbox runs here again, under the reservation ``pg_hex``."""
        with self.lock:
            asleep = self.asleep.pop(sandbox_id)
            self.pgs[sandbox_id] = pg_hex
            if asleep.job:
                self.jobs[sandbox_id] = asleep.job
            if asleep.name:
                self.names[sandbox_id] = asleep.name
            if asleep.actor:
                self.actors[sandbox_id] = asleep.actor
        self._unpersist(sandbox_id)
        self._gauges()

    def moved_to(self, sandbox_id: str, node_id: str) -> None:
        """The suspended sandbox was resumed on another node: calls that reach this host
        are forwarded there (the handles made before keep working)."""
        with self.lock:
            self.asleep.pop(sandbox_id, None)
            self.moved[sandbox_id] = node_id
        self._unpersist(sandbox_id)
        if self._state_dir is not None:
            (self._state_dir / f"{sandbox_id}.moved").write_text(node_id)
        self._gauges()

    def drop_moved(self, sandbox_id: str) -> None:
        """The sandbox that moved away has ended: nothing to forward any more."""
        with self.lock:
            self.moved.pop(sandbox_id, None)
        if self._state_dir is not None:
            (self._state_dir / f"{sandbox_id}.moved").unlink(missing_ok=True)

    def asleep_bytes(self) -> int:
        with self.lock:
            return sum(a.size_bytes for a in self.asleep.values())

    def load(self, state_dir: Path, suspended: list[str],
             default_bundle: Callable[[str], dict[str, float]]) -> None:
        """A restarted host: the sandboxes its runtime found suspended (``suspended``) and
        those that moved away, from what the previous incarnation wrote in ``state_dir``.
        A suspended sandbox without a note (suspended by a runtime outside Ray) reserves
        what its config asks for and is detached."""
        state_dir.mkdir(parents=True, exist_ok=True)
        self._state_dir = state_dir
        with self.lock:
            for sid in suspended:
                asleep = _read_asleep(state_dir / f"{sid}.json")
                self.asleep[sid] = asleep or Asleep(bundle=default_bundle(sid))
            for f in state_dir.glob("*.moved"):
                sid = f.name.removesuffix(".moved")
                if ID_RE.match(sid):
                    self.moved[sid] = f.read_text()[:64].strip()
        for f in state_dir.glob("*.json"):  # notes of sandboxes deleted meanwhile
            if f.stem not in suspended:
                f.unlink(missing_ok=True)
        self._gauges()

    def _persist(self, sandbox_id: str, asleep: Asleep) -> None:
        if self._state_dir is not None:
            tmp = self._state_dir / f"{sandbox_id}.tmp"
            tmp.write_text(json.dumps(asdict(asleep)))
            tmp.replace(self._state_dir / f"{sandbox_id}.json")

    def _unpersist(self, sandbox_id: str) -> None:
        if self._state_dir is not None:
            (self._state_dir / f"{sandbox_id}.json").unlink(missing_ok=True)

    def close_when_idle(self, timeout: float) -> list[str]:
        """Refuse new creates, wait (bounded) for those in flight; the ids to delete."""
        with self.lock:
            self.closing = True
            self.idle.wait_for(lambda: self.inflight == 0, timeout=timeout)
            return list(self.pgs)

    def busy(self) -> bool:
        """Anything that keeps the host: sandboxes running or suspended here, creates,
        processes, and sandboxes that moved away (old handles reach them through here)."""
        with self.lock:
            return bool(self.pgs or self.inflight or self.procs or self.closing or
                        self.asleep or self.moved or self._turns)


def _read_asleep(path: Path) -> Asleep | None:
    try:
        with open(path, "rb") as f:
            raw = json.loads(f.read(_ASLEEP_MAX))
        return Asleep(**raw)
    except (OSError, ValueError, TypeError):
        return None
