"""Named volumes (``runtime.volumes``): size-capped filesystems that outlive sandboxes.

``<home>/volumes/<name>/`` holds ``volume.json`` (:class:`VolumeRecord`), ``volume.img`` (a
sparse ext4 image of exactly ``size`` bytes, journaled: ``disk.mkfs_ext4``) and ``mnt/``.
While any sandbox uses a volume, its image is loop-mounted on ``mnt/`` once, and each sandbox
gets a bind of ``mnt/`` in its own directory (``sandboxes/<id>/volumes/<i>``) that the OCI
spec binds in; a read-only use is a read-only bind in the host kernel.

Nothing is counted in memory or in files: who uses a volume is read from the mount table
(a bind under the sandboxes directory whose loop device is backed by the volume's image), so
a process that dies leaves nothing a count could get wrong. A sandbox's teardown unmounts its
binds (everything under its directory), then :meth:`VolumeStore.release_idle` unmounts every
volume left without binds; ``gc()`` does the same after dead owners. Every change to the
mounts happens under one store-wide lock file. Host code never looks inside a volume's files.
"""

from __future__ import annotations

import builtins
import fcntl
import os
import shutil
import socket
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Literal, overload

from pydantic import BaseModel, ConfigDict, ValidationError

from . import _mount, archive, disk
from .config import VOLUME_NAME_RE, VolumeMount, parse_size
from .errors import (
    ConfigError,
    SandboxCreationError,
    SandboxStateError,
    VolumeExistsError,
    VolumeInUseError,
    VolumeNotFoundError,
)
from .records import tombstone_file

MIN_SIZE = 16 << 20  # a floor: below it the journal and ext4's metadata take much of the cap
# A sandbox killed a moment ago may still hold the filesystem in its processes' mount
# namespace (its loop device lives until they are reaped): how long a mount waits for that.
_LOOP_GONE_WAIT_S = 5.0
# How long a mount, delete or export waits for a deleted user's teardown to unbind it.
_TEARDOWN_WAIT_S = 5.0


class VolumeRecord(BaseModel):
    """``volume.json``: what a volume is, written once at create."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str
    size: int
    node: str
    created_at: float


class VolumeUse(BaseModel):
    """One sandbox's mount of a volume."""

    sandbox_id: str
    readonly: bool


class VolumeInfo(VolumeRecord):
    """A volume as ``inspect``/``list`` show it: ``used`` is the bytes its image takes on the
    node's disk (at most ``size``), ``mounts`` the sandboxes that have it mounted now."""

    used: int
    mounts: list[VolumeUse]


