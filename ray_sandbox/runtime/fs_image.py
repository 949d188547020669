"""Filesystem images: a running sandbox's files as an OCI image that later sandboxes start
from (Modal's ``snapshot_filesystem``). See docs/snapshots.md, "Filesystem images".

Diffs (:func:`capture_diff`, the usual path). The host compares the sandbox's root, as the
agent lists it, with the image's unpacked rootfs, which the host trusts, and writes only what
differs: into a directory in overlayfs's form, which the image store adds as a layer on the
source image without a copy or an unpack (``images.layers``), and as one uncompressed OCI
layer (whiteouts ``.wh.<name>``, opaque directories) on top of the source image's layers,
referenced, in an OCI layout at ``<home>/fs-images/<scope>/<id>``: what other nodes fetch.

- A file, symlink or directory whose type, mode, owner, size and mtime (a symlink's target)
  equal the image's is unchanged; its content is not read.
- A directory whose mtime equals the image's is not even listed: nothing below it changed.
  This holds because creating, removing or renaming an entry changes its directory's mtime,
  and gVisor's overlay creates an entry in every directory above a file it copies up (a
  file changed in place, or whose mode changed): tests/test_fs_image_diff.py checks this
  of the runsc in use.
- A sandbox that forges both (sets a changed file's size and mtime, or a directory's mtime,
  back to the image's) loses its own changes: the image is its own.

Mounts (``/proc``, ``/sys``, ``/dev``, ``/tmp``, volumes, the agent's ``/.rsb``, the
generated ``/etc/hosts``) are not part of the root and are left out (what the image has
there stays); so are device nodes, sockets, FIFOs (an image's file replaced by one counts as
deleted), names beginning ``.wh.`` (no layer can hold them) and extended attributes. Hard
links among the changed files stay links.

The whole root (:func:`capture`) is copied instead where a diff cannot be trusted
(:func:`refused`): the image's rootfs is gone, its layout has no OCI layers to reference, or
the store cannot stack one more layer on it (not root; a chain of ``images.layers.MAX_DEPTH``
images). The store then unpacks that single layer with umoci, as it unpacks any registry
image; hard links become copies there.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import posixpath
import re
import secrets
import shutil
import stat
import tarfile
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

from . import archive, paths
from .agent import SANDBOX_RUN_DIR
from .agent import protocol as p
from .agent.client import READS_MAX_BYTES, AgentClient
from .errors import (
    ConfigError,
    ImageError,
    ImageNotFoundError,
    SandboxFileError,
    StoreFullError,
    UnsafePathError,
)
from .images import Image, ImageStore
from .images.models import ImageConfig
from .results import FileInfo, FileType

DIR = "fs-images"
REF_NAME = "image"  # the tag inside each layout
MAX_BYTES = 16 << 30  # a layer bigger than this is refused (the caller may raise it)
MAX_ENTRIES = 2_000_000
DISK_RESERVE = 1 << 30  # left free on the node's disk whatever the snapshot's size
_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
_CONFIG = "application/vnd.oci.image.config.v1+json"
_LAYER = "application/vnd.oci.image.layer.v1.tar"
_ID_RE = re.compile(r"^[0-9a-f]{32}$")
_SCOPE_RE = re.compile(r"^[0-9a-zA-Z_-]{1,64}$")
_AGENT_DIR = posixpath.dirname(SANDBOX_RUN_DIR).lstrip("/")
_LAYERS = {_LAYER, f"{_LAYER}+gzip", f"{_LAYER}+zstd"}
_WH = ".wh."  # a layer's whiteout prefix: such names are never written into a layer
_OPAQUE_XATTR = "trusted.overlay.opaque"
_MEMBER_OVERHEAD = 3 * tarfile.BLOCKSIZE  # a member's header and PAX header, counted
_TAR_SLACK = 1 << 20  # the layer's end blocks and padding beyond what was counted
_READS_FILES = 512  # files per READS request, at most
_READS_PATHS = READS_MAX_BYTES // 2  # ... and bytes of their paths
_READS_ITEM = 32  # a path's TLV headers and its length's TLV
_OPEN_DIRS = 64  # directories of a diff kept open at once
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_REF_RE = re.compile(rf"^oci:/(?:.*/)?{DIR}/([0-9a-zA-Z_-]{{1,64}})/([0-9a-f]{{32}}):{REF_NAME}$")


def root(home: Path | None = None) -> Path:
    return (home or paths.home()) / DIR


def layout(scope: str, image_id: str, home: Path | None = None) -> Path:
    """Where image ``image_id`` taken in ``scope`` (a Ray node id, or ``local``) lives."""
    if not _SCOPE_RE.match(scope) or not _ID_RE.match(image_id):
        raise ImageError(f"not a filesystem image: {scope}/{image_id}")
    return root(home) / scope / image_id


def reference(path: Path) -> str:
    return f"oci:{path}:{REF_NAME}"


def parse(ref: str) -> tuple[str, str] | None:
    """(scope, id) if ``ref`` names a filesystem image, in whatever node's home: homes may
    differ between nodes, so a node finds the image in its own home (:func:`local_ref`)."""
    m = _REF_RE.match(ref)
    return (m.group(1), m.group(2)) if m else None


def local_ref(ref: str, home: Path | None = None) -> str:
    """``ref`` pointed at this node's home if it names a filesystem image, else ``ref``."""
    parsed = parse(ref)
    return ref if parsed is None else reference(layout(*parsed, home))


