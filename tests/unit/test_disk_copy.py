"""disk.py's sparse copy: the data extents of a template, holes left as holes."""

from __future__ import annotations

import os

from ray_sandbox.runtime.disk import _copy_sparse


def test_sparse_copy_keeps_data_and_holes(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    size = 64 << 20
    with open(src, "wb") as f:
        f.truncate(size)
        for off in (0, 5 << 20, size - 4096):
            f.seek(off)
            f.write(os.urandom(4096))
    fd = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        _copy_sparse(src, fd)
    finally:
        os.close(fd)
    assert dst.read_bytes() == src.read_bytes()
    assert os.stat(dst).st_blocks * 512 <= 1 << 20


def test_sparse_copy_of_an_all_hole_file(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    with open(src, "wb") as f:
        f.truncate(1 << 20)
    fd = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 1 << 20)
        _copy_sparse(src, fd)
    finally:
        os.close(fd)
    assert dst.read_bytes() == bytes(1 << 20)
