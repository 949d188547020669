"""SandboxRuntime: create, drive and delete gVisor sandboxes on this node, without Ray.

A facade of short verbs over the concept modules: ``launch`` (create/restore/destroy),
``records`` (what the node knows), ``exec_request`` (what a command asks for), ``files``,
``checkpoint`` and ``snapshot`` (``runtime.snapshots``), ``volumes`` (``runtime.volumes``),
``suspension`` (``runtime.suspensions``), ``idle`` (idle delete and suspend), ``reaper``
(TTL and gc), ``connections`` (agent clients), ``fs_image`` (filesystem images), ``verbs``
(the verb table: each verb's request, declared once). It has over 40 methods (at most 55)
because it is the stable public surface (tests/unit/public_api.json): each verb is a typed
signature, a docstring and a few lines over those modules, and splitting it would split the
API users call (``filesystem_image_in_use`` and ``delete_filesystem_image``, for example,
are such verbs over ``fs_image`` and ``launch``); its deprecated snapshot aliases and
awaitable twins are generated, not written out. The longest verb, ``personalize`` (a node
host's stock hands a booted sandbox to its caller), is ~25 lines of record and policy
updates that belong to no other module.

State lives on disk (``home()/sandboxes/<id>/record.json`` plus runsc's own state), so any
process on the node can address any sandbox by id, status is read from runsc rather than from
bookkeeping, and a reaper can clean up after a creator that died.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import inspect
import logging
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from . import (
    _subreaper,
    archive,
    checkpoint,
    files,
    fs_image,
    hostfs,
    network,
    paths,
    procfs,
    reaper,
    status,
)
from .agent.client import AgentClient, AgentProcess
from .agent.pyrepl import PythonContext, PythonResult
from .config import MAX_TIMEOUT, EgressPolicy, SandboxConfig, boot_key, make_config
from .connections import Connections
from .errors import (
    ConfigError,
    ImageError,
    ImageNotFoundError,
    SandboxCreationError,
    SandboxDiedError,
    SandboxError,
    SandboxNotFoundError,
    SandboxStateError,
)
from .exec_request import stdin_bytes
from .idle import IdleWatch
from .images import Image, ImageStore
from .launch import Launcher, all_or_nothing, as_creation_error
from .records import RAY_ID_PREFIX, Records, SandboxRecord, check_id, owner_fields, parse_id
from .results import (
    ExecResult,
    FileInfo,
    OutputChunk,
    SandboxLink,
    SandboxState,
    SandboxStatus,
)
from .runsc import Runsc
from .secrets import SecretStore
from .snapshot import Snapshot, SnapshotDir, SnapshotStore, copy_tree
from .suspension import SUSPENDED, Suspensions
from .verbs import (
    VERBS,
    CommandRequest,
    EgressRequest,
    ExecRequest,
    LinkRequest,
    MkdirRequest,
    NoRequest,
    PathRequest,
    PythonRequest,
    ReadRequest,
    RemoveRequest,
    SpawnRequest,
    StatRequest,
    WriteRequest,
)
from .volumes import VolumeStore

T = TypeVar("T")
_RESTORE_PARALLEL = 8  # concurrent restores; two cores saturate well before this

log = logging.getLogger(__name__)


class LimitNotEnforcedWarning(UserWarning):
    """A configured limit cannot be enforced in this mode (e.g. cgroups when rootless)."""


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


def _maps_death(method: Callable[..., T]) -> Callable[..., T]:
    """A call whose agent connection died reports why the sandbox died (e.g. OOMKilled)."""

    @functools.wraps(method)
    def wrapper(self: SandboxRuntime, sandbox_id: str, *args: Any, **kwargs: Any) -> T:
        try:
            return method(self, sandbox_id, *args, **kwargs)
        except SandboxDiedError as exc:
            raise self._died(sandbox_id, exc) from None

    return wrapper


def _verb(method: Callable[[Any, str, Any], T]) -> Callable[..., T]:
    """A verb of the table (``verbs.VERBS``, named like the method): its request is given,
    or made from positions and keywords (``exec(sid, "ls", timeout=5)``), and checked before
    anything runs; a death during the call says why the sandbox died."""
    row = next(v for v in VERBS.values() if v.method == method.__name__)

    @functools.wraps(method)
    def wrapper(self: SandboxRuntime, sandbox_id: str, *args: Any, **kwargs: Any) -> T:
        request = row.request.of(args, kwargs, sandbox_id=sandbox_id)
        if row.streams:  # a generator: it maps a death itself, as it is consumed
            return method(self, sandbox_id, request)
        try:
            return method(self, sandbox_id, request)
        except SandboxDiedError as exc:
            raise self._died(sandbox_id, exc) from None

    wrapper.verb = row  # type: ignore[attr-defined]
    return wrapper


def _deprecated(alias: str, name: str) -> Callable[..., Any]:
    def method(self: SandboxRuntime, *args: Any, **kwargs: Any) -> Any:
        warnings.warn(f"SandboxRuntime.{alias} is deprecated: use runtime.snapshots.{name}",
                      DeprecationWarning, stacklevel=2)
        return getattr(self.snapshots, name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = alias
    method.__doc__ = f"Deprecated: ``runtime.snapshots.{name}``."
    return method


def _in_thread(name: str) -> Callable[..., Any]:
    async def method(self: SandboxRuntime, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(getattr(self, name), *args, **kwargs)

    method.__name__ = method.__qualname__ = f"{name}_async"
    method.__doc__ = f"``{name}`` in a thread, awaitable."
    return method


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
        self._connections = Connections(_io_timeout(io_timeout))
        self.home = Path(home) if home is not None else paths.home()
        self.sandboxes_dir = self.home / "sandboxes"
        self.snapshots_dir = self.home / "snapshots"
        self.records = Records(self.sandboxes_dir)
        self.snapshots = SnapshotStore(self.snapshots_dir)
        self.volumes = VolumeStore(self.home)
        # what EgressPolicy.inject rules name: read by each sandbox's egress proxy at every
        # request (docs/network.md, "Credential injection")
        self.secrets = SecretStore.of_home(self.home)
        self.images = images or ImageStore(paths.images(self.home))
        self.runsc = Runsc(self.home / "runsc")
        self.runsc.root.mkdir(parents=True, exist_ok=True)
        self._launcher = Launcher(self.home, self.records, self._connections, self.runsc,
                                  self.images, self.volumes)
        self._ttl = reaper.TtlTimer(self._expire)
        self.suspensions = Suspensions(self.records, self._launcher, self._connections,
                                       lambda rec: self._idle.watch(rec),
                                       self._connections.stop_pythons)
        self._idle = IdleWatch(self.records, self._launcher, self._connections,
                               self.suspensions)
        _subreaper.ensure()
        if reap:
            self.gc()

    # --- lifecycle -------------------------------------------------------------------------

    def create(
        self,
        config: SandboxConfig | Mapping[str, Any] | str | None = None,
        *,
        detach: bool = False,
        **kwargs: Any,
    ) -> str:
        """Create and start a sandbox; returns its id once it is ready for exec.

        ``config`` is a config, or the image reference (``create("python:3.12-slim")``, as
        Ray's ``SandboxRuntime.create`` takes it). Keyword arguments are
        :class:`SandboxConfig` fields (``image``, ``cpu``, ``memory``, ``shell``,
        ``spec_transform``/``_oci_spec_transform_fn`` …). ``detach=True`` lets the sandbox
        outlive this process (then only ``delete`` or its TTL end it).
        """
        if isinstance(config, str):
            if "image" in kwargs:
                raise ConfigError("image given twice: positionally and as image=")
            config, kwargs = None, {"image": config, **kwargs}
        cfg = make_config(config, **kwargs)
        if cfg.effective_rootless and (cfg.memory or cfg.cpu):
            warnings.warn(
                "rootless sandboxes run without cgroups: memory/cpu limits are NOT enforced",
                LimitNotEnforcedWarning,
                stacklevel=2,
            )
        sandbox_id = uuid.uuid4().hex
        self._adopt(self._launcher.create(sandbox_id, cfg, detach))
        return sandbox_id

    def _adopt(self, rec: SandboxRecord) -> None:
        self.records.adopt(rec)
        if rec.ttl_deadline is not None:
            self._ttl.schedule(rec.sandbox_id, rec.ttl_deadline)
        self._idle.watch(rec)

    def personalize(
        self,
        sandbox_id: str,
        config: SandboxConfig | Mapping[str, Any] | None = None,
        *,
        detach: bool = False,
        **kwargs: Any,
    ) -> None:
        """Give a running sandbox that nobody has used yet, booted for a config of the same
        :func:`boot_key`, to a new owner with ``config``: its env, user, labels, TTL,
        workdir, exec timeout and egress policy become the config's, ``created_at`` is now,
        and ``detach`` sets its owner as in :meth:`create`. ConfigError if its boot differs.
        Whether it is unused is the caller's to know (a node host's stock)."""
        cfg = make_config(config, **kwargs)
        rec = self.records.get(sandbox_id)
        old = rec.sandbox_config
        key = boot_key(cfg)
        if key is None or key != boot_key(old):
            raise ConfigError("the sandbox was booted for another configuration",
                              sandbox_id=sandbox_id)
        if cfg.workdir:
            self._client(sandbox_id).mkdir(cfg.workdir, parents=True)
        if cfg.network in ("public", "sandbox") and cfg.egress != old.egress:
            self.set_egress(sandbox_id, cfg.egress or EgressPolicy())
        now = time.time()
        rec = rec.model_copy(update={
            "config": cfg.model_dump(mode="json"), "created_at": now,
            "ttl_deadline": now + cfg.ttl_seconds if cfg.ttl_seconds else None,
            **owner_fields(detach),
        })
        self.records.write(rec)
        self._adopt(rec)

    def ping(self, sandbox_id: str) -> str:
        """The agent's version; opens the connection later calls reuse."""
        return self._client(sandbox_id).ping()

    def _expire(self, sandbox_id: str) -> None:
        if self.records.owns(sandbox_id):
            self._launcher.destroy(sandbox_id, reason="TTLExpired")

    def delete(self, sandbox_id: str, *, wait: bool = False) -> None:
        """Stop the sandbox and remove everything it owns. Idempotent. On return it can no
        longer run or be reached and its id raises SandboxNotFoundError; runsc state,
        network, cgroups, mounts and files are removed in the background (by the next
        :meth:`gc` if this process dies first), or before it returns with ``wait=True``
        (for a process that may be killed right after, e.g. a server on SIGTERM)."""
        check_id(sandbox_id)
        if wait:
            self._launcher.destroy(sandbox_id, reason="Deleted")
        else:
            self._launcher.delete(sandbox_id, reason="Deleted")

    terminate = delete

    @_verb
    def pause(self, sandbox_id: str, req: NoRequest) -> None:
        """Freeze every process of the sandbox (``runsc pause``). Until :meth:`resume`,
        exec, spawn and file calls raise :class:`SandboxStateError` instead of waiting."""
        rec = self._require_state(sandbox_id, "running")
        self.records.set_phase(rec, "paused")
        try:
            self.runsc.pause(sandbox_id)
        except SandboxError:
            self.records.set_phase(rec, "created")
            raise

    @_verb
    def resume(self, sandbox_id: str, req: NoRequest) -> None:
        """Thaw a paused sandbox; its processes go on where they stopped."""
        rec = self._require_state(sandbox_id, "paused")
        self.runsc.resume(sandbox_id)
        self.records.set_phase(rec, "created")

    def _require_state(self, sandbox_id: str, *allowed: str) -> SandboxRecord:
        """The record, if runsc reports the container in one of ``allowed`` states."""
        rec = self.records.get(sandbox_id)
        try:
            status = self.runsc.state(sandbox_id).status
        except SandboxNotFoundError:
            status = "missing"
        if status not in allowed:
            raise SandboxStateError(f"sandbox is {status}; this needs it {' or '.join(allowed)}",
                                    sandbox_id=sandbox_id)
        return rec

    # --- snapshot, restore, fork -------------------------------------------------------------

    def snapshot(
        self, sandbox_id: str, *, detach: bool = False, labels: Mapping[str, str] | None = None,
        drain_timeout: float = 30.0,
    ) -> Snapshot:
        """Checkpoint a running sandbox (memory, processes, writable layers) to disk; it keeps
        running. Calls made meanwhile wait; calls already running get ``drain_timeout``
        seconds to finish. Spawned processes keep running but their handles are detached
        (see docs/snapshots.md). ``detach=True`` lets the snapshot outlive this process."""
        checkpoint.check_support(self.runsc)
        rec = self._require_state(sandbox_id, "running")
        sdir = self.records.sdir(sandbox_id)
        sd = self.snapshots.new()
        try:
            with checkpoint.held(self._client(sandbox_id), sdir, drain_timeout,
                                 lambda: self._connections.stop_pythons(sandbox_id)):
                checkpoint.checkpoint(self.runsc, rec, sd.image)
                # Host dirs are not in gVisor's image; copied while the agent still holds.
                copy_tree(sdir.upper, sd.upper)
                if sdir.work.is_dir():
                    copy_tree(sdir.work, sd.work)
            shutil.copyfile(sdir.bundle / "config.json", sd.spec)
            shutil.copyfile(sdir.etc / "hostname", sd.hostname)
            snap = Snapshot(
                snapshot_id=sd.path.name, source_id=sandbox_id, path=str(sd.path),
                config=rec.config, image=rec.image, image_digest=rec.image_digest,
                image_env=rec.image_env, image_user=rec.image_user,
                image_workdir=rec.image_workdir, network=rec.network,
                overlay=rec.overlay != "none", platform=rec.platform, rootless=rec.rootless,
                source_dir=str(sdir.path), labels=dict(labels or {}), **owner_fields(detach),
            )  # fmt: skip
            return sd.seal(snap)
        except BaseException:
            sd.remove()
            raise

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
        checkpoint.check_support(self.runsc)
        snap, sd = self.snapshots.open(snapshot)
        sd.verify(snap)
        config = dict(snap.config)
        if sandbox_ids != [snap.source_id]:  # a copy; a move (its own id) keeps them
            config["expose_ports"] = ()  # published ports are leased node-wide
        if labels is not None:
            config["labels"] = dict(labels)
        cfg = make_config(config)
        ids = sandbox_ids or [uuid.uuid4().hex for _ in range(k)]
        all_or_nothing(ids, lambda i: self._restore_copy(snap, sd, i, cfg, detach, on_restore),
                       self._launcher.destroy, _RESTORE_PARALLEL)
        return ids

    def _restore_copy(self, snap: Snapshot, sd: SnapshotDir, sandbox_id: str,
                      cfg: SandboxConfig, detach: bool, on_restore: str | list[str] | None,
                      ) -> None:
        """One copy, retried once from scratch (a fresh restore can fail transiently)."""
        for attempt in (1, 2):
            try:
                self._adopt(self._launcher.restore(snap, sd, sandbox_id, cfg, detach))
                if on_restore is not None:
                    res = self.exec(sandbox_id, on_restore)
                    if not res.ok:
                        raise SandboxCreationError(f"on_restore exited {res.exit_code}",
                                                   sandbox_id=sandbox_id, stderr=res.stderr)
                return
            except SandboxError as exc:
                self._launcher.destroy(sandbox_id)
                if attempt == 2 or isinstance(exc, ConfigError | ImageError):
                    raise as_creation_error(exc, f"restoring snapshot {snap.snapshot_id}",
                                            sandbox_id) from exc
            except BaseException:
                self._launcher.destroy(sandbox_id)
                raise

    def fork(self, sandbox_id: str, k: int = 1, **restore_kw: Any) -> list[str]:
        """``k`` running copies of a running sandbox (snapshot + restore; the snapshot is
        deleted afterwards). Keyword arguments go to :meth:`restore`."""
        snap = self.snapshot(sandbox_id)
        try:
            return self.restore(snap, k, **restore_kw)
        finally:
            self.snapshots.delete(snap)

    # Deprecated: the same verbs of ``runtime.snapshots`` (SnapshotStore), named twice here
    delete_snapshot = _deprecated("delete_snapshot", "delete")
    list_snapshots = _deprecated("list_snapshots", "list")
    get_snapshot = _deprecated("get_snapshot", "get")
    has_snapshot = _deprecated("has_snapshot", "has")
    export_snapshot = _deprecated("export_snapshot", "export")
    import_snapshot = _deprecated("import_snapshot", "import_")

    # --- status ----------------------------------------------------------------------------

    def snapshot_filesystem(self, sandbox_id: str, *, scope: str = "local",
                            max_bytes: int | None = None) -> Image:
        """The sandbox's files (its root; mounts, devices and xattrs left out) as an image
        in this node's store: create sandboxes with ``image=<it>.ref``. Processes and memory
        are not kept (that is :meth:`snapshot`). ``max_bytes`` defaults to the image's size
        plus the sandbox's ``disk=`` (16 GiB without one); ``scope`` names the node (Ray's
        node id)."""
        rec = self.records.get(sandbox_id)
        base = self.images.inspect(rec.image_digest)
        if max_bytes is None:
            disk = rec.sandbox_config.effective_disk
            max_bytes = fs_image.MAX_BYTES if disk is None else base.size_bytes + disk
        dest = fs_image.layout(scope, uuid.uuid4().hex, self.home)
        dest.parent.mkdir(parents=True, exist_ok=True)
        client = self._client(sandbox_id)

        def diff(into: Path) -> None:
            fs_image.capture_diff(client, sandbox_id, base, into, dest, max_bytes=max_bytes)

        try:
            refused = fs_image.refused(base, self.images)
            if refused is None:  # what changed since boot, as a layer on the image
                try:
                    return self.images.add_layer(fs_image.reference(dest), dest,
                                                 parent=base.digest, build=diff)
                except BaseException:
                    with contextlib.suppress(ImageError):  # stored, then not mountable
                        self.images.remove(fs_image.reference(dest))
                    raise
            log.info("filesystem image of %s: copying the whole root (%s)", sandbox_id,
                     refused)
            return self.images.get(fs_image.capture(client, sandbox_id, base.config, dest,
                                                    max_bytes=max_bytes))
        except BaseException:
            fs_image.remove(scope, dest.name, self.home)
            raise

    def filesystem_image_in_use(self, ref: str) -> bool:
        """Whether a sandbox of this home runs from its copy of the image (a sandbox
        deleted, whose teardown is pending, does not: that teardown is finished first).
        Another home's sandboxes on a shared store are that home's to answer for."""
        digest = fs_image.local_digest(ref, self.images, self.home)
        if digest is None:
            return False
        self._launcher.settle_pins(digest)
        return self._launcher.pinned_here(digest)

    def delete_filesystem_image(self, ref: str) -> None:
        """Remove an image made by :meth:`snapshot_filesystem` (here, or fetched from another
        node) from the store and the disk. Idempotent; ImageInUseError while a sandbox of
        this node uses it (a deleted one's pending teardown is finished first)."""
        scope, image_id = fs_image.parse_strict(ref)
        digest = fs_image.local_digest(ref, self.images, self.home)
        if digest is not None:
            self._launcher.settle_pins(digest)
            with contextlib.suppress(ImageNotFoundError):  # removed meanwhile
                self.images.remove(fs_image.local_ref(ref, self.home))
        fs_image.remove(scope, image_id, self.home)

    def oom_killed(self, sandbox_id: str) -> bool:
        """Whether the kernel OOM-killed a process of this sandbox (its memory cgroup's
        counter: cheap, no runsc call; False once the sandbox is deleted)."""
        check_id(sandbox_id)
        return procfs.oom_killed(sandbox_id)

    @_verb
    def get_status(self, sandbox_id: str, req: NoRequest) -> SandboxStatus:
        """The sandbox's state as runsc reports it now."""
        check_id(sandbox_id)
        reason = self.records.tombstone(sandbox_id)
        if reason is not None:  # deleted (or being deleted) by this runtime
            return SandboxStatus(sandbox_id=sandbox_id, state=SandboxState.TERMINATED,
                                 reason=reason)
        rec = self.records.load(sandbox_id)
        if rec is None:
            raise SandboxNotFoundError("no such sandbox", sandbox_id=sandbox_id)
        if rec.phase == SUSPENDED and (sus := self.suspensions.state(sandbox_id)):
            return SandboxStatus(
                sandbox_id=sandbox_id, state=SandboxState.SUSPENDED, reason=sus.reason,
                created_at=datetime.fromtimestamp(rec.created_at, tz=UTC),
                suspended_at=datetime.fromtimestamp(sus.since, tz=UTC), image=rec.image,
                labels=rec.config.get("labels", {}))
        try:
            runsc_status: str | None = self.runsc.state(sandbox_id).status
        except SandboxNotFoundError:
            runsc_status = None
        state, reason = status.derive(rec, runsc_status)
        return SandboxStatus(
            sandbox_id=sandbox_id,
            state=state,
            reason=reason,
            created_at=datetime.fromtimestamp(rec.created_at, tz=UTC),
            image=rec.image,
            labels=rec.config.get("labels", {}),
        )

    def list(self, *, all: bool = False, labels: Mapping[str, str] | None = None) -> list[str]:
        """Ids of this runtime's sandboxes (``all=True``: every sandbox on the node)."""
        ids = self.records.on_disk() if all else self.records.owned()
        return self.records.select(ids, labels)

    def record(self, sandbox_id: str) -> SandboxRecord:
        """The node's record of a sandbox (config, image, owner, endpoints)."""
        return self.records.get(sandbox_id)

    # --- exec --------------------------------------------------------------------------------

    def _client(self, sandbox_id: str) -> AgentClient:
        rec = self.records.get(sandbox_id)
        if rec.phase == SUSPENDED or self.suspensions.busy(sandbox_id):
            if not self.suspensions.auto_resume:
                raise SandboxStateError("sandbox is suspended", sandbox_id=sandbox_id)
            self.suspensions.resume(sandbox_id)  # the caller sees only the latency
            rec = self.records.get(sandbox_id)
        if rec.phase == "paused":
            # Its processes are frozen: a call would only hang until its deadline.
            raise SandboxStateError("sandbox is paused; resume it first", sandbox_id=sandbox_id)
        client = self._connections.get(sandbox_id, self.records.sdir(sandbox_id).socket,
                                       lambda: self.records.read(sandbox_id) is not None)
        if client is None:
            raise SandboxNotFoundError("sandbox was deleted", sandbox_id=sandbox_id)
        return client

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

    @_verb
    def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        """Run a command and wait for it (:class:`ExecRequest`: ``exec(sid, "ls -l",
        timeout=5)``). A string runs through ``shell`` (default ``/bin/sh -c``); a list runs
        as argv. A timeout kills the whole process tree inside and returns the partial
        output with ``timed_out=True``."""
        args = req.agent_args(self.records.get(sandbox_id))
        return self._client(sandbox_id).exec(**args, stdin=stdin_bytes(req.stdin, sandbox_id),
                                             max_output_bytes=req.max_output_bytes)

    @_verb
    def exec_stream(self, sandbox_id: str,
                    req: ExecRequest) -> Iterator[OutputChunk | ExecResult]:
        """Like :meth:`exec`, yielding output chunks as they arrive and the result last."""
        args = req.agent_args(self.records.get(sandbox_id))
        data = stdin_bytes(req.stdin, sandbox_id)
        return self._stream(sandbox_id, self._client(sandbox_id).exec_stream(
            **args, stdin=data, max_output_bytes=req.max_output_bytes))

    def _stream(self, sandbox_id: str,
                chunks: Iterator[OutputChunk | ExecResult]) -> Iterator[OutputChunk | ExecResult]:
        try:
            yield from chunks
        except SandboxDiedError as exc:
            raise self._died(sandbox_id, exc) from None

    @_verb
    def spawn(self, sandbox_id: str, req: SpawnRequest) -> AgentProcess:
        """Start a background process (:class:`SpawnRequest`); the handle writes stdin,
        reads output, waits, kills. ``timeout`` kills its tree after that many seconds (not
        the sandbox's exec default: a background process runs until it ends unless asked)."""
        args = req.agent_args(self.records.get(sandbox_id))
        return self._client(sandbox_id).spawn(**args, pty=req.pty)

    def open_pty(
        self, sandbox_id: str, command: str | builtins.list[str] = "/bin/sh", *, rows: int = 24,
        cols: int = 80, **kw: Any,
    ) -> AgentProcess:
        """An interactive terminal session (write keys, read screen bytes, resize, close)."""
        if isinstance(command, str) and command.startswith("/") and " " not in command:
            command = [command]
        return self.spawn(sandbox_id, command, pty=(rows, cols), **kw)

    @_verb
    def run_python(self, sandbox_id: str, req: PythonRequest) -> PythonResult:
        """Run code in a persistent interpreter inside the sandbox (state is kept per
        ``context`` between calls, like a notebook kernel). A timeout or crash restarts the
        interpreter, resetting that context's state."""
        rec = self.records.get(sandbox_id)
        client = self._client(sandbox_id)

        def start() -> PythonContext:
            args = CommandRequest(command=["python3"]).agent_args(rec)
            return PythonContext(client, env=args["env"], cwd=args["cwd"], user=args["user"])

        ctx = self._connections.python(sandbox_id, req.context, start)
        timeout = req.timeout if req.timeout is not None else rec.config.get("timeout_seconds")
        return ctx.run(req.code, timeout=timeout)

    @_verb
    def set_egress(self, sandbox_id: str, req: EgressRequest) -> None:
        """Replace a ``public``/``sandbox`` network's egress policy; effective within a second
        (open connections to newly denied addresses are cut)."""
        self.records.get(sandbox_id)
        network.set_egress(sandbox_id, self.records.sdir(sandbox_id).path, req.policy)

    @_verb
    def link(self, sandbox_id: str, req: LinkRequest) -> SandboxLink:
        """Let ``sandbox_id`` open TCP connections to ``port`` of sandbox ``to`` (both
        ``network="sandbox"``, both of this runtime); nothing else of ``to`` opens."""
        self.records.get(sandbox_id)
        self.records.get(req.to)
        host, port = network.link(sandbox_id, self.records.sdir(sandbox_id).path, req.to,
                                  self.records.sdir(req.to).path, req.port)
        return SandboxLink(to=req.to, host=host, port=port)

    @_verb
    def unlink(self, sandbox_id: str, req: LinkRequest) -> None:
        """Close a :meth:`link` (idempotent); connections it carries are cut."""
        self.records.get(sandbox_id)
        check_id(req.to)  # the peer may be gone, but its id names its veth
        network.unlink(sandbox_id, self.records.sdir(sandbox_id).path, req.to, req.port)

    @_verb
    def links(self, sandbox_id: str, req: NoRequest) -> builtins.list[SandboxLink]:
        """The sandbox's links to peers that still exist."""
        self.records.get(sandbox_id)
        out = []
        for to, port in network.links(self.records.sdir(sandbox_id).path):
            if self.records.load(to) and (host := network.address(self.records.sdir(to).path)):
                out.append(SandboxLink(to=to, host=host, port=port))
        return out

    # awaitable twins, run in a thread (a SandboxRuntime is thread-safe)
    exec_async = _in_thread("exec")
    create_async = _in_thread("create")
    delete_async = _in_thread("delete")

    # --- files -------------------------------------------------------------------------------

    @_verb
    def read_file(self, sandbox_id: str, req: ReadRequest) -> bytes:
        """The file's bytes; over ``max_bytes`` (default 64 MiB, None for no bound) raises
        FileTooLargeError, whatever the sandbox claims its size is."""
        return self._client(sandbox_id).read_file(req.path, max_bytes=req.max_bytes)

    @_verb
    def write_file(self, sandbox_id: str, req: WriteRequest) -> None:
        """Write (or append to) a file (``data``: str, bytes, an iterable of bytes or a
        binary file); missing parent directories are created."""
        payload = req.data.encode() if isinstance(req.data, str) else req.data
        self._client(sandbox_id).write_file(req.path, payload, mode=req.mode,
                                            append=req.append)

    @_maps_death
    def upload_file(self, sandbox_id: str, local_path: str | Path, remote_path: str) -> None:
        """Copy a host file into the sandbox, streaming (bounded memory); keeps its mode."""
        mode = os.stat(local_path).st_mode & 0o7777
        with open(local_path, "rb") as f:
            self._client(sandbox_id).write_file(remote_path, f, mode=mode)

    @_maps_death
    def download_file(self, sandbox_id: str, remote_path: str, local_path: str | Path, *,
                      max_bytes: int | None = hostfs.DOWNLOAD_MAX) -> None:
        """Copy a sandbox file to the host, streaming; written atomically and never through
        a link (see ``hostfs.write_atomic``), mode kept. Over ``max_bytes`` (default 1 GiB,
        None for no bound) raises FileTooLargeError and leaves nothing."""
        files.download(self._client(sandbox_id), remote_path, local_path, max_bytes)

    def iter_read(self, sandbox_id: str, path: str, *,
                  max_bytes: int | None = None) -> Iterator[bytes]:
        """The file's bytes in chunks (bounded memory); past ``max_bytes`` FileTooLargeError."""
        return self._client(sandbox_id).iter_read(path, max_bytes=max_bytes)

    @_verb
    def stat(self, sandbox_id: str, req: StatRequest) -> FileInfo:
        return self._client(sandbox_id).stat(req.path, follow_symlinks=req.follow_symlinks)

    @_verb
    def exists(self, sandbox_id: str, req: PathRequest) -> bool:
        try:
            self._client(sandbox_id).stat(req.path, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False

    @_verb
    def list_dir(self, sandbox_id: str, req: PathRequest) -> builtins.list[FileInfo]:
        return self._client(sandbox_id).list_dir(req.path)

    @_verb
    def mkdir(self, sandbox_id: str, req: MkdirRequest) -> None:
        self._client(sandbox_id).mkdir(req.path, parents=req.parents, mode=req.mode)

    @_verb
    def remove(self, sandbox_id: str, req: RemoveRequest) -> None:
        self._client(sandbox_id).remove(req.path, recursive=req.recursive)

    @_maps_death
    def put_archive(self, sandbox_id: str, remote_dir: str,
                    stream: Iterable[bytes] | BinaryIO) -> None:
        """Extract a tar stream into ``remote_dir`` inside the sandbox (modes, symlinks and
        empty directories kept; members escaping ``remote_dir`` are refused)."""
        files.put_archive(self._client(sandbox_id), sandbox_id, remote_dir, stream)

    def get_archive(self, sandbox_id: str, remote_dir: str) -> Iterator[bytes]:
        """A tar stream of ``remote_dir`` (streamed in bounded memory)."""
        return files.get_archive(self._client(sandbox_id), sandbox_id, remote_dir)

    def upload_dir(self, sandbox_id: str, local_dir: str | Path, remote_dir: str) -> None:
        self.put_archive(sandbox_id, remote_dir, archive.pack_local(Path(local_dir)))

    def download_dir(self, sandbox_id: str, remote_dir: str, local_dir: str | Path) -> None:
        archive.extract_local(self.get_archive(sandbox_id, remote_dir), Path(local_dir))

    # --- reaping and closing -----------------------------------------------------------------

    def gc(self) -> builtins.list[str]:
        """Remove what dead owners left behind: sandboxes whose creator died, expired
        detached sandboxes, runsc containers and processes without a record, stale pins.
        Returns the ids removed."""
        return reaper.gc(self.records, self._launcher, self.snapshots)

    def close(self) -> None:
        """Delete every sandbox this runtime created (detached ones included) and the
        snapshots it took that are not detached, and wait (bounded) until every background
        teardown has finished."""
        for snap in self.snapshots.list():
            if snap.owner_pid == os.getpid():
                self.snapshots.delete(snap)
        for sid in self.records.owned():
            try:
                self._launcher.delete(sid, reason="Deleted")
            except SandboxError:
                pass
        self._launcher.drain()

    def __enter__(self) -> SandboxRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _either_id(method: Callable[..., T]) -> Callable[..., T]:
    @functools.wraps(method)
    def wrapper(self: SandboxRuntime, sandbox_id: str, *args: Any, **kwargs: Any) -> T:
        if isinstance(sandbox_id, str) and sandbox_id.startswith(RAY_ID_PREFIX):
            sandbox_id = parse_id(sandbox_id)
        return method(self, sandbox_id, *args, **kwargs)

    return wrapper


# Every verb takes a sandbox's id in our form or in Ray's (``ray-sandbox-<32 hex>``, what
# ``get_instance_id`` shows): code written for Ray's SandboxRuntime passes either.
for _name, _fn in list(vars(SandboxRuntime).items()):
    if (not _name.startswith("_") and callable(_fn)
            and list(inspect.signature(_fn).parameters)[1:2] == ["sandbox_id"]):
        setattr(SandboxRuntime, _name, _either_id(_fn))