def parse_strict(ref: str) -> tuple[str, str]:
    """(scope, id) of the filesystem image ``ref``; ConfigError if it names none."""
    parsed = parse(ref)
    if parsed is None:
        raise ConfigError(f"{ref!r} is not a filesystem image")
    return parsed


def local_digest(ref: str, images: ImageStore, home: Path | None = None) -> str | None:
    """The digest of this node's copy of the filesystem image ``ref`` in ``images`` (None:
    it has none); ConfigError if ``ref`` names no filesystem image."""
    parse_strict(ref)
    try:
        return images.inspect(local_ref(ref, home)).digest
    except ImageNotFoundError:
        return None


def capture(client: AgentClient, sandbox_id: str, config: ImageConfig, dest: Path, *,
            max_bytes: int = MAX_BYTES, max_entries: int = MAX_ENTRIES) -> str:
    """Write the sandbox's root as an OCI layout at ``dest``; returns its reference. A
    failure leaves nothing behind."""
    part = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}.part")
    blobs = part / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    room = shutil.disk_usage(part).free - DISK_RESERVE  # the sandbox picks its files' sizes
    if room < max_bytes:
        max_bytes = room
        if room <= 0:
            shutil.rmtree(part, ignore_errors=True)
            raise StoreFullError(f"no room for a filesystem image under {dest.parent}",
                                 sandbox_id=sandbox_id)
    try:
        tar = _root_tar(client, sandbox_id, max_entries, max_bytes)
        layer = _write_blob(blobs, tar, max_bytes, sandbox_id)
        cfg = _write_json(blobs, _config_json(config, layer[0], sandbox_id))
        manifest = _write_json(blobs, {
            "schemaVersion": 2, "mediaType": _MANIFEST,
            "config": {"mediaType": _CONFIG, "digest": cfg[0], "size": cfg[1]},
            "layers": [{"mediaType": _LAYER, "digest": layer[0], "size": layer[1]}],
        })  # fmt: skip
        (part / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [{
            "mediaType": _MANIFEST, "digest": manifest[0], "size": manifest[1],
            "annotations": {"org.opencontainers.image.ref.name": REF_NAME}}]}))
        (part / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        os.replace(part, dest)
    except BaseException:
        shutil.rmtree(part, ignore_errors=True)
        raise
    return reference(dest)


def refused(base: Image, images: ImageStore) -> str | None:
    """Why the changes of a sandbox of ``base`` cannot be taken as a diff (None: they can):
    its unpacked rootfs, the comparison's reference, is gone, its layout is not an OCI one
    whose layers a new manifest can reference, or the store cannot add a layer on it
    (``ImageStore.layer_refused``). :func:`capture` then copies the whole root."""
    if not Path(base.rootfs).is_dir():
        return f"the rootfs of {base.digest} is gone"
    try:
        _base_manifest(base)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"the layout of {base.digest} is not one a layer can be added to: {exc}"
    return images.layer_refused(base.digest)


def capture_diff(client: AgentClient, sandbox_id: str, base: Image, diff: Path, dest: Path,
                 *, max_bytes: int = MAX_BYTES, max_entries: int = MAX_ENTRIES) -> str:
    """Write what the sandbox changed in its root since it started from ``base`` into the
    empty directory ``diff`` (overlayfs's form: ``images.layers``), and an OCI layout at
    ``dest``: ``base``'s layers, referenced, and one layer of those changes. Returns the
    layout's reference; a failure leaves no layout (``diff`` is the caller's to remove).

    The host compares the sandbox's entries with ``base``'s rootfs, never following a link
    there, and reads through the agent only what differs: a directory whose mtime equals
    the image's is not listed (module docstring, "Diffs"). ``max_bytes`` bounds what is
    written, counted from the sizes the sandbox announces before any file is read, and is
    lowered to the node's free disk (less DISK_RESERVE) under ``diff`` and ``dest``."""
    part = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}.part")
    blobs = part / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    try:
        max_bytes = min(max_bytes, _room(diff, part, sandbox_id))
        manifest, config = _base_manifest(base)
        _Diff(client, sandbox_id, Path(base.rootfs), diff, max_bytes, max_entries).run()
        layer = _write_blob(blobs, _layer(diff), max_bytes + _TAR_SLACK, sandbox_id)
        base_blobs = Path(base.rootfs).parent / "oci" / "blobs" / "sha256"
        for item in manifest["layers"]:
            _link_blob(base_blobs, blobs, item["digest"])
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        config["created"] = now
        config.setdefault("rootfs", {"type": "layers", "diff_ids": []})["diff_ids"].append(
            layer[0])
        config.setdefault("history", []).append(
            {"created": now, "created_by": f"ray_sandbox snapshot_filesystem of {sandbox_id}",
             "comment": "the files changed since the sandbox started"})
        cfg = _write_json(blobs, config)
        _write_index(part, {
            "schemaVersion": 2, "mediaType": _MANIFEST,
            "config": {"mediaType": _CONFIG, "digest": cfg[0], "size": cfg[1]},
            "layers": [*manifest["layers"],
                       {"mediaType": _LAYER, "digest": layer[0], "size": layer[1]}],
        })  # fmt: skip
        os.replace(part, dest)
    except BaseException:
        shutil.rmtree(part, ignore_errors=True)
        raise
    return reference(dest)


