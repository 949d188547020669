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

The actor's surface is every call a handle, the service or another node makes of this node.
The sandbox's verbs are not written here: ``call``/``stream`` dispatch any row of the verb
table (runtime/verbs.py) to the runtime, or to this module's function for the few verbs the
host adds to (``_OWN``). What runs here is kept in ``residents``, how sandboxes come up in
``boots``, the suspension calls in ``suspend`` (``SleepCalls``, which this class inherits),
and blocks, stock, copies, transfers and the channel in their own modules.
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
    ImageNotFoundError,
    SandboxCreationError,
    SandboxError,
    SandboxNotFoundError,
)
from ..runtime.results import ExecResult, SandboxLink
from ..runtime.snapshot import Snapshot, SnapshotDir
from ..runtime.verbs import ExecRequest, LinkRequest, Request, SpawnRequest, Verb
from . import metrics
from .blocks import Block, Blocks, Shape, sweep_dead_nodes
from .boots import BOOT_PARALLEL, Boots
from .channel import ChannelServer
from .labels import (
    HOST_PREFIX,
    NAME_LABEL,
    NAMESPACE,
    OWNER_ACTOR_LABEL,
)
from .placement import PG_LABEL, bundle_label, pg_gone, release_reaped
from .residents import Residents
from .stock import Stock
from .suspend import Sleep, SleepCalls
from .transfer import ImageImports, SnapshotImports, fetch, rechunk

_WATCH_INTERVAL = 1.0

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


