"""SandboxHost: one Ray actor per node that runs that node's sandboxes.

A Ray worker process per sandbox would cost ~1 s to start and ~100 MB each; instead each node
has one host actor (``num_cpus=0``, threaded) that embeds a :class:`SandboxRuntime`. Each
sandbox's CPU/memory/custom resources are reserved in Ray: as a slot of one of the host's
blocks (``blocks``: no GCS call per sandbox), or as its own placement group when a caller had
to wait for room (``placement``). A sandbox dies with the job that created it (one job-table
read per second for the whole node) or when its reservation is removed; when it ends (delete,
TTL) its slot is freed or its placement group removed.

A host with nothing left to run (no sandbox, no create in flight, no snapshot it owns) retires
after ``RAY_SANDBOX_HOST_IDLE_S`` seconds (default 60): Ray counts a node with a live actor as
busy, even a zero-CPU one, so a host that stayed would keep the autoscaler from ever removing
its node. Callers that reach a retiring or retired host start a fresh one
(``hosts.call_host``).

(~620 lines, ~50 methods: the actor's surface is every call a handle, the service or another
node makes of this node, each a few lines over the runtime; admission, blocks, stock, copies,
transfer, volumes and the channel already live in their own modules. Splitting the actor
class would need a second actor per node, which costs a Ray worker.)
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..runtime import SandboxRuntime, archive, fs_image, verbs
from ..runtime.agent.client import AgentProcess
from ..runtime.config import SandboxConfig
from ..runtime.errors import (
    CapacityError,
    ConfigError,
    HostRetiringError,
    ImageNotFoundError,
    SandboxCreationError,
    SandboxError,
    SandboxNotFoundError,
    SandboxStateError,
)
from ..runtime.results import ExecResult, SandboxLink, SandboxState, SandboxStatus
from ..runtime.snapshot import Snapshot, SnapshotDir
from ..runtime.verbs import ExecRequest, LinkRequest, NoRequest, Request, SpawnRequest
from . import metrics
from .blocks import Block, Blocks, Shape, sweep_dead_nodes
from .channel import ChannelServer
from .labels import DETACHED_LABEL, HOST_PREFIX, NAME_LABEL, NAMESPACE, SUSPENDED_LABEL
from .placement import PG_LABEL, bundle_label, pg_gone, release_reaped, remove_pg
from .stock import Stock
from .transfer import ImageImports, SnapshotImports, fetch, rechunk

_WATCH_INTERVAL = 1.0
_BOOT_PARALLEL = 16  # sandboxes booting at once on one host; more only queue in the kernel
_REFILL_QUIET_S = 0.1  # the stock refills once creates paused this long (first commands run)

log = logging.getLogger(__name__)


def _number_env(name: str, default: float) -> float:
    raw = os.environ.get(name, str(default))
    try:
        return float(raw)
    except ValueError:
        log.warning("%s=%r is not a number; using %g", name, raw, default)
        return default


def _sweep_interval() -> float:
    """How often reservations are checked one by one (removed by hand, a dead node's)."""
    return _number_env("RAY_SANDBOX_PG_SWEEP_S", 60.0)


def _dead_jobs() -> set[str]:
    """Ids of finished jobs (one GCS call). ``ray._private.state`` is the only job-table
    reader that does not need the dashboard."""
    try:
        return {j["JobID"] for j in ray._private.state.jobs() if j.get("IsDead")}
    except Exception:  # noqa: BLE001 - GCS hiccup: nothing is dead this round
        return set()


class SandboxHost:
    """The per-node actor. Its methods take a sandbox id and forward to the runtime."""

    def __init__(self, home: str | None = None) -> None:
        self.node_id = ray.get_runtime_context().get_node_id()
        self._rt = SandboxRuntime(home, reap=False)
        self._lock = threading.Lock()
        self._pgs: dict[str, str] = {}
        self._jobs: dict[str, str] = {}  # sandbox id -> owning job id (absent: detached)
        self._procs: dict[str, AgentProcess] = {}
        self._imports = SnapshotImports(self._rt, self.node_id)
        self._image_imports = ImageImports(self._rt.home, self.node_id)
        self._inflight = 0
        self._last_create = 0.0  # when the last create ended (monotonic)
        self._closing = False
        self._retiring = False
        self._idle_since = time.monotonic()
        self._idle_limit = _number_env("RAY_SANDBOX_HOST_IDLE_S", 60.0)
        self._idle = threading.Condition(self._lock)
        self._boots = threading.BoundedSemaphore(_BOOT_PARALLEL)
        self._blocks = Blocks(self.node_id, Path(self._rt.home) / "blocks",
                              idle_s=_number_env("RAY_SANDBOX_BLOCK_IDLE_S", 10.0))
        release_reaped(self._rt)  # a restarted host: the dead incarnation's sandboxes
        self._stock = Stock(
            self._rt, self._blocks, self.node_id, busy=self._creates_in_flight,
            per_shape=int(_number_env("RAY_SANDBOX_STOCK_PER_SHAPE", 8)),
            total=int(_number_env("RAY_SANDBOX_STOCK_MAX", 32)),
            idle_s=_number_env("RAY_SANDBOX_STOCK_IDLE_S", 30.0),
            share=_number_env("RAY_SANDBOX_STOCK_SHARE", 0.25))
        self._channel = ChannelServer.start(Path(self._rt.home) / "host.sock", self._direct)
        threading.Thread(target=self._watch, name="ray-sandbox-pg-watch", daemon=True).start()

    def ping(self) -> str:
        return self.node_id

    def channel(self) -> tuple[str, str | None, bytes | None]:
        """This host's node, where callers on that node reach :meth:`exec` without an actor
        call and the token they need (``channel.py``); (node, None, None) without one."""
        if self._channel is None or self._retiring:
            return self.node_id, None, None
        return self.node_id, str(self._channel.path), self._channel.token

    def _direct(self, verb: str, sandbox_id: str, request: Request) -> Any:
        """A call that came through the channel: exactly what the actor call does."""
        return self.call(verb, sandbox_id, request)

    def stock(self) -> dict[str, int]:
        """The stock's hits, misses, stocked sandboxes and target (``stock.py``)."""
        return self._stock.stats()

    def _creates_in_flight(self) -> bool:
        """Callers' creates, hand-outs from the stock included, or one ended less than
        ``_REFILL_QUIET_S`` ago: a refill boot (~160 ms of CPU) started during a burst of
        hand-outs, or right after it, delayed them and the first commands their callers send
        (bursts of 8, p50 128 ms on 2 cores)."""
        with self._lock:
            return (self._inflight > 0
                    or time.monotonic() - self._last_create < _REFILL_QUIET_S)

    # --- lifecycle -------------------------------------------------------------------------

    def create(self, config: SandboxConfig, pg_hex: str, name: str | None,
               detached: bool, owner_job: str | None = None) -> str:
        """A sandbox under the caller's own reservation ``pg_hex`` (one that waited for room
        as pending Ray demand); the reservation is removed when the sandbox ends."""
        return self._start(pg_hex, None if detached else owner_job,
                           lambda: self._boot(config, pg_hex, name))

    def create_many(self, config: SandboxConfig, bundle: Mapping[str, float], k: int,
                    detached: bool, owner_job: str | None = None, name: str | None = None,
                    ) -> tuple[list[str | SandboxError], dict[Shape, int]]:
        """Up to ``k`` sandboxes in this node's blocks, booted in parallel. Returns each one's
        id or error, in order (CapacityError for those the node has no room for), and the
        free slots this host advertises afterwards."""
        self._check_open()
        stocked: list[tuple[str, str]] = []
        while len(stocked) < k and (got := self._stock.take(config, bundle)) is not None:
            stocked.append(got)
        slots = self._slots(bundle, k - len(stocked))
        job = None if detached else owner_job

        def one(item: tuple[str | None, str]) -> str | SandboxError:
            sid, pg_hex = item
            try:
                return self._start(pg_hex, job, lambda: self._hand_out(sid, config, pg_hex, name)
                                   if sid else self._boot(config, pg_hex, name))
            except SandboxError as exc:
                return exc
            except Exception as exc:  # noqa: BLE001 - reported with the others, not raised
                return SandboxCreationError(f"{type(exc).__name__}: {exc}")

        items = stocked + [(None, pg_hex) for pg_hex in slots]
        results: list[str | SandboxError] = [one(items[0])] if len(items) == 1 else []
        if len(items) > 1:  # a thread per call costs a single create ~0.2 ms for nothing
            with ThreadPoolExecutor(max_workers=min(len(items), _BOOT_PARALLEL)) as ex:
                results = list(ex.map(one, items))
        missing = k - len(items)
        results += [CapacityError(f"node {self.node_id} had room for {len(items)} of {k}")
                    ] * missing
        return results, self._advertised()

    def _slots(self, bundle: Mapping[str, float], k: int) -> list[str]:
        """Up to ``k`` block slots; stocked sandboxes of the shape give theirs up to real
        demand when the node has no other room."""
        slots: list[str] = []
        for _ in range(2):
            if len(slots) == k:
                break
            try:
                slots += self._blocks.take(bundle, k - len(slots))
            except CapacityError:
                pass
            if len(slots) < k and not self._stock.evict(bundle, k - len(slots)):
                break
        return slots

    def _advertised(self) -> dict[Shape, int]:
        """Free slots per shape, a stocked sandbox counted as one (it yields its slot)."""
        free = self._blocks.free_slots()
        for shape, n in self._stock.shapes().items():
            free[shape] = free.get(shape, 0) + n
        return free

    def _hand_out(self, sid: str, config: SandboxConfig, pg_hex: str, name: str | None) -> str:
        """A stocked sandbox becomes the caller's; one that cannot be is deleted and the
        caller gets a fresh boot in its slot."""
        try:
            self._rt.personalize(sid, config.model_copy(
                update={"labels": self._labels(config, pg_hex, name)}))
            return sid
        except SandboxError as exc:
            log.warning("stocked sandbox %s could not be handed out (%s); booting anew",
                        sid, exc)
            try:
                self._rt.delete(sid)
            except SandboxError:
                pass
            return self._boot(config, pg_hex, name)

    @staticmethod
    def _labels(config: SandboxConfig, pg_hex: str, name: str | None) -> dict[str, str]:
        labels = {**config.labels, PG_LABEL: pg_hex}
        if name:
            labels[NAME_LABEL] = name
        return labels

    def _boot(self, config: SandboxConfig, pg_hex: str, name: str | None) -> str:
        labels = self._labels(config, pg_hex, name)
        t0 = time.perf_counter()
        if config.image:  # a filesystem image from another node is fetched first
            image = self._image_imports.local_ref(config.image, start_host)
            config = config.model_copy(update={"image": image})
        with self._boots:
            sid = self._rt.create(config.model_copy(update={"labels": labels}), detach=False)
        metrics.observe_create(time.perf_counter() - t0)
        return sid

    def blocks(self) -> list[Block]:
        """This host's blocks: placement group, shape, size, slots used."""
        return self._blocks.reserved()

    def _check_open(self) -> None:
        if self._retiring:  # the caller keeps its reservation and asks a fresh host
            raise HostRetiringError(f"the sandbox host on {self.node_id} is retiring")
        if self._closing:
            raise SandboxStateError(f"the sandbox host on {self.node_id} is shutting down")

    def _release(self, pg_hex: str) -> None:
        """Free a sandbox's reservation: its block slot, or its own placement group."""
        if self._blocks.owns(pg_hex):
            self._blocks.give(pg_hex)
        else:
            remove_pg(pg_hex)

    def _start(self, pg_hex: str, owner_job: str | None, start: Callable[[], str]) -> str:
        """``start()`` a sandbox under the reservation ``pg_hex`` and adopt it. Counted in
        flight so ``shutdown`` can wait for it; refused once shutting down. The reservation
        is released if the sandbox never comes up."""
        with self._lock:
            if self._closing and not self._retiring:  # a retiring host's caller keeps it
                self._release(pg_hex)
            self._check_open()
            self._inflight += 1
        try:
            sid = start()
            with self._lock:
                self._pgs[sid] = pg_hex
                if owner_job:
                    self._jobs[sid] = owner_job
                n = len(self._pgs)
            metrics.set_live(self.node_id, n)
            return sid
        except BaseException:
            self._release(pg_hex)
            raise
        finally:
            with self._lock:
                self._inflight -= 1
                self._last_create = time.monotonic()
                self._idle.notify_all()

    def delete(self, sandbox_id: str) -> None:
        try:
            if self._rt.oom_killed(sandbox_id):  # the cgroup that tells goes with the delete
                metrics.count_oom()
            self._rt.delete(sandbox_id)
        finally:
            with self._lock:
                pg_hex = self._pgs.pop(sandbox_id, None)
                self._jobs.pop(sandbox_id, None)
                for key in [k for k in self._procs if k.startswith(sandbox_id)]:
                    self._procs.pop(key).close()
            if pg_hex:
                self._release(pg_hex)
            metrics.set_live(self.node_id, len(self._pgs))

    def shutdown(self, timeout: float = 60.0) -> int:
        """Delete every sandbox on this host, including ones whose create was in flight
        (used by ``ray_sandbox.shutdown``); later creates are refused."""
        with self._lock:
            self._closing = True
            self._idle.wait_for(lambda: self._inflight == 0, timeout=timeout)
            ids = list(self._pgs)
        for sid in ids:
            try:
                self.delete(sid)
            except SandboxError:
                pass
        self._stock.close()
        self._rt.close()  # waits for the background teardowns of the deletes above
        self._blocks.release_all()
        return len(ids)

    def _watch(self) -> None:
        """Ends sandboxes whose owner is gone and gives back idle blocks. Each second: one
        job-table read for all of this node's sandboxes (a job's sandboxes die with it).
        Every ``RAY_SANDBOX_PG_SWEEP_S`` seconds (60): each distinct reservation (removed
        by hand, or a detached owner's) and the blocks of dead nodes. One GCS call per
        sandbox per second would saturate the GCS at ~6-7k sandboxes (docs/scale.md)."""
        every = _sweep_interval()
        next_sweep = time.monotonic() + every
        while True:
            time.sleep(_WATCH_INTERVAL)
            with self._lock:
                items = list(self._pgs.items())
                jobs = dict(self._jobs)
            live = set(self._rt.list())
            dead_jobs = _dead_jobs() if jobs else set()
            gone: set[str] = set()
            if time.monotonic() >= next_sweep:
                next_sweep = time.monotonic() + every
                gone = {pg for pg in {pg for _, pg in items} if pg_gone(pg)}
                sweep_dead_nodes()
            if self._retire_if_idle():
                return
            self._blocks.shrink()
            for sid, pg_hex in items:
                if sid not in live:  # ended by its TTL or idle timeout
                    with self._lock:
                        self._pgs.pop(sid, None)
                        self._jobs.pop(sid, None)
                    self._release(pg_hex)
                elif jobs.get(sid) in dead_jobs or pg_hex in gone:
                    log.info("the owner of %s is gone; deleting the sandbox", sid)
                    try:
                        self.delete(sid)
                    except SandboxError:
                        pass
            for pg_hex in gone:  # a block removed by hand: its sandboxes went above
                if self._blocks.owns(pg_hex):
                    self._blocks.drop(pg_hex)

    def _retire_if_idle(self) -> bool:
        """Leave once idle for the idle limit, so the node can be scaled down."""
        with self._lock:
            busy = bool(self._pgs or self._inflight or self._procs or self._closing)
        if not busy:
            me = os.getpid()
            busy = any(snap.owner_pid == me for snap in self._rt.snapshots.list())
        now = time.monotonic()
        if busy:
            self._idle_since = now
            return False
        if now - self._idle_since < self._idle_limit:
            return False
        with self._lock:
            if self._pgs or self._inflight:  # a create got in meanwhile
                self._idle_since = now
                return False
            self._retiring = True
        if self._channel is not None:
            self._channel.close()
        self._stock.close()
        self._rt.close()  # the stock's deletes and every other teardown finish first
        self._blocks.release_all()
        log.info("idle for %.0fs: the sandbox host on %s retires", self._idle_limit,
                 self.node_id)
        ray.get_runtime_context().current_actor.__ray_terminate__.remote()
        return True

    # --- pause, snapshot, restore, suspend ---------------------------------------------------

    def snapshot(self, sandbox_id: str, labels: dict[str, str] | None = None,
                 detach: bool = False) -> Snapshot:
        """A snapshot on this node, labelled with the sandbox's Ray reservation so copies
        reserve the same. Owned by this host unless ``detach``."""
        with self._lock:
            pg_hex = self._pgs.get(sandbox_id)
        extra = {**(labels or {}),
                 **(bundle_label(pg_hex, self._blocks.shape(pg_hex)) if pg_hex else {})}
        snap = self._rt.snapshot(sandbox_id, labels=extra, detach=detach)
        snap = snap.model_copy(update={"node_id": self.node_id})
        SnapshotDir(self._rt.snapshots_dir / snap.snapshot_id).write(snap)
        return snap

    def restore(self, snapshot: Snapshot, pg_hex: str, name: str | None = None,
                sandbox_id: str | None = None, owner_job: str | None = None) -> str:
        """One copy of ``snapshot`` under the reservation ``pg_hex`` (fetched from the node
        that holds it first, if that is another node)."""

        def start() -> str:
            self._imports.ensure_local(snapshot, start_host)
            labels = {k: v for k, v in snapshot.config.get("labels", {}).items()
                      if k not in (PG_LABEL, NAME_LABEL)}
            labels[PG_LABEL] = pg_hex
            if name:
                labels[NAME_LABEL] = name
            ids = [sandbox_id] if sandbox_id else None
            return self._rt.restore(snapshot, 1, labels=labels, sandbox_ids=ids)[0]

        return self._start(pg_hex, owner_job, start)

    def snapshot_filesystem(self, sandbox_id: str, max_bytes: int | None = None) -> str:
        """The sandbox's files as an image; its reference works on any node."""
        kw = {} if max_bytes is None else {"max_bytes": max_bytes}
        return self._rt.snapshot_filesystem(sandbox_id, scope=self.node_id, **kw).ref

    def fs_image_stream(self, image_id: str) -> Iterator[bytes]:
        """A filesystem image taken here, as a tar of its OCI layout (for another node)."""
        path = fs_image.layout(self.node_id, image_id, self._rt.home)
        if not path.is_dir():
            raise ImageNotFoundError(f"no filesystem image {image_id} on node {self.node_id}")
        yield from rechunk(archive.pack_local(path))

    def delete_filesystem_image(self, ref: str) -> None:
        self._stock.forget_image(ref)
        self._rt.delete_filesystem_image(ref)

    def filesystem_image_in_use(self, ref: str) -> bool:
        """Whether a caller's sandbox runs from it: the stock's own copies give way."""
        self._stock.forget_image(ref)
        return self._rt.filesystem_image_in_use(ref)

    def snapshot_stream(self, snapshot_id: str) -> Iterator[bytes]:
        """The snapshot's files as a tar stream (for a restore on another node)."""
        yield from self._rt.snapshots.export(snapshot_id)

    def delete_snapshot(self, snapshot_id: str) -> None:
        self._rt.snapshots.delete(snapshot_id)

    def suspend(self, sandbox_id: str) -> Snapshot:
        """Checkpoint to disk, delete the sandbox, release its reservation. The snapshot
        outlives this host process (detached) until the sandbox is resumed or deleted."""
        rec = self._rt.record(sandbox_id)
        labels = {SUSPENDED_LABEL: sandbox_id}
        name = rec.config.get("labels", {}).get(NAME_LABEL)
        if name:
            labels[NAME_LABEL] = name
        with self._lock:
            if sandbox_id not in self._jobs:  # no owning job: it comes back detached
                labels[DETACHED_LABEL] = "1"
        snap = self.snapshot(sandbox_id, labels=labels, detach=True)
        self.delete(sandbox_id)
        return snap

    def find_suspended(self, key: str) -> Snapshot | None:
        """The suspension snapshot of the sandbox with this id or name, if on this node."""
        for snap in self._rt.snapshots.list():
            lbl = snap.labels
            if SUSPENDED_LABEL in lbl and key in (lbl[SUSPENDED_LABEL], lbl.get(NAME_LABEL)):
                return snap
        return None

    def list(self, labels: dict[str, str] | None = None) -> list[tuple[str, dict[str, str]]]:
        out = []
        stocked = self._stock.ids()
        for sid in self._rt.list(labels=labels):
            if sid in stocked:
                continue
            try:
                out.append((sid, self._rt.record(sid).config.get("labels", {})))
            except SandboxError:
                continue
        return out

    def config(self, sandbox_id: str) -> SandboxConfig:
        """The sandbox's config as its caller gave it: our own labels taken out."""
        cfg = self._rt.record(sandbox_id).sandbox_config
        return cfg.model_copy(update={"labels": {k: v for k, v in cfg.labels.items()
                                                 if not k.startswith("ray-sandbox/")}})

    # --- the verbs of the table (runtime/verbs.py), dispatched generically ------------------

    def call(self, verb: str, sandbox_id: str, request: Request) -> Any:
        """Any verb of the table that answers once: the runtime's method, or this host's
        own version of it (``_OWN``) where the host adds something."""
        row = verbs.verb(verb)
        if row.streams:
            raise ConfigError(f"{verb} streams: call it through stream()")
        own = _OWN.get(verb)
        if own is not None:
            return own(self, sandbox_id, row.request.of((request,)))
        return getattr(self._rt, row.method)(sandbox_id, row.request.of((request,)))

    def stream(self, verb: str, sandbox_id: str, request: Request) -> Iterator[Any]:
        """A verb of the table that streams (a Ray streaming generator)."""
        row = verbs.verb(verb)
        if not row.streams:
            raise ConfigError(f"{verb} does not stream: call it through call()")
        yield from getattr(self._rt, row.method)(sandbox_id, row.request.of((request,)))

    def _exec(self, sandbox_id: str, request: ExecRequest) -> ExecResult:
        t0 = time.perf_counter()
        res = self._rt.exec(sandbox_id, request)
        metrics.observe_exec(time.perf_counter() - t0)
        return res

    def _spawn(self, sandbox_id: str, request: SpawnRequest) -> tuple[str, int]:
        """The process stays here; callers drive it by its key (:meth:`process`)."""
        proc = self._rt.spawn(sandbox_id, request)
        key = f"{sandbox_id}:{proc.pid}"
        with self._lock:
            self._procs[key] = proc
        return key, proc.pid

    def _status(self, sandbox_id: str, request: NoRequest) -> SandboxStatus:
        with self._lock:
            live = sandbox_id in self._pgs
        if not live and self.find_suspended(sandbox_id) is not None:
            return SandboxStatus(sandbox_id=sandbox_id, state=SandboxState.SUSPENDED)
        return self._rt.get_status(sandbox_id, request)

    def _resume(self, sandbox_id: str, request: NoRequest) -> None:
        if self.find_suspended(sandbox_id) is not None:
            raise SandboxStateError(
                "sandbox is suspended: bring it back with ray_sandbox.resume(name or handle)",
                sandbox_id=sandbox_id,
            )
        self._rt.resume(sandbox_id, request)

    def _link(self, sandbox_id: str, request: LinkRequest) -> SandboxLink:
        try:
            return self._rt.link(sandbox_id, request)
        except SandboxNotFoundError as exc:
            if exc.sandbox_id != request.to:
                raise
            raise SandboxNotFoundError(f"{exc.message} on the node of {sandbox_id} (links join "
                                       "sandboxes on one node)", sandbox_id=request.to) from None

    def process(self, key: str, op: str, *args: Any, **kw: Any) -> Any:
        """Drive a spawned process by its key: one of ``AgentProcess.OPS``."""
        with self._lock:
            proc = self._procs.get(key)
        if proc is None:
            raise SandboxNotFoundError(f"no such process {key}")
        if op not in AgentProcess.OPS:
            raise ConfigError(f"unknown process operation {op!r}; one of "
                              f"{', '.join(AgentProcess.OPS)}")
        result = getattr(proc, op)(*args, **kw)
        if op == "close":
            with self._lock:
                self._procs.pop(key, None)
        return result

    def processes(self, sandbox_id: str) -> list[tuple[str, int]]:
        with self._lock:
            return [(k, p.pid) for k, p in self._procs.items() if k.startswith(sandbox_id)]

    # --- transfers -------------------------------------------------------------------------

    def write_from_refs(self, sandbox_id: str, path: str, refs: list[ray.ObjectRef],
                        mode: int) -> None:
        """Write a file whose bytes arrive as object refs (fetched one at a time)."""
        self._rt.write_file(sandbox_id, path, fetch(refs), mode=mode)

    def put_archive_from_refs(self, sandbox_id: str, remote_dir: str,
                              refs: list[ray.ObjectRef]) -> None:
        self._rt.put_archive(sandbox_id, remote_dir, fetch(refs))

    def read_stream(self, sandbox_id: str, path: str,
                    max_bytes: int | None = None) -> Iterator[bytes]:
        """The file in ~4 MiB objects; bounded here too, since Ray runs a streaming
        generator to its end whether or not the caller still reads."""
        yield from rechunk(self._rt.iter_read(sandbox_id, path, max_bytes=max_bytes))

    def archive_stream(self, sandbox_id: str, remote_dir: str) -> Iterator[bytes]:
        yield from rechunk(self._rt.get_archive(sandbox_id, remote_dir))


# Where this host adds to a verb (metrics, the processes it keeps, a suspended sandbox's
# status, a clearer error), its own method answers instead of the runtime's.
_OWN: dict[str, Callable[..., Any]] = {
    "exec": SandboxHost._exec, "spawn": SandboxHost._spawn, "status": SandboxHost._status,
    "resume": SandboxHost._resume, "link": SandboxHost._link,
}

# Each kind of call has threads of its own, so no kind can take them all (docs/scale.md,
# "A host's threads"): commands and file transfers, which last as long as the sandbox's
# code wants, run in "work"; creates and copies, which wait for boots and image pulls, in
# "create"; everything else (status, list, delete, links, ...) keeps the default group's
# threads: 1,088 sleeping execs in 17 sandboxes wedged every caller of the node for ~30 s
# while all calls shared one pool of 1,024.
# The table's verbs name their group at the call (``call.options(concurrency_group=...)``).
WORK_METHODS = ("stream", "process", "write_from_refs", "put_archive_from_refs",
                "read_stream", "archive_stream", "snapshot", "snapshot_filesystem",
                "snapshot_stream", "fs_image_stream")
CREATE_METHODS = ("create", "create_many", "restore", "suspend")
for _name in WORK_METHODS:
    setattr(SandboxHost, _name, ray.method(concurrency_group="work")(getattr(SandboxHost, _name)))
for _name in CREATE_METHODS:
    setattr(SandboxHost, _name,
            ray.method(concurrency_group="create")(getattr(SandboxHost, _name)))


@functools.cache
def _remote_host(work: int, create: int, control: int) -> Any:
    # concurrency groups are declared with the class (Ray takes no groups in .options())
    return ray.remote(concurrency_groups={"work": work, "create": create, "control": control})(
        SandboxHost)


def host_threads() -> tuple[int, int, int]:
    """Threads of the work, create and default groups (``RAY_SANDBOX_HOST_WORK_THREADS``,
    ``..._CREATE_THREADS``, ``..._CONTROL_THREADS``)."""
    return (int(_number_env("RAY_SANDBOX_HOST_WORK_THREADS", 960)),
            int(_number_env("RAY_SANDBOX_HOST_CREATE_THREADS", 64)),
            int(_number_env("RAY_SANDBOX_HOST_CONTROL_THREADS", 64)))


def start_host(node_id: str, home: str | None = None) -> Any:
    """The host actor of ``node_id``, started there if it does not exist yet."""
    work, create, control = host_threads()
    return _remote_host(work, create, control).options(
        name=HOST_PREFIX + node_id,
        namespace=NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        num_cpus=0,
        max_concurrency=control,
        max_restarts=-1,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        # every call would send a task event to the GCS: at 100k sandboxes the GCS's main
        # per-sandbox cost once blocks removed placement groups (benchmarks/bench_blocks.py)
        enable_task_events=False,
    ).remote(home)


__all__ = ["SandboxHost", "start_host"]
