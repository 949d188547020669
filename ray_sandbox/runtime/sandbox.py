"""SandboxRuntime: create, drive and delete gVisor sandboxes on this node, without Ray.

(Over 600 lines and ~75 methods: the split into launch, records, exec requests, files,
snapshots, holds and the reaper is issue 16's open part, docs/ENGINEERING.md.)

State lives on disk (``home()/sandboxes/<id>/record.json`` plus runsc's own state), so any
process on the node can address any sandbox by id, status is read from runsc rather than from
bookkeeping, and a reaper can clean up after a creator that died.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import heapq
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from . import _mount, _subreaper, archive, bundle, disk, hostfs, network, paths, procfs
from .agent.client import READ_MAX, AgentClient, AgentProcess, connect_agent_socket
from .agent.pyrepl import PythonContext, PythonResult
from .bundle import SandboxDir
from .config import MAX_TIMEOUT, EgressPolicy, SandboxConfig, make_config
from .errors import (
    CommandError,
    ConfigError,
    ExecError,
    ImageError,
    ImageNotFoundError,
    SandboxCreationError,
    SandboxDiedError,
    SandboxError,
    SandboxNotFoundError,
    SandboxStateError,
    SnapshotCorruptError,
    SnapshotNotFoundError,
    ToolMissingError,
    UnsafePathError,
)
from .images import Image, ImageStore
from .results import ExecResult, FileInfo, FileType, OutputChunk, SandboxState, SandboxStatus
from .runsc import TARGET_VERSION, Runsc, RunscFlags
from .snapshot import (
    Snapshot,
    SnapshotDir,
    copy_tree,
    pack,
    rewrite_paths,
    unpack,
)
from .spec import Spec

T = TypeVar("T")
_log = logging.getLogger(__name__)
_ID_RE = re.compile(r"^[0-9a-f]{32}$")
_READY_TIMEOUT = 20.0
HOLD_FILE = "checkpoint.hold"  # the agent's HOLD_NAME (agent.c)
_CHECKPOINT_RETRY_S = 3.0
_RESTORE_PARALLEL = 8  # concurrent restores; two cores saturate well before this


class LimitNotEnforcedWarning(UserWarning):
    """A configured limit cannot be enforced in this mode (e.g. cgroups when rootless)."""


class SandboxRecord(BaseModel):
    """What the node knows about a sandbox; written before runsc starts it."""

    model_config = ConfigDict(extra="ignore")

    sandbox_id: str
    config: dict[str, Any]
    image: str
    image_digest: str
    rootfs: str  # the sandbox's own overlay root
    image_rootfs: str  # the shared, read-only image rootfs
    image_env: list[str] = Field(default_factory=list)
    image_user: str | None = None
    image_workdir: str | None = None
    created_at: float
    ttl_deadline: float | None = None
    owner_pid: int | None = None
    owner_start: int | None = None
    network: str = "none"
    overlay: str = "none"
    platform: str = "ptrace"
    rootless: bool = False
    directfs: bool = True
    oci_seccomp: bool = False  # the spec has a seccomp filter for the sentry to enforce
    phase: str = "creating"  # creating | created | paused
    endpoints: dict[int, tuple[str, int]] = Field(default_factory=dict)

    @property
    def sandbox_config(self) -> SandboxConfig:
        return SandboxConfig(**self.config)

    @property
    def runsc_flags(self) -> RunscFlags:
        return RunscFlags(network=self.network, overlay=self.overlay, rootless=self.rootless,
                          platform=self.platform, directfs=self.directfs,
                          oci_seccomp=self.oci_seccomp)






def _io_timeout(given: float | None) -> float:
    """The agent frame deadline: ``given``, else ``RAY_SANDBOX_AGENT_IO_TIMEOUT``, else 60 s."""
    raw: Any = given if given is not None else os.environ.get("RAY_SANDBOX_AGENT_IO_TIMEOUT", 60.0)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = float("nan")
    if not 0 < value <= MAX_TIMEOUT:  # also refuses nan
        raise ConfigError(f"io_timeout / RAY_SANDBOX_AGENT_IO_TIMEOUT must be seconds in "
                          f"(0, {MAX_TIMEOUT:.0f}], got {raw!r}")
    return value


def _start_of(pid: int) -> int | None:
    st = procfs.stat(pid)
    return None if st is None else st.start


def _owner_alive(rec: SandboxRecord) -> bool:
    if rec.owner_pid is None:
        return True  # detached: only deleted explicitly or by its TTL
    # A zombie is dead: its parent (e.g. a subreaper that does not collect it) may never reap.
    st = procfs.stat(rec.owner_pid)
    return st is not None and st.start == rec.owner_start and st.state != "Z"


def _agent_binary() -> Path:
    env = os.environ.get("RAY_SANDBOX_AGENT")
    path = Path(env) if env else Path(__file__).resolve().parent / "agent" / bundle.AGENT_NAME
    if not path.is_file():
        raise SandboxCreationError(
            f"the in-sandbox agent {path} is missing; build it with "
            "`make -C ray_sandbox/runtime/agent` (scripts/setup.sh does)"
        )
    return path


def _localize_spec(spec: dict[str, Any], sandbox_id: str, netns: str | None) -> dict[str, Any]:
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
            m["source"] = str(_agent_binary().parent)
    return spec








def _accepts(path: Path) -> bool:
    """Whether the agent listens on its socket ``path`` (the probe connection is closed at
    once; the agent's handler for it sees EOF and exits)."""
    try:
        connect_agent_socket(path).close()
    except OSError:
        return False
    return True


def _stdin_bytes(stdin: bytes | str | None, sandbox_id: str) -> bytes | None:
    if not isinstance(stdin, str):
        return stdin
    try:
        return stdin.encode()
    except UnicodeEncodeError:
        raise ExecError("stdin text cannot be encoded as UTF-8", sandbox_id=sandbox_id) from None




def _maps_death(method: Callable[..., T]) -> Callable[..., T]:
    """A file operation whose agent connection died reports why the sandbox died (e.g.
    OOMKilled), like exec does."""

    @functools.wraps(method)
    def wrapper(self: SandboxRuntime, sandbox_id: str, *args: Any, **kwargs: Any) -> T:
        try:
            return method(self, sandbox_id, *args, **kwargs)
        except SandboxDiedError as exc:
            raise self._died(sandbox_id, exc) from None

    return wrapper


class SandboxRuntime:
    """Create and drive gVisor sandboxes on this node.

    >>> runtime = SandboxRuntime()
    >>> sb = runtime.create(image="ray-sandbox/python", memory="512Mi")
    >>> runtime.exec(sb, "python3 -c 'print(1)'").stdout
    '1\\n'
    >>> runtime.delete(sb)

    Thread-safe. ``reap=True`` first cleans up sandboxes whose creating process died.
    """

    def __init__(
        self,
        home: str | Path | None = None,
        *,
        images: ImageStore | None = None,
        reap: bool = True,
        io_timeout: float | None = None,
    ) -> None:
        # how long one frame to or from a sandbox's agent may take (a frozen agent must not
        # pin the caller); RAY_SANDBOX_AGENT_IO_TIMEOUT reaches the runtime of a Ray host too
        self._io_timeout = _io_timeout(io_timeout)
        self.home = Path(home) if home is not None else paths.home()
        self.sandboxes_dir = self.home / "sandboxes"
        self._pin_prefix = hashlib.sha256(str(self.home.resolve()).encode()).hexdigest()[:12] + ":"
        self.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        self.snapshots_dir = self.home / "snapshots"
        self.snapshots_dir.mkdir(parents=True, exist_ok=True)
        self.images = images or ImageStore(paths.images(self.home))
        self.runsc = Runsc(self.home / "runsc")
        self.runsc.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._clients: dict[str, AgentClient] = {}
        self._records: dict[str, SandboxRecord] = {}
        self._owned: set[str] = set()
        self._tombstones: dict[str, str] = {}
        self._pycontexts: dict[tuple[str, str], PythonContext] = {}
        self._ttl_heap: list[tuple[float, str]] = []
        self._ttl_cv = threading.Condition(self._lock)
        self._ttl_thread: threading.Thread | None = None
        _subreaper.ensure()
        if reap:
            self.gc()

    # --- lifecycle -------------------------------------------------------------------------

    def create(
        self,
        config: SandboxConfig | Mapping[str, Any] | None = None,
        *,
        detach: bool = False,
        **kwargs: Any,
    ) -> str:
        """Create and start a sandbox; returns its id once it is ready for exec.

        Keyword arguments are :class:`SandboxConfig` fields (``image``, ``cpu``, ``memory``,
        ``spec_transform``/``_oci_spec_transform_fn`` …). ``detach=True`` lets the sandbox
        outlive this process (then only ``delete`` or its TTL end it).
        """
        cfg = make_config(config, **kwargs)
        if cfg.effective_rootless and (cfg.memory or cfg.cpu):
            warnings.warn(
                "rootless sandboxes run without cgroups: memory/cpu limits are NOT enforced",
                LimitNotEnforcedWarning,
                stacklevel=2,
            )
        agent = _agent_binary()
        sandbox_id = uuid.uuid4().hex
        image = self._get_pinned(cfg.image, sandbox_id)
        sdir = SandboxDir(self.sandboxes_dir / sandbox_id)
        try:
            sdir.create()
            rec = self._start(sandbox_id, sdir, cfg, image, agent, detach)
        except BaseException as exc:
            self._destroy(sandbox_id)
            self.images.unpin(image.digest, self._pin_owner(sandbox_id))  # no record yet
            if isinstance(exc, SandboxCreationError):
                raise
            if isinstance(exc, SandboxError):
                raise SandboxCreationError(
                    f"creating sandbox failed: {exc.message}",
                    sandbox_id=sandbox_id,
                    argv=exc.argv,
                    returncode=exc.returncode,
                    stderr=exc.stderr,
                ) from exc
            raise
        with self._lock:
            self._records[sandbox_id] = rec
            self._owned.add(sandbox_id)
            if rec.ttl_deadline is not None:
                self._schedule_ttl(sandbox_id, rec.ttl_deadline)
        return sandbox_id

    def _pin_owner(self, sandbox_id: str) -> str:
        """The image pin of a sandbox: ``<home key>:<id>``, so that runtimes of several homes
        on one shared image store never take each other's pins for stale ones."""
        return self._pin_prefix + sandbox_id

    def _get_pinned(self, ref: str, sandbox_id: str) -> Image:
        """The image, pinned for this sandbox (a concurrent remove between get and pin makes
        the store fetch it again)."""
        for attempt in range(3):
            image = self.images.get(ref)
            try:
                self.images.pin(image.digest, self._pin_owner(sandbox_id))
                return image
            except ImageNotFoundError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _start(
        self, sandbox_id: str, sdir: SandboxDir, cfg: SandboxConfig, image, agent: Path,
        detach: bool,
    ) -> SandboxRecord:
        attachment, overlay = self._prepare(sandbox_id, sdir, cfg, image)
        if cfg.readonly and cfg.workdir:
            bundle.seed_workdir(Path(image.rootfs), cfg.workdir, sdir.work,
                                sandbox_id=sandbox_id)
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
        from .spec import apply_transform

        spec = apply_transform(spec, cfg.spec_transform, sandbox_id=sandbox_id)
        hostname = spec.hostname or "sandbox"
        bundle.write_bundle(
            sdir, spec, hostname=hostname, resolv_conf=attachment.resolv_conf,
            hosts=attachment.hosts,
        )
        rec = self._new_record(sandbox_id, sdir, cfg, image, attachment, overlay, detach,
                               image_user=image.config.user or None,
                               image_workdir=image.config.working_dir or None,
                               oci_seccomp=spec.linux.seccomp is not None)
        self.runsc.run_detached(sandbox_id, sdir.bundle, rec.runsc_flags,
                                prefix=attachment.run_prefix, log_dir=sdir.path)
        self._wait_ready(sandbox_id, sdir)
        if cfg.workdir and not cfg.readonly:
            # Like a Dockerfile WORKDIR: it exists even if the image lacks it. Made through
            # the agent, inside the sandbox, so image symlinks cannot point it at the host.
            self._clients[sandbox_id].mkdir(cfg.workdir, parents=True)
        rec = rec.model_copy(update={"phase": "created"})
        self._write_record(sdir, rec)
        return rec

    def _prepare(
        self, sandbox_id: str, sdir: SandboxDir, cfg: SandboxConfig, image,
        upper: Path | None = None,
    ) -> tuple[Any, str]:
        """Root overlay (upper layer copied from ``upper`` if given), the size-capped disk,
        network, gVisor overlay dir; returns the network attachment and the ``--overlay2``
        value."""
        if upper is not None:
            copy_tree(upper, sdir.upper)
        _mount.mount_overlay(Path(image.rootfs), sdir.upper, sdir.ovwork, sdir.root,
                             sandbox_id=sandbox_id)
        # Only a writable root (runsc's filestore) or a workdir bind write to the node's disk;
        # a read-only sandbox without a workdir writes only to memory-bounded tmpfs.
        if cfg.disk is not None and (not cfg.readonly or cfg.workdir):
            disk.attach(sdir.disk_image, sdir.disk, cfg.disk, sandbox_id=sandbox_id)
        attachment = network.attach(sandbox_id, cfg, sdir.path)
        overlay = "none"
        if not cfg.readonly:
            sdir.overlay.mkdir()
            overlay = f"root:dir={sdir.overlay}"
        return attachment, overlay

    def _new_record(
        self, sandbox_id: str, sdir: SandboxDir, cfg: SandboxConfig, image, attachment: Any,
        overlay: str, detach: bool, *, image_user: str | None, image_workdir: str | None,
        oci_seccomp: bool,
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
            owner_pid=None if detach else os.getpid(),
            owner_start=None if detach else procfs.stat(os.getpid()).start,
            network=attachment.runsc_network,
            overlay=overlay,
            platform=cfg.platform,
            rootless=cfg.effective_rootless,
            directfs=cfg.directfs,
            oci_seccomp=oci_seccomp,
            endpoints=attachment.endpoints,
        )
        self._write_record(sdir, rec)
        return rec

    def _wait_ready(self, sandbox_id: str, sdir: SandboxDir) -> None:
        client = AgentClient(sdir.socket, sandbox_id=sandbox_id)
        deadline = time.monotonic() + _READY_TIMEOUT
        next_state_check = time.monotonic() + 0.25
        while True:
            if sdir.socket.exists():
                try:
                    client.ping()
                    with self._lock:
                        self._clients[sandbox_id] = client
                    return
                except SandboxError:
                    pass
            now = time.monotonic()
            if now > deadline:
                client.close()
                raise SandboxCreationError(
                    f"sandbox agent did not become ready within {_READY_TIMEOUT:g}s",
                    sandbox_id=sandbox_id, stderr=self._runsc_log(sdir),
                )
            if now > next_state_check:
                next_state_check = now + 0.25
                st = self.runsc.state(sandbox_id)
                if st.status == "stopped":
                    client.close()
                    raise SandboxCreationError(
                        "sandbox stopped while starting", sandbox_id=sandbox_id,
                        stderr=self._runsc_log(sdir),
                    )
            time.sleep(0.002)

    @staticmethod
    def _runsc_log(sdir: SandboxDir) -> str:
        try:
            return (sdir.path / "runsc.err").read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    @staticmethod
    def _write_record(sdir: SandboxDir, rec: SandboxRecord) -> None:
        tmp = sdir.record.with_suffix(".tmp")
        tmp.write_text(rec.model_dump_json())
        os.replace(tmp, sdir.record)

    def delete(self, sandbox_id: str) -> None:
        """Stop the sandbox and remove everything it owns. Idempotent."""
        self._check_id(sandbox_id)
        self._destroy(sandbox_id, reason="Deleted")

    terminate = delete

    def _destroy(self, sandbox_id: str, reason: str | None = None) -> None:
        with self._lock:
            client = self._clients.pop(sandbox_id, None)
            self._records.pop(sandbox_id, None)
            self._owned.discard(sandbox_id)
            if reason:
                self._tombstones[sandbox_id] = reason
            for key in [k for k in self._pycontexts if k[0] == sandbox_id]:
                self._pycontexts.pop(key)
        if client:
            client.close()
        sdir = SandboxDir(self.sandboxes_dir / sandbox_id)
        errors: list[Exception] = []
        try:
            self.runsc.delete(sandbox_id)
        except SandboxError as exc:
            errors.append(exc)
        try:
            network.detach(sandbox_id, sdir.path)
        except SandboxError as exc:
            errors.append(exc)
        rec = self._load_record(sandbox_id)
        if rec is not None:
            self.images.unpin(rec.image_digest, self._pin_owner(sandbox_id))
        for cg in procfs.cgroup_dirs(sandbox_id):
            try:
                cg.rmdir()
            except OSError:
                pass
        for leftover in self.runsc.root.glob(f"*{sandbox_id}*"):
            leftover.unlink(missing_ok=True)
        for point in _mount.mounts_under(sdir.path):
            _mount.unmount(point)
        sdir.remove()
        if errors:
            raise errors[0]

    # --- pause, snapshot, restore, fork ------------------------------------------------------

    def _require_state(self, sandbox_id: str, *allowed: str) -> SandboxRecord:
        """The record, if runsc reports the container in one of ``allowed`` states."""
        rec = self._record(sandbox_id)
        try:
            status = self.runsc.state(sandbox_id).status
        except SandboxNotFoundError:
            status = "missing"
        if status not in allowed:
            raise SandboxStateError(
                f"sandbox is {status}; this needs it {' or '.join(allowed)}",
                sandbox_id=sandbox_id,
            )
        return rec

    def _set_phase(self, rec: SandboxRecord, phase: str) -> None:
        rec = rec.model_copy(update={"phase": phase})
        with self._lock:
            if rec.sandbox_id in self._records:
                self._records[rec.sandbox_id] = rec
        self._write_record(SandboxDir(self.sandboxes_dir / rec.sandbox_id), rec)

    def pause(self, sandbox_id: str) -> None:
        """Freeze every process of the sandbox (``runsc pause``). Until :meth:`resume`,
        exec, spawn and file calls raise :class:`SandboxStateError` instead of waiting."""
        rec = self._require_state(sandbox_id, "running")
        self._set_phase(rec, "paused")
        try:
            self.runsc.pause(sandbox_id)
        except SandboxError:
            self._set_phase(rec, "created")
            raise

    def resume(self, sandbox_id: str) -> None:
        """Thaw a paused sandbox; its processes go on where they stopped."""
        rec = self._require_state(sandbox_id, "paused")
        self.runsc.resume(sandbox_id)
        self._set_phase(rec, "created")

    def _check_checkpoint_support(self) -> None:
        version = self.runsc.version
        if not version.has_fast_checkpoint:
            raise ToolMissingError(
                f"snapshots need runsc {TARGET_VERSION} or newer; {self.runsc.binary} is "
                f"{version.version} (its checkpoint --leave-running blocks until the sandbox "
                "exits and it cannot write uncompressed images)"
            )

    def snapshot(
        self, sandbox_id: str, *, detach: bool = False, labels: Mapping[str, str] | None = None,
        drain_timeout: float = 30.0,
    ) -> Snapshot:
        """Checkpoint a running sandbox (memory, processes, writable layers) to disk; it keeps
        running. Calls made meanwhile wait; calls already running get ``drain_timeout``
        seconds to finish. Spawned processes keep running but their handles are detached
        (see docs/snapshots.md). ``detach=True`` lets the snapshot outlive this process."""
        self._check_checkpoint_support()
        rec = self._require_state(sandbox_id, "running")
        sdir = SandboxDir(self.sandboxes_dir / sandbox_id)
        snap_id = uuid.uuid4().hex
        sd = SnapshotDir(self.snapshots_dir / snap_id)
        sd.image.mkdir(parents=True)
        try:
            with self._held_agent(sandbox_id, sdir, drain_timeout):
                self._checkpoint(rec, sd.image)
                # Host dirs are not in gVisor's image; copied while the agent still holds.
                copy_tree(sdir.upper, sd.upper)
                if sdir.work.is_dir():
                    copy_tree(sdir.work, sd.work)
            shutil.copyfile(sdir.bundle / "config.json", sd.spec)
            shutil.copyfile(sdir.etc / "hostname", sd.hostname)
            snap = Snapshot(
                snapshot_id=snap_id, source_id=sandbox_id, path=str(sd.path),
                config=rec.config, image=rec.image, image_digest=rec.image_digest,
                image_env=rec.image_env, image_user=rec.image_user,
                image_workdir=rec.image_workdir, network=rec.network,
                overlay=rec.overlay != "none", platform=rec.platform, rootless=rec.rootless,
                source_dir=str(sdir.path),
                owner_pid=None if detach else os.getpid(),
                owner_start=None if detach else procfs.stat(os.getpid()).start,
                labels=dict(labels or {}),
            )  # fmt: skip
            return sd.seal(snap)
        except BaseException:
            sd.remove()
            raise

    @contextmanager
    def _held_agent(self, sandbox_id: str, sdir: SandboxDir, drain_timeout: float):
        """gVisor cannot checkpoint a socket bound or connected to the host: hold new calls,
        drop every connection, and have the agent close its listener (it does while the
        hold file exists); afterwards it listens again and held calls go on."""
        client = self._client(sandbox_id)
        hold = sdir.run / HOLD_FILE
        with client.quiesce(drain_timeout):
            # Warm interpreters cannot be reached after the hold anyway (their connections
            # go): stop them before it, so no copy carries an unreachable one.
            with self._lock:
                keys = [k for k in self._pycontexts if k[0] == sandbox_id]
                contexts = [self._pycontexts.pop(k) for k in keys]
            for ctx in contexts:
                # Killed and waited for: a connection merely dropped while the hold file
                # exists counts as "detach" to the agent, which would keep it running.
                ctx.kill()
            hold.touch()
            try:
                client.drop_connections()
                self._wait_socket(sdir, present=False, wake=True)
                yield
            finally:
                hold.unlink(missing_ok=True)
                self._wait_socket(sdir, present=True, wake=False)

    @staticmethod
    def _wait_socket(sdir: SandboxDir, *, present: bool, wake: bool,
                     timeout: float = 10.0) -> None:
        """Wait until the agent listens on its socket again (or has closed it). ``wake``
        connects once so the agent notices a new hold file without waiting for its next
        check. The socket file appears at bind(), a moment before listen(): until then a
        connect is refused, so reopening waits for a connect that succeeds."""
        if wake:
            _accepts(sdir.socket)
        deadline = time.monotonic() + timeout
        while not (_accepts(sdir.socket) if present else not sdir.socket.exists()):
            if time.monotonic() > deadline:
                raise SandboxStateError(
                    f"the agent did not {'re-open' if present else 'close'} its socket "
                    f"within {timeout:g}s", sandbox_id=sdir.path.name,
                )
            time.sleep(0.0005)

    def _checkpoint(self, rec: SandboxRecord, image: Path) -> None:
        # A handler may close its side of a dropped connection a moment after the drop:
        # until then gVisor refuses to encode it ("encoding error"); the failed attempt
        # leaves the sandbox running, so try again for a short while.
        deadline = time.monotonic() + _CHECKPOINT_RETRY_S
        while True:
            try:
                self.runsc.checkpoint(rec.sandbox_id, image, rec.runsc_flags)
                return
            except CommandError as exc:
                if "encoding error" not in (exc.stderr or "") or time.monotonic() > deadline:
                    raise
            for f in image.iterdir():
                f.unlink()
            time.sleep(0.01)

    def _snapshot_dir(self, snapshot: Snapshot | str) -> tuple[Snapshot, SnapshotDir]:
        snap_id = snapshot if isinstance(snapshot, str) else snapshot.snapshot_id
        if not isinstance(snap_id, str) or not _ID_RE.match(snap_id):
            raise SnapshotNotFoundError(f"not a snapshot id: {snap_id!r}")
        sd = SnapshotDir(self.snapshots_dir / snap_id)
        return sd.load(snap_id), sd

    def restore(
        self,
        snapshot: Snapshot | str,
        k: int = 1,
        *,
        labels: Mapping[str, str] | None = None,
        detach: bool = False,
        on_restore: str | list[str] | None = None,
        sandbox_ids: list[str] | None = None,
    ) -> list[str]:
        """Start ``k`` new sandboxes from a snapshot on this node; returns their ids once all
        are ready for exec. Each gets its own sandbox dir, root overlay upper, workdir copy,
        network, cgroups and runsc id. ``labels`` replace the source's labels;
        ``on_restore`` runs in each copy before it is returned (e.g. to reseed PRNGs; a
        fresh random seed is at /.rsb/run/seed). All or nothing: a copy that fails is
        retried once, then every copy made by this call is deleted and the error raised."""
        if k < 1:
            raise ConfigError(f"k must be at least 1, got {k}")
        if sandbox_ids is not None and len(sandbox_ids) != k:
            raise ConfigError("sandbox_ids must have k entries")
        self._check_checkpoint_support()
        snap, sd = self._snapshot_dir(snapshot)
        sd.verify(snap)
        ids = sandbox_ids or [uuid.uuid4().hex for _ in range(k)]
        made: list[str] = []
        with ThreadPoolExecutor(max_workers=min(k, _RESTORE_PARALLEL)) as pool:
            futures = [pool.submit(self._restore_retrying, snap, sd, i, labels, detach,
                                   on_restore) for i in ids]  # fmt: skip
            errors = []
            for i, fut in zip(ids, futures, strict=True):
                try:
                    fut.result()
                    made.append(i)
                except BaseException as exc:  # noqa: BLE001 - re-raised below
                    errors.append(exc)
        if errors:
            for i in made:
                with contextlib.suppress(SandboxError):
                    self._destroy(i)
            raise errors[0]
        return ids

    def _restore_retrying(self, snap: Snapshot, sd: SnapshotDir, sandbox_id: str,
                          labels: Mapping[str, str] | None, detach: bool,
                          on_restore: str | list[str] | None) -> None:
        for attempt in (1, 2):
            try:
                self._restore_one(snap, sd, sandbox_id, labels, detach, on_restore)
                return
            except SandboxError as exc:
                self._destroy(sandbox_id)
                if attempt == 2 or isinstance(exc, ConfigError | ImageError):
                    raise SandboxCreationError(
                        f"restoring snapshot {snap.snapshot_id} failed: {exc.message}",
                        sandbox_id=sandbox_id, argv=exc.argv, returncode=exc.returncode,
                        stderr=exc.stderr,
                    ) from exc
            except BaseException:
                self._destroy(sandbox_id)
                raise

    def _restore_one(self, snap: Snapshot, sd: SnapshotDir, sandbox_id: str,
                     labels: Mapping[str, str] | None, detach: bool,
                     on_restore: str | list[str] | None) -> None:
        config = dict(snap.config)
        # Published ports are leased node-wide: a copy cannot take its source's.
        config["expose_ports"] = ()
        if labels is not None:
            config["labels"] = dict(labels)
        cfg = make_config(config)
        image = self._get_pinned(snap.image, sandbox_id)
        if image.digest != snap.image_digest:
            raise SnapshotCorruptError(
                f"image {snap.image} is {image.digest} on this node, the snapshot needs "
                f"{snap.image_digest}", sandbox_id=sandbox_id,
            )
        sdir = SandboxDir(self.sandboxes_dir / sandbox_id)
        sdir.create()
        attachment, overlay = self._prepare(sandbox_id, sdir, cfg, image, upper=sd.upper)
        if sd.work.is_dir():
            copy_tree(sd.work, sdir.work)
        spec = rewrite_paths(json.loads(sd.spec.read_text()), snap.source_dir, str(sdir.path))
        spec = _localize_spec(spec, sandbox_id, attachment.netns_path)
        hostname = sd.hostname.read_text().strip()
        spec_model = Spec.model_validate(spec)
        bundle.write_bundle(sdir, spec_model, hostname=hostname,
                            resolv_conf=attachment.resolv_conf, hosts=attachment.hosts)
        (sdir.run / "seed").write_text(os.urandom(32).hex() + "\n")
        rec = self._new_record(sandbox_id, sdir, cfg, image, attachment, overlay, detach,
                               image_user=snap.image_user, image_workdir=snap.image_workdir,
                               oci_seccomp=spec_model.linux.seccomp is not None)
        # The source's global flags: a restore with another --directfs fails (ENOMEM).
        self.runsc.restore_detached(sandbox_id, sdir.bundle, sd.image, rec.runsc_flags,
                                    prefix=attachment.run_prefix, log_dir=sdir.path)
        self._wait_ready(sandbox_id, sdir)
        rec = rec.model_copy(update={"phase": "created"})
        self._write_record(sdir, rec)
        with self._lock:
            self._records[sandbox_id] = rec
            self._owned.add(sandbox_id)
            self._tombstones.pop(sandbox_id, None)  # a suspended sandbox back under its id
            if rec.ttl_deadline is not None:
                self._schedule_ttl(sandbox_id, rec.ttl_deadline)
        if on_restore is not None:
            res = self.exec(sandbox_id, on_restore)
            if not res.ok:
                raise SandboxCreationError(
                    f"on_restore exited {res.exit_code}", sandbox_id=sandbox_id,
                    stderr=res.stderr,
                )

    def fork(self, sandbox_id: str, k: int = 1, **restore_kw: Any) -> list[str]:
        """``k`` running copies of a running sandbox (snapshot + restore; the snapshot is
        deleted afterwards). Keyword arguments go to :meth:`restore`."""
        snap = self.snapshot(sandbox_id)
        try:
            return self.restore(snap, k, **restore_kw)
        finally:
            self.delete_snapshot(snap)

    def delete_snapshot(self, snapshot: Snapshot | str) -> None:
        """Remove a snapshot's files from this node. Idempotent."""
        snap_id = snapshot if isinstance(snapshot, str) else snapshot.snapshot_id
        if isinstance(snap_id, str) and _ID_RE.match(snap_id):
            SnapshotDir(self.snapshots_dir / snap_id).remove()

    def list_snapshots(self) -> list[Snapshot]:
        """Every complete snapshot on this node."""
        out = []
        for d in sorted(self.snapshots_dir.iterdir()):
            if _ID_RE.match(d.name):
                with contextlib.suppress(SandboxError):
                    out.append(SnapshotDir(d).load(d.name))
        return out

    def get_snapshot(self, snapshot_id: str) -> Snapshot:
        return self._snapshot_dir(snapshot_id)[0]

    def has_snapshot(self, snapshot_id: str) -> bool:
        return bool(_ID_RE.match(snapshot_id)) and (
            self.snapshots_dir / snapshot_id / "snapshot.json").exists()

    def export_snapshot(self, snapshot_id: str) -> Iterator[bytes]:
        """The snapshot's files as a tar stream, for :meth:`import_snapshot` on another node."""
        snap, sd = self._snapshot_dir(snapshot_id)
        sd.verify(snap)
        return pack(sd.path)

    def import_snapshot(self, chunks: Iterable[bytes], *, detach: bool = False) -> Snapshot:
        """Store a snapshot exported on another node (same id); owned by this process unless
        ``detach``. A damaged stream leaves nothing behind."""
        tmp = self.snapshots_dir / f".import-{uuid.uuid4().hex}"
        unpack(chunks, tmp)
        try:
            sd = SnapshotDir(tmp)
            snap = json.loads(sd.meta.read_text()).get("snapshot_id", "")
            snap = sd.load(snap)
            sd.verify(snap)
            dest = self.snapshots_dir / snap.snapshot_id
            snap = snap.model_copy(update={
                "path": str(dest),
                "owner_pid": None if detach else os.getpid(),
                "owner_start": None if detach else procfs.stat(os.getpid()).start,
            })  # fmt: skip
            sd.write(snap)
            os.replace(tmp, dest)
            return snap
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _gc_snapshots(self) -> list[str]:
        """Snapshots whose owner died, and partial ones (no snapshot.json) older than a
        minute (a snapshot being taken is younger)."""
        removed = []
        for d in sorted(self.snapshots_dir.iterdir()):
            if not _ID_RE.match(d.name):
                if d.name.startswith(".import-") and time.time() - d.stat().st_mtime > 60:
                    shutil.rmtree(d, ignore_errors=True)  # an import whose process died
                continue
            sd = SnapshotDir(d)
            try:
                snap = sd.load(d.name)
            except SnapshotNotFoundError:
                if time.time() - d.stat().st_mtime < 60:
                    continue
            except SandboxError:
                pass
            else:
                if snap.owner_pid is None or _start_of(snap.owner_pid) == snap.owner_start:
                    continue
            sd.remove()
            removed.append(d.name)
        return removed

    # --- status ----------------------------------------------------------------------------

    def _check_id(self, sandbox_id: str) -> None:
        if not isinstance(sandbox_id, str) or not _ID_RE.match(sandbox_id):
            raise SandboxNotFoundError(f"not a sandbox id: {sandbox_id!r}", sandbox_id=None)

    def _load_record(self, sandbox_id: str) -> SandboxRecord | None:
        with self._lock:
            rec = self._records.get(sandbox_id)
        if rec is not None:
            return rec
        try:
            return SandboxRecord.model_validate_json(
                (self.sandboxes_dir / sandbox_id / "record.json").read_text()
            )
        except (OSError, ValueError):
            return None

    def _record(self, sandbox_id: str) -> SandboxRecord:
        self._check_id(sandbox_id)
        rec = self._load_record(sandbox_id)
        if rec is None:
            reason = self._tombstones.get(sandbox_id)
            msg = f"sandbox was deleted ({reason})" if reason else "no such sandbox"
            raise SandboxNotFoundError(msg, sandbox_id=sandbox_id)
        return rec

    def oom_killed(self, sandbox_id: str) -> bool:
        """Whether the kernel OOM-killed a process of this sandbox (its memory cgroup's
        counter: cheap, no runsc call; False once the sandbox is deleted)."""
        self._check_id(sandbox_id)
        return procfs.oom_killed(sandbox_id)

    def get_status(self, sandbox_id: str) -> SandboxStatus:
        """The sandbox's state as runsc reports it now."""
        self._check_id(sandbox_id)
        reason = self._tombstones.get(sandbox_id)
        if reason is not None:  # deleted (or being deleted) by this runtime
            return SandboxStatus(sandbox_id=sandbox_id, state=SandboxState.TERMINATED,
                                 reason=reason)
        rec = self._load_record(sandbox_id)
        if rec is None:
            raise SandboxNotFoundError("no such sandbox", sandbox_id=sandbox_id)
        state, reason = self._runsc_state(rec)
        return SandboxStatus(
            sandbox_id=sandbox_id,
            state=state,
            reason=reason,
            created_at=datetime.fromtimestamp(rec.created_at, tz=UTC),
            image=rec.image,
            labels=rec.config.get("labels", {}),
        )

    def _runsc_state(self, rec: SandboxRecord) -> tuple[SandboxState, str | None]:
        try:
            st = self.runsc.state(rec.sandbox_id)
        except SandboxNotFoundError:
            if rec.phase == "creating":
                return SandboxState.PENDING, None
            return SandboxState.ERROR, "ContainerMissing"
        if st.status in ("creating", "created"):
            return SandboxState.PENDING, None
        if st.status == "running":
            return SandboxState.RUNNING, None
        if st.status == "paused":
            return SandboxState.PAUSED, None
        if procfs.oom_killed(rec.sandbox_id):
            return SandboxState.ERROR, "OOMKilled"
        if procfs.pids_exhausted(rec.sandbox_id):
            return SandboxState.ERROR, "PidsLimit"
        return SandboxState.ERROR, "SandboxExited"

    def list(self, *, all: bool = False, labels: Mapping[str, str] | None = None) -> list[str]:
        """Ids of this runtime's sandboxes (``all=True``: every sandbox on the node)."""
        if all:
            ids = sorted(p.name for p in self.sandboxes_dir.iterdir() if _ID_RE.match(p.name))
        else:
            with self._lock:
                ids = sorted(self._owned)
        if labels:
            keep = []
            for i in ids:
                rec = self._load_record(i)
                if rec and all_items(rec.config.get("labels", {}), labels):
                    keep.append(i)
            ids = keep
        return ids

    def record(self, sandbox_id: str) -> SandboxRecord:
        """The node's record of a sandbox (config, image, owner, endpoints)."""
        return self._record(sandbox_id)

    # --- exec --------------------------------------------------------------------------------

    def _client(self, sandbox_id: str) -> AgentClient:
        with self._lock:
            client = self._clients.get(sandbox_id)
            rec = self._records.get(sandbox_id)
        if rec is None:
            rec = self._load_record(sandbox_id)
        if rec is not None and rec.phase == "paused":
            # Its processes are frozen: a call would only hang until its deadline.
            raise SandboxStateError("sandbox is paused; resume it first", sandbox_id=sandbox_id)
        if client is not None:
            return client
        self._record(sandbox_id)
        client = AgentClient(self.sandboxes_dir / sandbox_id / "run" / "agent.sock",
                             sandbox_id=sandbox_id, io_timeout=self._io_timeout)
        with self._lock:
            return self._clients.setdefault(sandbox_id, client)

    def _exec_args(
        self,
        rec: SandboxRecord,
        command: str | list[str],
        *,
        cwd: str | None,
        env: Mapping[str, str] | None,
        user: str | None,
        shell: str | None,
        timeout: float | None,
    ) -> dict[str, Any]:
        cfg = rec.config
        if isinstance(command, str):
            sh = shell or "/bin/sh"
            if not os.path.lexists(Path(rec.image_rootfs) / sh.lstrip("/")):
                raise ExecError(
                    f"image {rec.image} has no {sh}; pass the command as an argv list",
                    sandbox_id=rec.sandbox_id,
                )
            argv = [sh, "-c", command]
        elif isinstance(command, list | tuple):
            argv = [str(a) for a in command]
            if not argv:
                raise ExecError("empty command", sandbox_id=rec.sandbox_id)
        else:
            raise ConfigError(f"command must be a string or a list of arguments, not "
                              f"{type(command).__name__}", sandbox_id=rec.sandbox_id)
        for a in argv:
            if "\0" in a:
                raise ExecError("command contains a NUL byte", sandbox_id=rec.sandbox_id)
        if env is not None and not isinstance(env, Mapping):
            raise ConfigError("env must be a mapping of names to strings",
                              sandbox_id=rec.sandbox_id)
        merged = {**cfg.get("env", {}), **(env or {})}
        for k, v in merged.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise ConfigError(f"environment variable {k!r}: names and values must be "
                                  "strings", sandbox_id=rec.sandbox_id)
            if not k or "=" in k or "\0" in k or "\0" in v:
                raise ExecError(f"invalid environment variable {k!r}", sandbox_id=rec.sandbox_id)
        if timeout is None:
            timeout = cfg.get("timeout_seconds")
        return {
            "argv": argv,
            "env": bundle.merge_env(rec.image_env, merged),
            "cwd": cwd or cfg.get("workdir") or rec.image_workdir or "/",
            "user": user or cfg.get("user") or rec.image_user or None,
            "timeout": timeout,
        }

    def exec(
        self,
        sandbox_id: str,
        command: str | list[str],
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        shell: str | None = None,
        stdin: bytes | str | None = None,
        max_output_bytes: int | None = None,
    ) -> ExecResult:
        """Run a command and wait for it. A string runs through ``shell`` (default
        ``/bin/sh -c``); a list runs as argv. A timeout kills the whole process tree inside
        and returns the partial output with ``timed_out=True``."""
        rec = self._record(sandbox_id)
        args = self._exec_args(rec, command, cwd=cwd, env=env, user=user, shell=shell,
                               timeout=timeout)
        data = _stdin_bytes(stdin, sandbox_id)
        try:
            return self._client(sandbox_id).exec(
                **args, stdin=data, max_output_bytes=max_output_bytes
            )
        except SandboxDiedError as exc:
            raise self._died(sandbox_id, exc) from None

    def exec_stream(
        self,
        sandbox_id: str,
        command: str | list[str],
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        shell: str | None = None,
        stdin: bytes | str | None = None,
        max_output_bytes: int | None = None,
    ) -> Iterator[OutputChunk | ExecResult]:
        """Like :meth:`exec`, yielding output chunks as they arrive and the result last."""
        rec = self._record(sandbox_id)
        args = self._exec_args(rec, command, cwd=cwd, env=env, user=user, shell=shell,
                               timeout=timeout)
        data = _stdin_bytes(stdin, sandbox_id)
        try:
            yield from self._client(sandbox_id).exec_stream(
                **args, stdin=data, max_output_bytes=max_output_bytes
            )
        except SandboxDiedError as exc:
            raise self._died(sandbox_id, exc) from None

    def spawn(
        self,
        sandbox_id: str,
        command: str | list[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        shell: str | None = None,
        pty: tuple[int, int] | None = None,
    ) -> AgentProcess:
        """Start a background process; the handle writes stdin, reads output, waits, kills."""
        rec = self._record(sandbox_id)
        args = self._exec_args(rec, command, cwd=cwd, env=env, user=user, shell=shell,
                               timeout=None)
        args.pop("timeout")
        return self._client(sandbox_id).spawn(**args, pty=pty)

    def open_pty(
        self, sandbox_id: str, command: str | list[str] = "/bin/sh", *, rows: int = 24,
        cols: int = 80, **kw: Any,
    ) -> AgentProcess:
        """An interactive terminal session (write keys, read screen bytes, resize, close)."""
        if isinstance(command, str) and command.startswith("/") and " " not in command:
            command = [command]
        return self.spawn(sandbox_id, command, pty=(rows, cols), **kw)

    def _died(self, sandbox_id: str, exc: SandboxError) -> SandboxError:
        try:
            status = self.get_status(sandbox_id)
        except SandboxError:
            return exc
        if status.state == SandboxState.RUNNING:
            return exc
        return SandboxDiedError(
            f"sandbox is {status.state.value}"
            + (f" ({status.reason})" if status.reason else "")
            + f": {exc.message}",
            sandbox_id=sandbox_id,
        )

    def run_python(
        self, sandbox_id: str, code: str, *, timeout: float | None = None,
        context: str = "default",
    ) -> PythonResult:
        """Run ``code`` in a persistent interpreter inside the sandbox (state is kept per
        ``context`` between calls, like a notebook kernel). A timeout or crash restarts the
        interpreter, resetting that context's state."""
        rec = self._record(sandbox_id)
        key = (sandbox_id, context)
        with self._lock:
            ctx = self._pycontexts.get(key)
            if ctx is None:
                args = self._exec_args(rec, ["python3"], cwd=None, env=None, user=None,
                                       shell=None, timeout=None)
                ctx = PythonContext(self._client(sandbox_id), env=args["env"],
                                    cwd=args["cwd"], user=args["user"])
                self._pycontexts[key] = ctx
        if timeout is None:
            timeout = rec.config.get("timeout_seconds")
        try:
            return ctx.run(code, timeout=timeout)
        except SandboxDiedError as exc:
            raise self._died(sandbox_id, exc) from None

    def set_egress(self, sandbox_id: str, policy: EgressPolicy | Mapping[str, Any]) -> None:
        """Replace a ``public``/``sandbox`` network's egress policy; effective within a second
        (open connections to newly denied addresses are cut)."""
        self._record(sandbox_id)
        network.set_egress(sandbox_id, self.sandboxes_dir / sandbox_id, policy)

    async def exec_async(self, sandbox_id: str, command: str | list[str], **kw: Any) -> ExecResult:
        return await asyncio.to_thread(self.exec, sandbox_id, command, **kw)

    async def create_async(self, config: Any = None, **kw: Any) -> str:
        return await asyncio.to_thread(self.create, config, **kw)

    async def delete_async(self, sandbox_id: str) -> None:
        await asyncio.to_thread(self.delete, sandbox_id)

    # --- files -------------------------------------------------------------------------------

    def _files(self, sandbox_id: str) -> AgentClient:
        self._record(sandbox_id)
        return self._client(sandbox_id)

    @_maps_death
    def read_file(self, sandbox_id: str, path: str, *,
                  max_bytes: int | None = READ_MAX) -> bytes:
        """The file's bytes; over ``max_bytes`` (default 64 MiB, None for no bound) raises
        FileTooLargeError, whatever the sandbox claims its size is."""
        return self._files(sandbox_id).read_file(path, max_bytes=max_bytes)

    def write_file(
        self, sandbox_id: str, path: str, data: str | bytes | Iterable[bytes] | BinaryIO, *,
        mode: int = 0o644, append: bool = False,
    ) -> None:
        """Write (or append to) a file; missing parent directories are created."""
        payload = data.encode() if isinstance(data, str) else data
        self._files(sandbox_id).write_file(path, payload, mode=mode, append=append)

    @_maps_death
    def upload_file(self, sandbox_id: str, local_path: str | Path, remote_path: str) -> None:
        """Copy a host file into the sandbox, streaming (bounded memory); keeps its mode."""
        mode = os.stat(local_path).st_mode & 0o7777
        with open(local_path, "rb") as f:
            self._files(sandbox_id).write_file(remote_path, f, mode=mode)

    @_maps_death
    def download_file(self, sandbox_id: str, remote_path: str, local_path: str | Path, *,
                      max_bytes: int | None = hostfs.DOWNLOAD_MAX) -> None:
        """Copy a sandbox file to the host, streaming; written atomically and never through
        a link (see ``hostfs.write_atomic``), mode kept. Over ``max_bytes`` (default 1 GiB,
        None for no bound) raises FileTooLargeError and leaves nothing."""
        client = self._files(sandbox_id)
        mode = client.stat(remote_path, follow_symlinks=True).mode
        hostfs.write_atomic(local_path, client.iter_read(remote_path, max_bytes=max_bytes),
                            mode)

    def iter_read(self, sandbox_id: str, path: str, *,
                  max_bytes: int | None = None) -> Iterator[bytes]:
        """The file's bytes in chunks (bounded memory); past ``max_bytes`` FileTooLargeError."""
        return self._files(sandbox_id).iter_read(path, max_bytes=max_bytes)

    @_maps_death
    def stat(self, sandbox_id: str, path: str, *, follow_symlinks: bool = False) -> FileInfo:
        return self._files(sandbox_id).stat(path, follow_symlinks=follow_symlinks)

    def exists(self, sandbox_id: str, path: str) -> bool:
        try:
            self.stat(sandbox_id, path)
            return True
        except FileNotFoundError:
            return False

    @_maps_death
    def list_dir(self, sandbox_id: str, path: str) -> list[FileInfo]:
        return self._files(sandbox_id).list_dir(path)

    @_maps_death
    def mkdir(self, sandbox_id: str, path: str, *, parents: bool = True, mode: int = 0o755) -> None:
        self._files(sandbox_id).mkdir(path, parents=parents, mode=mode)

    @_maps_death
    def remove(self, sandbox_id: str, path: str, *, recursive: bool = False) -> None:
        self._files(sandbox_id).remove(path, recursive=recursive)

    @_maps_death
    def put_archive(self, sandbox_id: str, remote_dir: str,
                    stream: Iterable[bytes] | BinaryIO) -> None:
        """Extract a tar stream into ``remote_dir`` inside the sandbox (modes, symlinks and
        empty directories kept; members escaping ``remote_dir`` are refused)."""
        import tarfile

        client = self._files(sandbox_id)
        base = remote_dir.rstrip("/") or "/"
        client.mkdir(base, parents=True)
        try:
            self._put_members(client, sandbox_id, base, stream)
        except tarfile.TarError as exc:
            raise UnsafePathError(f"not a valid tar stream: {exc}",
                                  sandbox_id=sandbox_id) from None

    @staticmethod
    def _put_members(client: AgentClient, sandbox_id: str, base: str,
                     stream: Iterable[bytes] | BinaryIO) -> None:
        import tarfile

        links: set[str] = set()  # symlinks this archive made: never written through
        with tarfile.open(fileobj=archive.as_file(stream), mode="r|*") as tar:
            for m in tar:
                rel = archive.member_path(m.name)
                if not rel:
                    continue
                via = archive.through_link(rel, links)
                if via is not None:
                    raise UnsafePathError(
                        f"member {m.name!r} goes through the archive's own symlink {via!r}",
                        sandbox_id=sandbox_id,
                    )
                dest = f"{base.rstrip('/')}/{rel}"
                if m.isdir():
                    client.mkdir(dest, parents=True, mode=m.mode & 0o7777 or 0o755)
                    client.chmod(dest, m.mode & 0o7777)
                elif m.issym():
                    if not archive.link_target_ok(rel, m.linkname):
                        raise UnsafePathError(
                            f"symlink {m.name!r} -> {m.linkname!r} points outside the target",
                            sandbox_id=sandbox_id,
                        )
                    client.symlink(m.linkname, dest)
                    links.add(rel)
                elif m.islnk():
                    src = archive.member_path(m.linkname)
                    if src in links or archive.through_link(src, links) is not None:
                        raise UnsafePathError(
                            f"hard link {m.name!r} -> {m.linkname!r} goes through a symlink",
                            sandbox_id=sandbox_id,
                        )
                    data = client.read_file(f"{base.rstrip('/')}/{src}")
                    client.write_file(dest, data, mode=m.mode & 0o7777)
                elif m.isfile():
                    f = tar.extractfile(m)
                    assert f is not None
                    client.write_file(dest, f, mode=m.mode & 0o7777)
                else:
                    raise UnsafePathError(f"unsupported archive member type: {m.name!r}",
                                          sandbox_id=sandbox_id)

    def get_archive(self, sandbox_id: str, remote_dir: str) -> Iterator[bytes]:
        """A tar stream of ``remote_dir`` (streamed in bounded memory)."""
        import tarfile

        client = self._files(sandbox_id)
        base = remote_dir.rstrip("/") or "/"
        if client.stat(base).type != FileType.DIRECTORY:
            raise ExecError(f"{remote_dir} is not a directory", sandbox_id=sandbox_id)
        for info in client.walk(base):
            rel = info.path[len(base):].lstrip("/") if info.path.startswith("/") else info.path
            if not rel:
                continue
            ti = tarfile.TarInfo(rel)
            ti.mode = info.mode & 0o7777
            ti.mtime = int(info.mtime)
            if info.type == FileType.DIRECTORY:
                ti.type = tarfile.DIRTYPE
                yield archive.header(ti)
            elif info.type == FileType.SYMLINK:
                ti.type = tarfile.SYMTYPE
                ti.linkname = info.link_target or ""
                yield archive.header(ti)
            elif info.type == FileType.FILE:
                ti.size = info.size
                yield from archive.file_blocks(ti, client.iter_read(f"{base}/{rel}"))
        yield archive.end_blocks()

    def upload_dir(self, sandbox_id: str, local_dir: str | Path, remote_dir: str) -> None:
        self.put_archive(sandbox_id, remote_dir, archive.pack_local(Path(local_dir)))

    def download_dir(self, sandbox_id: str, remote_dir: str, local_dir: str | Path) -> None:
        archive.extract_local(self.get_archive(sandbox_id, remote_dir), Path(local_dir))

    # --- TTL and reaping ---------------------------------------------------------------------

    def _schedule_ttl(self, sandbox_id: str, deadline: float) -> None:
        heapq.heappush(self._ttl_heap, (deadline, sandbox_id))
        if self._ttl_thread is None:
            self._ttl_thread = threading.Thread(
                target=self._ttl_loop, name="ray-sandbox-ttl", daemon=True
            )
            self._ttl_thread.start()
        self._ttl_cv.notify()

    def _ttl_loop(self) -> None:
        while True:
            with self._ttl_cv:
                while not self._ttl_heap:
                    self._ttl_cv.wait()
                deadline, sid = self._ttl_heap[0]
                delay = deadline - time.time()
                if delay > 0:
                    # capped: a far deadline must not overflow the wait (and the loop wakes
                    # for earlier ones anyway, through notify)
                    self._ttl_cv.wait(timeout=min(delay, 3600.0))
                    continue
                heapq.heappop(self._ttl_heap)
                live = sid in self._owned
            if live:
                try:
                    self._destroy(sid, reason="TTLExpired")
                except Exception:  # one failed teardown must not end every other TTL
                    _log.exception("TTL teardown of sandbox %s failed", sid)

    def gc(self) -> list[str]:
        """Remove what dead owners left behind: sandboxes whose creator died, expired
        detached sandboxes, runsc containers and processes without a record, stale pins.
        Returns the ids removed."""
        removed: list[str] = []
        now = time.time()
        live: set[str] = set()
        dead: list[tuple[str, str]] = []
        for d in sorted(self.sandboxes_dir.iterdir()) if self.sandboxes_dir.exists() else []:
            if not _ID_RE.match(d.name):
                continue
            rec = self._load_record(d.name)
            with self._lock:
                mine = d.name in self._owned
            expired = rec is not None and rec.ttl_deadline is not None and rec.ttl_deadline < now
            if mine or (rec is not None and _owner_alive(rec) and not expired):
                live.add(d.name)
            elif rec is None and time.time() - d.stat().st_mtime < 60:
                live.add(d.name)  # being created right now by another process
            else:
                dead.append((d.name, "TTLExpired" if expired else "OwnerDied"))
        # A dead owner's `runsc run` may still be running: stop it first, or it would go on
        # to create cgroups after we cleaned up.
        self._kill_stray_runsc(live)
        for sid, reason in dead:
            self._destroy(sid, reason=reason)
            removed.append(sid)
        try:
            containers = self.runsc.list()
        except SandboxError:
            containers = []
        for c in containers:
            if c.id not in live and _ID_RE.match(c.id):
                self._destroy(c.id, reason="Orphaned")
                removed.append(c.id)
        self._kill_stray_runsc(live)
        network.gc(live, self.sandboxes_dir)
        removed += self._gc_snapshots()
        # The store may be shared by several homes: only this home's pins are ours to judge.
        mine = {self._pin_owner(sid) for sid in live}
        for image in self.images.list():
            for owner in self.images.pins(image.digest) - mine:
                if owner.startswith(self._pin_prefix) and _ID_RE.match(owner.split(":")[1]):
                    self.images.unpin(image.digest, owner)
        return sorted(set(removed))

    def _kill_stray_runsc(self, live: set[str]) -> None:
        """Kill, and wait out, runsc processes of this root that belong to no live sandbox:
        sandbox/gofer processes runsc no longer lists (a ``runsc run`` killed half-way,
        PLATFORM §9.8) and runsc commands a dead owner left running."""
        marker = f"--root={self.runsc.root}"
        killed: list[int] = []
        for pid_dir in Path("/proc").iterdir():
            if not pid_dir.name.isdigit():
                continue
            try:
                args = (pid_dir / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if not args or (args[0] not in (b"runsc-sandbox", b"runsc-gofer")
                            and os.path.basename(args[0]) != b"runsc"):
                continue
            if marker.encode() not in args:
                continue
            ids = [a.decode() for a in args if _ID_RE.match(a.decode(errors="ignore"))]
            if ids and not any(i in live for i in ids):
                try:
                    os.kill(int(pid_dir.name), 9)
                    killed.append(int(pid_dir.name))
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        while killed and time.monotonic() < deadline:
            _subreaper.reap_orphans()
            killed = [pid for pid in killed
                      if (st := procfs.stat(pid)) is not None and st.state != "Z"]
            if killed:
                time.sleep(0.01)
        _subreaper.reap_orphans()

    # --- context manager -------------------------------------------------------------------

    def close(self) -> None:
        """Delete every sandbox this runtime created (detached ones included) and the
        snapshots it took that are not detached."""
        with self._lock:
            ids = list(self._owned)
        for snap in self.list_snapshots():
            if snap.owner_pid == os.getpid():
                self.delete_snapshot(snap)
        for sid in ids:
            try:
                self._destroy(sid, reason="Deleted")
            except SandboxError:
                pass

    def __enter__(self) -> SandboxRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def all_items(have: Mapping[str, str], want: Mapping[str, str]) -> bool:
    return all(have.get(k) == v for k, v in want.items())