class VolumeStore:
    """The volumes of one home. Thread- and process-safe."""

    def __init__(self, home: Path) -> None:
        # Resolved, as the kernel names mount points and loop backing files (the volume root
        # may be a link to a PVC or hostPath, docs/volumes.md).
        self.root = (home / "volumes").resolve()
        self._sandboxes = (home / "sandboxes").resolve()
        self.node = socket.gethostname()  # in records; through Ray, infos carry Ray's node id

    # --- the public verbs ------------------------------------------------------------------

    def create(self, name: str, size: int | str) -> VolumeInfo:
        """A new, empty volume of ``size`` bytes (``"1Gi"``, ``"512Mi"`` or bytes)."""
        _check_name(name)
        try:
            nbytes = parse_size(size)
        except ValueError as exc:
            raise ConfigError(f"volume {name!r}: {exc}") from None
        if nbytes < MIN_SIZE:
            raise ConfigError(f"volume {name!r}: size must be at least {MIN_SIZE >> 20}Mi")
        reason = disk.unavailable()
        if reason:
            raise SandboxCreationError(f"volumes cannot be made here: {reason}")
        with self._building(name) as tmp:
            with open(tmp / "volume.img", "xb") as f:
                f.truncate(nbytes)
            disk.mkfs_ext4(tmp / "volume.img", sandbox_id=None, journal=True)
            self._commit(tmp, name, nbytes, time.time())
        return self.inspect(name)

    def list(self) -> list[VolumeInfo]:
        table = self._table()
        names = sorted(p.name for p in self.root.glob("*") if VOLUME_NAME_RE.match(p.name))
        return [info for n in names if (info := self._info(n, table)) is not None]

    def inspect(self, name: str) -> VolumeInfo:
        info = self._info(name, self._table())
        if info is None:
            raise VolumeNotFoundError(f"no volume {name!r} on this node")
        return info

    def delete(self, name: str) -> None:
        """Remove the volume and its data; refused while a sandbox has it mounted."""
        self.inspect(name)
        with self._when_free(lambda t: [(name, u) for u in self._users(name, t)],
                             "delete them first"):
            vdir = self._dir(name)
            _mount.unmount(vdir / "mnt")
            if os.path.ismount(vdir / "mnt"):
                raise VolumeInUseError(f"volume {name!r} is still mounted on {vdir / 'mnt'}")
            # File by file, never a tree walk: nothing of the volume's contents is touched.
            # A loop still bound to the image (a sandbox still dying) ends with its last mount.
            (vdir / "volume.json").unlink(missing_ok=True)
            (vdir / "volume.img").unlink(missing_ok=True)
            try:
                (vdir / "mnt").rmdir()
                vdir.rmdir()
            except OSError as exc:
                raise SandboxStateError(f"volume {name!r}: {vdir} cannot be removed: "
                                        f"{exc.strerror}") from None

    def export_stream(self, name: str) -> Iterator[bytes]:
        """The volume as a byte stream for :meth:`import_stream` (on another node, through
        the object store): its record, then the image's data extents (holes are not sent).
        The volume must be idle; the image is copied aside under the lock (sparse, time and
        space as its used bytes), so sandboxes may mount it again while the copy streams."""
        self.inspect(name)
        with self._when_free(lambda t: [(name, u) for u in self._users(name, t)],
                             "it is copied only when idle"):
            _mount.unmount(self._dir(name) / "mnt")  # idle but mounted: flush it to the image
            self._wait_unbound(name, None)
            aside = self.root / f".export-{name}-{os.getpid()}-{time.monotonic_ns()}"
            disk.clone(self._dir(name) / "volume.img", aside)
            try:
                copy = open(aside, "rb")  # noqa: SIM115 - the stream closes it
            finally:
                aside.unlink()  # nothing to clean up later: the open file keeps it readable
        return _frames((self._dir(name) / "volume.json").read_bytes(), copy)

    def import_stream(self, name: str, chunks: Iterable[bytes]) -> VolumeInfo:
        """A new volume ``name`` on this node from :meth:`export_stream`'s bytes."""
        _check_name(name)
        stream = _Stream(chunks)
        if stream.read(len(_MAGIC)) != _MAGIC:
            raise ConfigError(f"volume {name!r}: not a volume stream")
        (n,) = _FRAME.unpack(stream.read(_FRAME.size))[1:]
        if n > _RECORD_MAX:
            raise ConfigError(f"volume {name!r}: record of {n} bytes in the stream")
        source = VolumeRecord.model_validate_json(stream.read(n))
        with self._building(name) as tmp:
            with open(tmp / "volume.img", "xb") as f:
                f.truncate(source.size)
                while (head := stream.read(_FRAME.size, eof_ok=True)) is not None:
                    offset, length = _FRAME.unpack(head)
                    if length > archive.TRANSFER_CHUNK or offset + length > source.size:
                        raise ConfigError(f"volume {name!r}: extent {offset}+{length} "
                                          f"outside its {source.size} bytes")
                    os.pwrite(f.fileno(), stream.read(length), offset)
            self._commit(tmp, name, source.size, source.created_at)
        return self.inspect(name)

    # --- what the launcher and gc use ------------------------------------------------------

    def attach(self, sandbox_id: str, binds: Sequence[tuple[str, bool, Path]]) -> None:
        """Bind each ``(volume name, readonly, target)`` for a starting sandbox, mounting the
        volume first if no sandbox uses it. A read-write volume is mounted by one sandbox at
        a time, and never beside read-only users (their view would go stale). A user that was
        deleted and is still being torn down (``terminate`` returns before its teardown ends)
        is waited for, up to ``_LOOP_GONE_WAIT_S``: delete-then-create must work."""
        if not binds:
            return
        wanted: dict[str, bool] = {}
        for name, readonly, _ in binds:
            if name in wanted and not (readonly and wanted[name]):
                raise ConfigError(f"volume {name!r} is mounted twice, once read-write",
                                  sandbox_id=sandbox_id)
            wanted[name] = readonly
        for name in wanted:
            if self._record(name) is None:
                raise ConfigError(f"volume {name!r} does not exist on this node "
                                  f"({self.node})", sandbox_id=sandbox_id)
        with self._when_free(lambda t: self._blockers(wanted, t),
                             "a read-write volume is mounted by one sandbox at a time (a fork "
                             "or copy of a sandbox with a read-write volume needs its source "
                             "gone first, or the volume read-only)", sandbox_id) as table:
            # Made before any mount: the sandbox's teardown releases volumes only if it exists.
            binds[0][2].parent.mkdir(exist_ok=True)
            for name in wanted:
                self._ensure_mounted(name, table, sandbox_id)
            for name, readonly, target in binds:
                _mount.bind(self._dir(name) / "mnt", target, readonly=readonly,
                            sandbox_id=sandbox_id)

    @contextmanager
    def _when_free(self, blockers: Callable[[_Table], builtins.list[tuple[str, VolumeUse]]],
                   advice: str, sandbox_id: str | None = None) -> Iterator[_Table]:
        """The lock and the mount table once ``blockers(table)`` names no user. Users that
        were deleted and are still being torn down (``delete`` returns before the unbind)
        are waited for, up to ``_TEARDOWN_WAIT_S``; a live one is refused at once."""
        deadline = time.monotonic() + _TEARDOWN_WAIT_S
        while True:
            with self._locked():
                table = self._table()
                found = blockers(table)
                if not found:
                    yield table
                    return
                dying = all(tombstone_file(self._sandboxes, u.sandbox_id).exists()
                            for _, u in found)
                if not dying or time.monotonic() > deadline:
                    name, u = found[0]
                    raise VolumeInUseError(
                        f"volume {name!r} is mounted by sandbox {u.sandbox_id} "
                        f"({'read-only' if u.readonly else 'read-write'}"
                        f"{'; deleted, its teardown still running' if dying else ''}): "
                        f"{advice}", sandbox_id=sandbox_id or u.sandbox_id)
            time.sleep(0.05)  # outside the lock: the teardown takes it to let go

    def _blockers(self, wanted: dict[str, bool],
                  table: _Table) -> builtins.list[tuple[str, VolumeUse]]:
        """The (volume, user) pairs that keep ``wanted`` from being mounted."""
        return [(name, u) for name, readonly in wanted.items()
                if (users := self._users(name, table))
                and not (readonly and all(u.readonly for u in users)) for u in users]

    def release_idle(self) -> builtins.list[str]:
        """Unmount every volume no sandbox has bound any more; returns their names."""
        if not self.root.is_dir():  # a home that never made a volume: nothing to look at
            return []
        released = []
        with self._locked():
            table = self._table()
            for name in sorted(table.mounted):
                if not self._users(name, table):
                    _mount.unmount(self._dir(name) / "mnt")
                    released.append(name)
            for tmp in self.root.glob(".new-*"):  # a create that died half-way
                shutil.rmtree(tmp, ignore_errors=True)
            for aside in self.root.glob(".export-*"):  # an export that died half-way
                aside.unlink(missing_ok=True)
        return released

    # --- inside ----------------------------------------------------------------------------

    def _dir(self, name: str) -> Path:
        return self.root / name

    @contextmanager
    def _building(self, name: str) -> Iterator[Path]:
        """The directory a new volume is built in, under the lock, and renamed into place by
        :meth:`_commit`; nothing of it stays if building fails (a crash leaves a dot-dir that
        gc removes)."""
        with self._locked():
            if self._dir(name).exists():
                raise VolumeExistsError(f"volume {name!r} already exists on this node")
            tmp = self.root / f".new-{name}"
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                tmp.mkdir()
                yield tmp
            except OSError as exc:
                raise SandboxCreationError(f"volume {name!r} cannot be made in {self.root}: "
                                           f"{exc}") from None
            finally:
                shutil.rmtree(tmp, ignore_errors=True)

    def _commit(self, tmp: Path, name: str, size: int, created_at: float) -> None:
        (tmp / "mnt").mkdir()
        rec = VolumeRecord(name=name, size=size, node=self.node, created_at=created_at)
        (tmp / "volume.json").write_text(rec.model_dump_json())
        os.rename(tmp, self._dir(name))

    def _record(self, name: str) -> VolumeRecord | None:
        try:
            return VolumeRecord.model_validate_json((self._dir(name) / "volume.json").read_text())
        except (OSError, ValueError):
            return None

    def _info(self, name: str, table: _Table) -> VolumeInfo | None:
        rec = self._record(name)
        if rec is None:
            return None
        try:
            used = os.stat(self._dir(name) / "volume.img").st_blocks * 512
        except OSError:
            return None  # deleted while we looked
        return VolumeInfo(**rec.model_dump(), used=used, mounts=self._users(name, table))

    def _table(self) -> _Table:
        return _Table(self.root, self._sandboxes)

    def _users(self, name: str, table: _Table) -> builtins.list[VolumeUse]:
        return table.users.get(name, [])

    def _ensure_mounted(self, name: str, table: _Table, sandbox_id: str) -> None:
        if name in table.mounted:
            return
        # Two loop devices on one image would be two ext4 instances writing one disk.
        self._wait_unbound(name, sandbox_id)
        mnt = self._dir(name) / "mnt"
        disk.mount_image(self._dir(name) / "volume.img", mnt, sandbox_id=sandbox_id)
        # Never bind a bare mnt/ dir: the sandbox would write to the node's disk, uncapped.
        if os.stat(mnt).st_dev == os.stat(mnt.parent).st_dev:
            raise SandboxCreationError(f"volume {name!r} did not mount on {mnt}",
                                       sandbox_id=sandbox_id)
        table.mounted.add(name)

    def _wait_unbound(self, name: str, sandbox_id: str | None) -> None:
        """Until no loop device is bound to the image: a sandbox still dying may hold the
        filesystem for a moment in its processes' mount namespace; past that, refuse."""
        deadline = time.monotonic() + _LOOP_GONE_WAIT_S
        while held := disk.loops_backed_by(self._dir(name) / "volume.img"):
            if time.monotonic() > deadline:
                raise VolumeInUseError(
                    f"volume {name!r} is still held by /dev/{held[0]} outside this runtime "
                    "(a sandbox still dying, or a mount made by hand)", sandbox_id=sandbox_id,
                )
            time.sleep(0.05)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # per open file: excludes threads and processes
            yield
        finally:
            os.close(fd)


