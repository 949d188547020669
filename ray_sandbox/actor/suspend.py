"""How one host suspends its sandboxes and brings them back (docs/snapshots.md, "Idle
suspend"): the runtime suspends in place (runtime/suspension.py) and this module adds Ray:
the reservation given back at a suspend and taken again at a resume, on this node when it
has room, else on another node, where the sandbox moves; the node's disk budget for
suspended state; and the threads idle suspends run on, so that no caller waits for one.

A move: the suspended sandbox's files become a snapshot here (hard links to its checkpoint),
the other node's host restores it under the same id and name, and what it left here is torn
down; this host forwards the calls that still reach it (``Residents.moved``).

With ``RAY_SANDBOX_SUSPEND_DIR`` (a path every node mounts) a suspended sandbox's state is a
complete snapshot there plus a note (``ray.json``: its node, reservation, owner, name), so
that when its node is gone the host of another node can take it over (:meth:`take_over`,
``ray_sandbox.resume``): it renames the directory away (one taker wins), restores the
sandbox under its id and name, and a node that comes back removes what it had of it."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ray

from ..runtime import SandboxRuntime, checkpoint, procfs
from ..runtime.config import UNLIMITED, parse_size
from ..runtime.errors import (
    CapacityError,
    ConfigError,
    ResumeError,
    SandboxError,
    SandboxNotFoundError,
    SandboxStateError,
)
from ..runtime.records import ID_RE
from ..runtime.results import SandboxState, SandboxStatus
from ..runtime.snapshot import SnapshotDir, pack
from ..runtime.verbs import NoRequest
from . import metrics
from .blocks import Blocks
from .boots import Boots
from .placement import PG_LABEL, bundle_label, node_alive, remove_pg, reserve
from .residents import Asleep, Residents
from .template import SandboxTemplate
from .volumes import volume_node

SUSPEND_PARALLEL = 4  # idle suspends at once on one host (each ~50-100 ms of runsc)
_DRAIN_S = 30.0  # an asked-for suspend waits this long for the calls inside to end
NOTE = "ray.json"  # beside a shared snapshot: the Ray side of the suspended sandbox
_NOTE_MAX = 64 * 1024
_SHARED_SCAN_MAX = 100_000  # entries of the shared path one take-over looks at

log = logging.getLogger(__name__)


def disk_budget(home: Path) -> int | None:
    """Bytes the node's suspended sandboxes may take: ``RAY_SANDBOX_SUSPEND_DISK`` (a size,
    ``"N%"`` of the home's filesystem, or ``"unlimited"``; default ``"25%"``)."""
    raw = os.environ.get("RAY_SANDBOX_SUSPEND_DISK", "25%").strip()
    try:
        if raw == UNLIMITED:
            return None
        if raw.endswith("%"):
            share = float(raw[:-1]) / 100
            if not 0 < share <= 1:
                raise ValueError(raw)
            return int(shutil.disk_usage(home).total * share)
        return parse_size(raw)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"RAY_SANDBOX_SUSPEND_DISK={raw!r}: a size, 'N%' or 'unlimited' "
                          f"({exc})") from None


def resume_timeout() -> float:
    """How long a call into a suspended sandbox waits for room to resume it anywhere
    (``RAY_SANDBOX_RESUME_TIMEOUT_S``, default 60); then CapacityError, the state kept."""
    try:
        return float(os.environ.get("RAY_SANDBOX_RESUME_TIMEOUT_S", 60.0))
    except ValueError:
        return 60.0


