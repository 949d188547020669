"""Snapshots: a checkpoint of a running sandbox plus the host-side files it needs, on disk.

``home()/snapshots/<id>/`` holds everything one snapshot owns:

    image/          runsc's checkpoint (checkpoint.img, pages.img, pages_meta.img): memory,
                    processes, the gVisor overlay root (readonly=False) and tmpfs mounts
    upper/          a copy of the kernel overlay's upper layer (``<sandbox>/upper``)
    work/           a copy of a read-only sandbox's workdir (``<sandbox>/work``), if any
    config.json     the sandbox's OCI spec (its paths are rewritten for each restored copy)
    hostname        the sandbox's hostname (copies keep it)
    snapshot.json   the :class:`Snapshot`; written last, so a snapshot without it is partial

``upper/`` and ``work/`` are host directories that gVisor does not put into its image; a restore
gives every copy fresh copies of them. Deleting the directory deletes the snapshot.
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import io
import json
import os
import shutil
import stat
import tarfile
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from . import procfs
from .archive import TRANSFER_CHUNK, as_file, member_path
from .errors import SandboxError, SnapshotCorruptError, SnapshotNotFoundError
from .records import ID_RE, owner_fields

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

IMAGE_FILES = ("checkpoint.img", "pages.img", "pages_meta.img")
_HASHED = ("checkpoint.img", "pages_meta.img")  # small; pages.img is checked by size
_XATTR_PAX = "SCHILY.xattr."  # how GNU tar and libarchive carry xattrs in pax headers
_IMPORTING = ".import-"  # an import being unpacked, renamed to its id once verified
_PARTIAL_S = 60.0  # a partial snapshot or import older than this lost its process


class Snapshot(BaseModel):
    """A serializable reference to a snapshot's data on ``node_id`` (see the module doc)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    snapshot_id: str
    source_id: str = Field(description="the sandbox it was taken from")
    node_id: str | None = Field(None, description="Ray node holding the data (None: local)")
    path: str = Field(description="its directory on that node")
    config: dict[str, Any] = Field(description="the source's SandboxConfig (JSON form)")
    image: str
    image_digest: str
    image_env: list[str] = Field(default_factory=list)
    image_user: str | None = None
    image_workdir: str | None = None
    network: str
    overlay: bool = Field(description="the source had a gVisor overlay root (readonly=False)")
    platform: str
    rootless: bool
    source_dir: str = Field(description="the source's sandbox dir: prefix rewritten in the spec")
    size_bytes: int = 0
    files: dict[str, int] = Field(default_factory=dict, description="image file sizes")
    digests: dict[str, str] = Field(default_factory=dict, description="sha256 of small files")
    created_at: float = Field(default_factory=time.time)
    owner_pid: int | None = None
    owner_start: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)