def _room(diff: Path, part: Path, sandbox_id: str) -> int:
    """What the changes may take: the diff and its layer each hold them once, on one
    filesystem or two."""
    free = [(os.stat(p).st_dev, shutil.disk_usage(p).free - DISK_RESERVE) for p in (diff, part)]
    room = free[0][1] // 2 if free[0][0] == free[1][0] else min(f for _, f in free)
    if room <= 0:
        raise StoreFullError(f"no room for a filesystem image under {part.parent}",
                             sandbox_id=sandbox_id)
    return room


def _base_manifest(base: Image) -> tuple[dict[str, Any], dict[str, Any]]:
    """(manifest, config) of ``base``'s own layout, if every layer is an OCI one."""
    oci = Path(base.rootfs).parent / "oci"
    blobs = oci / "blobs" / "sha256"
    (entry,) = json.loads((oci / "index.json").read_bytes())["manifests"]
    manifest = json.loads((blobs / _hex(entry["digest"])).read_bytes())
    if manifest.get("mediaType", _MANIFEST) != _MANIFEST:
        raise ValueError(f"manifest type {manifest.get('mediaType')}")
    if manifest["config"].get("mediaType") != _CONFIG:
        raise ValueError(f"config type {manifest['config'].get('mediaType')}")
    for item in manifest["layers"]:
        if item.get("mediaType") not in _LAYERS:
            raise ValueError(f"layer type {item.get('mediaType')}")
        if not (blobs / _hex(item["digest"])).is_file():
            raise ValueError(f"layer {item['digest']} is missing")
    config = json.loads((blobs / _hex(manifest["config"]["digest"])).read_bytes())
    if not isinstance(config, dict):
        raise ValueError("the config is not an object")
    return manifest, config


def _hex(digest: str) -> str:
    algo, _, value = digest.partition(":")
    if algo != "sha256" or not re.fullmatch(r"[0-9a-f]{64}", value):
        raise ValueError(f"not a sha256 digest: {digest!r}")
    return value


def _link_blob(src: Path, dest: Path, digest: str) -> None:
    """A base layer into the new layout: a hard link (a copy across filesystems)."""
    try:
        os.link(src / _hex(digest), dest / _hex(digest))
    except FileExistsError:
        pass
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        shutil.copyfile(src / _hex(digest), dest / _hex(digest))


