"""Checks and encodes the arguments of agent requests on the host, before any I/O.

Anything that does not fit the wire (a float where an integer goes, an int64 overflow, a
timeout ``poll`` cannot wait for, a str where bytes go, a NUL byte) is a ConfigError naming
the argument, raised before a connection is used, never a TypeError, OverflowError or
``struct.error`` from inside the encoder.
"""

from __future__ import annotations

import math
import os
import posixpath
from collections.abc import Iterable, Iterator, Sequence
from typing import BinaryIO, cast

from ..errors import ConfigError, SandboxError, UnsafePathError
from . import protocol as p

INT64_MAX = 2**63 - 1  # integers are int64 on the wire
MAX_TIMEOUT = 366 * 86400.0  # seconds; longer is no timeout at all: pass None
UPLOAD_CHUNK = p.FRAME_MAX
PathArg = str | bytes | os.PathLike[str] | os.PathLike[bytes]
StrOrBytes = str | bytes
BytesLike = bytes | bytearray | memoryview
UploadData = BytesLike | Iterable[bytes] | BinaryIO


def check_int(value: object, what: str, sandbox_id: str | None, *, lo: int = 0,
              hi: int = INT64_MAX) -> int:  # fmt: skip
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"{what} must be an integer in {lo}..{hi}, got {value!r}",
                          sandbox_id=sandbox_id)  # fmt: skip
    return value


def check_seconds(value: object, what: str, sandbox_id: str | None) -> float | None:
    """A timeout in seconds: positive and at most MAX_TIMEOUT; None or inf mean none."""
    if value is None or (isinstance(value, float) and value == math.inf):
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
        0 < value <= MAX_TIMEOUT
    ):
        raise ConfigError(
            f"{what} must be a number of seconds in (0, {MAX_TIMEOUT:g}] or None, got {value!r}",
            sandbox_id=sandbox_id,
        )
    return float(value)


def check_bytes(value: object, what: str, sandbox_id: str | None) -> BytesLike:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise ConfigError(f"{what} must be bytes, got {type(value).__name__}",
                          sandbox_id=sandbox_id)  # fmt: skip
    return value


def _fsencode(value: object, what: str, sandbox_id: str | None,
              error: type[SandboxError] = ConfigError) -> bytes:  # fmt: skip
    """Bytes for the wire; a value that is no str/bytes/path, or a str the file system
    encoding cannot carry (a lone surrogate outside surrogateescape's range), is a typed
    error, not a TypeError or UnicodeEncodeError."""
    try:
        if not isinstance(value, str | bytes | os.PathLike):
            raise TypeError  # what os.fsencode would raise
        return os.fsencode(value)
    except TypeError:
        raise error(f"{what} must be str or bytes, got {value!r}", sandbox_id=sandbox_id) from None
    except UnicodeEncodeError:
        raise error(f"{what} cannot be encoded: {value!r}", sandbox_id=sandbox_id) from None


def bytes_arg(value: object, what: str, sandbox_id: str | None) -> bytes:
    raw = _fsencode(value, what, sandbox_id)
    if b"\0" in raw:
        raise ConfigError(f"{what} contains a NUL byte: {value!r}", sandbox_id=sandbox_id)
    return raw


def sandbox_path(path: PathArg, sandbox_id: str | None = None) -> bytes:
    """An absolute, normalized path inside the sandbox as bytes (any byte but NUL)."""
    raw = _fsencode(path, "path", sandbox_id, UnsafePathError)
    if b"\0" in raw:
        raise UnsafePathError(f"path contains a NUL byte: {path!r}", sandbox_id=sandbox_id)
    if not raw.startswith(b"/"):
        raise UnsafePathError(
            f"path must be absolute inside the sandbox: {path!r}", sandbox_id=sandbox_id
        )
    norm = posixpath.normpath(raw)
    return b"/" + norm.lstrip(b"/")