class SandboxHost(SleepCalls):
    """The per-node actor: the runtime's verbs for every sandbox of its node (``call``,
    ``stream``: runtime/verbs.py), creates and copies under Ray's reservations, and the
    transfers that cross nodes through the object store. Its suspension calls (suspend,
    wake, take_over, find_suspended, suspended) are written in suspend.py (``SleepCalls``)."""

    def __init__(self, home: str | None = None) -> None:
        self.node_id = ray.get_runtime_context().get_node_id()
        self._rt = SandboxRuntime(home, reap=False)
        self._imports = SnapshotImports(self._rt, self.node_id)
        self._idle_since = time.monotonic()
        self._idle_limit = _number_env("RAY_SANDBOX_HOST_IDLE_S", 60.0)
        self._blocks = Blocks(self.node_id, Path(self._rt.home) / "blocks",
                              idle_s=_number_env("RAY_SANDBOX_BLOCK_IDLE_S", 10.0))
        self._here = Residents(self.node_id, self._blocks)
        release_reaped(self._rt)  # a restarted host: the dead incarnation's sandboxes
        self._stock = Stock(
            self._rt, self._blocks, self.node_id, busy=self._here.creating,
            per_shape=int(_number_env("RAY_SANDBOX_STOCK_PER_SHAPE", 8)),
            total=int(_number_env("RAY_SANDBOX_STOCK_MAX", 32)),
            idle_s=_number_env("RAY_SANDBOX_STOCK_IDLE_S", 30.0),
            share=_number_env("RAY_SANDBOX_STOCK_SHARE", 0.25))
        self._boots = Boots(self._rt, self._blocks, self._stock,
                            ImageImports(self._rt.home, self.node_id), start_host)
        # the sandboxes a previous incarnation suspended are this one's (gc kept them)
        self._sleep = Sleep(self._rt, self._here, self._blocks, self._boots, self.node_id,
                            start_host, self.restore)
        self._channel = ChannelServer.start(Path(self._rt.home) / "host.sock", self.call)
        threading.Thread(target=_watch, args=(self,), name="ray-sandbox-pg-watch",
                         daemon=True).start()

    def ping(self) -> str:
        return self.node_id

    def channel(self) -> tuple[str, str | None, bytes | None]:
        """This host's node, where callers on that node reach :meth:`call` without an actor
        call and the token they need (``channel.py``); (node, None, None) without one."""
        if self._channel is None or self._here.retiring:
            return self.node_id, None, None
        return self.node_id, str(self._channel.path), self._channel.token

    def stock(self) -> dict[str, int]:
        """The stock's hits, misses, stocked sandboxes and target (``stock.py``)."""
        return self._stock.stats()

    def blocks(self, give_back_empty: bool = False) -> list[Block]:
        """This host's blocks: placement group, shape, size, slots used; with
        ``give_back_empty``, empty ones are given back to Ray first (a create of another
        shape is waiting for room that idle blocks hold)."""
        if give_back_empty:
            self._blocks.shrink(idle_s=0.0)
        return self._blocks.reserved()

    # --- lifecycle -------------------------------------------------------------------------

    def create(self, config: SandboxConfig, pg_hex: str, name: str | None,
               detached: bool, owner_job: str | None = None) -> str:
        """A sandbox under the caller's own reservation ``pg_hex`` (one that waited for room
        as pending Ray demand); the reservation is removed when the sandbox ends."""
        return self._here.start(pg_hex, None if detached else owner_job,
                                lambda: self._boots.boot(config, pg_hex, name), name,
                                config.labels.get(OWNER_ACTOR_LABEL))

    def create_many(self, config: SandboxConfig, bundle: Mapping[str, float], k: int,
                    detached: bool, owner_job: str | None = None, name: str | None = None,
                    ) -> tuple[list[str | SandboxError], dict[Shape, int]]:
        """Up to ``k`` sandboxes in this node's blocks, booted in parallel. Returns each one's
        id or error, in order (CapacityError for those the node has no room for), and the
        free slots this host advertises afterwards."""
        self._here.check_open()
        stocked: list[tuple[str, str]] = []
        while len(stocked) < k and (got := self._stock.take(config, bundle)) is not None:
            stocked.append(got)
        slots = self._boots.slots(bundle, k - len(stocked))
        job = None if detached else owner_job

        def one(item: tuple[str | None, str]) -> str | SandboxError:
            sid, pg_hex = item
            try:
                return self._here.start(
                    pg_hex, job, lambda: self._boots.hand_out(sid, config, pg_hex, name)
                    if sid else self._boots.boot(config, pg_hex, name), name,
                    config.labels.get(OWNER_ACTOR_LABEL))
            except SandboxError as exc:
                return exc
            except Exception as exc:  # noqa: BLE001 - reported with the others, not raised
                return SandboxCreationError(f"{type(exc).__name__}: {exc}")

        items = stocked + [(None, pg_hex) for pg_hex in slots]
        results: list[str | SandboxError] = [one(items[0])] if len(items) == 1 else []
        if len(items) > 1:  # a thread per call costs a single create ~0.2 ms for nothing
            with ThreadPoolExecutor(max_workers=min(len(items), BOOT_PARALLEL)) as ex:
                results = list(ex.map(one, items))
        missing = k - len(items)
        results += [CapacityError(f"node {self.node_id} had room for {len(items)} of {k}")
                    ] * missing
        return results, self._boots.advertised()

    def delete(self, sandbox_id: str) -> None:
        """End the sandbox (running or suspended here, or forwarded to the node it moved
        to) and give its name back. A suspend or resume under way is waited for."""
        with self._here.inside(sandbox_id, None) as moved:
            if moved is not None:
                self._sleep.forward(sandbox_id, moved,
                                    lambda h: h.delete.remote(sandbox_id))
                self._here.drop_moved(sandbox_id)
                return
            try:
                if self._rt.oom_killed(sandbox_id):  # its cgroup goes with the delete
                    metrics.count_oom()
                self._rt.delete(sandbox_id)
            finally:
                self._here.forget(sandbox_id)

    def shutdown(self, timeout: float = 60.0) -> int:
        """Delete every sandbox on this host, including ones whose create was in flight
        (used by ``ray_sandbox.shutdown``); later creates are refused."""
        ids = self._here.close_when_idle(timeout)
        with self._here.lock:
            ids += list(self._here.asleep)
            self._here.moved.clear()  # their new hosts are shut down too
        for sid in ids:
            try:
                self.delete(sid)
            except SandboxError:
                pass
        self._sleep.close()
        self._stock.close()
        self._rt.close()  # waits for the background teardowns of the deletes above
        self._blocks.release_all()
        return len(ids)

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
        with self._here.lock:
            moved = self._here.moved.get(sandbox_id)
        if moved is not None:
            return self._sleep.forward(sandbox_id, moved, lambda h: h.config.remote(sandbox_id))
        cfg = self._rt.record(sandbox_id).sandbox_config
        return cfg.model_copy(update={"labels": {k: v for k, v in cfg.labels.items()
                                                 if not k.startswith("ray-sandbox/")}})

    # --- snapshots, copies, filesystem images (suspension: suspend.SleepCalls) -------------

    def snapshot(self, sandbox_id: str, labels: dict[str, str] | None = None,
                 detach: bool = False) -> Snapshot:
        """A snapshot on this node, labelled with the sandbox's Ray reservation so copies
        reserve the same. Owned by this host unless ``detach``. A suspended sandbox is
        resumed first; one that moved is snapshotted on its node."""
        with self._here.inside(sandbox_id, self._sleep.wake) as moved:
            if moved is not None:
                return self._sleep.forward(sandbox_id, moved, lambda h: h.snapshot.remote(
                    sandbox_id, labels, detach))
            with self._here.lock:
                pg_hex = self._here.pgs.get(sandbox_id)
            extra = {**(labels or {}),
                     **(bundle_label(pg_hex, self._blocks.shape(pg_hex)) if pg_hex else {})}
            snap = self._rt.snapshot(sandbox_id, labels=extra, detach=detach)
            snap = snap.model_copy(update={"node_id": self.node_id})
            SnapshotDir(self._rt.snapshots_dir / snap.snapshot_id).write(snap)
            return snap

    def restore(self, snapshot: Snapshot, pg_hex: str, name: str | None = None,
                sandbox_id: str | None = None, owner_job: str | None = None,
                owner_actor: str | None = None) -> str:
        """One copy of ``snapshot`` under the reservation ``pg_hex`` (fetched from the node
        that holds it first, if that is another node); under ``sandbox_id``, its source's
        own id, it is the source moved here (a resume on another node)."""

        def start() -> str:
            self._imports.ensure_local(snapshot, start_host)
            labels = {k: v for k, v in snapshot.config.get("labels", {}).items()
                      if k not in (PG_LABEL, NAME_LABEL)}
            labels[PG_LABEL] = pg_hex
            if name:
                labels[NAME_LABEL] = name
            ids = [sandbox_id] if sandbox_id else None
            return self._rt.restore(snapshot, 1, labels=labels, sandbox_ids=ids)[0]

        return self._here.start(pg_hex, owner_job, start, name, owner_actor)

    def delete_snapshot(self, snapshot_id: str) -> None:
        self._rt.snapshots.delete(snapshot_id)

    def snapshot_filesystem(self, sandbox_id: str, max_bytes: int | None = None) -> str:
        """The sandbox's files as an image; its reference works on any node."""
        kw = {} if max_bytes is None else {"max_bytes": max_bytes}
        with self._here.inside(sandbox_id, self._sleep.wake) as moved:
            if moved is not None:
                return self._sleep.forward(sandbox_id, moved, lambda h: h.snapshot_filesystem
                                           .remote(sandbox_id, max_bytes))
            return self._rt.snapshot_filesystem(sandbox_id, scope=self.node_id, **kw).ref

    def delete_filesystem_image(self, ref: str) -> None:
        self._stock.forget_image(ref)
        self._rt.delete_filesystem_image(ref)

    def filesystem_image_in_use(self, ref: str) -> bool:
        """Whether a caller's sandbox runs from it: the stock's own copies give way."""
        self._stock.forget_image(ref)
        return self._rt.filesystem_image_in_use(ref)

    # --- the verbs of the table (runtime/verbs.py), dispatched generically ------------------

    def call(self, verb: str, sandbox_id: str, request: Request) -> Any:
        """Any verb of the table that answers once: the runtime's method, or this host's
        own version of it (``_OWN``) where the host adds something. Every verb but
        ``status`` resumes a suspended sandbox first (the caller sees only the latency);
        one that moved to another node is called there."""
        row = verbs.verb(verb)
        if row.streams:
            raise ConfigError(f"{verb} streams: call it through stream()")
        req = row.request.of((request,))
        with self._here.lock:
            woken = verb == "resume" and sandbox_id in self._here.asleep
        with self._here.inside(sandbox_id, None if verb == "status" else self._sleep.wake
                               ) as moved:
            if moved is not None:
                return self._sleep.forward(sandbox_id, moved, lambda h: h.call.options(
                    concurrency_group=row.group).remote(verb, sandbox_id, req))
            if woken:  # resume of a suspended sandbox: the gate brought it back
                return None
            own = _OWN.get(verb)
            if own is not None:
                return own(self, sandbox_id, req)
            return getattr(self._rt, row.method)(sandbox_id, req)

    def stream(self, verb: str, sandbox_id: str, request: Request) -> Iterator[Any]:
        """A verb of the table that streams (a Ray streaming generator)."""
        row = verbs.verb(verb)
        if not row.streams:
            raise ConfigError(f"{verb} does not stream: call it through call()")
        req = row.request.of((request,))
        with self._here.inside(sandbox_id, self._sleep.wake) as moved:
            if moved is not None:
                yield from self._sleep.forward_stream(moved, lambda h: _stream_of(
                    h.stream, row, verb, sandbox_id, req))
                return
            yield from getattr(self._rt, row.method)(sandbox_id, req)

    def process(self, key: str, op: str, *args: Any, **kw: Any) -> Any:
        """Drive a spawned process by its key: one of ``AgentProcess.OPS``."""
        sandbox_id = key.partition(":")[0]
        with self._here.lock:
            moved = self._here.moved.get(sandbox_id)
        if moved is not None:
            return self._sleep.forward(sandbox_id, moved, lambda h: h.process.remote(
                key, op, *args, **kw))
        with self._here.lock:
            proc = self._here.procs.get(key)
        if proc is None:
            raise SandboxNotFoundError(f"no such process {key}")
        if op not in AgentProcess.OPS:
            raise ConfigError(f"unknown process operation {op!r}; one of "
                              f"{', '.join(AgentProcess.OPS)}")
        result = getattr(proc, op)(*args, **kw)
        if op == "close":
            with self._here.lock:
                self._here.procs.pop(key, None)
        return result

    def processes(self, sandbox_id: str) -> list[tuple[str, int]]:
        with self._here.lock:
            moved = self._here.moved.get(sandbox_id)
            if moved is None:
                return [(k, p.pid) for k, p in self._here.procs.items()
                        if k.startswith(sandbox_id + ":")]
        return self._sleep.forward(sandbox_id, moved,
                                   lambda h: h.processes.remote(sandbox_id))

    # --- transfers through the object store (actor/transfer.py) ----------------------------

    def read_out(self, kind: str, key: str, arg: Any = None) -> Iterator[bytes]:
        """Bytes for another process or node, in ~4 MiB objects: a sandbox's ``file`` (key
        = sandbox id, arg = ``(path, max_bytes)``: bounded here too, since Ray runs a
        streaming generator to its end whether or not the caller still reads) or
        ``archive`` (arg = its directory); a ``snapshot`` taken here (key = its id) or a
        ``fs_image`` (key = its id), as tars."""
        if kind in ("file", "archive"):
            with self._here.inside(key, self._sleep.wake) as moved:
                if moved is not None:
                    yield from self._sleep.forward_stream(moved, lambda h: h.read_out.options(
                        num_returns="streaming").remote(kind, key, arg))
                elif kind == "file":
                    path, max_bytes = arg
                    yield from rechunk(self._rt.iter_read(key, path, max_bytes=max_bytes))
                else:
                    yield from rechunk(self._rt.get_archive(key, arg))
        elif kind == "snapshot":
            yield from self._rt.snapshots.export(key)
        elif kind == "fs_image":
            path = fs_image.layout(self.node_id, key, self._rt.home)
            if not path.is_dir():
                raise ImageNotFoundError(f"no filesystem image {key} on node {self.node_id}")
            yield from rechunk(archive.pack_local(path))
        else:
            raise ConfigError(f"nothing to read out of kind {kind!r}")

    def write_in(self, kind: str, sandbox_id: str, path: str, refs: list[ray.ObjectRef],
                 mode: int = 0o644) -> None:
        """Bytes that arrive as object refs (fetched one at a time) into the sandbox: a
        ``file`` at ``path`` with ``mode``, or an ``archive`` unpacked in ``path``."""
        if kind not in ("file", "archive"):
            raise ConfigError(f"nothing to write in of kind {kind!r}")
        with self._here.inside(sandbox_id, self._sleep.wake) as moved:
            if moved is not None:
                self._sleep.forward(sandbox_id, moved, lambda h: h.write_in.remote(
                    kind, sandbox_id, path, refs, mode))
            elif kind == "file":
                self._rt.write_file(sandbox_id, path, fetch(refs), mode=mode)
            else:
                self._rt.put_archive(sandbox_id, path, fetch(refs))