def _write_index(part: Path, manifest: dict[str, Any]) -> None:
    digest, size = _write_json(part / "blobs" / "sha256", manifest)
    (part / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": _MANIFEST, "digest": digest, "size": size,
        "annotations": {"org.opencontainers.image.ref.name": REF_NAME}}]}))
    (part / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')


def _config_json(config: ImageConfig, layer_digest: str, sandbox_id: str) -> dict[str, Any]:
    inner = {"Env": config.env, "WorkingDir": config.working_dir, "User": config.user,
             "Entrypoint": config.entrypoint or None, "Cmd": config.cmd or None,
             "Labels": config.labels or None, "StopSignal": config.stop_signal}
    out: dict[str, Any] = {
        "created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "architecture": config.architecture, "os": config.os,
        "config": {k: v for k, v in inner.items() if v not in (None, "")},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        "history": [{"created_by": f"ray_sandbox snapshot_filesystem of {sandbox_id}"}],
    }  # fmt: skip
    if config.variant:
        out["variant"] = config.variant
    return out


def _write_json(blobs: Path, value: dict[str, Any]) -> tuple[str, int]:
    data = json.dumps(value, sort_keys=True).encode()
    return _write_blob(blobs, [data], len(data), None)


def _write_blob(blobs: Path, chunks: Iterable[bytes], max_bytes: int,
                sandbox_id: str | None) -> tuple[str, int]:
    """Stream ``chunks`` into a blob named by its digest; (digest, size)."""
    tmp = blobs / f".tmp-{secrets.token_hex(4)}"
    h, n = hashlib.sha256(), 0
    with open(tmp, "wb") as f:
        for chunk in chunks:
            n += len(chunk)
            if n > max_bytes:
                raise ImageError(f"the sandbox's files are over {max_bytes} bytes; pass a "
                                 "larger max_bytes to snapshot them", sandbox_id=sandbox_id)
            h.update(chunk)
            f.write(chunk)
    os.replace(tmp, blobs / h.hexdigest())
    return f"sha256:{h.hexdigest()}", n


def mount_points(mounts: str) -> set[str]:
    """Every mount point in a ``/proc/mounts`` text but the root (octal escapes decoded)."""
    out = set()
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) >= 2:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])
            if point != "/":
                out.add(posixpath.normpath(point))
    return out


def _root_tar(client: AgentClient, sandbox_id: str, max_entries: int,
              max_bytes: int) -> Iterator[bytes]:
    """The root as a tar stream, mounts left out. Names and sizes come from the sandbox:
    every name is checked, a file is cut or padded to the size its entry announced, and the
    announced sizes are counted before any is read, so a claimed (or sparse) huge file is
    refused before the host writes it."""
    skip = mount_points(client.read_file("/proc/mounts", max_bytes=1 << 20).decode(
        errors="replace"))
    count = announced = 0
    for top in client.list_dir("/"):
        path = "/" + top.name
        if path in skip:
            continue
        entries: Iterable[FileInfo] = [top]
        if top.type == FileType.DIRECTORY:
            entries = _chain(top, client.walk(path, max_entries=max_entries), path)
        for info in entries:
            count += 1
            if count > max_entries:
                raise ImageError(f"over {max_entries} files to snapshot", sandbox_id=sandbox_id)
            if any(info.path == m or info.path.startswith(m + "/") for m in skip):
                continue
            announced += tarfile.BLOCKSIZE + (info.size if info.type == FileType.FILE else 0)
            if announced > max_bytes:
                raise ImageError(f"the sandbox's files are over {max_bytes} bytes (at "
                                 f"{info.path}); pass a larger max_bytes to snapshot them",
                                 sandbox_id=sandbox_id)
            yield from _member(client, info, sandbox_id)
    yield archive.end_blocks()


def _chain(top: FileInfo, walked: Iterator[FileInfo], base: str) -> Iterator[FileInfo]:
    """``top`` then its walk, every path made absolute (the walk's are relative)."""
    yield top.model_copy(update={"path": base})
    for info in walked:
        yield info.model_copy(update={"path": f"{base}/{info.path}"})