FILL_IMAGE = "ray-sandbox/busybox"  # built offline on every node


def fill(runtime: Any, name: str, tar: Iterable[bytes], *, path: str = "/") -> None:
    """Unpack a tar stream into volume ``name`` (under ``path``) inside a short-lived
    sandbox of ``runtime`` that mounts it read-write. The host never unpacks into a volume:
    its contents may have been written by sandboxes (links included), while inside gVisor
    the agent's own checks apply and no member can leave the mount."""
    target = "/volume/" + path.strip("/")
    sid = runtime.create(image=FILL_IMAGE, memory="64Mi", cpu=None, volumes={"/volume": name},
                         labels={"ray-sandbox/role": "volume-fill"})
    try:
        runtime.mkdir(sid, target, parents=True)
        runtime.put_archive(sid, target, tar)
    finally:
        runtime.delete(sid, wait=True)


class _Table:
    """The volumes' mounts as the kernel has them: which are mounted on their ``mnt/``,
    and which sandboxes bind them (by the loop device's backing file)."""

    def __init__(self, root: Path, sandboxes: Path) -> None:
        self.mounted: set[str] = set()
        self.users: dict[str, list[VolumeUse]] = {}
        backing: dict[str, str | None] = {}
        for m in _mount.mount_table():
            if m.point.parent.parent == root and m.point.name == "mnt":
                self.mounted.add(m.point.parent.name)
                continue
            if not (m.point.parent.name == "volumes" and m.point.parent.parent.parent == sandboxes):
                continue
            if m.device not in backing:
                backing[m.device] = _backing_file(m.device)
            image = backing[m.device]
            if image is not None and Path(image).parent.parent == root:
                self.users.setdefault(Path(image).parent.name, []).append(
                    VolumeUse(sandbox_id=m.point.parent.parent.name, readonly=m.readonly))


