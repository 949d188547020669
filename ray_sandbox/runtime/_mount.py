"""Every host mount the runtime makes, and the mount table it reads.

The per-sandbox root is a kernel overlayfs over the shared, read-only image rootfs: runsc's
gofer creates missing mount points (``/.rsb/run``, a workdir, a mount added by a
spec_transform) in the *host* directory it is given as the root. Giving it a per-sandbox
overlay whose upper layer is private means those land in the sandbox's own directory and the
shared image is never written. Volumes are bound into a sandbox's directory (read-only binds
are read-only on the host). mount(2)/umount2(2) are called directly: one syscall each.
"""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import SandboxCreationError

_MNT_DETACH = 2
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND = 32, 4096
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


# overlayfs splits its options at "," and lowerdir at ":" (a backslash escapes both)
_OVERLAY_UNSAFE = frozenset(",:\\")
# mount(2)'s data is one page; the kernel refuses longer options
OPTIONS_MAX = 4000


def overlay_path_ok(path: Path) -> bool:
    """Whether ``path`` can be named in an overlay mount's options as it is."""
    return not _OVERLAY_UNSAFE.intersection(str(path))


def mount_lowers(lowers: list[Path], target: Path) -> None:
    """A read-only overlay of ``lowers`` (topmost first, at least two) on ``target``; nosuid,
    nodev. Raises OSError (the mount's errno) if the kernel refuses it."""
    opts = "lowerdir=" + ":".join(str(p) for p in lowers)
    if len(lowers) < 2 or len(opts) > OPTIONS_MAX or not all(map(overlay_path_ok, lowers)):
        raise OSError(errno.EINVAL, f"cannot name these lower directories: {opts[:200]}")
    if _libc.mount(b"overlay", os.fsencode(target), b"overlay",
                   _MS_RDONLY | _MS_NOSUID | _MS_NODEV, opts.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mounting an overlay of {len(lowers)} layers on {target}: "
                           f"{os.strerror(err)}")


def mount_tmpfs(target: Path, *, size: str, mode: str = "0755") -> None:
    """A size-capped tmpfs: a directory the sandbox can write to without reaching the disk."""
    opts = f"size={size},mode={mode}".encode()
    if _libc.mount(b"tmpfs", os.fsencode(target), b"tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC,
                   opts) != 0:
        err = ctypes.get_errno()
        raise SandboxCreationError(f"mounting a tmpfs on {target} failed: {os.strerror(err)}")


def mount_block(device: str, target: Path, fstype: str, data: str = "", *,
                sandbox_id: str | None) -> None:
    """Mount a block device (e.g. a loop device) on ``target``; nosuid/nodev because the host
    should never honour a device node or setuid bit the sandbox wrote there."""
    if _libc.mount(os.fsencode(device), os.fsencode(target), fstype.encode(),
                   _MS_NOSUID | _MS_NODEV, data.encode()) != 0:
        err = ctypes.get_errno()
        raise SandboxCreationError(
            f"mounting {device} ({fstype}) on {target} failed: {os.strerror(err)}",
            sandbox_id=sandbox_id,
        )


def bind(source: Path, target: Path, *, readonly: bool, sandbox_id: str,
         harden: bool = False) -> None:
    """Bind ``source`` (a mount point, never a path inside a sandbox's files) on ``target``.
    A read-only bind is read-only in the host kernel, so nothing the sandbox does (a remount
    inside gVisor, links, renames) can write through it; nosuid/nodev stay as on the source
    (a remount must repeat them, else it would clear them)."""
    target.mkdir(exist_ok=True)
    steps: list[tuple[bytes | None, int]] = [(os.fsencode(source), _MS_BIND)]
    if readonly:
        steps.append((None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV))
    elif harden:  # writable, but what is written there gains no privilege on the host
        steps.append((None, _MS_BIND | _MS_REMOUNT | _MS_NOSUID | _MS_NODEV))
    for src, flags in steps:
        if _libc.mount(src, os.fsencode(target), None, flags, None) != 0:
            err = ctypes.get_errno()
            unmount(target)
            raise SandboxCreationError(
                f"binding {source} on {target} failed: {os.strerror(err)}", sandbox_id=sandbox_id,
            )


def unmount(target: Path) -> bool:
    """Lazily unmount ``target``; False if it was not mounted."""
    if _libc.umount2(os.fsencode(target), _MNT_DETACH) == 0:
        return True
    return False


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/self/mountinfo: where, which device (``major:minor``), read-only."""

    point: Path
    device: str
    readonly: bool


def mount_table() -> list[MountEntry]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")
            out.append(MountEntry(Path(point), fields[2], "ro" in fields[5].split(",")))
    return out


def mounts_under(prefix: Path) -> list[Path]:
    """Mount points below ``prefix`` (from /proc/self/mountinfo), deepest first."""
    pre = str(prefix).rstrip("/") + "/"
    out = [m.point for m in mount_table() if str(m.point).startswith(pre)]
    return sorted(out, key=lambda p: len(p.parts), reverse=True)