def _member(client: AgentClient, info: FileInfo, sandbox_id: str) -> Iterator[bytes]:
    try:
        name = archive.member_path(info.path.lstrip("/"))
    except UnsafePathError:
        return  # a name no tar may hold: not a file of this root
    if not name:
        return
    ti = tarfile.TarInfo(name)
    ti.mode, ti.uid, ti.gid = info.mode & 0o7777, info.uid, info.gid
    ti.mtime = int(info.mtime)
    if info.type == FileType.DIRECTORY:
        ti.type = tarfile.DIRTYPE
        yield archive.header(ti)
    elif info.type == FileType.SYMLINK:
        ti.type, ti.linkname = tarfile.SYMTYPE, info.link_target or ""
        yield archive.header(ti)
    elif info.type == FileType.FILE:
        ti.size = info.size
        yield archive.header(ti)
        yield from _exactly(client.iter_read(info.path, length=info.size), info.size)


def _exactly(chunks: Iterable[bytes], size: int) -> Iterator[bytes]:
    """``size`` bytes and the block padding: a file that changed or went away while it was
    read is cut or zero-filled, so the tar stays well formed (a busy file's copy is not
    atomic)."""
    left = size
    try:
        for chunk in chunks:
            if left <= 0:
                break
            yield chunk[:left]
            left -= min(len(chunk), left)
    except SandboxFileError:
        pass  # gone or unreadable since the walk saw it: the zeros below stand for it
    while left > 0:
        fill = min(left, archive.TRANSFER_CHUNK)
        yield b"\0" * fill
        left -= fill
    if size % tarfile.BLOCKSIZE:
        yield b"\0" * (tarfile.BLOCKSIZE - size % tarfile.BLOCKSIZE)


def publish(layout_dir: Path, scope: str, image_id: str, home: Path | None = None) -> str:
    """An OCI layout already on this node (a stored image's, e.g. a Dockerfile build's) as
    the filesystem image ``image_id`` of ``scope``, so that other nodes fetch it as they fetch
    a ``snapshot_filesystem`` image; returns its reference. Blobs are hard-linked where the
    disk allows (copied otherwise); publishing an id that exists already changes nothing."""
    dest = layout(scope, image_id, home)
    if dest.is_dir():
        return reference(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}.part")
    try:
        (part / "blobs" / "sha256").mkdir(parents=True)
        for blob in (layout_dir / "blobs" / "sha256").iterdir():
            target = part / "blobs" / "sha256" / blob.name
            try:
                os.link(blob, target)
            except OSError:
                shutil.copyfile(blob, target)
        for name in ("index.json", "oci-layout"):
            shutil.copyfile(layout_dir / name, part / name)
        try:
            os.replace(part, dest)
        except OSError:
            if not dest.is_dir():  # not a concurrent publish of the same id
                raise
    finally:
        shutil.rmtree(part, ignore_errors=True)
    return reference(dest)