# --- where this host adds to a verb, and its watch loop: functions of the host ------------


def _exec(host: SandboxHost, sandbox_id: str, request: ExecRequest) -> ExecResult:
    t0 = time.perf_counter()
    res = host._rt.exec(sandbox_id, request)
    metrics.observe_exec(time.perf_counter() - t0)
    return res


def _spawn(host: SandboxHost, sandbox_id: str, request: SpawnRequest) -> tuple[str, int]:
    """The process stays here; callers drive it by its key (``SandboxHost.process``)."""
    proc = host._rt.spawn(sandbox_id, request)
    key = f"{sandbox_id}:{proc.pid}"
    with host._here.lock:
        host._here.procs[key] = proc
    return key, proc.pid


def _stream_of(method: Any, row: Verb, verb: str, sandbox_id: str, req: Request) -> Any:
    return method.options(num_returns="streaming", concurrency_group=row.group).remote(
        verb, sandbox_id, req)


def _link(host: SandboxHost, sandbox_id: str, request: LinkRequest) -> SandboxLink:
    try:
        return host._rt.link(sandbox_id, request)
    except SandboxNotFoundError as exc:
        if exc.sandbox_id != request.to:
            raise
        raise SandboxNotFoundError(f"{exc.message} on the node of {sandbox_id} (links join "
                                   "sandboxes on one node)", sandbox_id=request.to) from None