class SnapshotDir:
    """Paths of one snapshot's directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.image = path / "image"
        self.upper = path / "upper"
        self.work = path / "work"
        self.spec = path / "config.json"
        self.hostname = path / "hostname"
        self.meta = path / "snapshot.json"

    def load(self, snapshot_id: str) -> Snapshot:
        try:
            return Snapshot.model_validate_json(self.meta.read_text())
        except FileNotFoundError:
            raise SnapshotNotFoundError("no such snapshot (deleted?)",
                                        sandbox_id=snapshot_id) from None
        except (OSError, ValueError) as exc:
            raise SnapshotCorruptError(f"snapshot metadata unreadable: {exc}",
                                       sandbox_id=snapshot_id) from None

    def seal(self, snap: Snapshot) -> Snapshot:
        """Records sizes and digests, then writes snapshot.json (the completion mark)."""
        files = {n: (self.image / n).stat().st_size for n in IMAGE_FILES}
        snap = snap.model_copy(update={
            "files": files,
            "digests": {n: _sha256(self.image / n) for n in _HASHED},
            "size_bytes": tree_size(self.path),
        })  # fmt: skip
        self.write(snap)
        return snap

    def write(self, snap: Snapshot) -> None:
        tmp = self.meta.with_suffix(".tmp")
        tmp.write_text(snap.model_dump_json())
        os.replace(tmp, self.meta)

    def verify(self, snap: Snapshot) -> None:
        """Raises :class:`SnapshotCorruptError` if an image file is missing or changed."""
        for name, size in snap.files.items():
            f = self.image / name
            try:
                actual = f.stat().st_size
            except OSError:
                actual = -1
            if actual != size:
                raise SnapshotCorruptError(
                    f"snapshot file {name} is missing or has {actual} bytes, not {size}",
                    sandbox_id=snap.snapshot_id,
                )
        for name, digest in snap.digests.items():
            if _sha256(self.image / name) != digest:
                raise SnapshotCorruptError(f"snapshot file {name} is damaged",
                                           sandbox_id=snap.snapshot_id)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class SnapshotStore:
    """The snapshots of one home (``home()/snapshots``), reached as ``runtime.snapshots``:
    find, list, delete, export, import and collect them. Taking and restoring one needs a
    running sandbox and lives in the runtime."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)

    def new(self) -> SnapshotDir:
        """An empty directory for a snapshot about to be taken (partial until sealed)."""
        sd = SnapshotDir(self.root / uuid.uuid4().hex)
        sd.image.mkdir(parents=True)
        return sd

    def open(self, snapshot: Snapshot | str) -> tuple[Snapshot, SnapshotDir]:
        snap_id = snapshot if isinstance(snapshot, str) else snapshot.snapshot_id
        if not isinstance(snap_id, str) or not ID_RE.match(snap_id):
            raise SnapshotNotFoundError(f"not a snapshot id: {snap_id!r}")
        sd = SnapshotDir(self.root / snap_id)
        return sd.load(snap_id), sd

    def get(self, snapshot_id: str) -> Snapshot:
        return self.open(snapshot_id)[0]

    def has(self, snapshot_id: str) -> bool:
        return bool(ID_RE.match(snapshot_id)) and SnapshotDir(self.root / snapshot_id).meta.exists()

    def list(self) -> list[Snapshot]:
        """Every complete snapshot of this home."""
        out = []
        for d in sorted(self.root.iterdir()):
            if ID_RE.match(d.name):
                with contextlib.suppress(SandboxError):
                    out.append(SnapshotDir(d).load(d.name))
        return out

    def delete(self, snapshot: Snapshot | str) -> None:
        """Remove a snapshot's files. Idempotent."""
        snap_id = snapshot if isinstance(snapshot, str) else snapshot.snapshot_id
        if isinstance(snap_id, str) and ID_RE.match(snap_id):
            SnapshotDir(self.root / snap_id).remove()

    def export(self, snapshot_id: str) -> Iterator[bytes]:
        """The snapshot's files as a tar stream, for :meth:`import_` on another node."""
        snap, sd = self.open(snapshot_id)
        sd.verify(snap)
        return pack(sd.path)

    def import_(self, chunks: Iterable[bytes], *, detach: bool = False) -> Snapshot:
        """Store a snapshot exported on another node (same id); owned by this process unless
        ``detach``. A damaged stream leaves nothing behind."""
        tmp = self.root / f"{_IMPORTING}{uuid.uuid4().hex}"
        unpack(chunks, tmp)
        try:
            sd = SnapshotDir(tmp)
            snap_id = json.loads(sd.meta.read_text()).get("snapshot_id", "")
            snap = sd.load(snap_id)
            sd.verify(snap)
            dest = self.root / snap.snapshot_id
            snap = snap.model_copy(update={"path": str(dest), **owner_fields(detach)})
            sd.write(snap)
            os.replace(tmp, dest)
            return snap
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def gc(self) -> builtins.list[str]:
        """Remove snapshots whose owner died, and partial ones (no snapshot.json) or imports
        older than a minute (one being taken or imported is younger). Returns their ids."""
        removed = []
        now = time.time()
        for d in sorted(self.root.iterdir()):
            if not ID_RE.match(d.name):
                if d.name.startswith(_IMPORTING) and now - d.stat().st_mtime > _PARTIAL_S:
                    shutil.rmtree(d, ignore_errors=True)  # an import whose process died
                continue
            sd = SnapshotDir(d)
            try:
                snap = sd.load(d.name)
            except SnapshotNotFoundError:
                if now - d.stat().st_mtime < _PARTIAL_S:
                    continue
            except SandboxError:
                pass
            else:
                if snap.owner_pid is None or procfs.is_running(snap.owner_pid, snap.owner_start):
                    continue
            sd.remove()
            removed.append(d.name)
        return removed


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tree_size(path: Path) -> int:
    """Bytes allocated on disk below ``path`` (sparse files count what they use)."""
    total = 0
    for root, dirs, files in os.walk(path):
        for name in files + dirs:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


# --- copying host trees that hold overlayfs metadata -------------------------------------


