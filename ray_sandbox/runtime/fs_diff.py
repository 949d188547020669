"""The diff of a filesystem image (docs/snapshots.md, "Filesystem images"; fs_image.py's
docstring, "Diffs"): a sandbox's root, as its agent lists it, compared with its image's
unpacked rootfs, the changes written into a directory in overlayfs's form (:class:`Diff`),
and that directory as one OCI layer with whiteouts (:func:`layer`). Everything it learns
from the sandbox is bounded and checked here; fs_image.py makes the image of it."""

from __future__ import annotations

import os
import posixpath
import re
import stat
import tarfile
from collections import OrderedDict
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import BinaryIO

from . import archive
from .agent import SANDBOX_RUN_DIR
from .agent import protocol as p
from .agent.client import READS_MAX_BYTES, AgentClient
from .errors import ImageError

_AGENT_DIR = posixpath.dirname(SANDBOX_RUN_DIR).lstrip("/")
_WH = ".wh."  # a layer's whiteout prefix: such names are never written into a layer
_OPAQUE_XATTR = "trusted.overlay.opaque"
_MEMBER_OVERHEAD = 3 * tarfile.BLOCKSIZE  # a member's header and PAX header, counted
_READS_FILES = 512  # files per READS request, at most
_READS_PATHS = READS_MAX_BYTES // 2  # ... and bytes of their paths
_READS_ITEM = 32  # a path's TLV headers and its length's TLV
_OPEN_DIRS = 64  # directories of a diff kept open at once
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def mount_points(mounts: str) -> set[str]:
    """Every mount point in a ``/proc/mounts`` text but the root (octal escapes decoded)."""
    out = set()
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) >= 2:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])
            if point != "/":
                out.add(posixpath.normpath(point))
    return out