class Sleep:
    """The suspend side of one host."""

    def __init__(self, rt: SandboxRuntime, here: Residents, blocks: Blocks, boots: Boots,
                 node_id: str, start_host: Callable[..., Any],
                 restore: Callable[..., str]) -> None:
        self._rt = rt
        self._restore = restore  # the host's: a copy of a snapshot under a reservation
        self._here = here
        self._blocks = blocks
        self._boots = boots
        self.node_id = node_id
        self._start_host = start_host
        self.budget = disk_budget(rt.home)
        self._pledged = 0  # bytes of suspends under way (the budget counts them already)
        self._lock = threading.Lock()
        self._queued: set[str] = set()
        # what this host did since it started (the metrics say the same, cluster-wide)
        self.counts = {"suspends": 0, "refused": 0, "resumes": 0, "moves": 0}
        self._pool = ThreadPoolExecutor(max_workers=SUSPEND_PARALLEL,
                                        thread_name_prefix="ray-sandbox-suspend")
        here.load(Path(rt.home) / "asleep", rt.suspensions.adopt(), self._config_bundle)
        rt.suspensions.idle = self.idle
        rt.suspensions.auto_resume = False  # a resume takes a reservation first: wake()

    def _config_bundle(self, sandbox_id: str) -> dict[str, float]:
        return SandboxTemplate(config=self._rt.record(sandbox_id).sandbox_config).bundle

    # --- suspend --------------------------------------------------------------------------

    def idle(self, sandbox_id: str) -> bool:
        """``idle_suspend_seconds`` passed: suspend the sandbox in this host's threads (the
        runtime's timer thread must not wait on runsc). A suspend that is refused (in use
        meanwhile, past the disk budget) has the runtime look again later."""
        with self._lock:
            if sandbox_id in self._queued:
                return True
            self._queued.add(sandbox_id)
        self._pool.submit(self._idle_suspend, sandbox_id)
        return True

    def _idle_suspend(self, sandbox_id: str) -> None:
        try:
            done = self.suspend(sandbox_id, reason="Idle", strict=False)
        except Exception:  # noqa: BLE001 - logged; the sandbox runs on, looked at later
            log.exception("idle suspend of %s failed", sandbox_id)
            done = False
        finally:
            with self._lock:
                self._queued.discard(sandbox_id)
        if not done:
            self._rt.suspensions.watch_idle(sandbox_id)

    def suspend(self, sandbox_id: str, *, reason: str, strict: bool) -> bool:
        """Suspend a sandbox running here and give its reservation back. ``strict`` (asked
        for): wait up to 30 s for the calls inside, and raise when it cannot be
        (SandboxStateError in use, CapacityError past the disk budget); else False."""
        tag = "idle" if reason == "Idle" else "asked"
        turn = self._here.begin_suspend(sandbox_id, _DRAIN_S if strict else 0.0)
        if turn is None:
            metrics.count_suspend(tag, "refused")
            self._count("refused")
            if strict:
                raise SandboxStateError("the sandbox is not running on this node, or calls "
                                        "are still inside it", sandbox_id=sandbox_id)
            return False
        pledge = 0
        try:
            pledge = self._pledge(sandbox_id)
            if pledge < 0:
                metrics.count_suspend(tag, "refused")
                self._count("refused")
                if strict:
                    raise CapacityError(f"the node's disk budget for suspended sandboxes "
                                        f"({self.budget} bytes) is used up",
                                        sandbox_id=sandbox_id)
                log.info("sandbox %s stays running: the node's disk budget for suspended "
                         "sandboxes is used up", sandbox_id)
                return False
            with self._here.lock:
                pg_hex = self._here.pgs[sandbox_id]
            bundle = self._bundle(pg_hex)
            t0 = time.perf_counter()
            try:
                state = self._rt.suspensions.suspend(
                    sandbox_id, reason=reason, drain_timeout=_DRAIN_S if strict else 0.0,
                    labels={PG_LABEL: None})
            except SandboxError:
                metrics.count_suspend(tag, "failed")
                if strict:
                    raise
                log.warning("idle suspend of %s failed; it runs on", sandbox_id, exc_info=True)
                return False
            metrics.count_suspend(tag, "ok", time.perf_counter() - t0)
            self._here.fell_asleep(sandbox_id, bundle, state.size_bytes, state.since)
            if state.snapshot:  # on the shared path: another node may take it over
                with self._here.lock:
                    asleep = self._here.asleep[sandbox_id]
                note = {"node": self.node_id, **asleep.__dict__}
                (Path(state.snapshot) / NOTE).write_text(json.dumps(note))
            self._count("suspends")
            return True
        finally:
            with self._lock:
                self._pledged -= max(pledge, 0)
            self._here.end_suspend(sandbox_id, turn)

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def _pledge(self, sandbox_id: str) -> int:
        """The bytes the suspend will take (about what the sandbox holds in memory now),
        counted against the budget while it runs; -1 if the node is past its budget (the
        checkpoints of its suspended sandboxes and the suspends under way), so a burst of
        suspends overshoots it by at most SUSPEND_PARALLEL checkpoints."""
        need = procfs.memory_used(sandbox_id) or 0
        with self._lock:
            if self.budget is not None and \
                    self._here.asleep_bytes() + self._pledged >= self.budget:
                return -1
            self._pledged += need
        return need

    def _bundle(self, pg_hex: str) -> dict[str, float]:
        """What the sandbox's reservation holds: a block slot's shape, or its placement
        group's bundle."""
        shape = self._blocks.shape(pg_hex)
        if shape is not None:
            return dict(shape)
        label = bundle_label(pg_hex)
        return {k: v for k, v in json.loads(next(iter(label.values()), "{}")).items()
                if not k.startswith("node:")}

    # --- resume ---------------------------------------------------------------------------

    def wake(self, sandbox_id: str, placement: str = "any", timeout: float | None = None,
             ) -> None:
        """Resume a sandbox suspended here: under a slot of this node's blocks when there
        is room (or when ``placement`` is ``"local"``), else under a placement group
        wherever Ray has room (``"any"``, or a node id), moving it there if that is
        another node. Waits for room at most ``timeout`` seconds (default
        RAY_SANDBOX_RESUME_TIMEOUT_S): CapacityError. The state stays on disk on any
        failure (ResumeError, CapacityError); the next call tries again."""
        with self._here.lock:
            asleep = self._here.asleep.get(sandbox_id)
        if asleep is None:
            return
        t0 = time.perf_counter()
        node = self._node_for(sandbox_id, placement)
        try:
            slots = self._boots.slots(asleep.bundle, 1) if node in (None, self.node_id) \
                else []
            if slots:
                self._resume_here(sandbox_id, slots[0])
                metrics.count_resume("here", "ok", time.perf_counter() - t0)
                self._count("resumes")
                return
            # detached: a group this host makes must not die with this host's process; the
            # sandbox's owner is its job, as before (Residents.jobs)
            pg_hex, where = reserve(asleep.bundle, node_id=node,
                                    timeout=timeout or resume_timeout(), lifetime="detached")
            if where == self.node_id:
                self._resume_here(sandbox_id, pg_hex)
                metrics.count_resume("here", "ok", time.perf_counter() - t0)
            else:
                self._move(sandbox_id, asleep, pg_hex, where)
                metrics.count_resume("moved", "ok", time.perf_counter() - t0)
                self._count("moves")
            self._count("resumes")
        except BaseException:
            metrics.count_resume("here" if node in (None, self.node_id) else "moved",
                                 "failed")
            raise

    def _node_for(self, sandbox_id: str, placement: str) -> str | None:
        """Where the sandbox must resume: the node of its volumes (another one named is a
        ConfigError), this node for ``"local"``, a node named, or anywhere (None)."""
        volumes = self._rt.record(sandbox_id).config.get("volumes") or {}
        if names := [v["name"] for v in volumes.values()]:
            node = volume_node(names)
            if placement not in ("local", "any", node):
                raise ConfigError(f"the sandbox mounts volume(s) {', '.join(sorted(names))} "
                                  f"of node {node}; it cannot run on node {placement}",
                                  sandbox_id=sandbox_id)
            return node
        if placement == "local":
            return self.node_id
        return None if placement == "any" else placement

    def _resume_here(self, sandbox_id: str, pg_hex: str) -> None:
        try:
            self._rt.suspensions.resume(sandbox_id, labels={PG_LABEL: pg_hex})
        except BaseException:
            self._here.release(pg_hex)
            raise
        self._here.woke(sandbox_id, pg_hex)

    def _move(self, sandbox_id: str, asleep: Asleep, pg_hex: str, node: str) -> None:
        """Resume the sandbox on ``node`` under ``pg_hex`` (same id and name), then tear
        down what it left here; calls reaching this host are forwarded from now on."""
        try:
            snap = self._rt.suspensions.export(sandbox_id, self._rt.snapshots,
                                               labels=bundle_label(pg_hex, asleep.bundle))
        except BaseException:
            remove_pg(pg_hex)
            raise
        snap = snap.model_copy(update={"node_id": self.node_id})
        SnapshotDir(Path(snap.path)).write(snap)
        other = self._start_host(node)
        try:
            ray.get(other.restore.remote(snap, pg_hex, asleep.name, sandbox_id,
                                         owner_job=asleep.job, owner_actor=asleep.actor))
        except ray.exceptions.RayActorError as exc:
            remove_pg(pg_hex)  # the call may not have reached it; removing twice is harmless
            raise ResumeError(f"resuming on node {node} failed: {exc}",
                              sandbox_id=sandbox_id) from None
        except SandboxError as exc:  # its host gave the reservation back
            raise ResumeError(f"resuming on node {node} failed: {exc.message}",
                              sandbox_id=sandbox_id) from exc
        finally:
            self._rt.snapshots.delete(snap.snapshot_id)
            other.delete_snapshot.remote(snap.snapshot_id)  # its imported copy
        self._here.moved_to(sandbox_id, node)
        try:
            self._rt.delete(sandbox_id)  # its network, mounts and checkpoint here
        except SandboxError:
            log.warning("tearing down %s here after its move failed; gc finishes it",
                        sandbox_id, exc_info=True)

    def take_over(self, key: str, placement: str = "any") -> tuple[str, str | None] | None:
        """Resume here the sandbox with id or name ``key`` suspended on the shared path by a
        node that is gone (None: none there, or its node is alive). Its directory is renamed
        away first, so one host takes it; on failure it is put back for the next try."""
        shared = checkpoint.shared_dir()
        if shared is None or not shared.is_dir():
            return None
        if ID_RE.match(key):
            candidates: Iterator[Path] = iter([shared / key])
        else:  # a name: the notes say (at most _SHARED_SCAN_MAX entries are looked at)
            candidates = (d for i, d in enumerate(shared.iterdir()) if i < _SHARED_SCAN_MAX)
        for d in candidates:
            if not ID_RE.match(d.name):
                continue
            note = _read_note(d / NOTE)
            if note is None or key not in (d.name, note.get("name")):
                continue
            if _node_alive(str(note.get("node"))):
                return None  # its own host resumes it
            taken = shared / f".taken-{d.name}-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(d, taken)
            except FileNotFoundError:
                continue  # another host took it meanwhile
            try:
                self._restore_taken(d.name, taken, note, placement)
            except BaseException:
                os.rename(taken, d)
                raise
            shutil.rmtree(taken, ignore_errors=True)
            return self.node_id, note.get("name")
        return None

    def _restore_taken(self, sandbox_id: str, taken: Path, note: dict[str, Any],
                       placement: str) -> None:
        snap = self._rt.snapshots.import_(pack(taken))  # owned by this host
        try:
            snap = snap.model_copy(update={"node_id": self.node_id})
            node = None if placement == "any" else placement
            if node not in (None, self.node_id):
                raise ConfigError("a sandbox taken over from the shared path resumes on the "
                                  "node of the host that takes it", sandbox_id=sandbox_id)
            pg_hex, _ = reserve(dict(note.get("bundle") or {}), node_id=self.node_id,
                                timeout=resume_timeout(), lifetime="detached")
            self._restore(snap, pg_hex, note.get("name"), sandbox_id,
                          owner_job=note.get("job"), owner_actor=note.get("actor"))
            self._count("resumes")
            metrics.count_resume("taken_over", "ok")
        finally:
            self._rt.snapshots.delete(snap.snapshot_id)

    # --- forwarding to the node a sandbox moved to ----------------------------------------

    def forward(self, sandbox_id: str, node: str, call: Callable[[Any], Any]) -> Any:
        """``ray.get(call(host of node))``; a sandbox that ended there is forgotten here."""
        try:
            return ray.get(call(self._start_host(node)))
        except SandboxNotFoundError:
            self._here.drop_moved(sandbox_id)
            raise

    def forward_stream(self, node: str, call: Callable[[Any], Any]) -> Iterator[Any]:
        for ref in call(self._start_host(node)):
            yield ray.get(ref)

    def sweep_moved(self) -> None:
        """Forget moved sandboxes that ended on their new node (one status call each)."""
        with self._here.lock:
            moved = dict(self._here.moved)
        for sid, node in moved.items():
            try:
                status = ray.get(self._start_host(node).call.remote(
                    "status", sid, NoRequest()), timeout=30)
                if status.state == SandboxState.TERMINATED:
                    self._here.drop_moved(sid)
            except SandboxError:
                self._here.drop_moved(sid)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                if not _node_alive(node):
                    self._here.drop_moved(sid)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)




