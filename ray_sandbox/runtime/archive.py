"""Tar streams for directory transfer, in bounded memory, with escape checks.

``pack_local``/``extract_local`` work on the host filesystem; ``member_path`` is the one check
every archive member passes before it is written anywhere (host or sandbox): no absolute paths,
no ``..``, no NUL. Host extraction additionally uses tarfile's ``data`` filter, which also
rejects links that point outside the target and device files.
"""

from __future__ import annotations

import io
import os
import posixpath
import tarfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from .errors import UnsafePathError

BLOCK = tarfile.BLOCKSIZE
CHUNK = 1 << 20


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


class _ChunkReader(io.RawIOBase):
    """File-like view of an iterator of byte chunks (for tarfile's stream mode)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._it = iter(chunks)
        self._buf = b""

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[override]
        while not self._buf:
            try:
                self._buf = next(self._it)
            except StopIteration:
                return 0
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


def as_file(chunks: Iterable[bytes] | BinaryIO) -> BinaryIO:
    if hasattr(chunks, "read"):
        return chunks  # type: ignore[return-value]
    return io.BufferedReader(_ChunkReader(chunks), buffer_size=CHUNK)  # type: ignore[arg-type]


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
                    yield from file_blocks(info, iter(lambda f=f: f.read(CHUNK), b""))
    yield end_blocks()


def extract_local(stream: Iterable[bytes] | BinaryIO, dest: Path) -> None:
    """Extract a tar stream into ``dest`` on the host; nothing can land outside ``dest``."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=as_file(stream), mode="r|*") as tar:
        for m in tar:
            member_path(m.name)
            try:
                tar.extract(m, dest, filter="data")
            except (tarfile.FilterError, tarfile.OutsideDestinationError) as exc:
                raise UnsafePathError(f"refusing archive member {m.name!r}: {exc}") from exc
