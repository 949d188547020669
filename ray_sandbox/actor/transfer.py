"""Bytes through Ray's object store in ~4 MiB objects: files and directories between the
caller's node and a sandbox's host, and snapshots between hosts. Memory on either side stays
bounded by a chunk, and a sandbox on another node works the same as a local one."""

from __future__ import annotations

import os
import secrets
import shutil
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import ray

from ..runtime import SandboxRuntime, archive, fs_image, hostfs
from ..runtime.errors import ImageNotFoundError
from ..runtime.snapshot import Snapshot
from ..runtime.verbs import StatRequest


def rechunk(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """Coalesce small pieces so each yielded object is ~4 MiB (fewer Ray objects)."""
    buf: list[bytes] = []
    size = 0
    for c in chunks:
        buf.append(c)
        size += len(c)
        if size >= archive.TRANSFER_CHUNK:
            yield b"".join(buf)
            buf, size = [], 0
    if buf:
        yield b"".join(buf)


def fetch(refs: Iterable[ray.ObjectRef]) -> Iterator[bytes]:
    """The bytes behind ``refs`` (a list or a streaming generator), one object at a time."""
    for ref in refs:
        yield ray.get(ref)


def put_chunks(chunks: Iterable[bytes]) -> list[ray.ObjectRef]:
    """Bytes into the object store in ~4 MiB objects, for a task on another node to fetch.
    An empty stream still sends one (empty) object: the host then writes an empty file."""
    return [ray.put(c) for c in rechunk(chunks)] or [ray.put(b"")]


# --- the caller's side of SandboxHandle's local-path methods (done during ``.remote()``) ----

def upload_file(host: Any, sandbox_id: str, local: str | Path, remote: str) -> ray.ObjectRef:
    mode = Path(local).stat().st_mode & 0o7777
    with open(local, "rb") as f:
        refs = put_chunks(iter(lambda: f.read(archive.TRANSFER_CHUNK), b""))
    return host.write_in.remote("file", sandbox_id, remote, refs, mode)


def download_file(host: Any, sandbox_id: str, remote: str, local: str | Path, *,
                  max_bytes: int | None = hostfs.DOWNLOAD_MAX) -> ray.ObjectRef:
    info = ray.get(host.call.options(concurrency_group="work").remote(
        "stat", sandbox_id, StatRequest(path=remote, follow_symlinks=True)))
    gen = host.read_out.options(num_returns="streaming").remote("file", sandbox_id,
                                                               (remote, max_bytes))
    chunks = hostfs.bounded(fetch(gen), max_bytes, remote, sandbox_id)
    hostfs.write_atomic(local, chunks, info.mode)
    return ray.put(None)


def upload_dir(host: Any, sandbox_id: str, local: str | Path, remote: str) -> ray.ObjectRef:
    refs = put_chunks(archive.pack_local(Path(local)))
    return host.write_in.remote("archive", sandbox_id, remote, refs)


def download_dir(host: Any, sandbox_id: str, remote: str, local: str | Path) -> ray.ObjectRef:
    gen = host.read_out.options(num_returns="streaming").remote("archive", sandbox_id,
                                                               remote)
    archive.extract_local(fetch(gen), Path(local))
    return ray.put(None)


# --- snapshots between hosts ---------------------------------------------------------------

class SnapshotImports:
    """Copies snapshots held by other nodes into this node's store, once each (the copy is
    owned by this host and deleted with the snapshot): k copies restored here at once wait
    for one fetch."""

    def __init__(self, rt: SandboxRuntime, node_id: str) -> None:
        self._rt = rt
        self._node_id = node_id
        self._lock = threading.Lock()
        self._fetching: dict[str, threading.Lock] = {}

    def ensure_local(self, snap: Snapshot, host_of: Callable[[str], Any]) -> None:
        """``host_of(node_id)`` is the host actor that streams the snapshot's files."""
        if snap.node_id in (None, self._node_id):
            return
        with self._lock:
            lock = self._fetching.setdefault(snap.snapshot_id, threading.Lock())
        with lock:
            if self._rt.snapshots.has(snap.snapshot_id):
                return
            source = host_of(snap.node_id)
            gen = source.read_out.options(num_returns="streaming").remote(
                "snapshot", snap.snapshot_id)
            self._rt.snapshots.import_(fetch(gen))


class ImageImports:
    """Copies filesystem images taken on other nodes (``fs_image``: their reference names
    the node) into this node's home before a sandbox starts from one, once each."""

    def __init__(self, home: Path, node_id: str) -> None:
        self._home = home
        self._node_id = node_id
        self._lock = threading.Lock()
        self._fetching: dict[str, threading.Lock] = {}

    def local_ref(self, ref: str, host_of: Callable[[str], Any]) -> str:
        """``ref`` as this node's copy, fetched first if it is not here yet; other
        references as they are. ``host_of(node_id)`` is the host actor that streams it."""
        parsed = fs_image.parse(ref)
        if parsed is None:
            return ref
        node, image_id = parsed
        dest = fs_image.layout(node, image_id, self._home)
        with self._lock:
            lock = self._fetching.setdefault(image_id, threading.Lock())
        with lock:
            if node != self._node_id and not dest.is_dir():
                self._fetch(ref, node, image_id, dest, host_of)
        return fs_image.reference(dest)

    @staticmethod
    def _fetch(ref: str, node: str, image_id: str, dest: Path,
               host_of: Callable[[str], Any]) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest.with_name(f".{image_id}.{secrets.token_hex(4)}.part")
        try:
            gen = host_of(node).read_out.options(num_returns="streaming").remote(
                "fs_image", image_id)
            archive.extract_local(fetch(gen), part)
            os.replace(part, dest)
        except (ray.exceptions.RayError, OSError) as exc:
            raise ImageNotFoundError(f"filesystem image {ref} could not be fetched from node "
                                     f"{node}: {exc}") from None
        finally:
            shutil.rmtree(part, ignore_errors=True)
