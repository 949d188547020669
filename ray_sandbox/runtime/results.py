"""Values returned by the runtime: exec results, output chunks, file and sandbox info."""

from __future__ import annotations

import enum
from datetime import datetime
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field


class ExecResult(BaseModel):
    """Outcome of one command. A non-zero ``exit_code`` is a result, not an error.

    ``exit_code`` is the process's exit status, or 128 + signal number when it was killed by a
    signal (-1 when it never started). ``timed_out`` means the timeout fired and the whole
    process tree was killed; ``truncated`` means output beyond ``max_output_bytes`` was dropped.
    """

    model_config = ConfigDict(frozen=True)

    exit_code: int
    stdout_bytes: bytes = b""
    stderr_bytes: bytes = b""
    duration_seconds: float = 0.0
    timed_out: bool = False
    truncated: bool = False
    signal: int | None = None

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", errors="replace")

    @property
    def duration_ms(self) -> float:
        """``duration_seconds`` in milliseconds (Ray's name)."""
        return self.duration_seconds * 1000.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


ExecutionResult = ExecResult  # Ray's other name for it


class OutputChunk(BaseModel):
    """A piece of output from a running command, as it arrived."""

    model_config = ConfigDict(frozen=True)

    stream: str  # "stdout" | "stderr"
    data: bytes

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


class FileType(enum.StrEnum):
    FILE = "file"
    DIRECTORY = "directory"
    SYMLINK = "symlink"
    OTHER = "other"


class FileInfo(BaseModel):
    """``stat`` of a path inside a sandbox (symlinks are not followed)."""

    model_config = ConfigDict(frozen=True)

    path: str
    name: str
    type: FileType
    size: int
    mode: int = Field(description="permission bits, e.g. 0o644")
    uid: int = 0
    gid: int = 0
    mtime: float = 0.0
    link_target: str | None = None


class SandboxState(enum.StrEnum):
    """Lifecycle states, derived from runsc's real container state."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    PAUSED = "PAUSED"
    SUSPENDED = "SUSPENDED"
    TERMINATED = "TERMINATED"
    ERROR = "ERROR"


class SandboxStatus(BaseModel):
    """What a sandbox is doing now, read from runsc (not from bookkeeping). It compares
    equal to its state, and carries the states as class attributes, so Ray's
    ``status == SandboxStatus.RUNNING`` holds (Ray's SandboxStatus is the enum)."""

    model_config = ConfigDict(frozen=True)

    PENDING: ClassVar[SandboxState] = SandboxState.PENDING
    RUNNING: ClassVar[SandboxState] = SandboxState.RUNNING
    PAUSED: ClassVar[SandboxState] = SandboxState.PAUSED
    SUSPENDED: ClassVar[SandboxState] = SandboxState.SUSPENDED
    TERMINATED: ClassVar[SandboxState] = SandboxState.TERMINATED
    ERROR: ClassVar[SandboxState] = SandboxState.ERROR

    sandbox_id: str
    state: SandboxState
    reason: str | None = None  # e.g. "OOMKilled", "Exited", "TTLExpired", "Deleted", "Idle"
    created_at: datetime | None = None
    suspended_at: datetime | None = None  # SUSPENDED since then (reason: "Idle" or "Suspended")
    image: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SandboxState):
            return self.state == other
        return super().__eq__(other)

    def __hash__(self) -> int:
        return hash((self.sandbox_id, self.state, self.reason))


class SandboxLink(BaseModel):
    """A link from one ``network="sandbox"`` sandbox to a TCP port of another: connect to
    ``host:port`` from the linking sandbox (docs/network.md, "Links")."""

    model_config = ConfigDict(frozen=True)

    to: str  # the peer's sandbox id
    host: str
    port: int
