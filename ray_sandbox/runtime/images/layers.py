"""Layered images: an image stored as its parent plus one directory of changes (a filesystem
image, ``runtime/fs_image.py``), added without a registry copy or an unpack.

Such an image's directory holds ``diff/`` (the changes in overlayfs's own form: a deleted
name is a 0/0 character device, a directory whose old content is all gone has
``trusted.overlay.opaque``) beside the usual ``oci/`` (the parent's layers and one more) and
``rootfs/``, which is a read-only overlay mount of ``diff/`` on the parent's layers. The
mount is made the first time the image is looked up (:func:`ensure_mounted`; again after a
reboot) and detached when the image is deleted. The chain of parents is at most
:data:`MAX_DEPTH` long: mount(2) takes one page of options.

A layered image keeps its parent stored with a pin of its own (``image-<its hex>``, never a
sandbox's, so pins' staleness rules do not apply). Removing the parent's last reference
keeps its files while a child needs them (:func:`live_owners`); the child's deletion drops
the pin and deletes such an unreferenced parent (``eviction``). The pin is written under
the parent's lock together with the child's publication, so a pin whose child is not stored
is one whose writer died: it is dropped under that lock too.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from .. import _mount
from ..errors import ImageCorruptError, ImageError, ImageNotFoundError
from .pins import owners
from .reference import _hex
from .storedir import StoreDir

MAX_DEPTH = 16  # parents of a layered image, at most (each one an overlay lower dir)
_CHILD = re.compile(r"^image-([0-9a-f]{64})$")
_LOCK_S = 60.0


def child_owner(digest: str) -> str:
    """The owner name of the pin by which image ``digest`` keeps its parent."""
    return f"image-{_hex(digest)}"


def lowers(store_dir: StoreDir, digest: str) -> list[Path]:
    """The directories an overlay of image ``digest`` stacks, topmost first: each layered
    image's ``diff/``, then the first plain image's ``rootfs/``."""
    out: list[Path] = []
    for _ in range(MAX_DEPTH + 1):
        record = store_dir.record(digest)
        if record is None:
            raise ImageNotFoundError(f"{digest} is not in the image store")
        if record.parent is None:
            return [*out, store_dir.image(digest) / "rootfs"]
        out.append(store_dir.image(digest) / "diff")
        digest = record.parent
    raise ImageCorruptError(f"{digest}: more than {MAX_DEPTH} layered parents")


def refused(store_dir: StoreDir, parent: str) -> str | None:
    """Why a layer cannot be added on ``parent`` (None: it can): the chain would be too long,
    or the store's path cannot be named in an overlay's options."""
    if os.geteuid() != 0:
        return "overlay mounts need root"
    if not _mount.overlay_path_ok(store_dir.root):
        return f"the store's path {store_dir.root} has a ',', ':' or '\\'"
    try:
        below = lowers(store_dir, parent)
    except ImageError as exc:
        return str(exc)
    if len(below) > MAX_DEPTH:
        return f"{parent} already has {len(below) - 1} layered parents (at most {MAX_DEPTH})"
    names = [store_dir.image("sha256:" + "0" * 64) / "diff", *below]  # the child's diff is as long
    if len("lowerdir=" + ":".join(map(str, names))) > _mount.OPTIONS_MAX:
        return "the overlay's options would be longer than mount(2) takes"
    return None


def ensure_mounted(store_dir: StoreDir, digest: str) -> None:
    """Mount a layered image's rootfs unless it is (under the image's lock: one mount)."""
    rootfs = store_dir.image(digest) / "rootfs"
    if os.path.ismount(rootfs):
        return
    with store_dir.locked(f"img-{_hex(digest)}", time.monotonic() + _LOCK_S):
        if os.path.ismount(rootfs) or store_dir.record(digest) is None:
            return  # mounted meanwhile, or removed
        try:
            _mount.mount_lowers(lowers(store_dir, digest), rootfs)
        except OSError as exc:
            raise ImageError(f"cannot mount the rootfs of {digest}: {exc.strerror}") from None


def live_owners(store_dir: StoreDir, digest: str) -> tuple[set[str], set[str]]:
    """(pins of sandboxes and users, pins of stored children) of ``digest``; a child's pin
    whose child is not stored (its writer died before publishing it) is removed. The caller
    holds the image's lock."""
    others, children = set(), set()
    for owner in owners(store_dir, digest):
        match = _CHILD.match(owner)
        if match is None:
            others.add(owner)
        elif store_dir.record(f"sha256:{match.group(1)}") is not None:
            children.add(owner)
        else:
            (store_dir.image(digest) / "pins" / owner).unlink(missing_ok=True)
    return others, children


def pin_parent(store_dir: StoreDir, parent: str, child: str) -> None:
    """``child`` keeps ``parent``: the caller holds the parent's lock and publishes the child
    before releasing it."""
    pins = store_dir.image(parent) / "pins"
    if store_dir.record(parent) is None or not pins.is_dir():
        raise ImageNotFoundError(f"{parent} is not in the image store")
    fd = os.open(pins / child_owner(child), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                 | os.O_CLOEXEC, 0o644)
    os.close(fd)


def unpin_parent(store_dir: StoreDir, parent: str, child: str) -> None:
    (store_dir.image(parent) / "pins" / child_owner(child)).unlink(missing_ok=True)
