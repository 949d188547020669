"""Suspending a sandbox in place and resuming it: ``runtime.suspensions``.

A suspended sandbox costs the node disk, not memory: its processes, memory, the gVisor
overlay root and tmpfs mounts are in a checkpoint on disk (checkpoint.py, ``SuspendState``),
its runsc container is gone (sentry, gofer, cgroups: the memory is freed), and everything
else it had on the node stays as it was: its directory and record, the root overlay
mount, the ``disk=`` filesystem, volume binds, and its network (netns, veth and address,
nft table with published ports and links, DNS helper, leases). A resume is therefore
``runsc restore`` in the same directory plus the agent's readiness (launch.py,
``Launcher.resume_in_place``); nothing is mounted, attached or copied.

The record says ``phase="suspended"`` once the checkpoint is complete and the container is
gone (the commit point); until then a crash leaves a sandbox its owner's death reaps like
any other. A suspended sandbox is detached on disk (no owner process), so gc and a
restarted Ray host keep it; its TTL still counts (the owning runtime's timer, or gc after
the deadline). A resume that fails leaves the checkpoint and the record as they were:
:class:`ResumeError`, and the next call tries again. Concurrent resumes of one sandbox run
once; the others wait for it.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from . import checkpoint, network, reaper
from .agent.client import AgentClient
from .bundle import SandboxDir
from .connections import Connections
from .errors import ConfigError, ResumeError, SandboxError, SandboxStateError
from .launch import Launcher
from .records import Records, SandboxRecord, owner_fields
from .snapshot import Snapshot, SnapshotDir, SnapshotStore, copy_tree, tree_size

SUSPENDED = "suspended"  # the record's phase
_log = logging.getLogger(__name__)
_RESUME_WAIT_S = 180.0  # a concurrent resume of the same sandbox: runsc's own timeouts first


class Suspensions:
    """In-place suspend and resume of one runtime's sandboxes. Thread-safe.

    ``idle`` is what ``idle_suspend_seconds`` calls (a Ray host sets it: it suspends in its
    own threads and releases the reservation); ``auto_resume`` whether a call of this
    runtime into a suspended sandbox resumes it first (a Ray host turns it off: it resumes
    under a new reservation before it calls)."""

    def __init__(self, records: Records, launcher: Launcher, connections: Connections,
                 on_resumed: Callable[[SandboxRecord], None],
                 stop_pythons: Callable[[str], None]) -> None:
        self._records = records
        self._launcher = launcher
        self._connections = connections
        self._on_resumed = on_resumed
        self._stop_pythons = stop_pythons
        self._lock = threading.Lock()
        self._turning: dict[str, threading.Event] = {}
        self.idle: Callable[[str], bool] | None = None
        self.auto_resume = True
        self.timings: dict[str, float] = {}  # the last resume's steps, seconds (benchmarks)

    # --- state ---------------------------------------------------------------------------

    def state(self, sandbox_id: str) -> checkpoint.SuspendState | None:
        """The suspended sandbox's checkpoint (where, how large, since when); None if it is
        not suspended."""
        rec = self._records.load(sandbox_id)
        if rec is None or rec.phase != SUSPENDED:
            return None
        return checkpoint.SuspendState.read(self._records.sdir(sandbox_id))

    def list(self) -> list[str]:
        """Ids of this home's suspended sandboxes (any owner)."""
        return [sid for sid in self._records.on_disk()
                if (rec := self._records.load(sid)) is not None and rec.phase == SUSPENDED]

    def usage(self) -> tuple[int, int]:
        """How many of this home's sandboxes are suspended and the disk their checkpoints
        take (bytes)."""
        n = size = 0
        for sid in self.list():
            state = checkpoint.SuspendState.read(self._records.sdir(sid))
            n += 1
            size += state.size_bytes if state is not None else 0
        return n, size

    # --- suspend ---------------------------------------------------------------------------

    def suspend(self, sandbox_id: str, *, reason: str = "Suspended",
                drain_timeout: float = 30.0, last_used: float | None = None,
                labels: Mapping[str, str | None] | None = None) -> checkpoint.SuspendState:
        """Checkpoint the running sandbox to disk and stop its container, keeping the rest
        in place. Calls already running get ``drain_timeout`` seconds (then
        :class:`SandboxStateError` and it keeps running); spawned processes keep running
        inside but their handles end, as with a snapshot (docs/snapshots.md)."""
        with self._lock:
            if sandbox_id in self._turning:
                raise SandboxStateError("the sandbox is being suspended or resumed",
                                        sandbox_id=sandbox_id)
            turn = self._turning[sandbox_id] = threading.Event()
        try:
            return self._suspend(sandbox_id, reason, drain_timeout, last_used, labels)
        finally:
            with self._lock:
                self._turning.pop(sandbox_id, None)
            turn.set()

    def busy(self, sandbox_id: str) -> bool:
        """Whether a suspend or resume of the sandbox is under way."""
        with self._lock:
            return sandbox_id in self._turning

    def _suspend(self, sandbox_id: str, reason: str, drain_timeout: float,
                 last_used: float | None, labels: Mapping[str, str | None] | None,
                 ) -> checkpoint.SuspendState:
        checkpoint.check_support(self._launcher.runsc)
        rec = self._records.get(sandbox_id)
        if rec.phase != "created":
            raise SandboxStateError(f"sandbox is {rec.phase}; a suspend needs it running",
                                    sandbox_id=sandbox_id)
        if rec.network == "host" or rec.sandbox_config.network == "public":
            raise ConfigError("runsc cannot checkpoint the host's sockets a network="
                              f"{rec.sandbox_config.network!r} sandbox uses; suspend needs "
                              "'none' or 'sandbox'", sandbox_id=sandbox_id)
        sdir = self._records.sdir(sandbox_id)
        shared = checkpoint.shared_dir()
        image = checkpoint.suspend_image(sdir, shared)
        snap_dir = image.parent if shared else None
        shutil.rmtree(snap_dir or image, ignore_errors=True)  # an attempt cut short
        image.mkdir(parents=True)
        client = self._client(sandbox_id)
        used = last_used if last_used is not None else time.time()
        try:
            with checkpoint.held(client, sdir, drain_timeout,
                                 lambda: self._stop_pythons(sandbox_id), stops=True):
                checkpoint.checkpoint(self._launcher.runsc, rec, image)
                # saved: what runs after the save would be lost, so it ends at once (a save
                # that failed left it running, and the hold ends as after a snapshot)
                self._launcher.runsc.kill_sandbox(sandbox_id)
        except BaseException:
            shutil.rmtree(snap_dir or image, ignore_errors=True)
            raise
        # From here the suspend completes; what cannot be cleaned up now the resume cleans
        # up (a container left behind).
        self._connections.close(sandbox_id)
        readdressed = False
        with contextlib.suppress(SandboxError):
            self._launcher.runsc.delete(sandbox_id)
            # the veth's address back in its netns now, not on the resume's path (a client
            # meanwhile is refused at once by the node's kernel instead of waiting)
            network.reattach(sandbox_id, sdir.path)
            readdressed = True
        snapshot = None
        if snap_dir is not None:  # the rest of a snapshot, for another node
            try:
                self._complete_snapshot(rec, sdir, SnapshotDir(snap_dir))
                snapshot = str(snap_dir)
            except (OSError, SandboxError) as exc:
                _log.warning("sandbox %s: no complete snapshot on the shared path (%s); it "
                             "resumes on this node only", sandbox_id, exc)
        state = checkpoint.SuspendState(
            image=str(image), snapshot=snapshot, size_bytes=tree_size(snap_dir or image),
            since=time.time(), last_used=used, reason=reason,
            detached=rec.owner_pid is None, readdressed=readdressed)
        state.write(sdir)
        # the commit: suspended, and detached on disk so that no gc reaps it meanwhile
        self._records.write(rec.model_copy(update={
            "phase": SUSPENDED, "config": relabel(rec.config, labels),
            **owner_fields(detach=True)}))
        return state

    def _complete_snapshot(self, rec: SandboxRecord, sdir: SandboxDir,
                           sd: SnapshotDir) -> None:
        """The snapshot files besides the checkpoint, so that another node's host can
        restore the sandbox from the shared path alone."""
        copy_tree(sdir.upper, sd.upper)
        if sdir.work.is_dir():
            copy_tree(sdir.work, sd.work)
        shutil.copyfile(sdir.bundle / "config.json", sd.spec)
        shutil.copyfile(sdir.etc / "hostname", sd.hostname)
        sd.seal(self.snapshot_of(rec, sd))

    @staticmethod
    def snapshot_of(rec: SandboxRecord, sd: SnapshotDir,
                    labels: dict[str, str] | None = None) -> Snapshot:
        """The :class:`Snapshot` that describes a suspended sandbox's files in ``sd``."""
        return Snapshot(
            snapshot_id=sd.path.name, source_id=rec.sandbox_id, path=str(sd.path),
            config=rec.config, image=rec.image, image_digest=rec.image_digest,
            image_env=rec.image_env, image_user=rec.image_user,
            image_workdir=rec.image_workdir, network=rec.network,
            overlay=rec.overlay != "none", platform=rec.platform, rootless=rec.rootless,
            source_dir=str(Path(rec.rootfs).parent), labels=dict(labels or {}),
            **owner_fields(detach=True),
        )  # fmt: skip

    # --- resume ----------------------------------------------------------------------------

    def resume(self, sandbox_id: str, *, labels: Mapping[str, str | None] | None = None,
               ) -> bool:
        """Start the suspended sandbox again in place; False if it was not suspended (it
        runs, or a concurrent resume brought it back). :class:`ResumeError` if runsc or
        the agent fail: the checkpoint stays for the next try. ``labels`` are set (None:
        removed) on its record once it runs."""
        while True:
            with self._lock:
                turn = self._turning.get(sandbox_id)
                if turn is None:
                    turn = self._turning[sandbox_id] = threading.Event()
                    break
            if not turn.wait(_RESUME_WAIT_S):
                raise ResumeError("another resume of the sandbox did not finish",
                                  sandbox_id=sandbox_id)
        try:
            return self._resume(sandbox_id, labels)
        finally:
            with self._lock:
                self._turning.pop(sandbox_id, None)
            turn.set()

    def _resume(self, sandbox_id: str, labels: Mapping[str, str | None] | None) -> bool:
        rec = self._records.get(sandbox_id)
        if rec.phase != SUSPENDED:
            return False
        sdir = self._records.sdir(sandbox_id)
        state = checkpoint.SuspendState.read(sdir)
        if state is None or not Path(state.image).is_dir():
            raise ResumeError("the suspended sandbox's checkpoint is missing",
                              sandbox_id=sandbox_id)
        timings: dict[str, float] = {}
        try:
            rec = self._launcher.resume_in_place(rec, Path(state.image), detach=state.detached,
                                                 readdressed=state.readdressed, timings=timings)
        except SandboxError as exc:
            raise ResumeError(f"resume failed: {exc.message}", sandbox_id=sandbox_id,
                              argv=exc.argv, returncode=exc.returncode,
                              stderr=exc.stderr) from exc
        t0 = time.perf_counter()
        if labels:
            rec = rec.model_copy(update={"config": relabel(rec.config, labels)})
            self._records.write(rec)
        checkpoint.remove_suspended(sdir)
        self._on_resumed(rec)
        timings["record"] = time.perf_counter() - t0
        self.timings = timings
        return True

    def watch_idle(self, sandbox_id: str) -> None:
        """Look at the running sandbox's idleness again later (an idle suspend that was
        refused: in use meanwhile, or no disk budget)."""
        rec = self._records.load(sandbox_id)
        if rec is not None and rec.phase != SUSPENDED:
            self._on_resumed(rec)

    def export(self, sandbox_id: str, store: SnapshotStore,
               labels: dict[str, str] | None = None) -> Snapshot:
        """A snapshot of the suspended sandbox in ``store``, which another node restores
        under the sandbox's own id (a move; the snapshot is deleted afterwards). The
        checkpoint's files are hard links where one filesystem holds both."""
        rec = self._records.get(sandbox_id)
        state = self.state(sandbox_id)
        if state is None:
            raise SandboxStateError("sandbox is not suspended", sandbox_id=sandbox_id)
        sdir = self._records.sdir(sandbox_id)
        sd = store.new()
        try:
            for f in Path(state.image).iterdir():
                try:
                    os.link(f, sd.image / f.name)
                except OSError:
                    shutil.copyfile(f, sd.image / f.name)
            copy_tree(sdir.upper, sd.upper)
            if sdir.work.is_dir():
                copy_tree(sdir.work, sd.work)
            shutil.copyfile(sdir.bundle / "config.json", sd.spec)
            shutil.copyfile(sdir.etc / "hostname", sd.hostname)
            return sd.seal(self.snapshot_of(rec, sd, labels))
        except BaseException:
            sd.remove()
            raise

    def adopt(self) -> builtins.list[str]:
        """This runtime takes the home's suspended sandboxes (a restarted Ray host): each
        becomes owned here again on its next resume, one whose resume was cut short by a
        crash loses its half-started container, and one another node took over from the
        shared path (RAY_SANDBOX_SUSPEND_DIR) while this one was away is removed here.
        Returns the ids adopted."""
        ids = self.list()
        # a resume or suspend its process left running (a restore that would finish, a
        # checkpoint): nothing of a suspended sandbox may run now
        reaper.kill_stray_runsc(self._launcher.runsc,
                                set(self._records.on_disk()) - set(ids))
        kept = []
        for sid in ids:
            rec = self._records.load(sid)
            if rec is None:
                continue
            state = checkpoint.SuspendState.read(self._records.sdir(sid))
            if state is not None and state.snapshot and not Path(state.snapshot).is_dir():
                # taken over from the shared path while this node was away: it runs on
                # another node now, so what it left here goes
                _log.info("sandbox %s was resumed elsewhere from the shared path; removing "
                          "what it left here", sid)
                self._launcher.destroy(sid, reason="MovedAway")
                continue
            kept.append(sid)
            if self._launcher.runsc.has_container(sid):
                self._launcher.runsc.kill_sandbox(sid)
                with contextlib.suppress(SandboxError):
                    self._launcher.runsc.delete(sid)
            (self._records.sdir(sid).run / checkpoint.HOLD_FILE).unlink(missing_ok=True)
            self._records.adopt(rec)
        return kept

    def _client(self, sandbox_id: str) -> AgentClient:
        client = self._connections.get(sandbox_id, self._records.sdir(sandbox_id).socket,
                                       lambda: self._records.read(sandbox_id) is not None)
        if client is None:
            raise SandboxStateError("sandbox was deleted", sandbox_id=sandbox_id)
        return client



def relabel(config: dict[str, Any], labels: Mapping[str, str | None] | None,
            ) -> dict[str, Any]:
    """``config`` (a record's, JSON form) with ``labels`` set; a None value removes one."""
    if not labels:
        return config
    merged = dict(config.get("labels") or {})
    for k, v in labels.items():
        if v is None:
            merged.pop(k, None)
        else:
            merged[k] = v
    return {**config, "labels": merged}
