"""``disk=``: a size-capped filesystem per sandbox, and the only place that runs mkfs.ext4.

A sparse ext4 image file of ``disk`` bytes in the sandbox's directory is mounted through a
loop device. It is a copy of a template formatted once per size (mkfs costs ~11 ms of CPU per
sandbox, copying the template's ~2 MiB of metadata ~1 ms). The sandbox's host-backed writable
storage (runsc's overlay filestore for a writable root, the workdir bind of a read-only one)
lives on it, so a write beyond the cap fails inside with ENOSPC while the sandbox keeps
running and the node's disk is untouched.

The loop device is bound with ``LOOP_CONFIGURE`` + ``LO_FLAGS_AUTOCLEAR`` on an fd this process
holds until the mount has taken its own reference: a crash before the mount frees the device
(the kernel closes the fd), and unmounting the filesystem frees it afterwards. Nothing here
keeps per-sandbox state: teardown is "unmount everything under the sandbox dir", which delete
and the reaper already do. The templates (``<home>/disks/``, one small sparse file per size)
are the host's own; nothing a sandbox writes reaches them.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

from . import _mount, _proc
from .errors import SandboxCreationError

_LOOP_CONTROL = "/dev/loop-control"
_LOOP_CTL_GET_FREE = 0x4C82
_LOOP_CONFIGURE = 0x4C0A  # Linux >= 5.8: bind + status in one ioctl
_LO_FLAGS_AUTOCLEAR = 4
# struct loop_config { u32 fd; u32 block_size; struct loop_info64 info; u64 reserved[8]; }
# struct loop_info64 { u64 device, inode, rdevice, offset, sizelimit;
#                      u32 number, encrypt_type, encrypt_key_size, flags;
#                      u8 file_name[64], crypt_name[64], encrypt_key[32]; u64 init[2]; }
_LOOP_CONFIG = struct.Struct("=II5Q4I64s64s32s2Q8Q")
_CONFIGURE_ATTEMPTS = 16  # another process can take the device GET_FREE named
_MKFS_TIMEOUT = 60.0


def unavailable() -> str | None:
    """Why ``disk=`` cannot be enforced on this node, or None if it can."""
    if os.geteuid() != 0:
        return "not root: mounting a loop device needs CAP_SYS_ADMIN"
    if shutil.which("mkfs.ext4") is None:
        return "mkfs.ext4 is not installed (package e2fsprogs; run scripts/setup.sh)"
    try:
        with open("/proc/filesystems") as f:
            if not any(line.split()[-1:] == ["ext4"] for line in f):
                return "the kernel has no ext4 support"
    except OSError as exc:
        return f"cannot read /proc/filesystems: {exc}"
    try:
        os.close(os.open(_LOOP_CONTROL, os.O_RDWR | os.O_CLOEXEC))
    except OSError as exc:
        return f"no loop devices ({_LOOP_CONTROL}: {exc.strerror})"
    return None


def mkfs_ext4(image: Path, *, sandbox_id: str | None, journal: bool = False) -> None:
    """Format ``image`` (a new sparse file) as ext4.

    A sandbox's disk has no journal: the data dies with the sandbox, so crash consistency buys
    nothing, and the default journal costs host disk (32 MiB per GiB). A volume's outlives
    everything and stays mounted while sandboxes use it, so it keeps the journal (a crash of
    the node then costs a replay at the next mount, not an fsck); lazy_journal_init leaves it
    unwritten, as it reads zeros in a new sparse file. No reserved blocks: the gofer writes as
    root and would use them anyway. lazy_itable_init (with the noinit_itable mount option):
    nobody writes the inode tables, which in a sparse image already read as zeros."""
    features = ["-E", "lazy_itable_init=1,lazy_journal_init=1"] if journal else \
        ["-O", "^has_journal", "-E", "lazy_itable_init=1"]
    _proc.run(["mkfs.ext4", "-q", "-F", "-m", "0", *features, str(image)],
              timeout=_MKFS_TIMEOUT, sandbox_id=sandbox_id, what="mkfs.ext4")


def template(templates: Path, size: int, *, sandbox_id: str) -> Path:
    """The formatted ``size``-byte image every disk of that size is copied from; made on first
    use (concurrent makers race harmlessly: each renames a whole file into place)."""
    path = templates / f"ext4-{size}.img"
    if path.is_file():
        return path
    templates.mkdir(parents=True, exist_ok=True)
    tmp = templates / f".{path.name}.{os.getpid()}.{sandbox_id}"
    try:
        with open(tmp, "wb") as f:
            f.truncate(size)
        mkfs_ext4(tmp, sandbox_id=sandbox_id)
        os.rename(tmp, path)
    except OSError as exc:
        raise SandboxCreationError(f"a {size}-byte disk template cannot be made in "
                                   f"{templates}: {exc}", sandbox_id=sandbox_id) from None
    finally:
        tmp.unlink(missing_ok=True)
    return path


def data_extents(fd: int) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of each data extent of the file behind ``fd``; holes are skipped."""
    size, off = os.fstat(fd).st_size, 0
    while off < size:
        try:
            start = os.lseek(fd, off, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data past off
                return
            raise
        off = os.lseek(fd, start, os.SEEK_HOLE)
        yield start, off


def _copy_sparse(src: Path, dst_fd: int) -> None:
    """Copy ``src``'s data extents into ``dst_fd`` (already of the same size); holes stay holes."""
    fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for start, end in data_extents(fd):
            pos = start
            while pos < end:
                n = os.copy_file_range(fd, dst_fd, end - pos, pos, pos)
                if n == 0:
                    raise OSError(errno.EIO, f"{src} shrank while it was copied")
                pos += n
    finally:
        os.close(fd)


def clone(src: Path, dst: Path) -> None:
    """A sparse copy of ``src`` at the new path ``dst`` (holes stay holes)."""
    fd = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, os.stat(src).st_size)
        _copy_sparse(src, fd)
    finally:
        os.close(fd)