class SleepCalls:
    """The host actor's suspension calls (``ray_sandbox.suspend``/``resume``, the idle
    figures), written here beside :class:`Sleep`, which does the work; ``SandboxHost``
    inherits them, so they are its remote methods."""

    node_id: str
    _rt: SandboxRuntime
    _here: Residents
    _sleep: Sleep

    def suspend(self, sandbox_id: str) -> SandboxStatus:
        """Checkpoint the sandbox to disk in place, end its container and give its Ray
        reservation back (docs/snapshots.md, "Idle suspend"); status SUSPENDED until the
        next call into it, or ``ray_sandbox.resume``, brings it back. Idempotent. Waits up
        to 30 s for calls inside it; CapacityError past the node's disk budget."""
        with self._here.lock:
            moved = self._here.moved.get(sandbox_id)
            asleep = sandbox_id in self._here.asleep
        if moved is not None:
            return self._sleep.forward(sandbox_id, moved,
                                       lambda h: h.suspend.remote(sandbox_id))
        if not asleep:
            self._rt.record(sandbox_id)  # SandboxNotFoundError for an unknown id
            self._sleep.suspend(sandbox_id, reason="Suspended", strict=True)
        return self._rt.get_status(sandbox_id)

    def wake(self, sandbox_id: str, placement: str = "any",
             timeout: float | None = None) -> tuple[str, str | None]:
        """Resume a sandbox suspended here (``ray_sandbox.resume``): on this node when it
        has room, else wherever Ray has room (``placement``: "any", "local" or a node id).
        Returns (the node it runs on, its name)."""
        def wake(sid: str) -> None:
            self._sleep.wake(sid, placement, timeout)

        with self._here.lock:
            name = self._here.names.get(sandbox_id) or (
                a.name if (a := self._here.asleep.get(sandbox_id)) else None)
        with self._here.inside(sandbox_id, wake) as moved:
            if moved is None:
                self._rt.record(sandbox_id)  # SandboxNotFoundError for an unknown id
            return moved or self.node_id, name

    def take_over(self, key: str, placement: str = "any") -> tuple[str, str | None] | None:
        """Resume here a sandbox suspended on the shared path (RAY_SANDBOX_SUSPEND_DIR) by a
        node that is gone; (this node, its name), or None if there is none of that key."""
        return self._sleep.take_over(key, placement)

    def find_suspended(self, key: str) -> str | None:
        """The id of the sandbox suspended here whose id or name is ``key``."""
        with self._here.lock:
            for sid, asleep in self._here.asleep.items():
                if key in (sid, asleep.name):
                    return sid
        return None

    def suspended(self) -> dict[str, int | None]:
        """This node's suspended sandboxes: how many, the disk their checkpoints take, the
        node's budget for them (None: unlimited), sandboxes that moved away, and what this
        host did since it started (suspends, refused suspends, resumes, moves)."""
        with self._here.lock:
            n = len(self._here.asleep)
            size = sum(a.size_bytes for a in self._here.asleep.values())
            moved = len(self._here.moved)
        return {"suspended": n, "bytes": size, "budget": self._sleep.budget, "moved": moved,
                **self._sleep.counts}


def _node_alive(node: str) -> bool:
    try:
        return node_alive(node)
    except Exception:  # noqa: BLE001 - GCS hiccup: assume alive
        return True


def _read_note(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            note = json.loads(f.read(_NOTE_MAX))
        return note if isinstance(note, dict) else None
    except (OSError, ValueError):
        return None
