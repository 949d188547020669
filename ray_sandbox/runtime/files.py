"""Files and directory trees between the host and a sandbox, through its agent: tar streams
in and out of the sandbox and downloads onto the host. Every archive member and link passes
the checks in ``archive``; every host write goes through ``hostfs``."""

from __future__ import annotations

import tarfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from . import archive, hostfs
from .agent.client import AgentClient
from .errors import ExecError, UnsafePathError
from .results import FileType


def download(client: AgentClient, remote_path: str, local_path: str | Path,
             max_bytes: int | None) -> None:
    """Copy a sandbox file to the host atomically, never through a link, mode kept."""
    mode = client.stat(remote_path, follow_symlinks=True).mode
    hostfs.write_atomic(local_path, client.iter_read(remote_path, max_bytes=max_bytes), mode)


def put_archive(client: AgentClient, sandbox_id: str, remote_dir: str,
                stream: Iterable[bytes] | BinaryIO) -> None:
    """Extract a tar stream into ``remote_dir`` inside the sandbox (modes, symlinks and empty
    directories kept; members escaping ``remote_dir`` are refused)."""
    base = remote_dir.rstrip("/") or "/"
    client.mkdir(base, parents=True)
    try:
        _put_members(client, sandbox_id, base, stream)
    except tarfile.TarError as exc:
        raise UnsafePathError(f"not a valid tar stream: {exc}", sandbox_id=sandbox_id) from None


def _put_members(client: AgentClient, sandbox_id: str, base: str,
                 stream: Iterable[bytes] | BinaryIO) -> None:
    links: set[str] = set()  # symlinks this archive made: never written through
    with tarfile.open(fileobj=archive.as_file(stream), mode="r|*") as tar:
        for m in tar:
            rel = archive.member_path(m.name)
            if not rel:
                continue
            via = archive.through_link(rel, links)
            if via is not None:
                raise UnsafePathError(
                    f"member {m.name!r} goes through the archive's own symlink {via!r}",
                    sandbox_id=sandbox_id,
                )
            dest = f"{base.rstrip('/')}/{rel}"
            if m.isdir():
                client.mkdir(dest, parents=True, mode=m.mode & 0o7777 or 0o755)
                client.chmod(dest, m.mode & 0o7777)
            elif m.issym():
                if not archive.link_target_ok(rel, m.linkname):
                    raise UnsafePathError(
                        f"symlink {m.name!r} -> {m.linkname!r} points outside the target",
                        sandbox_id=sandbox_id,
                    )
                client.symlink(m.linkname, dest)
                links.add(rel)
            elif m.islnk():
                src = archive.member_path(m.linkname)
                if src in links or archive.through_link(src, links) is not None:
                    raise UnsafePathError(
                        f"hard link {m.name!r} -> {m.linkname!r} goes through a symlink",
                        sandbox_id=sandbox_id,
                    )
                data = client.read_file(f"{base.rstrip('/')}/{src}")
                client.write_file(dest, data, mode=m.mode & 0o7777)
            elif m.isfile():
                f = tar.extractfile(m)
                assert f is not None
                client.write_file(dest, f, mode=m.mode & 0o7777)
            else:
                raise UnsafePathError(f"unsupported archive member type: {m.name!r}",
                                      sandbox_id=sandbox_id)


def get_archive(client: AgentClient, sandbox_id: str, remote_dir: str) -> Iterator[bytes]:
    """A tar stream of ``remote_dir`` (streamed in bounded memory)."""
    base = remote_dir.rstrip("/") or "/"
    if client.stat(base).type != FileType.DIRECTORY:
        raise ExecError(f"{remote_dir} is not a directory", sandbox_id=sandbox_id)
    for info in client.walk(base):
        rel = info.path[len(base):].lstrip("/") if info.path.startswith("/") else info.path
        if not rel:
            continue
        ti = tarfile.TarInfo(rel)
        ti.mode = info.mode & 0o7777
        ti.mtime = int(info.mtime)
        if info.type == FileType.DIRECTORY:
            ti.type = tarfile.DIRTYPE
            yield archive.header(ti)
        elif info.type == FileType.SYMLINK:
            ti.type = tarfile.SYMTYPE
            ti.linkname = info.link_target or ""
            yield archive.header(ti)
        elif info.type == FileType.FILE:
            ti.size = info.size
            yield from archive.file_blocks(ti, client.iter_read(f"{base}/{rel}"))
    yield archive.end_blocks()
