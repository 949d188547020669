"""The image store's directory: where each record lives, reading records, and the flock
locks and work directories that let threads and processes share it. Layout under the root
(default ``paths.images()``: ``$RAY_SANDBOX_IMAGES`` or ``home()/images``; docs/images.md)::

    blobs/sha256/<hex>        pool of every blob, hard-linked into the images that use it
    sha256/<hex>/             one image, published by a single rename (never half-visible)
        image.json            digest, parsed config, size
        used                  empty; its mtime is the last use (LRU eviction)
        pins/<owner>          one file per pin (:mod:`.pins`); pinned images are kept
        oci/                  an OCI layout holding just this image (tag "image")
        rootfs/               the unpacked root filesystem, used read-only
    refs/<key>.json           reference (+ platform) -> digest
    locks/<name>.lock         flock files: ref-<key> (resolve/pull), img-<hex> (unpack/pin/remove)
    tmp/<name>.<random>/      work directories, each owned by whoever holds locks/<name>.lock
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic import ValidationError

from .. import _mount
from ..errors import ImageBusyError
from .models import Image, _ImageRecord, _RefRecord
from .reference import _hex


def ref_key(ref: str, platform: str) -> str:
    """The name of a reference's file under refs/ (and of its ref-<key> lock)."""
    return hashlib.sha256(f"{ref}\n{platform}".encode()).hexdigest()[:32]


class StoreDir:
    """The files under one store root; holds no state but the path."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def make_dirs(self) -> None:
        for sub in ("blobs/sha256", "sha256", "refs", "locks", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    @property
    def blobs(self) -> Path:
        return self.root / "blobs" / "sha256"

    def image(self, digest: str) -> Path:
        return self.root / "sha256" / _hex(digest)

    def digests(self) -> Iterator[str]:
        """The digest of every directory under sha256/."""
        for entry in os.scandir(self.root / "sha256"):
            yield f"sha256:{entry.name}"

    def ref_file(self, key: str) -> Path:
        return self.root / "refs" / f"{key}.json"

    def ref_path(self, record: _RefRecord) -> Path:
        return self.ref_file(ref_key(record.ref, record.platform))

    def ref_record(self, key: str) -> _RefRecord | None:
        try:
            return _RefRecord.model_validate_json(self.ref_file(key).read_bytes())
        except FileNotFoundError:
            return None

    def ref_records(self) -> list[_RefRecord]:
        records = []
        for entry in os.scandir(self.root / "refs"):
            try:
                records.append(_RefRecord.model_validate_json(Path(entry.path).read_bytes()))
            except (FileNotFoundError, ValidationError):
                continue  # removed meanwhile, or not ours
        return records

    def image_records(self) -> list[tuple[float, _ImageRecord]]:
        """(last use, record) of every published image."""
        found = []
        for entry in os.scandir(self.root / "sha256"):
            try:
                record = _ImageRecord.model_validate_json(
                    Path(entry.path, "image.json").read_bytes())
                found.append((os.stat(Path(entry.path, "used")).st_mtime, record))
            except FileNotFoundError:
                continue
        return found

    def load(self, digest: str, *, ref: str, touch: bool) -> Image | None:
        path = self.image(digest)
        try:
            record = _ImageRecord.model_validate_json((path / "image.json").read_bytes())
            if touch:
                os.utime(path / "used")
                last_used = time.time()
            else:
                last_used = os.stat(path / "used").st_mtime
        except FileNotFoundError:
            return None  # never stored, or removed by someone else just now
        return Image(ref=ref, digest=record.digest, rootfs=path / "rootfs", config=record.config,
                     size_bytes=record.size_bytes, created=record.created, last_used=last_used,
                     parent=record.parent)

    def record(self, digest: str) -> _ImageRecord | None:
        """The published image's record; None if it is not stored."""
        try:
            return _ImageRecord.model_validate_json(
                (self.image(digest) / "image.json").read_bytes())
        except FileNotFoundError:
            return None

    @contextmanager
    def locked(self, name: str, deadline: float) -> Iterator[None]:
        """Exclusive flock on locks/<name>.lock; excludes other threads and processes alike
        because every acquisition opens its own file description."""
        fd = os.open(self.root / "locks" / f"{name}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                     0o644)
        try:
            delay = 0.005
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise ImageBusyError(f"timed out waiting for image lock {name}") from None
                    time.sleep(delay)
                    delay = min(delay * 2, 0.1)
            yield
        finally:
            os.close(fd)

    @contextmanager
    def workdir(self, owner: str) -> Iterator[Path]:
        """A fresh tmp/<owner>.<random> directory; the caller holds locks/<owner>.lock."""
        path = Path(tempfile.mkdtemp(prefix=f"{owner}.", dir=self.root / "tmp"))
        try:
            yield path
        finally:
            _rmtree(path)

    def sweep(self) -> None:
        """Remove work directories whose owner lock is free: their process died (an image
        it was deleting may still have its rootfs mounted there)."""
        for entry in os.scandir(self.root / "tmp"):
            owner = entry.name.split(".", 1)[0]
            try:
                with self.locked(owner, deadline=0):
                    unmount_under(Path(entry.path))
                    _rmtree(Path(entry.path))
            except ImageBusyError:
                continue  # a live pull, build or removal is using it


_STACKED_MAX = 8  # mounts stacked on one point that a removal detaches


def unmount_under(path: Path) -> None:
    """Detach every mount at or below ``path`` (a layered image's rootfs), deepest first,
    so that a removal never descends into one."""
    for point in [*_mount.mounts_under(path), path]:
        for _ in range(_STACKED_MAX):  # stacked mounts: one detach each
            if not _mount.unmount(point):
                break


def _rmtree(path: Path) -> None:
    """Delete a file or tree; read-only directories inside images are made writable first."""

    def retry_writable(func: Callable[[str], object], name: str,
                       exc_info: tuple[type[BaseException], BaseException, object]) -> None:
        if isinstance(exc_info[1], FileNotFoundError):
            return
        if not isinstance(exc_info[1], PermissionError):
            raise exc_info[1]
        os.chmod(os.path.dirname(name), 0o700)
        func(name)

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, onerror=retry_writable)
    else:
        path.unlink(missing_ok=True)
