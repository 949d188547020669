"""Filesystem images: a running sandbox's files as an OCI image that later sandboxes start
from (Modal's ``snapshot_filesystem``). See docs/snapshots.md, "Filesystem images".

The agent walks the sandbox's root and reads its files; the host writes them as one
uncompressed layer of an OCI layout (``<home>/fs-images/<scope>/<id>``), with the source
image's config. Nothing of the sandbox's is unpacked on the host here: the image store later
unpacks the layer with umoci, as it unpacks any registry image. Mounts (``/proc``, ``/sys``,
``/dev``, ``/tmp``, volumes, the agent's ``/.rsb``, the generated ``/etc/hosts``) are not
part of the root and are left out; so are device nodes, sockets, FIFOs and extended
attributes. Hard links become copies.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
import secrets
import shutil
import tarfile
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from . import archive, paths
from .agent.client import AgentClient
from .errors import ImageError, SandboxFileError, StoreFullError, UnsafePathError
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
        pad = min(left, archive.TRANSFER_CHUNK)
        yield b"\0" * pad
        left -= pad
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
