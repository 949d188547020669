"""The per-sandbox root: a kernel overlayfs over the shared, read-only image rootfs.

runsc's gofer creates missing mount points (``/.rsb/run``, a workdir, a mount added by a
spec_transform) in the *host* directory it is given as the root. Giving it a per-sandbox
overlay whose upper layer is private means those land in the sandbox's own directory and the
shared image is never written. mount(2)/umount2(2) are called directly: one syscall each.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from .errors import SandboxCreationError

_MNT_DETACH = 2
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 2, 4, 8
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def mount_overlay(lower: Path, upper: Path, work: Path, target: Path, *, sandbox_id: str) -> None:
    for d in (upper, work, target):
        d.mkdir(exist_ok=True)
    opts = f"lowerdir={lower},upperdir={upper},workdir={work}".encode()
    if _libc.mount(b"overlay", os.fsencode(target), b"overlay", 0, opts) != 0:
        err = ctypes.get_errno()
        raise SandboxCreationError(
            f"mounting the sandbox root overlay on {target} failed: {os.strerror(err)}",
            sandbox_id=sandbox_id,
        )


def mount_tmpfs(target: Path, *, size: str, mode: str = "0755") -> None:
    """A size-capped tmpfs: a directory the sandbox can write to without reaching the disk."""
    opts = f"size={size},mode={mode}".encode()
    if _libc.mount(b"tmpfs", os.fsencode(target), b"tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC,
                   opts) != 0:
        err = ctypes.get_errno()
        raise SandboxCreationError(f"mounting a tmpfs on {target} failed: {os.strerror(err)}")


def mount_block(device: str, target: Path, fstype: str, data: str = "", *,
                sandbox_id: str) -> None:
    """Mount a block device (e.g. a loop device) on ``target``; nosuid/nodev because the host
    should never honour a device node or setuid bit the sandbox wrote there."""
    if _libc.mount(os.fsencode(device), os.fsencode(target), fstype.encode(),
                   _MS_NOSUID | _MS_NODEV, data.encode()) != 0:
        err = ctypes.get_errno()
        raise SandboxCreationError(
            f"mounting {device} ({fstype}) on {target} failed: {os.strerror(err)}",
            sandbox_id=sandbox_id,
        )


def unmount(target: Path) -> bool:
    """Lazily unmount ``target``; False if it was not mounted."""
    if _libc.umount2(os.fsencode(target), _MNT_DETACH) == 0:
        return True
    return False


def mounts_under(prefix: Path) -> list[Path]:
    """Mount points below ``prefix`` (from /proc/self/mountinfo), deepest first."""
    out = []
    pre = str(prefix).rstrip("/") + "/"
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")
            if point.startswith(pre):
                out.append(Path(point))
    return sorted(out, key=lambda p: len(p.parts), reverse=True)