def _bind_loop(image_fd: int, name: str, *, sandbox_id: str | None) -> tuple[int, int]:
    """A loop device bound to ``image_fd`` with autoclear: (its open fd, its number)."""
    config = _LOOP_CONFIG.pack(image_fd, 0, 0, 0, 0, 0, 0, 0, 0, 0, _LO_FLAGS_AUTOCLEAR,
                               os.fsencode(name)[:63], b"", b"", 0, 0, *[0] * 8)
    try:
        with open(_LOOP_CONTROL, "r+b", buffering=0) as ctl:
            for _ in range(_CONFIGURE_ATTEMPTS):
                number = fcntl.ioctl(ctl, _LOOP_CTL_GET_FREE)
                fd = os.open(f"/dev/loop{number}", os.O_RDWR | os.O_CLOEXEC)
                try:
                    fcntl.ioctl(fd, _LOOP_CONFIGURE, config)
                    return fd, number
                except OSError as exc:
                    os.close(fd)
                    if exc.errno != errno.EBUSY:
                        raise
            raise OSError(errno.EBUSY, "every free loop device was taken before it was bound")
    except OSError as exc:
        raise SandboxCreationError(f"binding a loop device for disk= failed: {exc}",
                                   sandbox_id=sandbox_id) from None


def attach(image: Path, mountpoint: Path, size: int, *, templates: Path, sandbox_id: str) -> None:
    """Create a ``size``-byte ext4 image at ``image`` (from its template in ``templates``) and
    mount it on ``mountpoint``."""
    reason = unavailable()
    if reason:
        raise SandboxCreationError(f"disk= cannot be enforced here: {reason}",
                                   sandbox_id=sandbox_id)
    source = template(templates, size, sandbox_id=sandbox_id)
    try:
        clone(source, image)
    except OSError as exc:
        raise SandboxCreationError(f"a {size}-byte disk image cannot be made here: {exc}",
                                   sandbox_id=sandbox_id) from None
    mountpoint.mkdir()
    mount_image(image, mountpoint, sandbox_id=sandbox_id)


def mount_image(image: Path, mountpoint: Path, *, sandbox_id: str | None) -> None:
    """Mount the ext4 ``image`` on the existing directory ``mountpoint`` through a loop
    device that lives exactly as long as the mount (autoclear)."""
    try:
        fd = os.open(image, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        raise SandboxCreationError(f"opening the disk image failed: {exc}",
                                   sandbox_id=sandbox_id) from None
    try:
        loop, number = _bind_loop(fd, str(image), sandbox_id=sandbox_id)
    finally:
        os.close(fd)
    try:
        # noinit_itable: see mkfs_ext4; the kernel's lazyinit thread would otherwise zero
        # every inode table, un-sparsing the image.
        _mount.mount_block(f"/dev/loop{number}", mountpoint, "ext4",
                           "noinit_itable", sandbox_id=sandbox_id)
    finally:
        os.close(loop)  # the mount holds the device now; if it failed, autoclear frees it


def loop_backings() -> list[tuple[str, str]]:
    """Every bound loop device (``loopN``) and its backing file, as sysfs reports it (a
    deleted file reads "<path> (deleted)")."""
    out = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            out.append((backing.parent.parent.name, backing.read_text().strip()))
        except OSError:
            continue  # released while we looked
    return out


def loops_backed_by(image: Path) -> list[str]:
    """The loop devices (``loopN``) bound to ``image``: while one exists, some mount of it
    lives, in this mount namespace or another (a sandbox's gofer still holding it)."""
    return [dev for dev, path in loop_backings() if path == str(image)]
