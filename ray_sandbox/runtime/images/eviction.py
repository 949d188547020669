"""What deletes images: remove, prune, least recently used eviction down to ``max_bytes``
(never a pinned image: :mod:`.pins`), and the cleanup of pool blobs and references that point
at deleted images."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from ..errors import ImageBusyError, ImageInUseError, ImageNotFoundError
from . import layers
from .reference import _hex
from .storedir import StoreDir, _rmtree, unmount_under


def remove(store_dir: StoreDir, digest: str, *, untag: Path | None, name: str) -> list[str]:
    """Drop the reference file ``untag``, or with None every reference to ``digest``, and
    delete the image once none is left. ``name`` is what the caller asked for, for errors."""
    with store_dir.locked(f"img-{_hex(digest)}", time.monotonic() + 60):
        refs = [store_dir.ref_path(r) for r in store_dir.ref_records() if r.digest == digest]
        doomed = refs if untag is None else [untag]
        stored = (store_dir.image(digest) / "image.json").exists()
        if not stored and not refs:
            raise ImageNotFoundError(f"{name} is not in the image store")
        deletes_image = stored and len(doomed) == len(refs)
        children: set[str] = set()
        if deletes_image:
            pinned, children = layers.live_owners(store_dir, digest)
            if pinned:
                raise ImageInUseError(f"{digest} is pinned by {sorted(pinned)}")
        for path in doomed:
            path.unlink(missing_ok=True)
        # an image others are layered on loses its names, and goes with its last child
        deletes_image = deletes_image and not children
        removed = [digest] if deletes_image and _delete_image(store_dir, digest) else []
    _gc_blobs(store_dir)
    return removed


def prune(store_dir: StoreDir, *, all_images: bool) -> list[str]:
    store_dir.sweep()
    referenced = {r.digest for r in store_dir.ref_records()}
    removed = [
        digest for digest in store_dir.digests()
        if (all_images or digest not in referenced) and _delete_if_unpinned(store_dir, digest)
    ]
    _drop_dangling_refs(store_dir)
    _gc_blobs(store_dir)
    return removed


def evict(store_dir: StoreDir, max_bytes: int | None, keep: str) -> None:
    """Delete least recently used unpinned images until the store fits ``max_bytes``."""
    if max_bytes is None:
        return
    records = sorted(store_dir.image_records(), key=lambda item: item[0])
    total = sum(r.size_bytes for _, r in records)
    for _, record in records:
        if total <= max_bytes:
            break
        if record.digest != keep and _delete_if_unpinned(store_dir, record.digest):
            total -= record.size_bytes
    _drop_dangling_refs(store_dir)
    _gc_blobs(store_dir)


def _delete_image(store_dir: StoreDir, digest: str) -> bool:
    """Rename the image away (it vanishes atomically), then delete it; hold img-<hex>. A
    layered image's rootfs is detached first, then its parent loses its pin and goes too if
    nothing else keeps it (``layers``)."""
    hex_ = _hex(digest)
    record = store_dir.record(digest)
    try:
        doomed = Path(tempfile.mkdtemp(prefix=f"img-{hex_}.", dir=store_dir.root / "tmp"))
        os.rename(store_dir.image(digest), doomed / "image")
    except FileNotFoundError:
        return False
    finally:
        unmount_under(doomed)
        _rmtree(doomed)
    if record is not None and record.parent is not None:
        _release_parent(store_dir, record.parent, digest)
    return True


def _release_parent(store_dir: StoreDir, parent: str, child: str) -> None:
    """Drop ``child``'s pin of ``parent``, and delete ``parent`` if no reference names it
    and nothing else pins it (its own references were removed while the child needed it).
    Locks go child to parent, as when the child was added."""
    with store_dir.locked(f"img-{_hex(parent)}", time.monotonic() + 60):
        layers.unpin_parent(store_dir, parent, child)
        pinned, children = layers.live_owners(store_dir, parent)
        if pinned or children or any(r.digest == parent for r in store_dir.ref_records()):
            return
        _delete_image(store_dir, parent)


def _delete_if_unpinned(store_dir: StoreDir, digest: str, timeout: float = 1.0) -> bool:
    try:
        with store_dir.locked(f"img-{_hex(digest)}", time.monotonic() + timeout):
            return not any(layers.live_owners(store_dir, digest)) and _delete_image(
                store_dir, digest)
    except ImageBusyError:
        return False  # someone is pinning or removing it right now: not a candidate


def _drop_dangling_refs(store_dir: StoreDir) -> None:
    for record in store_dir.ref_records():
        if not (store_dir.image(record.digest) / "image.json").exists():
            store_dir.ref_path(record).unlink(missing_ok=True)


def _gc_blobs(store_dir: StoreDir) -> None:
    """Delete pool blobs no image links to. A pull that links one concurrently keeps its
    own hard link, so nothing in flight is lost."""
    for entry in os.scandir(store_dir.blobs):
        try:
            if entry.stat(follow_symlinks=False).st_nlink == 1:
                os.unlink(entry.path)
        except FileNotFoundError:
            continue
