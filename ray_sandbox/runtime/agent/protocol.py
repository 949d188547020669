"""Wire format of the rsb-agent protocol (mirrors ``wire.h``; described in docs/agent.md).

A frame is ``u32 big-endian payload length, u8 type, payload``. Request and reply payloads
are TLVs: ``u8 tag, u32 big-endian length, value``, integers as 8-byte big-endian two's
complement. Stream payloads (stdout, stdin, file data) are raw bytes. Pure: no I/O here.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ..errors import ProtocolError

PROTOCOL_VERSION = 1
FRAME_MAX = 1 << 20
HEADER = struct.Struct(">IB")
_TLV = struct.Struct(">BI")
_INT = struct.Struct(">q")


class Op(enum.IntEnum):
    """Requests, client to agent."""

    PING = 0x01
    EXEC = 0x02
    READ = 0x03
    WRITE = 0x04
    STAT = 0x05
    LISTDIR = 0x06
    MKDIR = 0x07
    REMOVE = 0x08
    SYMLINK = 0x09
    CHMOD = 0x0A
    RENAME = 0x0B
    WALK = 0x0C
    READS = 0x0D


class Stream(enum.IntEnum):
    """Frames inside an EXEC or WRITE; DATA also carries file content to the client."""

    DATA = 0x20
    CLOSE = 0x21  # end of the client's stream (stdin EOF / end of upload); always last
    SIGNAL = 0x22
    RESIZE = 0x23


class Reply(enum.IntEnum):
    """Agent to client."""

    OK = 0x40
    ERROR = 0x41
    STARTED = 0x42
    STDOUT = 0x43
    STDERR = 0x44
    EXIT = 0x45
    ENTRY = 0x46
    END = 0x47  # READS: one file's data ended


class Tag(enum.IntEnum):
    ARG = 1
    ENV = 2
    ENV_SET = 3
    CWD = 4
    USER = 5
    TIMEOUT_MS = 6
    MAX_OUTPUT = 7
    PTY_ROWS = 8
    PTY_COLS = 9
    PATH = 10
    PATH2 = 11
    MODE = 12
    APPEND = 13
    PARENTS = 14
    RECURSIVE = 15
    FOLLOW = 16
    OFFSET = 17
    LENGTH = 18
    CHUNK = 19
    ERRNO = 30
    MESSAGE = 31
    PID = 32
    EXIT_CODE = 33
    SIGNAL = 34
    TIMED_OUT = 35
    TRUNCATED = 36
    DURATION_US = 37
    RETIRE = 38
    VERSION = 39
    TYPE = 40
    SIZE = 41
    UID = 42
    GID = 43
    MTIME_NS = 44
    LINK = 45
    INO = 46
    NLINK = 47
    DEV = 48



Field = tuple[int, bytes | int]


def encode_fields(fields: Iterable[Field]) -> bytes:
    parts = []
    for tag, value in fields:
        raw = _INT.pack(value) if isinstance(value, int) else value
        parts.append(_TLV.pack(tag, len(raw)))
        parts.append(raw)
    return b"".join(parts)


def decode_fields(payload: bytes | bytearray | memoryview) -> dict[int, list[bytes]]:
    """TLVs by tag, repeated tags in order."""
    out: dict[int, list[bytes]] = {}
    view = memoryview(payload)
    pos = 0
    while pos < len(view):
        if len(view) - pos < _TLV.size:
            raise ProtocolError("truncated field header")
        tag, length = _TLV.unpack_from(view, pos)
        pos += _TLV.size
        if len(view) - pos < length:
            raise ProtocolError(f"field {tag} overruns its frame")
        out.setdefault(tag, []).append(bytes(view[pos : pos + length]))
        pos += length
    return out


def decode_int(raw: bytes) -> int:
    if len(raw) != _INT.size:
        raise ProtocolError(f"integer field of {len(raw)} bytes")
    value: int = _INT.unpack(raw)[0]
    return value


def frame(ftype: int, payload: bytes | bytearray | memoryview = b"") -> bytes:
    if len(payload) > FRAME_MAX:
        raise ProtocolError(f"frame of {len(payload)} bytes exceeds {FRAME_MAX}")
    return HEADER.pack(len(payload), ftype) + bytes(payload)


def request(op: Op, fields: Iterable[Field] = ()) -> bytes:
    return frame(op, encode_fields(fields))


def signal_frame(signo: int) -> bytes:
    return frame(Stream.SIGNAL, struct.pack(">I", signo))


def resize_frame(rows: int, cols: int) -> bytes:
    return frame(Stream.RESIZE, struct.pack(">HH", rows, cols))


def data_frames(data: bytes | bytearray | memoryview, chunk: int = FRAME_MAX) -> Iterator[bytes]:
    view = memoryview(data)
    for pos in range(0, len(view), chunk):
        yield frame(Stream.DATA, view[pos : pos + chunk])


CLOSE_FRAME = frame(Stream.CLOSE)


def _one(fields: dict[int, list[bytes]], tag: Tag, default: bytes | None = None) -> bytes:
    values = fields.get(tag)
    if not values:
        if default is None:
            raise ProtocolError(f"missing field {tag.name}")
        return default
    return values[-1]


def _int(fields: dict[int, list[bytes]], tag: Tag, default: int | None = None) -> int:
    values = fields.get(tag)
    if not values:
        if default is None:
            raise ProtocolError(f"missing field {tag.name}")
        return default
    return decode_int(values[-1])


@dataclass(frozen=True)
class Exit:
    exit_code: int
    signal: int
    timed_out: bool
    truncated: bool
    duration_us: int
    retire: bool  # the handler closes the connection (descendants outlived the command)


def parse_exit(payload: bytes | bytearray) -> Exit:
    f = decode_fields(payload)
    return Exit(
        exit_code=_int(f, Tag.EXIT_CODE),
        signal=_int(f, Tag.SIGNAL, 0),
        timed_out=bool(_int(f, Tag.TIMED_OUT, 0)),
        truncated=bool(_int(f, Tag.TRUNCATED, 0)),
        duration_us=_int(f, Tag.DURATION_US, 0),
        retire=bool(_int(f, Tag.RETIRE, 0)),
    )


def parse_error(payload: bytes | bytearray) -> tuple[int, str]:
    f = decode_fields(payload)
    return _int(f, Tag.ERRNO), _one(f, Tag.MESSAGE, b"").decode("utf-8", "replace")


def parse_end(payload: bytes | bytearray) -> tuple[int, int]:
    """READS' END frame: (bytes sent for the file, errno; 0 if it was read)."""
    f = decode_fields(payload)
    return _int(f, Tag.SIZE), _int(f, Tag.ERRNO, 0)


