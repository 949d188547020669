"""Bringing a sandbox up and taking it down: the pipeline that create and restore share
(image pin, root overlay, disk, volumes, network, bundle, record, runsc, agent ready) and its exact
inverse. Everything a launch made is undone by :meth:`Launcher.destroy`, which also cleans
up after a launch that stopped half-way. :meth:`Launcher.delete` is the same in two phases:
the sandbox stops at once, the rest is torn down in the background (:class:`Teardowns`).

(~610 lines: a launch and its exact inverse belong side by side, so that every step made has
its undo in view; bundle, disk, network and mounts are their own modules.)"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from . import _mount, bundle, checkpoint, disk, docker, network, procfs
from ._inotify import DirWatch
from .agent.client import AgentClient
from .bundle import SandboxDir
from .config import PullNetwork, SandboxConfig
from .connections import Connections
from .errors import (
    ConfigError,
    ImageNotFoundError,
    SandboxCreationError,
    SandboxError,
    SandboxStateError,
    SnapshotCorruptError,
    VolumeInUseError,
    VolumeNotFoundError,
)
from .images import Image, ImageStore
from .images.pins import home_key
from .records import ID_RE, Records, SandboxRecord, owner_fields
from .runsc import Runsc
from .snapshot import Snapshot, SnapshotDir, copy_tree, rewrite_paths
from .spec import Spec, apply_transform
from .volumes import VolumeStore

_log = logging.getLogger(__name__)
READY_TIMEOUT = 20.0
# Background teardowns per runtime: each is mostly one `runsc delete` of a dead sandbox
# (~20-50 ms; ~1.5 s if another process started it: docs/platform.md,
# "Orphaned runsc processes"), so two threads keep up with the ~9 creates/s two cores allow.
TEARDOWN_WORKERS = 2
TEARDOWN_QUEUE = 64
# How long a re-used id waits for its previous sandbox's running teardown: runsc delete's
# own timeout and retries bound it well before this.
_SETTLE_WAIT_S = 120.0
_DRAIN_WAIT_S = 120.0  # a runtime's close(); a stuck runsc delete alone may take 3 × 30 s
# How often a starting sandbox's runsc state is checked for a crash. Each check is a runsc
# process (~20 ms of CPU); with 16 boots in flight on 2 cores, a 0.25 s period spent a tenth
# of the CPU the boots needed. A crash is reported within a second instead.
_STATE_CHECK_S = 1.0


def agent_binary() -> Path:
    env = os.environ.get("RAY_SANDBOX_AGENT")
    path = Path(env) if env else Path(__file__).resolve().parent / "agent" / bundle.AGENT_NAME
    if not path.is_file():
        raise SandboxCreationError(
            f"the in-sandbox agent {path} is missing; build it with "
            "`make -C ray_sandbox/runtime/agent` (scripts/setup.sh does)"
        )
    return path


def localize_spec(spec: dict[str, Any], sandbox_id: str, netns: str | None) -> dict[str, Any]:
    """A restored copy's spec: its own id annotation and network namespace, and this node's
    agent directory."""
    spec.setdefault("annotations", {})["dev.ray-sandbox.id"] = sandbox_id
    for ns in spec.get("linux", {}).get("namespaces", []):
        if ns.get("type") == "network":
            ns.pop("path", None)
            if netns:
                ns["path"] = netns
    for m in spec.get("mounts", []):
        if m.get("destination") == bundle.AGENT_DIR:
            m["source"] = str(agent_binary().parent)
    return spec


def as_creation_error(exc: SandboxError, what: str, sandbox_id: str) -> SandboxCreationError:
    """``exc`` as the SandboxCreationError of a failed create or restore, its command kept."""
    return SandboxCreationError(f"{what} failed: {exc.message}", sandbox_id=sandbox_id,
                                argv=exc.argv, returncode=exc.returncode, stderr=exc.stderr)


def all_or_nothing(ids: Iterable[str], start: Callable[[str], None],
                   undo: Callable[[str], None], parallel: int) -> None:
    """Run ``start`` for every id, ``parallel`` at a time; if any fails, ``undo`` the ones
    that succeeded and raise the first error."""
    ids = list(ids)
    made: list[str] = []
    errors: list[BaseException] = []
    with ThreadPoolExecutor(max_workers=max(1, min(len(ids), parallel))) as pool:
        futures = [pool.submit(start, i) for i in ids]
        for i, fut in zip(ids, futures, strict=True):
            try:
                fut.result()
                made.append(i)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)
    if errors:
        for i in made:
            with contextlib.suppress(SandboxError):
                undo(i)
        raise errors[0]


class Teardowns:
    """Runs ``finish(sandbox_id)`` for deleted sandboxes on at most ``workers`` threads with
    at most ``limit`` waiting; a delete past that finishes in its caller (back-pressure:
    never an unbounded queue or a thread per delete). Threads start on demand, end when the
    queue is empty, and are not daemons: interpreter exit waits for what is queued (a process
    killed first leaves the rest to gc, through the tombstones)."""

    def __init__(self, finish: Callable[[str], None], *, workers: int, limit: int) -> None:
        self._finish = finish
        self._workers = workers
        self._limit = limit
        self._cv = threading.Condition()
        self._queue: deque[str] = deque()
        self._running: set[str] = set()
        self._threads = 0

    def submit(self, sandbox_id: str) -> None:
        with self._cv:
            if sandbox_id in self._running or sandbox_id in self._queue:
                return
            inline = len(self._queue) >= self._limit
            if inline:
                self._running.add(sandbox_id)
            else:
                self._queue.append(sandbox_id)
                if self._threads < self._workers:
                    self._threads += 1
                    # not inherited: a delete from a daemon thread must not make it one
                    threading.Thread(target=self._loop, name="ray-sandbox-teardown",
                                     daemon=False).start()
        if inline:
            self._run(sandbox_id)

    def settle(self, sandbox_id: str, timeout: float) -> None:
        """Finish the id's pending teardown before the id is used again: a queued one now,
        in this thread; a running one is waited for (at most ``timeout`` seconds)."""
        with self._cv:
            queued = sandbox_id in self._queue
            if queued:
                self._queue.remove(sandbox_id)
                self._running.add(sandbox_id)
            else:
                self._cv.wait_for(lambda: sandbox_id not in self._running, timeout)
        if queued:
            self._run(sandbox_id)

    def run(self, sandbox_id: str, timeout: float, *, propagate: bool = False) -> bool:
        """Tear the id down now, in this thread: a queued teardown is taken over, a running
        one waited for (at most ``timeout`` seconds) instead of run twice at once, else one
        runs here (``propagate``: its error is raised, not logged). Whether it ran here."""
        with self._cv:
            if sandbox_id in self._running:
                self._cv.wait_for(lambda: sandbox_id not in self._running, timeout)
                return False
            if sandbox_id in self._queue:
                self._queue.remove(sandbox_id)
            self._running.add(sandbox_id)
        self._run(sandbox_id, propagate=propagate)
        return True

    def drain(self, timeout: float) -> bool:
        """Wait until nothing is queued or running (at most ``timeout`` seconds)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._running, timeout)

    def _run(self, sandbox_id: str, *, propagate: bool = False) -> None:
        """Finish one teardown the caller has marked running."""
        try:
            self._finish(sandbox_id)
        except Exception:  # one failed teardown must not end the others; gc finds the rest
            if propagate:
                raise
            _log.exception("teardown of sandbox %s failed", sandbox_id)
        finally:
            with self._cv:
                self._running.discard(sandbox_id)
                self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                if not self._queue:
                    self._threads -= 1
                    return
                sandbox_id = self._queue.popleft()
                self._running.add(sandbox_id)
            self._run(sandbox_id)