# Where this host adds to a verb (metrics, the processes it keeps, a clearer error), its own
# function answers instead of the runtime's method.
_OWN: dict[str, Callable[..., Any]] = {"exec": _exec, "spawn": _spawn, "link": _link}


def _watch(host: SandboxHost) -> None:
    """Ends sandboxes whose owner is gone and gives back idle blocks. Each second: one
    job-table read for all of this node's sandboxes (a job's sandboxes die with it).
    Every ``RAY_SANDBOX_PG_SWEEP_S`` seconds (60): each distinct reservation (removed
    by hand, or a detached owner's) and the blocks of dead nodes. One GCS call per
    sandbox per second would saturate the GCS at ~6-7k sandboxes (docs/scale.md)."""
    here = host._here
    every = _sweep_interval()
    next_sweep = time.monotonic() + every
    while True:
        time.sleep(_WATCH_INTERVAL)
        with here.lock:
            items = list(here.pgs.items())
            jobs = dict(here.jobs)
            actors = dict(here.actors)
            asleep = dict(here.asleep)  # suspended: owned by their job and actor still
        jobs.update({sid: a.job for sid, a in asleep.items() if a.job})
        actors.update({sid: a.actor for sid, a in asleep.items() if a.actor})
        live = set(host._rt.list())
        dead_jobs = _dead_jobs() if jobs else set()
        dead_actors = {a for a in set(actors.values()) if _actor_dead(a)}
        gone: set[str] = set()
        if time.monotonic() >= next_sweep:
            next_sweep = time.monotonic() + every
            gone = {pg for pg in {pg for _, pg in items} if pg_gone(pg)}
            sweep_dead_nodes()
            host._sleep.sweep_moved()
        if _retire_if_idle(host):
            return
        host._blocks.shrink()
        for sid, pg_hex in [*items, *((sid, None) for sid in asleep)]:
            if sid not in live:  # ended by its TTL or idle timeout
                here.forget(sid)
            elif jobs.get(sid) in dead_jobs or pg_hex in gone or \
                    actors.get(sid) in dead_actors:
                log.info("the owner of %s is gone; deleting the sandbox", sid)
                try:
                    host.delete(sid)
                except SandboxError:
                    pass
        for pg_hex in gone:  # a block removed by hand: its sandboxes went above
            if host._blocks.owns(pg_hex):
                host._blocks.drop(pg_hex)