class Diff:
    """One comparison of a sandbox's root with its image's rootfs, writing the changes into
    ``diff`` (module docstring, "Diffs"). Everything it learns from the sandbox (names,
    types, sizes, links, the order of entries) is checked: names are single components, a
    walked path's parent must be a directory this diff made, sizes are counted before any
    content is read, and the diff is written through directory fds opened without following
    links, never replacing what it wrote."""

    def __init__(self, client: AgentClient, sandbox_id: str, base: Path, diff: Path,
                 max_bytes: int, max_entries: int) -> None:
        self.client, self.sid, self.base = client, sandbox_id, base
        self.max_bytes, self.max_entries = max_bytes, max_entries
        self.root = os.open(diff, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        self.count = self.announced = 0
        self.skip: set[str] = set()
        self.dirs: dict[str, p.Entry] = {}  # the sandbox's directories met, by relative path
        self.made: dict[str, int] = {}  # directories made in the diff -> their mtime (ns)
        self.links: dict[tuple[int, int], tuple[str, int, int]] = {}  # (dev, ino) -> first
        self.queue: list[tuple[str, p.Entry]] = []  # files whose content is to be read
        self.queued = 0  # the size of their READS request, roughly
        self.linked: list[tuple[str, str]] = []  # (first name, hard link) to make
        self._fds: OrderedDict[str, int] = OrderedDict()  # directories of the diff, open

    def run(self) -> None:
        try:
            self.skip = {m.lstrip("/") for m in mount_points(self.client.read_file(
                "/proc/mounts", max_bytes=1 << 20).decode(errors="replace"))}
            self.skip.add(_AGENT_DIR)  # where the runtime mounts the agent's files
            todo = [""]  # directories in both roots whose content changed
            while todo:
                todo += self._visit(todo.pop())
            self._flush()
            for rel, mtime in self.made.items():
                os.utime(self._dir_fd(rel, make=False), ns=(mtime, mtime))
            st = os.lstat(self.base)  # the root itself: the image's
            os.fchown(self.root, st.st_uid, st.st_gid)
            os.fchmod(self.root, stat.S_IMODE(st.st_mode))
            os.utime(self.root, ns=(st.st_mtime_ns, st.st_mtime_ns))
        finally:
            self._close_fds()
            os.close(self.root)

    # -- the comparison -----------------------------------------------------------------------

    def _visit(self, rel: str) -> list[str]:
        """Compare the directory ``rel`` (in both roots, a real directory in the image's) and
        write what differs; returns its subdirectories to visit in turn."""
        seen: set[str] = set()
        deeper: list[str] = []
        for e in self.client.entries("/" + rel, max_entries=self._left()):
            self._counted()
            name = os.fsdecode(e.path)
            if not _component(name):
                continue  # no directory holds such a name: a broken or hostile agent
            path = _join(rel, name)
            seen.add(name)
            if self._skipped(path) or name.startswith(_WH):
                continue  # a mount, or a name no layer can hold
            b = _lstat(self.base / path)
            if e.type == "directory":
                self.dirs[path] = e
                if b is not None and stat.S_ISDIR(b.st_mode):
                    if not _same(e, b):
                        self._dir(path)  # its mode or owner changed
                    if e.mtime_ns != b.st_mtime_ns:
                        # an entry below changed (or a mount point was made there): look
                        # inside; the directory is in the diff once something in it is
                        deeper.append(path)
                else:
                    self._dir(path)  # new, or in place of a file of the image's
                    self._subtree(path)
            elif e.type == "file":
                if not (b is not None and stat.S_ISREG(b.st_mode) and _same(e, b)
                        and e.size == b.st_size and e.mtime_ns == b.st_mtime_ns):
                    self._file(path, e)
            elif e.type == "symlink":
                if not (b is not None and stat.S_ISLNK(b.st_mode) and e.link is not None
                        and (b.st_uid, b.st_gid) == (e.uid, e.gid)
                        and os.readlink(self.base / path) == os.fsdecode(e.link)):
                    self._symlink(path, e)
            else:
                seen.discard(name)  # devices, sockets, FIFOs are left out, as if deleted
        self._deletions(rel, seen)
        return deeper

    def _deletions(self, rel: str, seen: set[str]) -> None:
        """Whiteouts for the image's entries of ``rel`` the sandbox no longer has (mount
        points never count as deleted); an opaque directory where none is left."""
        names = os.listdir(self.base / rel)
        gone = [n for n in names if n not in seen and not self._skipped(_join(rel, n))]
        if rel and len(gone) > 1 and len(gone) == len(names):
            fd = self._parent_fd(_join(rel, "x"))
            os.setxattr(fd, _OPAQUE_XATTR, b"y")
            self._announce(rel, 0)
            return
        for name in sorted(gone):
            path = _join(rel, name)
            self._announce(path, 0)
            fd = self._parent_fd(path)
            try:
                os.mknod(name, stat.S_IFCHR, os.makedev(0, 0), dir_fd=fd)
            except FileExistsError:
                pass

    def _subtree(self, rel: str) -> None:
        """Everything below the new directory ``rel``, walked in the sandbox in one call."""
        made = {""}
        for e in self.client.entries("/" + rel, recursive=True, max_entries=self._left()):
            self._counted()
            sub = os.fsdecode(e.path)
            parent, _, name = sub.rpartition("/")
            if (parent not in made or not all(map(_component, sub.split("/")))
                    or name.startswith(_WH)):
                continue  # out of order, or a name no layer can hold: a broken agent
            path = _join(rel, sub)
            if self._skipped(path):
                continue
            if e.type == "directory":
                self.dirs[path] = e
                self._dir(path)
                made.add(sub)
            elif e.type == "file":
                self._file(path, e)
            elif e.type == "symlink":
                self._symlink(path, e)

    def _skipped(self, path: str) -> bool:
        """Whether ``path`` is a mount point or below one: its ancestors are looked up, so
        the cost is the path's depth, whatever the number of mounts the sandbox made."""
        if not self.skip:
            return False
        at = path.find("/")
        while at != -1:
            if path[:at] in self.skip:
                return True
            at = path.find("/", at + 1)
        return path in self.skip

    # -- bounds -----------------------------------------------------------------------------

    def _left(self) -> int:
        return max(1, self.max_entries - self.count + 1)

    def _counted(self) -> None:
        self.count += 1
        if self.count > self.max_entries:
            raise ImageError(f"over {self.max_entries} files to snapshot", sandbox_id=self.sid)

    def _announce(self, path: str, size: int) -> None:
        """Count a member of the layer (headers and content, as the sandbox announced it)
        before it is written."""
        self.announced += _MEMBER_OVERHEAD + size
        if self.announced > self.max_bytes:
            raise ImageError(f"the sandbox's changes are over {self.max_bytes} bytes (at "
                             f"/{path}); pass a larger max_bytes to snapshot them",
                             sandbox_id=self.sid)

    # -- writing the diff ---------------------------------------------------------------------

    def _dir(self, path: str) -> None:
        self._announce(path, 0)
        self._dir_fd(path, make=True)

    def _file(self, path: str, e: p.Entry) -> None:
        """Queue the file (its content is read in batches: :meth:`_flush`); a hard link of
        a file met before becomes a link to it in the diff."""
        self._announce(path, e.size)
        key = (e.dev, e.ino)
        first = self.links.get(key) if e.nlink > 1 else None
        if first is not None and first[1:] == (e.size, e.mtime_ns):
            self.linked.append((first[0], path))
        else:
            if e.nlink > 1:
                self.links.setdefault(key, (path, e.size, e.mtime_ns))
            self.queue.append((path, e))
            self.queued += len(path) + _READS_ITEM
        if len(self.queue) >= _READS_FILES or self.queued >= _READS_PATHS:
            self._flush()

    def _flush(self) -> None:
        """Read the queued files through the agent, a batch per request, into the diff;
        then make the hard links whose first name is written."""
        queue, self.queue, self.queued = self.queue, [], 0
        out: BinaryIO | None = None
        at = -1
        try:
            for i, data in self.client.read_files([("/" + path, e.size) for path, e in queue]):
                if i != at:  # the next file begins
                    at = i
                    out = self._create(queue[i][0])
                if data is not None:
                    if out is not None:
                        out.write(data)
                    continue
                if out is not None:  # ended: short (gone, or not a file now) reads as zeros
                    out.truncate(queue[i][1].size)
                    _set_meta(out.fileno(), queue[i][1])
                    out.close()
                    out = None
        finally:
            if out is not None:
                out.close()
        linked, self.linked = self.linked, []
        for first, path in linked:
            self._link(first, path)

    def _create(self, path: str) -> BinaryIO | None:
        fd = self._parent_fd(path)
        try:
            out = os.open(path.rpartition("/")[2], os.O_WRONLY | os.O_CREAT | os.O_EXCL
                          | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd)
        except FileExistsError:
            return None  # listed twice: the first one stays
        return os.fdopen(out, "wb")

    def _link(self, first: str, path: str) -> None:
        fd = self._parent_fd(path)
        src = self._dir_fd(first.rpartition("/")[0], make=False)
        try:
            os.link(first.rpartition("/")[2], path.rpartition("/")[2], src_dir_fd=src,
                    dst_dir_fd=fd, follow_symlinks=False)
        except (FileExistsError, FileNotFoundError):
            pass  # listed twice, or its first name was

    def _symlink(self, path: str, e: p.Entry) -> None:
        if e.link is None or b"\0" in e.link:
            return
        self._announce(path, len(e.link))
        fd = self._parent_fd(path)
        name = path.rpartition("/")[2]
        try:
            os.symlink(os.fsdecode(e.link), name, dir_fd=fd)
        except FileExistsError:
            return
        os.chown(name, e.uid, e.gid, dir_fd=fd, follow_symlinks=False)
        os.utime(name, ns=(e.mtime_ns, e.mtime_ns), dir_fd=fd, follow_symlinks=False)

    def _parent_fd(self, path: str) -> int:
        """The open fd of ``path``'s directory in the diff, made as needed."""
        return self._dir_fd(path.rpartition("/")[0], make=True)

    def _dir_fd(self, rel: str, *, make: bool) -> int:
        """``rel`` in the diff, opened one component at a time from the nearest directory
        already open, never through a link; with ``make``, missing directories are made
        with the sandbox's metadata of them. The fd stays open (the last _OPEN_DIRS do):
        the caller does not close it."""
        parts = rel.split("/") if rel else []
        k = len(parts)
        while k and "/".join(parts[:k]) not in self._fds:
            k -= 1
        done = "/".join(parts[:k])
        fd = self.root
        if k:
            self._fds.move_to_end(done)
            fd = self._fds[done]
        for part in parts[k:]:
            done = _join(done, part)
            if make and done not in self.made:
                try:
                    os.mkdir(part, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass  # listed twice
                else:
                    self.made[done] = self.dirs[done].mtime_ns
                    nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                    try:
                        _set_meta(nfd, self.dirs[done])
                    finally:
                        os.close(nfd)
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:  # ELOOP/ENOTDIR: what the sandbox listed twice
                raise ImageError(f"/{done} is listed both as a directory and not",
                                 sandbox_id=self.sid) from exc
            self._fds[done] = fd = nfd
            if len(self._fds) > _OPEN_DIRS:
                os.close(self._fds.popitem(last=False)[1])
        return fd

    def _close_fds(self) -> None:
        while self._fds:
            os.close(self._fds.popitem()[1])


def _set_meta(fd: int, e: p.Entry) -> None:
    """Owner, mode and mtime of what this process just made (as root: owned by 0:0)."""
    if e.uid or e.gid:
        os.fchown(fd, e.uid, e.gid)
    os.fchmod(fd, e.mode & 0o7777)  # after chown, which clears setuid bits
    os.utime(fd, ns=(e.mtime_ns, e.mtime_ns))


def _same(e: p.Entry, b: os.stat_result) -> bool:
    return (e.mode & 0o7777, e.uid, e.gid) == (stat.S_IMODE(b.st_mode), b.st_uid, b.st_gid)


def _lstat(path: Path) -> os.stat_result | None:
    """The image's entry at ``path``, whose parent is a real directory of the image's: the
    lookup follows no link."""
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _component(name: str) -> bool:
    return name not in ("", ".", "..") and "/" not in name and "\0" not in name


def _join(rel: str, name: str) -> str:
    return f"{rel}/{name}" if rel else name


def layer(diff: Path) -> Iterator[bytes]:
    """The OCI layer of an overlayfs diff directory (this process's own files): whiteouts
    and opaque directories become ``.wh.`` entries, written before their siblings; a file
    met again through a hard link becomes a link entry."""
    seen: dict[tuple[int, int], str] = {}
    for top, dirs, files, dfd in os.fwalk(diff, follow_symlinks=False):
        dirs.sort()
        rel = os.path.relpath(top, diff)
        rel = "" if rel == "." else rel
        if rel and _OPAQUE_XATTR in os.listxattr(dfd):
            yield archive.header(_whiteout_info(_join(rel, _WH + _WH + ".opq")))
        entries = [(name, os.stat(name, dir_fd=dfd, follow_symlinks=False))
                   for name in sorted(dirs + files)]
        entries.sort(key=lambda item: not _is_whiteout(item[1]))
        for name, st in entries:
            path = _join(rel, name)
            if _is_whiteout(st):
                yield archive.header(_whiteout_info(_join(rel, _WH + name)))
                continue
            ti = tarfile.TarInfo(path)
            ti.mode, ti.uid, ti.gid = stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid
            ti.mtime = st.st_mtime_ns // 10**9  # whole seconds, as most layers: no PAX header
            if stat.S_ISDIR(st.st_mode):
                ti.type = tarfile.DIRTYPE
                yield archive.header(ti)
            elif stat.S_ISLNK(st.st_mode):
                ti.type, ti.linkname = tarfile.SYMTYPE, os.readlink(name, dir_fd=dfd)
                yield archive.header(ti)
            elif stat.S_ISREG(st.st_mode):
                first = seen.get((st.st_dev, st.st_ino)) if st.st_nlink > 1 else None
                if first is not None:
                    ti.type, ti.linkname = tarfile.LNKTYPE, first
                    yield archive.header(ti)
                    continue
                seen[(st.st_dev, st.st_ino)] = path
                ti.size = st.st_size
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                with os.fdopen(fd, "rb") as f:
                    yield from archive.file_blocks(ti, iter(partial(f.read, archive.CHUNK), b""))
    yield archive.end_blocks()


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _whiteout_info(name: str) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.mode = 0o600
    return ti