class Launcher:
    """Starts sandboxes from images or snapshots, and destroys them, for one home."""

    def __init__(self, home: Path, records: Records, connections: Connections, runsc: Runsc,
                 images: ImageStore, volumes: VolumeStore) -> None:
        self._records = records
        self.volumes = volumes
        self._connections = connections
        self.runsc = runsc
        self.images = images
        self.home = home
        self._disks = home / "disks"
        # Image pins are `<home key>:<id>` and name the home (images/pins.py), so that any
        # runtime on a shared store can tell a pin whose sandbox is gone.
        self._pin_prefix = home_key(home) + ":"
        self._teardowns = Teardowns(self._teardown, workers=TEARDOWN_WORKERS,
                                    limit=TEARDOWN_QUEUE)

    # --- create and restore ------------------------------------------------------------------

    def create(self, sandbox_id: str, cfg: SandboxConfig, detach: bool) -> SandboxRecord:
        """Start a sandbox from its image; on any failure nothing of it is left."""
        agent = agent_binary()
        image = self._pinned(cfg.image, sandbox_id, cfg.pull_network)
        sdir = self._records.sdir(sandbox_id)
        try:
            sdir.create()
            return self._start(sandbox_id, sdir, cfg, image, agent, detach)
        except BaseException as exc:
            self.destroy(sandbox_id)
            self.images.unpin(image.digest, self._pin_owner(sandbox_id))  # no record yet
            if isinstance(exc, SandboxError) and not isinstance(exc, SandboxCreationError):
                raise as_creation_error(exc, "creating sandbox", sandbox_id) from exc
            raise

    def restore(self, snap: Snapshot, sd: SnapshotDir, sandbox_id: str, cfg: SandboxConfig,
                detach: bool) -> SandboxRecord:
        """Start a copy of a snapshot under ``sandbox_id``. On failure the caller destroys it
        (the copy is retried as a whole)."""
        # The caller's id: maybe that of a sandbox just deleted, whose teardown unpins the
        # same owner, so it is finished before the pin.
        self._settle(sandbox_id)
        image = self._pinned(snap.image, sandbox_id, cfg.pull_network)
        if image.digest != snap.image_digest:
            raise SnapshotCorruptError(
                f"image {snap.image} is {image.digest} on this node, the snapshot needs "
                f"{snap.image_digest}", sandbox_id=sandbox_id,
            )
        sdir = self._records.sdir(sandbox_id)
        sdir.create()
        attachment, overlay = self._prepare(sandbox_id, sdir, cfg, image, upper=sd.upper)
        if sd.work.is_dir():
            copy_tree(sd.work, sdir.work)
        spec = rewrite_paths(json.loads(sd.spec.read_text()), snap.source_dir, str(sdir.path))
        spec_model = Spec.model_validate(localize_spec(spec, sandbox_id, attachment.netns_path))
        bundle.write_bundle(sdir, spec_model, hostname=sd.hostname.read_text().strip(),
                            resolv_conf=attachment.resolv_conf, hosts=attachment.hosts)
        (sdir.run / "seed").write_text(os.urandom(32).hex() + "\n")
        rec = self._new_record(sandbox_id, sdir, cfg, image, attachment, overlay, detach,
                               image_user=snap.image_user, image_workdir=snap.image_workdir,
                               oci_seccomp=spec_model.linux.seccomp is not None)
        # The source's global flags: a restore with another --directfs fails (ENOMEM).
        self.runsc.restore_detached(sandbox_id, sdir.bundle, sd.image, rec.runsc_flags,
                                    prefix=attachment.run_prefix, log_dir=sdir.path)
        bundle.apply_cpu_share(sandbox_id, cfg)  # the copy's processes run from here
        self._wait_ready(sandbox_id, sdir)
        return self._records.set_phase(rec, "created")

    def resume_in_place(self, rec: SandboxRecord, image: Path, *, detach: bool,
                        readdressed: bool = False,
                        timings: dict[str, float] | None = None) -> SandboxRecord:
        """Start a sandbox suspended in place again from its checkpoint ``image``, in its
        own directory: its root overlay, disk, volume binds, network (netns, veth, address,
        published ports, links) and record stayed while it slept, so this is ``runsc
        restore`` and the agent's readiness only. Owned by this process unless ``detach``.
        On failure the half-started container is removed and the checkpoint kept; the
        caller raises (a retry starts over). ``timings`` gets each step's seconds."""
        sandbox_id = rec.sandbox_id
        sdir = self._records.sdir(sandbox_id)
        (sdir.run / checkpoint.HOLD_FILE).unlink(missing_ok=True)  # a suspend cut short
        steps = timings if timings is not None else {}
        t = time.perf_counter()

        def step(name: str) -> None:
            nonlocal t
            now = time.perf_counter()
            steps[name] = now - t
            t = now

        try:
            if self.runsc.has_container(sandbox_id):  # a resume that failed or was cut short
                self.runsc.kill_sandbox(sandbox_id)
                self.runsc.delete(sandbox_id)
                readdressed = False  # its restore took the address again
            prefix = network.reattach(sandbox_id, sdir.path, readdress=not readdressed)
            step("network")
            self.runsc.restore_detached(sandbox_id, sdir.bundle, image, rec.runsc_flags,
                                        prefix=prefix, log_dir=sdir.path)
            step("runsc_restore")
            bundle.apply_cpu_share(sandbox_id, rec.sandbox_config)
            step("cpu_share")
            self._wait_ready(sandbox_id, sdir)
            step("agent_ready")
        except BaseException:
            self._connections.close(sandbox_id)
            self.runsc.kill_sandbox(sandbox_id)
            with contextlib.suppress(SandboxError):
                self.runsc.delete(sandbox_id)
            raise
        rec = rec.model_copy(update={"phase": "created", **owner_fields(detach)})
        self._records.write(rec)
        return rec

    def _pin_owner(self, sandbox_id: str) -> str:
        return self._pin_prefix + sandbox_id

    def _pinned(self, ref: str, sandbox_id: str, network: PullNetwork = "node") -> Image:
        """The image, pinned for this sandbox (a concurrent remove between get and pin makes
        the store fetch it again), pulled over ``network`` (the config's ``pull_network``)."""
        for attempt in range(3):
            image = self.images.get(ref, network=network)
            try:
                self.images.pin(image.digest, self._pin_owner(sandbox_id), home=self.home)
                return image
            except ImageNotFoundError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _start(self, sandbox_id: str, sdir: SandboxDir, cfg: SandboxConfig, image: Image,
               agent: Path, detach: bool) -> SandboxRecord:
        attachment, overlay = self._prepare(sandbox_id, sdir, cfg, image)
        if cfg.readonly and cfg.workdir:
            bundle.seed_workdir(Path(image.rootfs), cfg.workdir, sdir.work, sandbox_id=sandbox_id)
        spec = bundle.build_spec(
            sandbox_id=sandbox_id,
            config=cfg,
            rootfs=sdir.root,
            image_env=list(image.config.env),
            sdir=sdir,
            agent_dir=agent.parent,
            netns_path=attachment.netns_path,
            host_network=attachment.runsc_network == "host",
            with_resolv_conf=attachment.resolv_conf is not None,
        )
        spec = apply_transform(spec, cfg.spec_transform, sandbox_id=sandbox_id)
        bundle.write_bundle(sdir, spec, hostname=spec.hostname or "sandbox",
                            resolv_conf=attachment.resolv_conf, hosts=attachment.hosts)
        rec = self._new_record(sandbox_id, sdir, cfg, image, attachment, overlay, detach,
                               image_user=image.config.user or None,
                               image_workdir=image.config.working_dir or None,
                               oci_seccomp=spec.linux.seccomp is not None)
        self.runsc.run_detached(sandbox_id, sdir.bundle, rec.runsc_flags,
                                prefix=attachment.run_prefix, log_dir=sdir.path)
        client = self._wait_ready(sandbox_id, sdir)
        if cfg.docker:  # ours, not user code: on the boot CPU limit, before the share
            docker.start(client, sandbox_id, cfg.network)
        bundle.apply_cpu_share(sandbox_id, cfg)
        if cfg.workdir and not cfg.readonly:
            # Like a Dockerfile WORKDIR: it exists even if the image lacks it. Made through
            # the agent, inside the sandbox, so image symlinks cannot point it at the host.
            client.mkdir(cfg.workdir, parents=True)
        return self._records.set_phase(rec, "created")

    def _prepare(self, sandbox_id: str, sdir: SandboxDir, cfg: SandboxConfig, image: Image,
                 upper: Path | None = None) -> tuple[network.NetworkAttachment, str]:
        """Root overlay (upper layer copied from ``upper`` if given), the size-capped disk,
        the volumes' binds, network, gVisor overlay dir; returns the network attachment and
        the ``--overlay2`` value."""
        if upper is not None:
            copy_tree(upper, sdir.upper)
        _mount.mount_overlay(Path(image.rootfs), sdir.upper, sdir.ovwork, sdir.root,
                             sandbox_id=sandbox_id)
        # Only a writable root (runsc's filestore) or a workdir bind write to the node's disk;
        # a read-only sandbox without a workdir writes only to memory-bounded tmpfs. The
        # capped disk is mounted nosuid,nodev; so is the plain directory of an uncapped one.
        if (size := cfg.effective_disk) is not None:
            disk.attach(sdir.disk_image, sdir.disk, size, templates=self._disks,
                        sandbox_id=sandbox_id)
        elif cfg.writes_to_disk:
            sdir.storage_unlimited()
        if cfg.volumes:
            if cfg.effective_rootless:
                raise ConfigError("volumes need rootful mode (loop-mounted filesystems; as "
                                  "root)", sandbox_id=sandbox_id)
            self.volumes.attach(sandbox_id, [(name, ro, bind) for _, name, ro, bind
                                             in sdir.volume_binds(cfg)])
        attachment = network.attach(sandbox_id, cfg, sdir.path, settle=self._settle)
        overlay = "none"
        if not cfg.readonly:
            sdir.overlay.mkdir()
            overlay = f"root:dir={sdir.overlay}"
        return attachment, overlay

    def _new_record(
        self, sandbox_id: str, sdir: SandboxDir, cfg: SandboxConfig, image: Image,
        attachment: network.NetworkAttachment, overlay: str, detach: bool, *,
        image_user: str | None, image_workdir: str | None, oci_seccomp: bool,
    ) -> SandboxRecord:
        """The record of a sandbox about to start, written before runsc runs."""
        now = time.time()
        rec = SandboxRecord(
            sandbox_id=sandbox_id,
            config=cfg.model_dump(mode="json"),
            image=cfg.image,
            image_digest=image.digest,
            rootfs=str(sdir.root),
            image_rootfs=str(image.rootfs),
            image_env=list(image.config.env),
            image_user=image_user,
            image_workdir=image_workdir,
            created_at=now,
            ttl_deadline=now + cfg.ttl_seconds if cfg.ttl_seconds else None,
            network=attachment.runsc_network,
            overlay=overlay,
            platform=cfg.platform,
            rootless=cfg.effective_rootless,
            directfs=cfg.directfs,
            oci_seccomp=oci_seccomp,
            endpoints=attachment.endpoints,
            **owner_fields(detach),
        )
        self._records.write(rec)
        return rec

    def _wait_ready(self, sandbox_id: str, sdir: SandboxDir) -> AgentClient:
        """Wait until the agent listens, or until runsc says the sandbox stopped, or
        READY_TIMEOUT; the ready client becomes the sandbox's connection."""
        deadline = time.monotonic() + READY_TIMEOUT
        next_state_check = time.monotonic() + _STATE_CHECK_S
        with DirWatch(sdir.run) as watch:
            # The agent renames its socket into place once it listens (agent.c, listen_at):
            # a socket there is an agent that accepts. The first call connects, so a create
            # does not fork a connection handler in the sandbox that nobody may use.
            while not sdir.socket.exists():
                now = time.monotonic()
                if now > deadline:
                    raise SandboxCreationError(
                        f"sandbox agent did not become ready within {READY_TIMEOUT:g}s",
                        sandbox_id=sandbox_id, stderr=_runsc_log(sdir),
                    )
                if now > next_state_check:
                    next_state_check = now + _STATE_CHECK_S
                    if self.runsc.state(sandbox_id).status == "stopped":
                        raise SandboxCreationError("sandbox stopped while starting",
                                                   sandbox_id=sandbox_id,
                                                   stderr=_runsc_log(sdir))
                watch.wait(min(deadline, next_state_check) - now)
        client = AgentClient(sdir.socket, sandbox_id=sandbox_id,
                             io_timeout=self._connections.io_timeout)
        self._connections.add(sandbox_id, client)
        return client

    # --- teardown ----------------------------------------------------------------------------

    def delete(self, sandbox_id: str, reason: str) -> None:
        """:meth:`_stop` the sandbox, then tear the rest down in the background (in this
        thread if no tombstone could be written: nothing would hand it to gc)."""
        if self._stop(sandbox_id, reason):
            self._teardowns.submit(sandbox_id)
        else:
            self._teardown(sandbox_id)

    def destroy(self, sandbox_id: str, reason: str | None = None) -> None:
        """Stop the sandbox and remove everything it owns, in this thread. Safe on a
        half-made or already removed sandbox; ``reason`` becomes its tombstone. A teardown
        of it already running (a delete racing its TTL) is waited for, not run twice."""
        self._stop(sandbox_id, reason)
        self._teardowns.run(sandbox_id, _SETTLE_WAIT_S, propagate=True)

    def finish_teardowns(self) -> list[str]:
        """Finish, in this thread, the teardowns this process left unfinished: its own
        tombstones, whose teardown failed part-way or was never handed over (their owner is
        alive, so gc leaves them to it, and a long-lived process must not leak them until it
        ends). Returns the ids it tore down; each is logged, since it means a teardown
        failed."""
        me, done = os.getpid(), []
        for sid in self._records.buried():
            stone = self._records.read_tombstone(sid)
            if stone is None or stone.owner_pid != me:
                continue
            if self._teardowns.run(sid, _SETTLE_WAIT_S):
                _log.warning("sandbox %s (%s) had an unfinished teardown; finished it now",
                             sid, stone.reason)
                done.append(sid)
        return done

    def _stop(self, sandbox_id: str, reason: str | None) -> bool:
        """The synchronous phase of a delete: afterwards the sandbox can no longer run or be
        reached and its id is gone for every process (SandboxNotFoundError), while its
        tombstone hands the rest of the teardown to gc if this process dies first. Returns
        whether the tombstone was written (not on a full disk)."""
        self._records.forget(sandbox_id, reason)
        try:
            self._records.bury(sandbox_id, reason or "Deleted")
            buried = True
        except OSError:
            buried = False
        self._connections.close(sandbox_id)
        self.runsc.kill_sandbox(sandbox_id)
        return buried

    def _teardown(self, sandbox_id: str) -> None:
        """Remove everything a stopped sandbox owns: runsc state, network, image pin,
        cgroups, mounts, files, and last its tombstone. Every step runs even if one fails."""
        sdir = self._records.sdir(sandbox_id)
        errors: list[Exception] = []
        try:
            self.runsc.delete(sandbox_id)
        except SandboxError as exc:
            errors.append(exc)
        try:
            network.detach(sandbox_id, sdir.path)
        except SandboxError as exc:
            errors.append(exc)
        rec = self._records.read(sandbox_id)
        try:  # e.g. the store's lock held past its timeout: the mounts must still go
            self._unpin(sandbox_id, rec)
        except SandboxError as exc:
            errors.append(exc)
        for cg in procfs.cgroup_dirs(sandbox_id):
            with contextlib.suppress(OSError):
                cg.rmdir()
        for leftover in self.runsc.root.glob(f"*{sandbox_id}*"):
            try:
                leftover.unlink(missing_ok=True)
            except OSError as exc:  # not a file: the mounts below must still go
                errors.append(SandboxError(f"runsc left {leftover}: {exc}",
                                           sandbox_id=sandbox_id))
        checkpoint.remove_suspended(sdir)  # a suspended sandbox's, also on a shared path
        had_volumes = sdir.volumes.is_dir()
        for point in _mount.mounts_under(sdir.path):
            _mount.unmount(point)
        if had_volumes:  # after its binds are gone: a volume no sandbox uses is unmounted
            self.volumes.release_idle()
            if _mount.mounts_under(sdir.volumes):
                # Removing the directory would walk into a volume and delete its data: keep
                # it (and the tombstone) for the next gc.
                raise SandboxStateError(f"volume binds still mounted under {sdir.volumes}",
                                        sandbox_id=sandbox_id)
            if rec is not None:
                self._delete_volumes_with(rec, errors)
        sdir.remove()
        self._records.unbury(sandbox_id)
        if errors:
            raise errors[0]

    def _unpin(self, sandbox_id: str, rec: SandboxRecord | None) -> None:
        """Drop the sandbox's image pin; without a record (a restore that failed before
        writing it) its pin is looked for on every image."""
        owner = self._pin_owner(sandbox_id)
        if rec is not None:
            self.images.unpin(rec.image_digest, owner)
            return
        with contextlib.suppress(OSError):  # a store wiped under us: nothing to unpin
            for digest in {image.digest for image in self.images.list()}:
                if owner in self.images.pins(digest):
                    self.images.unpin(digest, owner)

    def _delete_volumes_with(self, rec: SandboxRecord, errors: list[Exception]) -> None:
        """The sandbox's ``on_delete="delete"`` volumes, each unless another sandbox still
        has it mounted (then the last user's teardown, if it says so too, or a person)."""
        for mount in rec.sandbox_config.volumes.values():
            if mount.on_delete != "delete":
                continue
            try:
                self.volumes.delete(mount.name)
            except VolumeInUseError:
                continue  # still used elsewhere: kept
            except VolumeNotFoundError:
                continue  # deleted meanwhile
            except SandboxError as exc:
                errors.append(exc)

    def _settle(self, sandbox_id: str) -> None:
        """An id is used again only once its previous sandbox is gone: a pending teardown
        of ours is finished first, one a dead process left (its tombstone) here."""
        self._teardowns.settle(sandbox_id, _SETTLE_WAIT_S)
        if self._records.read_tombstone(sandbox_id) is not None:
            self._teardown(sandbox_id)

    def settle_pins(self, digest: str) -> None:
        """Finish the pending teardowns of this home's deleted sandboxes that still pin
        ``digest``: delete() returns before its teardown unpins, and removing the image
        right after must not find it in use. A live sandbox's pin is left alone."""
        for owner in self.images.pins(digest):
            sandbox_id = owner.removeprefix(self._pin_prefix)
            if owner.startswith(self._pin_prefix) and ID_RE.match(sandbox_id):
                self._settle(sandbox_id)

    def pinned_here(self, digest: str) -> bool:
        """Whether a sandbox of this home pins ``digest`` (the store may be shared)."""
        return any(o.startswith(self._pin_prefix) for o in self.images.pins(digest))

    def drain(self) -> None:
        """Wait for the background teardowns, at most ``_DRAIN_WAIT_S``, then finish any
        this process left unfinished."""
        if not self._teardowns.drain(_DRAIN_WAIT_S):
            _log.warning("sandbox teardowns still running after %gs; they go on in the "
                         "background, and gc() finishes what a dead process left",
                         _DRAIN_WAIT_S)
            return
        self.finish_teardowns()


def _runsc_log(sdir: SandboxDir) -> str:
    try:
        return (sdir.path / "runsc.err").read_text(errors="replace")[-4000:]
    except OSError:
        return ""