def exec_fields(
    argv: Sequence[StrOrBytes],
    env: Sequence[StrOrBytes] | None,
    cwd: PathArg | None,
    user: str | None,
    timeout: float | None,
    max_output_bytes: int | None,
    pty: tuple[int, int] | None,
    sandbox_id: str | None = None,
) -> bytes:
    """The EXEC request frame."""

    def bad(message: str) -> ConfigError:
        return ConfigError(message, sandbox_id=sandbox_id)

    if not isinstance(argv, list | tuple) or not argv:
        raise bad(f"argv must be a non-empty list, got {argv!r}")
    fields: list[p.Field] = [(p.Tag.ARG, bytes_arg(a, "argument", sandbox_id)) for a in argv]
    if env is not None:
        if not isinstance(env, list | tuple):
            raise bad(f"env must be a list of KEY=VALUE entries or None, got {env!r}")
        fields.append((p.Tag.ENV_SET, 1))
        for item in env:
            raw = bytes_arg(item, "environment entry", sandbox_id)
            if b"=" not in raw[1:]:
                raise bad(f"environment entry must be KEY=VALUE: {item!r}")
            fields.append((p.Tag.ENV, raw))
    if cwd is not None:
        fields.append((p.Tag.CWD, bytes_arg(cwd, "cwd", sandbox_id)))
    if user:
        fields.append((p.Tag.USER, bytes_arg(user, "user", sandbox_id)))
    seconds = check_seconds(timeout, "timeout", sandbox_id)
    if seconds is not None:
        fields.append((p.Tag.TIMEOUT_MS, math.ceil(seconds * 1000)))
    if max_output_bytes is not None:
        # 0 would mean "no limit" to the agent: not what a caller passing 0 means.
        fields.append((p.Tag.MAX_OUTPUT, check_int(max_output_bytes, "max_output_bytes",
                                                   sandbox_id, lo=1)))  # fmt: skip
    if pty is not None:
        if not isinstance(pty, tuple | list) or len(pty) != 2:
            raise bad(f"pty must be (rows, cols), got {pty!r}")
        fields += [(tag, check_int(n, f"pty {name}", sandbox_id, lo=1, hi=65535))
                   for tag, name, n in zip((p.Tag.PTY_ROWS, p.Tag.PTY_COLS),
                                           ("rows", "cols"), pty, strict=True)]  # fmt: skip
    payload = p.encode_fields(fields)
    if len(payload) > p.FRAME_MAX:
        raise bad(f"argv and env take {len(payload)} bytes, more than {p.FRAME_MAX}")
    return p.frame(p.Op.EXEC, payload)


def upload_chunks(data: UploadData, sandbox_id: str | None) -> Iterator[BytesLike]:
    """``data`` (bytes, a binary file, or an iterable of bytes) in frames of at most
    UPLOAD_CHUNK. The kind of ``data`` is checked now, the items of an iterable or the reads
    of a file as they come (a wrong one ends the upload with a ConfigError)."""
    if isinstance(data, bytes | bytearray | memoryview):
        return _split(memoryview(data))
    if hasattr(data, "read"):
        return _reads(cast(BinaryIO, data), sandbox_id)  # hasattr is not a type
    if isinstance(data, str) or not isinstance(data, Iterable):
        raise ConfigError(f"data must be bytes, a binary file or an iterable of bytes, got "
                          f"{type(data).__name__}", sandbox_id=sandbox_id)  # fmt: skip
    return (piece for item in data
            for piece in _split(memoryview(check_bytes(item, "data item", sandbox_id))))


def _split(view: memoryview) -> Iterator[memoryview]:
    for pos in range(0, len(view), UPLOAD_CHUNK):
        yield view[pos : pos + UPLOAD_CHUNK]


def _reads(f: BinaryIO, sandbox_id: str | None) -> Iterator[BytesLike]:
    while chunk := check_bytes(f.read(UPLOAD_CHUNK), "data read from the file", sandbox_id):
        yield chunk
