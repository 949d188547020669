"""Modal's ``modal.types`` as sandboxes use them: what ``sb.filesystem`` returns
(``FileInfo``, ``FileType``), the watch event names (``FileWatchEvent``,
``FileWatchEventType``) and ``SandboxConnectCredentials``."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FileType(enum.Enum):
    """What a ``FileInfo`` describes (a symlink is not followed)."""

    FILE = "file"
    DIRECTORY = "directory"
    SYMLINK = "symlink"


@dataclass(frozen=True)
class FileInfo:
    """A file, directory or symlink in a sandbox (``filesystem.stat``/``list_files``).
    ``owner``/``group`` are names from the sandbox's ``/etc/passwd``/``/etc/group`` (the
    number when it has none); ``mode`` holds the permission bits and ``permissions`` shows
    them as ``ls -l`` does. Entries of other kinds (devices, sockets, FIFOs) are reported as
    ``FILE``."""

    name: str
    path: str
    type: FileType
    size: int
    mode: int
    permissions: str
    owner: str
    group: str
    modified_time: float
    symlink_target: str | None

    def is_file(self) -> bool:
        return self.type == FileType.FILE

    def is_dir(self) -> bool:
        return self.type == FileType.DIRECTORY

    def is_symlink(self) -> bool:
        return self.type == FileType.SYMLINK


class FileWatchEventType(enum.Enum):
    """Kinds of change a watch reports (``filesystem.watch`` is refused here)."""

    Unknown = "Unknown"
    Access = "Access"
    Create = "Create"
    Modify = "Modify"
    Remove = "Remove"


@dataclass
class FileWatchEvent:
    paths: list[str]
    type: FileWatchEventType


@dataclass(frozen=True)
class SandboxConnectCredentials:
    """What ``create_connect_token`` returns on Modal (refused here)."""

    url: str
    token: str


__all__ = ["FileInfo", "FileType", "FileWatchEvent", "FileWatchEventType",
           "SandboxConnectCredentials"]
