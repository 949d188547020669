"""Host-side writes of bytes and links that a sandbox controls.

Everything here runs as root on the node with names, link targets and sizes chosen by code in
the sandbox, so nothing follows a link that could be the sandbox's: files are created with
``O_EXCL`` under unpredictable names in the destination directory and renamed into place (a
rename replaces a link, it never writes through one), modes are set on the fd, and a link is
judged by where it resolves through every link already on disk, not by its own text.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from .errors import FileTooLargeError

# download_file's default bound (read_file's is agent.client.READ_MAX): the bytes land on the
# caller's disk, and a sparse 8 GiB file costs the sandbox nothing.
DOWNLOAD_MAX = 1 << 30

# Linux's own bound on links followed in one lookup (MAXSYMLINKS): past it the kernel gives
# ELOOP, so a chain this long can never reach anything.
_MAX_HOPS = 40


def bounded(chunks: Iterable[bytes], max_bytes: int | None, what: str,
            sandbox_id: str = "") -> Iterator[bytes]:
    """``chunks`` as they come, raising FileTooLargeError once more than ``max_bytes`` came
    (None: no bound). The count is of bytes received, not of any size the sandbox claims."""
    n = 0
    for chunk in chunks:
        n += len(chunk)
        if max_bytes is not None and n > max_bytes:
            raise FileTooLargeError(f"{what} is larger than max_bytes={max_bytes}",
                                    sandbox_id=sandbox_id)
        yield chunk


def write_atomic(local: str | Path, chunks: Iterable[bytes], mode: int) -> None:
    """Write ``chunks`` to ``local`` atomically, never through a link: a fresh ``O_EXCL``
    temp file beside it, ``fchmod``-ed to ``mode & 0o777`` (no setuid/setgid bits from the
    sandbox), renamed over ``local``. On any error nothing is left behind."""
    local = Path(local)
    fd, tmp = tempfile.mkstemp(prefix=f".{local.name[:64]}.", suffix=".rsb-tmp",
                               dir=local.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            os.fchmod(f.fileno(), mode & 0o777)
        os.replace(tmp, local)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def resolves_inside(root_fd: int, rel: str) -> bool:
    """Whether the relative path ``rel`` under the directory ``root_fd`` stays inside it when
    every link on the way (already on disk) is followed, as the kernel would follow them
    later. Works one component at a time on directory fds, so no PATH_MAX limit applies
    (the gap behind CVE-2025-4517 in tarfile's own filter); a chain past MAXSYMLINKS counts
    as outside."""
    where: list[str] = []  # real directories from root, links already substituted
    todo = [p for p in rel.split("/") if p not in ("", ".")]
    hops = 0
    while todo:
        part = todo.pop(0)
        if part == "..":
            if not where:
                return False
            where.pop()
            continue
        target = _readlink_at(root_fd, where, part)
        if target is None:  # a directory, a file or nothing: the lookup goes on lexically
            where.append(part)
            continue
        hops += 1
        if hops > _MAX_HOPS or target.startswith("/"):
            return False
        todo[:0] = [p for p in target.split("/") if p not in ("", ".")]
    return True


def escaping_links(root_fd: int) -> set[str]:
    """Every symlink under ``root_fd`` (relative path) that resolves outside it. The walk
    never follows a link."""
    out = set()
    for dirpath, dirs, files, dir_fd in os.fwalk(".", dir_fd=root_fd):
        for name in dirs + files:  # a link to a directory is listed, never entered
            if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                rel = os.path.normpath(os.path.join(dirpath, name))
                if not resolves_inside(root_fd, rel):
                    out.add(rel)
    return out


def _readlink_at(root_fd: int, where: list[str], name: str) -> str | None:
    """The target of ``where/name`` if it is a symlink on disk, else None."""
    fd = os.dup(root_fd)
    try:
        for part in where:
            try:
                nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError:
                return None  # not a directory (or gone): nothing below it is a link
            os.close(fd)
            fd = nfd
        try:
            return os.readlink(name, dir_fd=fd)
        except OSError:
            return None
    finally:
        os.close(fd)
