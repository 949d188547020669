"""The volume stream's framing (pure): exact reads across any chunking, a clean end only
between frames, and the export frames of a sparse file carry only its data."""

import os

import pytest

from ray_sandbox.runtime.errors import ConfigError
from ray_sandbox.runtime.volumes import _FRAME, _MAGIC, _frames, _Stream


def test_exact_reads_across_chunks():
    s = _Stream([b"ab", b"", b"cdef", b"g"])
    assert s.read(3) == b"abc"
    assert s.read(4) == b"defg"
    assert s.read(1, eof_ok=True) is None


def test_an_end_inside_a_frame_is_an_error():
    s = _Stream([b"abc"])
    with pytest.raises(ConfigError, match="middle of a frame"):
        s.read(4, eof_ok=True)
    with pytest.raises(ConfigError):
        _Stream([]).read(1)


def test_frames_of_a_sparse_file_hold_its_data_only(tmp_path):
    path = tmp_path / "img"
    with open(path, "wb") as f:
        f.truncate(64 << 20)
        f.seek(40 << 20)
        f.write(b"x" * 5000)
    stream = _Stream(_frames(b'{"k":1}', open(path, "rb")))  # noqa: SIM115 - _frames closes it
    assert stream.read(len(_MAGIC)) == _MAGIC
    assert _FRAME.unpack(stream.read(_FRAME.size)) == (0, 7) and stream.read(7) == b'{"k":1}'
    data = {}
    while (head := stream.read(_FRAME.size, eof_ok=True)) is not None:
        offset, length = _FRAME.unpack(head)
        data[offset] = stream.read(length)
    # one extent, filesystem-block aligned, around the 5000 bytes written
    ((offset, chunk),) = data.items()
    assert offset <= 40 << 20 and b"x" * 5000 in chunk and len(chunk) < (1 << 20)
    assert os.path.getsize(path) == 64 << 20