def parse_pid(payload: bytes | bytearray) -> int:
    return _int(decode_fields(payload), Tag.PID)


def parse_version(payload: bytes | bytearray) -> str:
    return _one(decode_fields(payload), Tag.VERSION).decode("utf-8", "replace")


FILE_TYPES = {1: "file", 2: "directory", 3: "symlink", 4: "other"}


@dataclass(frozen=True)
class Entry:
    """A stat record as sent: ``path`` is what the agent was asked about, a directory
    entry's name (LISTDIR) or a path relative to the walked root (WALK)."""

    path: bytes
    type: str
    size: int
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    link: bytes | None
    ino: int = 0  # with dev and nlink: which names are hard links of one file
    nlink: int = 1
    dev: int = 0


def parse_entry(payload: bytes | bytearray) -> Entry:
    f = decode_fields(payload)
    link = f.get(Tag.LINK)
    return Entry(
        path=_one(f, Tag.PATH),
        type=FILE_TYPES.get(_int(f, Tag.TYPE), "other"),
        size=_int(f, Tag.SIZE),
        mode=_int(f, Tag.MODE),
        uid=_int(f, Tag.UID),
        gid=_int(f, Tag.GID),
        mtime_ns=_int(f, Tag.MTIME_NS),
        link=link[-1] if link else None,
        ino=_int(f, Tag.INO, 0),
        nlink=_int(f, Tag.NLINK, 1),
        dev=_int(f, Tag.DEV, 0),
    )
