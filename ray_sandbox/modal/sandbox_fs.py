"""Modal 1.6's file API, ``sb.filesystem`` (``SandboxFilesystem``), over the sandbox handle's
file verbs (``read_file``, ``write_file``, ``stat``, ``list_dir``, ``mkdir``, ``remove``,
``upload_file``, ``download_file``).

Paths are the sandbox's: absolute, or relative to its working directory (Modal requires
absolute ones; verifiers and Harbor resolve relative ones against the workdir themselves).
Failures raise Modal's ``SandboxFilesystem*Error`` classes, which are also ours
(``SandboxFilesystemNotFoundError`` is a ``FileNotFoundError``, …). ``watch`` is refused: the
sandbox's agent has no file-watching operation.
"""

from __future__ import annotations

import errno
import os
import stat as stat_mod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray

from ..actor.handle import SandboxHandle
from ..runtime import errors as E
from ..runtime.results import FileInfo as OurInfo
from ..runtime.results import FileType as OurType
from ._aio import dual
from ._refuse import refused
from .types import FileInfo, FileType

_NAMES_MAX = 1 << 20  # /etc/passwd and /etc/group are read up to this many bytes
_KIND = {OurType.DIRECTORY: FileType.DIRECTORY, OurType.SYMLINK: FileType.SYMLINK}

# ours -> Modal's, most specific first
_MODAL = (
    (E.SandboxFileNotFoundError, E.ModalSandboxFilesystemNotFoundError),
    (E.SandboxIsADirectoryError, E.ModalSandboxFilesystemIsADirectoryError),
    (E.SandboxNotADirectoryError, E.ModalSandboxFilesystemNotADirectoryError),
    (E.SandboxFileExistsError, E.ModalSandboxFilesystemPathAlreadyExistsError),
    (E.SandboxPermissionError, E.ModalSandboxFilesystemPermissionError),
    (E.FileTooLargeError, E.ModalSandboxFilesystemFileTooLargeError),
)


def modal_error(exc: E.SandboxFileError) -> E.ModalSandboxFilesystemError:
    """Modal's class for one of our file errors (same message and sandbox)."""
    if isinstance(exc, E.ModalSandboxFilesystemError):
        return exc
    cls: type[E.ModalSandboxFilesystemError] = E.ModalSandboxFilesystemError
    for ours, theirs in _MODAL:
        if isinstance(exc, ours):
            cls = theirs
            break
    else:
        if getattr(exc, "errno", None) == errno.ENOTEMPTY:
            cls = E.ModalSandboxFilesystemDirectoryNotEmptyError
    return cls(getattr(exc, "message", str(exc)), sandbox_id=getattr(exc, "sandbox_id", None))


@contextmanager
def modal_errors() -> Iterator[None]:
    try:
        yield
    except E.SandboxFileError as exc:
        raise modal_error(exc) from None


def _names(text: str) -> dict[int, str]:
    out: dict[int, str] = {}
    for line in text.splitlines():
        fields = line.split(":")
        if len(fields) > 2 and fields[2].isdigit():
            out.setdefault(int(fields[2]), fields[0])
    return out