_MAGIC = b"RSBVOL1\n"
_FRAME = struct.Struct(">QQ")  # (offset, length) of an extent; (0, n) before the record
_RECORD_MAX = 64 << 10


def _frames(record: bytes, image: BinaryIO) -> Iterator[bytes]:
    """The export stream: the record, then the image's data extents, ≤ 4 MiB each."""
    with image:
        fd = image.fileno()
        yield _MAGIC + _FRAME.pack(0, len(record)) + record
        for start, end in disk.data_extents(fd):
            for off in range(start, end, archive.TRANSFER_CHUNK):
                n = min(archive.TRANSFER_CHUNK, end - off)
                yield _FRAME.pack(off, n) + os.pread(fd, n, off)


class _Stream:
    """Exact reads over chunks of any size."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._it = iter(chunks)
        self._buf = bytearray()

    @overload
    def read(self, n: int, *, eof_ok: Literal[False] = False) -> bytes: ...
    @overload
    def read(self, n: int, *, eof_ok: bool) -> bytes | None: ...

    def read(self, n: int, *, eof_ok: bool = False) -> bytes | None:
        while len(self._buf) < n:
            chunk = next(self._it, None)
            if chunk is None:
                if eof_ok and not self._buf:
                    return None
                raise ConfigError("the volume stream ended in the middle of a frame")
            self._buf += chunk
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out


def _backing_file(device: str) -> str | None:
    try:
        return Path(f"/sys/dev/block/{device}/loop/backing_file").read_text().strip()
    except OSError:
        return None


def _check_name(name: str) -> None:
    try:
        VolumeMount(name=name)  # the one rule for names, config's
    except ValidationError as exc:
        raise ConfigError(exc.errors()[0]["msg"]) from None