def _copy_xattrs(src: str, dst: str) -> None:
    # Overlayfs keeps opaque directories and redirects in trusted.* xattrs; copy them all.
    for name in os.listxattr(src, follow_symlinks=False):
        try:
            os.setxattr(dst, name, os.getxattr(src, name, follow_symlinks=False),
                        follow_symlinks=False)
        except OSError:
            pass


def copy_tree(src: Path, dst: Path) -> None:
    """Copy a directory tree exactly: files, symlinks, whiteouts (0:0 char devices), modes,
    owners, times and xattrs. ``shutil.copytree`` would open a device node as a file."""
    os.mkdir(dst)
    for root, dirs, files in os.walk(src):
        rel = os.path.relpath(root, src)
        out = dst if rel == "." else dst / rel
        for name in dirs:
            s, d = os.path.join(root, name), out / name
            if os.path.islink(s):
                continue  # os.walk lists symlinks to directories here; copied below
            os.mkdir(d)
        for name in files + [n for n in dirs if os.path.islink(os.path.join(root, n))]:
            s, d = os.path.join(root, name), out / name
            st = os.lstat(s)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(s), d)
            elif stat.S_ISREG(st.st_mode):
                shutil.copyfile(s, d, follow_symlinks=False)
            else:
                os.mknod(d, st.st_mode, st.st_rdev)
            _copy_meta(s, d, st)
    for root, dirs, _ in os.walk(src, topdown=False):  # directory times last
        rel = os.path.relpath(root, src)
        for name in dirs + ["."] if rel == "." else dirs:
            s = os.path.normpath(os.path.join(root, name))
            if not os.path.islink(s):
                _copy_meta(s, dst / os.path.relpath(s, src), os.lstat(s))


def _copy_meta(src: str, dst: Path, st: os.stat_result) -> None:
    os.lchown(dst, st.st_uid, st.st_gid)
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(dst, stat.S_IMODE(st.st_mode))
    _copy_xattrs(src, str(dst))
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


# --- shipping a snapshot to another node ---------------------------------------------------


class _Sink(io.RawIOBase):
    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, b: ReadableBuffer) -> int:
        data = bytes(b)
        self.parts.append(data)
        return len(data)


def pack(path: Path) -> Iterator[bytes]:
    """The snapshot directory as a tar stream in ~4 MiB pieces (bounded memory), device
    nodes and xattrs included."""
    sink = _Sink()
    with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for root, dirs, files in os.walk(path):
            for name in sorted(dirs) + sorted(files):
                full = os.path.join(root, name)
                info = tar.gettarinfo(full, arcname=os.path.relpath(full, path))
                info.pax_headers = {
                    _XATTR_PAX + k: os.getxattr(full, k, follow_symlinks=False).hex()
                    for k in os.listxattr(full, follow_symlinks=False)
                }
                if info.isreg():
                    with open(full, "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
                if sum(map(len, sink.parts)) >= TRANSFER_CHUNK:
                    yield b"".join(sink.parts)
                    sink.parts.clear()
    yield b"".join(sink.parts)


def _keep_mode(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
    # tar_filter refuses members that would land outside dest (also through symlinks the
    # sandbox wrote into work/), but it also drops setuid/sticky bits: put them back.
    return tarfile.tar_filter(member, dest).replace(mode=member.mode, deep=False)


def unpack(chunks: Iterable[bytes], dest: Path) -> None:
    """Extract a :func:`pack` stream into the new directory ``dest`` (removed on failure)."""
    dest.mkdir(parents=True)
    try:
        with tarfile.open(fileobj=as_file(chunks), mode="r|") as tar:
            for m in tar:
                member_path(m.name)  # no absolute paths, no ..
                tar.extract(m, dest, filter=_keep_mode)
                target = str(dest / m.name)
                for k, v in m.pax_headers.items():
                    if k.startswith(_XATTR_PAX):
                        os.setxattr(target, k[len(_XATTR_PAX):], bytes.fromhex(v),
                                    follow_symlinks=False)
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise


# --- the spec of a restored copy ------------------------------------------------------------


def rewrite_paths(value: Any, old: str, new: str) -> Any:
    """``value`` (a JSON tree) with every string under directory ``old`` moved to ``new``."""
    if isinstance(value, dict):
        return {k: rewrite_paths(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [rewrite_paths(v, old, new) for v in value]
    if isinstance(value, str) and (value == old or value.startswith(old + "/")):
        return new + value[len(old):]
    return value