class SandboxFilesystem:
    """``sb.filesystem``: files of one sandbox."""

    def __init__(self, handle: SandboxHandle, resolve: Callable[[str], str]) -> None:
        self._handle: Any = handle  # verbs made from the verb table (actor/handle.py)
        self._resolve = resolve
        self._owners: tuple[dict[int, str], dict[int, str]] | None = None

    def __repr__(self) -> str:
        return f"SandboxFilesystem({self._handle.sandbox_id})"

    def _call(self, verb: str, *args: Any, **kwargs: Any) -> Any:
        with modal_errors():
            return ray.get(getattr(self._handle, verb).remote(*args, **kwargs))

    def _info(self, info: OurInfo) -> FileInfo:
        if self._owners is None:
            self._owners = (self._table("/etc/passwd"), self._table("/etc/group"))
        users, groups = self._owners
        kind = _KIND.get(info.type, FileType.FILE)
        type_bits = {FileType.DIRECTORY: stat_mod.S_IFDIR,
                     FileType.SYMLINK: stat_mod.S_IFLNK}.get(kind, stat_mod.S_IFREG)
        return FileInfo(name=info.name, path=info.path, type=kind, size=info.size,
                        mode=info.mode, permissions=stat_mod.filemode(type_bits | info.mode),
                        owner=users.get(info.uid, str(info.uid)),
                        group=groups.get(info.gid, str(info.gid)),
                        modified_time=info.mtime, symlink_target=info.link_target)

    def _table(self, path: str) -> dict[int, str]:
        try:
            data = ray.get(self._handle.read_file.remote(path, max_bytes=_NAMES_MAX))
        except E.SandboxError:
            return {}
        return _names(data.decode("utf-8", errors="replace"))

    # --- reading ---------------------------------------------------------------------------

    @dual
    def read_bytes(self, remote_path: str) -> bytes:
        """The file's bytes (over the read limit: ``SandboxFilesystemFileTooLargeError``)."""
        return self._call("read_file", self._resolve(remote_path))

    @dual
    def read_text(self, remote_path: str) -> str:
        """The file decoded as UTF-8."""
        return self.read_bytes(remote_path).decode("utf-8")

    @dual
    def stat(self, remote_path: str) -> FileInfo:
        """What the path is (a symlink itself, not its target)."""
        return self._info(self._call("stat", self._resolve(remote_path)))

    @dual
    def list_files(self, remote_path: str) -> list[FileInfo]:
        """The entries of a directory."""
        return [self._info(i) for i in self._call("list_dir", self._resolve(remote_path))]

    # --- writing ---------------------------------------------------------------------------

    @dual
    def write_bytes(self, data: bytes | bytearray | memoryview, remote_path: str) -> None:
        """Write (replace) the file; missing parent directories are made."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError(f"write_bytes needs bytes, not {type(data).__name__}")
        self._call("write_file", self._resolve(remote_path), bytes(data))

    @dual
    def write_text(self, data: str, remote_path: str) -> None:
        """Write (replace) the file as UTF-8; missing parent directories are made."""
        if not isinstance(data, str):
            raise TypeError(f"write_text needs str, not {type(data).__name__}")
        self._call("write_file", self._resolve(remote_path), data.encode("utf-8"))

    @dual
    def make_directory(self, remote_path: str, *, create_parents: bool = True) -> None:
        """Make a directory: with ``create_parents`` its missing parents too, and an existing
        directory is fine; without, the parent must exist and the path must not."""
        self._call("mkdir", self._resolve(remote_path), parents=create_parents)

    @dual
    def remove(self, remote_path: str, *, recursive: bool = False) -> None:
        """Remove a file, an empty directory, or with ``recursive`` a whole tree."""
        self._call("remove", self._resolve(remote_path), recursive=recursive)

    # --- between this machine and the sandbox ------------------------------------------------

    @dual
    def copy_from_local(self, local_path: str | os.PathLike[str], remote_path: str) -> None:
        """Copy a local file into the sandbox (parents made, the file replaced)."""
        local = Path(local_path)
        if local.is_dir():
            raise IsADirectoryError(f"{local_path}: a directory (copy_from_local copies a file)")
        if not local.exists():
            raise FileNotFoundError(f"{local_path}: no such local file")
        remote = self._resolve(remote_path)
        parent = os.path.dirname(remote)
        if parent and parent != "/":
            self._call("mkdir", parent, parents=True)
        with modal_errors():
            ray.get(self._handle.upload_file.remote(str(local), remote))

    @dual
    def copy_to_local(self, remote_path: str, local_path: str | os.PathLike[str]) -> None:
        """Copy a file of the sandbox here (local parents made, the local file replaced)."""
        local = Path(local_path)
        if local.is_dir():
            raise IsADirectoryError(f"{local_path}: a directory (copy_to_local writes a file)")
        local.parent.mkdir(parents=True, exist_ok=True)
        with modal_errors():
            ray.get(self._handle.download_file.remote(self._resolve(remote_path), str(local)))

    watch = refused("SandboxFilesystem.watch", "the sandbox's agent has no file-watching "
                    "operation; poll with stat() or list_files()")
