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
import re
import secrets
import shutil
import tarfile
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from . import archive, fs_diff, paths
from .agent.client import AgentClient
from .errors import (
    ConfigError,
    ImageError,
    ImageNotFoundError,
    SandboxFileError,
    StoreFullError,
    UnsafePathError,
)
from .fs_diff import mount_points
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
_LAYERS = {_LAYER, f"{_LAYER}+gzip", f"{_LAYER}+zstd"}
_TAR_SLACK = 1 << 20  # the layer's end blocks and padding beyond what was counted
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
        fs_diff.Diff(client, sandbox_id, Path(base.rootfs), diff, max_bytes, max_entries).run()
        layer = _write_blob(blobs, fs_diff.layer(diff), max_bytes + _TAR_SLACK, sandbox_id)
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


def remove(scope: str, image_id: str, home: Path | None = None) -> None:
    shutil.rmtree(layout(scope, image_id, home), ignore_errors=True)