class _Diff:
    """One comparison of a sandbox's root with its image's rootfs, writing the changes into
    ``diff`` (module docstring, "Diffs"). Everything it learns from the sandbox (names,
    types, sizes, links, the order of entries) is checked: names are single components, a
    walked path's parent must be a directory this diff made, sizes are counted before any
    content is read, and the diff is written through directory fds opened without following
    links, never replacing what it wrote."""

    def __init__(self, client: AgentClient, sandbox_id: str, base: Path, diff: Path,
                 max_bytes: int, max_entries: int) -> None:
        self.client, self.sid, self.base = client, sandbox_id, base
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self.root = os.open(diff, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        self.count = self.announced = 0
        self.skip: set[str] = set()
        self.dirs: dict[str, p.Entry] = {}  # the sandbox's directories met, by relative path
        self.made: dict[str, int] = {}  # directories made in the diff -> their mtime (ns)
        self.links: dict[tuple[int, int], tuple[str, int, int]] = {}  # (dev, ino) -> first
        self.queue: list[tuple[str, p.Entry]] = []  # files whose content is to be read
        self.queued = 0  # the size of their READS request, roughly
        self.linked: list[tuple[str, str]] = []  # (first name, hard link) to make
        self._fds: OrderedDict[str, int] = OrderedDict()  # directories of the diff, open

    def run(self) -> None:
        try:
            self.skip = {m.lstrip("/") for m in mount_points(self.client.read_file(
                "/proc/mounts", max_bytes=1 << 20).decode(errors="replace"))}
            self.skip.add(_AGENT_DIR)  # where the runtime mounts the agent's files
            todo = [""]  # directories in both roots whose content changed
            while todo:
                todo += self._visit(todo.pop())
            self._flush()
            for rel, mtime in self.made.items():
                os.utime(self._dir_fd(rel, make=False), ns=(mtime, mtime))
            st = os.lstat(self.base)  # the root itself: the image's
            os.fchown(self.root, st.st_uid, st.st_gid)
            os.fchmod(self.root, stat.S_IMODE(st.st_mode))
            os.utime(self.root, ns=(st.st_mtime_ns, st.st_mtime_ns))
        finally:
            self._close_fds()
            os.close(self.root)

    # -- the comparison -----------------------------------------------------------------------

    def _visit(self, rel: str) -> list[str]:
        """Compare the directory ``rel`` (in both roots, a real directory in the image's) and
        write what differs; returns its subdirectories to visit in turn."""
        seen: set[str] = set()
        deeper: list[str] = []
        for e in self.client.entries("/" + rel, max_entries=self._left()):
            self._counted()
            name = os.fsdecode(e.path)
            if not _component(name):
                continue  # no directory holds such a name: a broken or hostile agent
            path = _join(rel, name)
            seen.add(name)
            if self._skipped(path) or name.startswith(_WH):
                continue  # a mount, or a name no layer can hold
            b = _lstat(self.base / path)
            if e.type == "directory":
                self.dirs[path] = e
                if b is not None and stat.S_ISDIR(b.st_mode):
                    if not _same(e, b):
                        self._dir(path)  # its mode or owner changed
                    if e.mtime_ns != b.st_mtime_ns:
                        # an entry below changed (or a mount point was made there): look
                        # inside; the directory is in the diff once something in it is
                        deeper.append(path)
                else:
                    self._dir(path)  # new, or in place of a file of the image's
                    self._subtree(path)
            elif e.type == "file":
                if not (b is not None and stat.S_ISREG(b.st_mode) and _same(e, b)
                        and e.size == b.st_size and e.mtime_ns == b.st_mtime_ns):
                    self._file(path, e)
            elif e.type == "symlink":
                if not (b is not None and stat.S_ISLNK(b.st_mode) and e.link is not None
                        and (b.st_uid, b.st_gid) == (e.uid, e.gid)
                        and os.readlink(self.base / path) == os.fsdecode(e.link)):
                    self._symlink(path, e)
            else:
                seen.discard(name)  # devices, sockets, FIFOs are left out, as if deleted
        self._deletions(rel, seen)
        return deeper

    def _deletions(self, rel: str, seen: set[str]) -> None:
        """Whiteouts for the image's entries of ``rel`` the sandbox no longer has (mount
        points never count as deleted); an opaque directory where none is left."""
        names = os.listdir(self.base / rel)
        gone = [n for n in names if n not in seen and not self._skipped(_join(rel, n))]
        if rel and len(gone) > 1 and len(gone) == len(names):
            fd = self._parent_fd(_join(rel, "x"))
            os.setxattr(fd, _OPAQUE_XATTR, b"y")
            self._announce(rel, 0)
            return
        for name in sorted(gone):
            path = _join(rel, name)
            self._announce(path, 0)
            fd = self._parent_fd(path)
            try:
                os.mknod(name, stat.S_IFCHR, os.makedev(0, 0), dir_fd=fd)
            except FileExistsError:
                pass

    def _subtree(self, rel: str) -> None:
        """Everything below the new directory ``rel``, walked in the sandbox in one call."""
        made = {""}
        for e in self.client.entries("/" + rel, recursive=True, max_entries=self._left()):
            self._counted()
            sub = os.fsdecode(e.path)
            parent, _, name = sub.rpartition("/")
            if (parent not in made or not all(map(_component, sub.split("/")))
                    or name.startswith(_WH)):
                continue  # out of order, or a name no layer can hold: a broken agent
            path = _join(rel, sub)
            if self._skipped(path):
                continue
            if e.type == "directory":
                self.dirs[path] = e
                self._dir(path)
                made.add(sub)
            elif e.type == "file":
                self._file(path, e)
            elif e.type == "symlink":
                self._symlink(path, e)

    def _skipped(self, path: str) -> bool:
        """Whether ``path`` is a mount point or below one: its ancestors are looked up, so
        the cost is the path's depth, whatever the number of mounts the sandbox made."""
        if not self.skip:
            return False
        at = path.find("/")
        while at != -1:
            if path[:at] in self.skip:
                return True
            at = path.find("/", at + 1)
        return path in self.skip

    # -- bounds -----------------------------------------------------------------------------

    def _left(self) -> int:
        return max(1, self.max_entries - self.count + 1)

    def _counted(self) -> None:
        self.count += 1
        if self.count > self.max_entries:
            raise ImageError(f"over {self.max_entries} files to snapshot", sandbox_id=self.sid)

    def _announce(self, path: str, size: int) -> None:
        """Count a member of the layer (headers and content, as the sandbox announced it)
        before it is written."""
        self.announced += _MEMBER_OVERHEAD + size
        if self.announced > self.max_bytes:
            raise ImageError(f"the sandbox's changes are over {self.max_bytes} bytes (at "
                             f"/{path}); pass a larger max_bytes to snapshot them",
                             sandbox_id=self.sid)

    # -- writing the diff ---------------------------------------------------------------------

    def _dir(self, path: str) -> None:
        self._announce(path, 0)
        self._dir_fd(path, make=True)

    def _file(self, path: str, e: p.Entry) -> None:
        """Queue the file (its content is read in batches: :meth:`_flush`); a hard link of
        a file met before becomes a link to it in the diff."""
        self._announce(path, e.size)
        key = (e.dev, e.ino)
        first = self.links.get(key) if e.nlink > 1 else None
        if first is not None and first[1:] == (e.size, e.mtime_ns):
            self.linked.append((first[0], path))
        else:
            if e.nlink > 1:
                self.links.setdefault(key, (path, e.size, e.mtime_ns))
            self.queue.append((path, e))
            self.queued += len(path) + _READS_ITEM
        if len(self.queue) >= _READS_FILES or self.queued >= _READS_PATHS:
            self._flush()

    def _flush(self) -> None:
        """Read the queued files through the agent, a batch per request, into the diff;
        then make the hard links whose first name is written."""
        queue, self.queue, self.queued = self.queue, [], 0
        out: BinaryIO | None = None
        at = -1
        try:
            for i, data in self.client.read_files([("/" + path, e.size) for path, e in queue]):
                if i != at:  # the next file begins
                    at = i
                    out = self._create(queue[i][0])
                if data is not None:
                    if out is not None:
                        out.write(data)
                    continue
                if out is not None:  # ended: short (gone, or not a file now) reads as zeros
                    out.truncate(queue[i][1].size)
                    _set_meta(out.fileno(), queue[i][1])
                    out.close()
                    out = None
        finally:
            if out is not None:
                out.close()
        linked, self.linked = self.linked, []
        for first, path in linked:
            self._link(first, path)

    def _create(self, path: str) -> BinaryIO | None:
        fd = self._parent_fd(path)
        try:
            out = os.open(path.rpartition("/")[2], os.O_WRONLY | os.O_CREAT | os.O_EXCL
                          | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd)
        except FileExistsError:
            return None  # listed twice: the first one stays
        return os.fdopen(out, "wb")

    def _link(self, first: str, path: str) -> None:
        fd = self._parent_fd(path)
        src = self._dir_fd(first.rpartition("/")[0], make=False)
        try:
            os.link(first.rpartition("/")[2], path.rpartition("/")[2], src_dir_fd=src,
                    dst_dir_fd=fd, follow_symlinks=False)
        except (FileExistsError, FileNotFoundError):
            pass  # listed twice, or its first name was

    def _symlink(self, path: str, e: p.Entry) -> None:
        if e.link is None or b"\0" in e.link:
            return
        self._announce(path, len(e.link))
        fd = self._parent_fd(path)
        name = path.rpartition("/")[2]
        try:
            os.symlink(os.fsdecode(e.link), name, dir_fd=fd)
        except FileExistsError:
            return
        os.chown(name, e.uid, e.gid, dir_fd=fd, follow_symlinks=False)
        os.utime(name, ns=(e.mtime_ns, e.mtime_ns), dir_fd=fd, follow_symlinks=False)

    def _parent_fd(self, path: str) -> int:
        """The open fd of ``path``'s directory in the diff, made as needed."""
        return self._dir_fd(path.rpartition("/")[0], make=True)

    def _dir_fd(self, rel: str, *, make: bool) -> int:
        """``rel`` in the diff, opened one component at a time from the nearest directory
        already open, never through a link; with ``make``, missing directories are made
        with the sandbox's metadata of them. The fd stays open (the last _OPEN_DIRS do):
        the caller does not close it."""
        parts = rel.split("/") if rel else []
        k = len(parts)
        while k and "/".join(parts[:k]) not in self._fds:
            k -= 1
        done = "/".join(parts[:k])
        fd = self.root
        if k:
            self._fds.move_to_end(done)
            fd = self._fds[done]
        for part in parts[k:]:
            done = _join(done, part)
            if make and done not in self.made:
                try:
                    os.mkdir(part, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass  # listed twice
                else:
                    self.made[done] = self.dirs[done].mtime_ns
                    nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                    try:
                        _set_meta(nfd, self.dirs[done])
                    finally:
                        os.close(nfd)
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:  # ELOOP/ENOTDIR: what the sandbox listed twice
                raise ImageError(f"/{done} is listed both as a directory and not",
                                 sandbox_id=self.sid) from exc
            self._fds[done] = fd = nfd
            if len(self._fds) > _OPEN_DIRS:
                os.close(self._fds.popitem(last=False)[1])
        return fd

    def _close_fds(self) -> None:
        while self._fds:
            os.close(self._fds.popitem()[1])


def _set_meta(fd: int, e: p.Entry) -> None:
    """Owner, mode and mtime of what this process just made (as root: owned by 0:0)."""
    if e.uid or e.gid:
        os.fchown(fd, e.uid, e.gid)
    os.fchmod(fd, e.mode & 0o7777)  # after chown, which clears setuid bits
    os.utime(fd, ns=(e.mtime_ns, e.mtime_ns))


def _same(e: p.Entry, b: os.stat_result) -> bool:
    return (e.mode & 0o7777, e.uid, e.gid) == (stat.S_IMODE(b.st_mode), b.st_uid, b.st_gid)


def _lstat(path: Path) -> os.stat_result | None:
    """The image's entry at ``path``, whose parent is a real directory of the image's: the
    lookup follows no link."""
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _component(name: str) -> bool:
    return name not in ("", ".", "..") and "/" not in name and "\0" not in name


def _join(rel: str, name: str) -> str:
    return f"{rel}/{name}" if rel else name


def _layer(diff: Path) -> Iterator[bytes]:
    """The OCI layer of an overlayfs diff directory (this process's own files): whiteouts
    and opaque directories become ``.wh.`` entries, written before their siblings; a file
    met again through a hard link becomes a link entry."""
    seen: dict[tuple[int, int], str] = {}
    for top, dirs, files, dfd in os.fwalk(diff, follow_symlinks=False):
        dirs.sort()
        rel = os.path.relpath(top, diff)
        rel = "" if rel == "." else rel
        if rel and _OPAQUE_XATTR in os.listxattr(dfd):
            yield archive.header(_whiteout_info(_join(rel, _WH + _WH + ".opq")))
        entries = [(name, os.stat(name, dir_fd=dfd, follow_symlinks=False))
                   for name in sorted(dirs + files)]
        entries.sort(key=lambda item: not _is_whiteout(item[1]))
        for name, st in entries:
            path = _join(rel, name)
            if _is_whiteout(st):
                yield archive.header(_whiteout_info(_join(rel, _WH + name)))
                continue
            ti = tarfile.TarInfo(path)
            ti.mode, ti.uid, ti.gid = stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid
            ti.mtime = st.st_mtime_ns // 10**9  # whole seconds, as most layers: no PAX header
            if stat.S_ISDIR(st.st_mode):
                ti.type = tarfile.DIRTYPE
                yield archive.header(ti)
            elif stat.S_ISLNK(st.st_mode):
                ti.type, ti.linkname = tarfile.SYMTYPE, os.readlink(name, dir_fd=dfd)
                yield archive.header(ti)
            elif stat.S_ISREG(st.st_mode):
                first = seen.get((st.st_dev, st.st_ino)) if st.st_nlink > 1 else None
                if first is not None:
                    ti.type, ti.linkname = tarfile.LNKTYPE, first
                    yield archive.header(ti)
                    continue
                seen[(st.st_dev, st.st_ino)] = path
                ti.size = st.st_size
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                with os.fdopen(fd, "rb") as f:
                    yield from archive.file_blocks(ti, iter(partial(f.read, archive.CHUNK), b""))
    yield archive.end_blocks()


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _whiteout_info(name: str) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.mode = 0o600
    return ti


def remove(scope: str, image_id: str, home: Path | None = None) -> None:
    shutil.rmtree(layout(scope, image_id, home), ignore_errors=True)
