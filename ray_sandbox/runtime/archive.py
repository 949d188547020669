"""Tar streams for directory transfer, in bounded memory, with escape checks.

``pack_local``/``extract_local`` work on the host filesystem; ``member_path`` is the one check
every archive member passes before it is written anywhere (host or sandbox): no absolute paths,
no ``..``, no NUL. Host extraction never follows a symlink and refuses hard links and devices.
"""

from __future__ import annotations

import io
import os
import posixpath
import stat
import tarfile
from collections.abc import Iterable, Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, cast

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

from . import hostfs
from .errors import SandboxError, SandboxFileError, UnsafePathError

BLOCK = tarfile.BLOCKSIZE
CHUNK = 1 << 20
# Files, archives and snapshots cross Ray's object store (and snapshot exports) in pieces of
# this size: few enough objects, bounded memory on both sides.
TRANSFER_CHUNK = 4 << 20


def member_path(name: str) -> str:
    """Normalize an archive member name to a safe relative path, or raise UnsafePathError."""
    if "\0" in name:
        raise UnsafePathError(f"archive member name contains NUL: {name!r}")
    if name.startswith("/"):
        raise UnsafePathError(f"absolute path in archive: {name!r}")
    norm = posixpath.normpath(name)
    if norm == ".":
        return ""
    if norm == ".." or norm.startswith("../"):
        raise UnsafePathError(f"archive member escapes the target: {name!r}")
    return norm


def link_target_ok(member: str, target: str) -> bool:
    """True if a symlink at ``member`` pointing to ``target`` stays inside the archive root."""
    if target.startswith("/"):
        return False
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(member), target))
    return joined != ".." and not joined.startswith("../")


def through_link(member: str, links: set[str]) -> str | None:
    """The first of ``links`` (symlinks this archive created) that ``member``'s parent path
    goes through, or None. Each link may point inside the target on its own, yet a chain of
    them (``x/y -> ..``, then ``x/y/z -> ..``) leaves it: members are never written through
    one."""
    parts = member.split("/")
    for i in range(1, len(parts)):
        prefix = "/".join(parts[:i])
        if prefix in links:
            return prefix
    return None


class _ChunkReader(io.RawIOBase):
    """File-like view of an iterator of byte chunks (for tarfile's stream mode)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._it = iter(chunks)
        self._buf = b""

    def readable(self) -> bool:
        return True

    def readinto(self, b: WriteableBuffer) -> int:
        while not self._buf:
            try:
                self._buf = next(self._it)
            except StopIteration:
                return 0
        view = memoryview(b)
        n = min(len(view), len(self._buf))
        view[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


def as_file(chunks: Iterable[bytes] | BinaryIO) -> BinaryIO:
    if hasattr(chunks, "read"):
        return cast(BinaryIO, chunks)  # a file-like the caller passed (hasattr is not a type)
    return io.BufferedReader(_ChunkReader(chunks), buffer_size=CHUNK)


def header(info: tarfile.TarInfo) -> bytes:
    return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="surrogateescape")


def file_blocks(info: tarfile.TarInfo, data: Iterable[bytes]) -> Iterator[bytes]:
    """Header, the file's bytes as they come, and padding: one member in bounded memory."""
    yield header(info)
    n = 0
    for chunk in data:
        n += len(chunk)
        if n > info.size:
            raise UnsafePathError(f"{info.name} grew while it was being archived")
        yield chunk
    if n != info.size:
        raise UnsafePathError(f"{info.name} changed size while it was being archived")
    if n % BLOCK:
        yield b"\0" * (BLOCK - n % BLOCK)


def end_blocks() -> bytes:
    return b"\0" * (2 * BLOCK)


def tar_of(src: Path) -> Iterator[bytes]:
    """A tar stream of ``src``: a directory packed (:func:`pack_local`), or a tar file's own
    bytes."""
    if src.is_dir():
        yield from pack_local(src)
        return
    with open(src, "rb") as f:
        yield from iter(lambda: f.read(TRANSFER_CHUNK), b"")


def pack_local(src: Path) -> Iterator[bytes]:
    """Tar stream of the host directory ``src`` (modes, symlinks, empty dirs kept)."""
    src = Path(src)
    if not src.is_dir():
        raise NotADirectoryError(str(src))
    for dirpath, dirnames, filenames in os.walk(src, followlinks=False):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, src)
        for name in [*sorted(dirnames), *sorted(filenames)]:
            full = os.path.join(dirpath, name)
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            st = os.lstat(full)
            info = tarfile.TarInfo(rel)
            info.mode = st.st_mode & 0o7777
            info.mtime = int(st.st_mtime)
            if os.path.islink(full):
                info.type = tarfile.SYMTYPE
                info.linkname = os.readlink(full)
                yield header(info)
            elif os.path.isdir(full):
                info.type = tarfile.DIRTYPE
                yield header(info)
            elif os.path.isfile(full):
                info.size = st.st_size
                with open(full, "rb") as f:
                    yield from file_blocks(info, iter(partial(f.read, CHUNK), b""))
    yield end_blocks()


