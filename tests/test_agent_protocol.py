"""The pure wire format (protocol.py) and the client's request validation."""

from __future__ import annotations

import os
import random
import socket
import tempfile
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ray_sandbox.runtime.agent import AgentClient
from ray_sandbox.runtime.agent import protocol as p
from ray_sandbox.runtime.agent.client import _Conn, _exec_fields, _sandbox_path
from ray_sandbox.runtime.errors import ConfigError, SandboxDiedError, SandboxError, UnsafePathError

fields = st.lists(
    st.tuples(
        st.integers(0, 255),
        st.one_of(st.binary(max_size=64), st.integers(-(2**63), 2**63 - 1)),
    ),
    max_size=20,
)


@given(fields)
def test_fields_roundtrip(items):
    decoded = p.decode_fields(p.encode_fields(items))
    for tag, value in items:
        raw = decoded[tag].pop(0)
        assert (p.decode_int(raw) if isinstance(value, int) else raw) == value
    assert all(not left for left in decoded.values())


def test_reader_reassembles_frames_from_any_split():
    """The client's buffered reader, fed through a socket in random pieces."""
    rng = random.Random(7)
    sizes = [0, 1, 5, 4096, 65535, 65537, 300_000, p.FRAME_MAX]
    frames = [(rng.randrange(256), rng.randbytes(n)) for n in sizes]
    stream = b"".join(p.frame(t, payload) for t, payload in frames)
    ours, theirs = socket.socketpair()

    def feed() -> None:
        pos = 0
        while pos < len(stream):
            step = rng.choice([1, 3, 5, 100, 4096, 70000])
            theirs.sendall(stream[pos : pos + step])
            pos += step

    sender = threading.Thread(target=feed)
    sender.start()
    conn = _Conn(ours, "x")
    got = [conn.read_frame(time.monotonic() + 30) for _ in frames]
    sender.join()
    assert [(t, bytes(payload)) for t, payload in got] == frames
    theirs.close()
    with pytest.raises(SandboxDiedError):
        conn.read_frame(None)


def test_truncated_input_is_rejected():
    with pytest.raises(p.ProtocolError):
        p.decode_fields(p.encode_fields([(1, b"abc")])[:-1])
    with pytest.raises(p.ProtocolError):
        p.decode_int(b"\0\0")
    with pytest.raises(p.ProtocolError):
        p.frame(p.Stream.DATA, bytes(p.FRAME_MAX + 1))


def test_exit_and_entry_parsing():
    ex = p.parse_exit(
        p.encode_fields([(p.Tag.EXIT_CODE, 137), (p.Tag.SIGNAL, 9), (p.Tag.TIMED_OUT, 1)])
    )
    assert (ex.exit_code, ex.signal, ex.timed_out, ex.truncated, ex.retire) == (
        137, 9, True, False, False,
    )  # fmt: skip
    entry = p.parse_entry(
        p.encode_fields(
            [
                (p.Tag.PATH, b"a/\xff"),
                (p.Tag.TYPE, 3),
                (p.Tag.SIZE, 1),
                (p.Tag.MODE, 0o777),
                (p.Tag.UID, 0),
                (p.Tag.GID, 0),
                (p.Tag.MTIME_NS, -5),
                (p.Tag.LINK, b"t"),
            ]
        )  # fmt: skip
    )
    assert (entry.path, entry.type, entry.link, entry.mtime_ns) == (b"a/\xff", "symlink", b"t", -5)
    with pytest.raises(p.ProtocolError):
        p.parse_exit(b"")


@pytest.mark.parametrize(
    ("given", "want"),
    [("/a/b", b"/a/b"), ("/a/../b/", b"/b"), ("//x", b"/x"), ("/..", b"/"), (b"/\xff", b"/\xff")],
)
def test_sandbox_paths_are_normalized(given, want):
    assert _sandbox_path(given) == want


@pytest.mark.parametrize("bad", ["", "rel", "../etc/passwd", "./x", "/a\0b", b"x"])
def test_unsafe_paths_are_rejected(bad):
    with pytest.raises(UnsafePathError):
        _sandbox_path(bad)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"argv": []},
        {"argv": ["a\0"]},
        {"env": ["NOEQUALS"]},
        {"env": ["=x"]},
        {"timeout": 0},
        {"timeout": -1},
        {"max_output_bytes": -1},
        {"pty": (0, 80)},
        {"argv": ["x" * (p.FRAME_MAX + 1)]},
    ],
)
def test_bad_exec_requests_are_config_errors(kwargs):
    args = {"argv": ["true"], "env": None, "cwd": None, "user": None, "timeout": None,
            "max_output_bytes": None, "pty": None, **kwargs}  # fmt: skip
    with pytest.raises(ConfigError):
        _exec_fields(**args)


def test_config_errors_carry_the_sandbox_id():
    with pytest.raises(ConfigError) as info:
        _exec_fields(["a\0"], None, None, None, None, None, None, "box1")
    assert info.value.sandbox_id == "box1"


def test_exec_request_encodes_every_field():
    raw = _exec_fields(["a", b"\xff"], ["K=V"], "/w", "u:g", 1.5, 10, (3, 4))
    length, ftype = p.HEADER.unpack_from(raw)
    f = p.decode_fields(raw[p.HEADER.size :])
    assert ftype == p.Op.EXEC and length == len(raw) - p.HEADER.size
    assert f[p.Tag.ARG] == [b"a", b"\xff"] and f[p.Tag.ENV] == [b"K=V"]
    assert p.decode_int(f[p.Tag.TIMEOUT_MS][0]) == 1500
    assert [p.decode_int(f[t][0]) for t in (p.Tag.PTY_ROWS, p.Tag.PTY_COLS)] == [3, 4]


@pytest.mark.parametrize(
    "reply",
    [
        p.frame(p.Reply.OK, b"\x27\x00\x00"),  # truncated field
        p.HEADER.pack(p.FRAME_MAX + 1, p.Reply.OK),  # oversized frame
        p.frame(p.Reply.STDOUT, b"x"),  # not an answer to ping
        b"",  # hang-up
    ],
)
def test_a_broken_or_fake_agent_gives_sandbox_errors(reply):
    """User code can replace the socket with its own listener: replies are untrusted."""
    with tempfile.TemporaryDirectory(prefix="rsbp") as d:
        path = os.path.join(d, "agent.sock")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen(1)

        def answer() -> None:
            conn, _ = server.accept()
            conn.recv(100)
            conn.sendall(reply)
            conn.close()

        thread = threading.Thread(target=answer)
        thread.start()
        client = AgentClient(path, sandbox_id="fake")
        with pytest.raises(SandboxError) as info:
            client.ping(timeout=5)
        thread.join()
        server.close()
        client.close()
    assert info.value.sandbox_id == "fake"