def _actor_dead(actor_id: str) -> bool:
    """Whether the proxy actor of a sandbox (``Sandbox.remote``) is dead for good: killed,
    or its job ended (one GCS read; proxies are few, each a worker process)."""
    try:
        info = ray._private.state.actors(actor_id)
    except Exception:  # noqa: BLE001 - GCS hiccup: alive this round
        return False
    return bool(info) and info.get("State") == "DEAD"


def _retire_if_idle(host: SandboxHost) -> bool:
    """Leave once idle for the idle limit, so the node can be scaled down."""
    here = host._here
    busy = here.busy()
    if not busy:
        me = os.getpid()
        busy = any(snap.owner_pid == me for snap in host._rt.snapshots.list())
    now = time.monotonic()
    if busy:
        host._idle_since = now
        return False
    if now - host._idle_since < host._idle_limit:
        return False
    with here.lock:
        if here.pgs or here.inflight:  # a create got in meanwhile
            host._idle_since = now
            return False
        here.retiring = True
    if host._channel is not None:
        host._channel.close()
    host._stock.close()
    host._sleep.close()
    host._rt.close()  # the stock's deletes and every other teardown finish first
    host._blocks.release_all()
    log.info("idle for %.0fs: the sandbox host on %s retires", host._idle_limit, host.node_id)
    ray.get_runtime_context().current_actor.__ray_terminate__.remote()
    return True


# Each kind of call has threads of its own, so no kind can take them all (docs/scale.md,
# "A host's threads"): commands and file transfers, which last as long as the sandbox's
# code wants, run in "work"; creates and copies, which wait for boots and image pulls, in
# "create"; everything else (status, list, delete, links, ...) keeps the default group's
# threads: 1,088 sleeping execs in 17 sandboxes wedged every caller of the node for ~30 s
# while all calls shared one pool of 1,024.
# The table's verbs name their group at the call (``call.options(concurrency_group=...)``).
WORK_METHODS = ("stream", "process", "read_out", "write_in", "snapshot",
                "snapshot_filesystem")
CREATE_METHODS = ("create", "create_many", "restore", "suspend", "wake", "take_over")
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