def extract_local(stream: Iterable[bytes] | BinaryIO, dest: Path) -> None:
    """Extract a tar stream into ``dest`` on the host; nothing can land outside ``dest``.

    Every path is walked from ``dest`` one component at a time with ``O_NOFOLLOW`` directory
    fds, so a symlink (from the archive or already on disk) is never followed, and files are
    created with ``O_NOFOLLOW``. tarfile's own ``data`` filter is not relied on: Python
    3.11.7's can be bypassed with a chain of symlinks (CVE-2025-4517).

    A link's text may look harmless alone while a chain of links leaves ``dest``
    (``d/l -> ..``, then ``x -> d/l/..``), and a new link can redirect one already there,
    from this archive or an earlier download. So once the stream is done, every link under
    ``dest`` is resolved through the links on disk (``hostfs.resolves_inside``). If one that
    did not escape before now does, the archive's links that escape are removed (all of the
    archive's links, if it was an older link that now escapes) and UnsafePathError is
    raised; files, directories and the caller's own links are kept."""
    dest = Path(dest)
    fresh = not dest.exists()
    dest.mkdir(parents=True, exist_ok=True)
    root = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    links: list[str] = []
    try:
        # links that already escape are the caller's business, not this archive's
        before = set() if fresh else hostfs.escaping_links(root)
        with tarfile.open(fileobj=as_file(stream), mode="r|*") as tar:
            for m in tar:
                rel = member_path(m.name)
                if not rel:
                    if not m.isdir():
                        raise UnsafePathError(f"archive member {m.name!r} would replace the "
                                              "target directory")
                    continue
                try:
                    _extract_member(tar, m, rel, root)
                except SandboxError:
                    raise
                except (OSError, ValueError, KeyError) as exc:
                    raise SandboxFileError(f"cannot extract {m.name!r}: {exc}") from None
                if m.issym():
                    links.append(rel)
    except tarfile.TarError as exc:
        raise UnsafePathError(f"not a valid tar stream: {exc}") from None
    finally:
        escaped = sorted(hostfs.escaping_links(root) - before) if links else []
        if escaped:
            ours = set(links)
            _unlink_links(root, ours if set(escaped) - ours else set(escaped))
        os.close(root)
    if escaped:
        raise UnsafePathError("symlinks that resolve outside the target were removed: "
                              + ", ".join(escaped[:10]))


def _unlink_links(root: int, rels: set[str]) -> None:
    """Unlink each of ``rels`` that is still a symlink. Their parents are real directories
    (extraction never replaces a directory with a link), so this walk is not redirected."""
    for rel in rels:
        try:
            parent, name = _open_parent(root, rel)
        except (OSError, SandboxError):
            continue
        try:
            if stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
                os.unlink(name, dir_fd=parent)
        except OSError:
            pass  # already gone
        finally:
            os.close(parent)


def _open_parent(root: int, rel: str) -> tuple[int, str]:
    """A directory fd for the parent of ``rel`` (created as needed, never via a symlink)."""
    *dirs, name = rel.split("/")
    fd = os.dup(root)
    try:
        for part in dirs:
            try:
                os.mkdir(part, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            try:
                nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:  # ELOOP/ENOTDIR: a symlink or file in the way
                raise UnsafePathError(f"refusing {rel!r}: {part!r} is not a directory") from exc
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd, name


def _extract_member(tar: tarfile.TarFile, m: tarfile.TarInfo, rel: str, root: int) -> None:
    mode = m.mode & 0o777  # like tar's data filter: no setuid/setgid/sticky from outside
    if m.isdir():
        fd, _ = _open_parent(root, rel + "/.")  # the directory itself, made and opened
        try:
            os.fchmod(fd, mode | 0o700)
        finally:
            os.close(fd)
        return
    if not (m.isfile() or m.issym()):
        raise UnsafePathError(f"refusing archive member {m.name!r}: links and devices are "
                              "not extracted")
    parent, name = _open_parent(root, rel)
    try:
        try:
            os.unlink(name, dir_fd=parent)  # replace, never write through, what is there
        except FileNotFoundError:
            pass
        except IsADirectoryError as exc:
            raise UnsafePathError(f"refusing {rel!r}: a directory is in the way") from exc
        if m.issym():
            if "\0" in m.linkname or not link_target_ok(rel, m.linkname):
                raise UnsafePathError(f"symlink {m.name!r} -> {m.linkname!r} leaves the target")
            os.symlink(m.linkname, name, dir_fd=parent)
            return
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode,
                     dir_fd=parent)
        with os.fdopen(fd, "wb") as out:
            src = tar.extractfile(m)
            assert src is not None
            while chunk := src.read(CHUNK):
                out.write(chunk)
    finally:
        os.close(parent)
