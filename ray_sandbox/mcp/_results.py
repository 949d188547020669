"""What the tools return: pydantic models, sent to clients as structured content (and as JSON
text for clients that only read text)."""

from __future__ import annotations

import base64
import codecs
import json
from typing import Literal, Self

from pydantic import BaseModel, Field

from ..runtime import ExecResult, FileInfo


class SessionResult(BaseModel):
    session: str = Field(
        description="this session's handle; pass it as `session` if your client has no MCP "
        "session (2026-07-28 protocol over HTTP)"
    )


class CommandResult(SessionResult):
    exit_code: int = Field(description="the exit status; 128+N when killed by signal N")
    stdout: str
    stderr: str
    timed_out: bool = Field(description="the timeout fired and every process was killed")
    truncated: bool = Field(description="stdout or stderr was cut at the server's limit")
    duration_seconds: float

    @classmethod
    def of(cls, session: str, res: ExecResult, limit: int, **extra: object) -> Self:
        stdout, cut_out = capped_text(res.stdout_bytes, limit)
        stderr, cut_err = capped_text(res.stderr_bytes, limit)
        return cls(
            session=session, exit_code=res.exit_code, stdout=stdout, stderr=stderr,
            timed_out=res.timed_out, truncated=res.truncated or cut_out or cut_err,
            duration_seconds=round(res.duration_seconds, 3), **extra,
        )


class PythonRunResult(CommandResult):
    value: str | None = Field(None, description="repr() of the code's trailing expression")


class FileContent(SessionResult):
    path: str
    content: str
    encoding: Literal["utf-8", "base64"] = Field(description="base64 when not valid UTF-8")
    size: int = Field(description="the file's full size in bytes")
    truncated: bool = Field(description="only the first bytes, up to the server's limit")


class FileWritten(SessionResult):
    path: str
    size: int


class DirEntry(BaseModel):
    name: str
    type: Literal["file", "directory", "symlink", "other"]
    size: int
    mode: str = Field(description="permission bits in octal, e.g. '0644'")
    link_target: str | None = None

    @classmethod
    def of(cls, info: FileInfo) -> DirEntry:
        return cls(name=info.name, type=info.type.value, size=info.size,
                   mode=f"{info.mode & 0o7777:04o}", link_target=info.link_target)


class DirListing(SessionResult):
    path: str
    entries: list[DirEntry]
    truncated: bool = Field(description="more entries exist than the server returns")


class SessionEnded(BaseModel):
    session: str | None = Field(description="the handle of the session that ended")
    ended: bool = Field(description="False when there was no session to end")


# The official client refuses a server-sent event over 1 MiB, and a tool result goes out twice
# (structured content and its JSON text). So each text field of a result gets at most this
# many characters of JSON, whatever the limits in bytes say: escaping turns one control byte
# into six characters (\u0001).
WIRE_CHARS = 200 * 1024


def capped_text(data: bytes, limit: int) -> tuple[str, bool]:
    """At most ``limit`` bytes as text (invalid UTF-8 replaced) that fits WIRE_CHARS once
    JSON-escaped, and whether it was cut."""
    n = min(len(data), limit)
    while True:
        text = data[:n].decode("utf-8", errors="replace")
        if _fits(text):
            return text, n < len(data)
        n //= 2


def file_text(data: bytes, limit: int) -> tuple[str, Literal["utf-8", "base64"], bool]:
    """The first bytes of ``data`` (at most ``limit``, and fitting WIRE_CHARS once encoded)
    as UTF-8 text when they are UTF-8 (a character cut by the limit is dropped), else
    base64; and whether anything was cut."""
    n = min(len(data), limit)
    while True:
        cut = n < len(data)
        try:
            text: str = codecs.getincrementaldecoder("utf-8")().decode(data[:n], final=not cut)
            encoding: Literal["utf-8", "base64"] = "utf-8"
        except UnicodeDecodeError:
            text, encoding = base64.b64encode(data[:n]).decode("ascii"), "base64"
        if _fits(text):
            return text, encoding, cut
        n //= 2


def _fits(text: str) -> bool:
    return len(text) <= WIRE_CHARS // 6 or len(json.dumps(text)) <= WIRE_CHARS
