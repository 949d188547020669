"""File operations through a real agent running natively (paths are host paths here)."""

from __future__ import annotations

import hashlib
import os
import resource

import pytest

from ray_sandbox.runtime.errors import (
    SandboxFileError,
    SandboxFileExistsError,
    SandboxFileNotFoundError,
    SandboxIsADirectoryError,
    SandboxNotADirectoryError,
    SandboxPermissionError,
    UnsafePathError,
)
from ray_sandbox.runtime.results import FileType
from tests.fx_agent import descendants


@pytest.fixture
def fs(native_agent):
    base = native_agent.dir / "fs"
    base.mkdir()
    return native_agent.client, base


def test_write_read_roundtrip_binary(fs):
    c, base = fs
    data = bytes(range(256)) * 1000
    c.write_file(base / "a" / "b" / "blob.bin", data, mode=0o600)
    assert c.read_file(base / "a" / "b" / "blob.bin") == data
    assert (base / "a" / "b" / "blob.bin").stat().st_mode & 0o777 == 0o600
    assert c.read_file(base / "a" / "b" / "blob.bin") == (base / "a/b/blob.bin").read_bytes()


def test_write_from_iterable_and_file_object_and_append(fs, tmp_path):
    c, base = fs
    c.write_file(base / "f", [b"ab", b"", b"cd"])
    c.write_file(base / "f", b"ef", append=True)
    src = tmp_path / "src"
    src.write_bytes(b"xyz")
    with open(src, "rb") as fh:
        c.write_file(base / "g", fh)
    assert (base / "f").read_bytes() == b"abcdef"
    assert (base / "g").read_bytes() == b"xyz"


def test_write_replaces_atomically_without_leftovers(fs):
    c, base = fs
    c.write_file(base / "f", b"old")
    c.write_file(base / "f", b"new")
    assert sorted(os.listdir(base)) == ["f"]
    assert (base / "f").read_bytes() == b"new"


def test_partial_reads(fs):
    c, base = fs
    (base / "f").write_bytes(b"0123456789")
    assert b"".join(c.iter_read(base / "f", 3)) == b"0123456789"
    assert [bytes(x) for x in c.iter_read(base / "f", 4)] == [b"0123", b"4567", b"89"]
    assert b"".join(c.iter_read(base / "f", offset=2, length=5)) == b"23456"


def test_iter_read_yields_bytes_for_large_chunks(fs):
    # a frame over 64 KiB is received in place into a bytearray; iter_read (and every
    # stream built on it: download, archive, filesystem images) promises bytes
    c, base = fs
    data = os.urandom(3 << 20)
    (base / "big").write_bytes(data)
    chunks = list(c.iter_read(base / "big", 1 << 20))
    assert [type(x) for x in chunks] == [bytes] * 3
    assert b"".join(chunks) == data


def test_non_utf8_names(fs):
    c, base = fs
    name = os.fsdecode(b"caf\xe9-\xff.txt")
    c.write_file(os.path.join(base, name), b"x")
    assert os.fsencode(name) in os.listdir(os.fsencode(base))
    [info] = c.list_dir(base)
    assert info.name == name and os.fsencode(info.path) == os.fsencode(base) + b"/" + os.fsencode(
        name
    )
    assert c.read_file(info.path) == b"x"


def test_stat_and_symlinks(fs):
    c, base = fs
    c.write_file(base / "f", b"12345", mode=0o640)
    c.symlink("f", base / "link")
    f = c.stat(base / "f")
    assert (f.type, f.size, f.mode, f.name, f.path) == (
        FileType.FILE,
        5,
        0o640,
        "f",
        str(base / "f"),
    )
    link = c.stat(base / "link")
    assert link.type == FileType.SYMLINK and link.link_target == "f"
    assert c.stat(base / "link", follow_symlinks=True).type == FileType.FILE
    assert c.stat(base).type == FileType.DIRECTORY
    assert c.exists(base / "f") and not c.exists(base / "nope")


def test_mkdir_chmod_rename_remove(fs):
    c, base = fs
    c.mkdir(base / "x" / "y" / "z", mode=0o700)
    assert (base / "x/y/z").stat().st_mode & 0o777 == 0o700
    c.mkdir(base / "x" / "y" / "z")  # parents=True: exists is fine
    with pytest.raises(SandboxFileExistsError):
        c.mkdir(base / "x", parents=False)
    c.write_file(base / "x/y/z/f", b"1")
    c.chmod(base / "x/y/z/f", 0o751)
    assert (base / "x/y/z/f").stat().st_mode & 0o777 == 0o751
    c.rename(base / "x/y/z/f", base / "moved")
    assert (base / "moved").read_bytes() == b"1"
    with pytest.raises(SandboxFileError):  # ENOTEMPTY
        c.remove(base / "x")
    c.remove(base / "x", recursive=True)
    c.remove(base / "moved")
    assert os.listdir(base) == []


def test_list_dir_and_walk(fs):
    c, base = fs
    for rel in ("a/1", "a/b/2", "c"):
        c.write_file(base / rel, rel.encode())
    c.symlink("/etc", base / "a" / "etc-link")  # not followed
    assert [i.name for i in c.list_dir(base)] == ["a", "c"]
    walked = {i.path: i.type for i in c.walk(base)}
    assert walked == {
        "a": FileType.DIRECTORY,
        "a/1": FileType.FILE,
        "a/b": FileType.DIRECTORY,
        "a/b/2": FileType.FILE,
        "a/etc-link": FileType.SYMLINK,
        "c": FileType.FILE,
    }
    order = [i.path for i in c.walk(base)]
    assert order.index("a") < order.index("a/b") < order.index("a/b/2")


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda c, b: c.read_file(b / "missing"), SandboxFileNotFoundError),
        (lambda c, b: c.read_file(b), SandboxIsADirectoryError),
        (lambda c, b: c.list_dir(b / "file"), SandboxNotADirectoryError),
        (lambda c, b: c.walk(b / "file").__next__(), SandboxNotADirectoryError),
        (lambda c, b: c.write_file(b / "file" / "x", b""), SandboxNotADirectoryError),
        (lambda c, b: c.write_file(b, b"x"), SandboxIsADirectoryError),
        (lambda c, b: c.symlink("x", b / "file"), SandboxFileExistsError),
        (lambda c, b: c.stat(b / "missing"), SandboxFileNotFoundError),
        (lambda c, b: c.remove(b / "missing"), SandboxFileNotFoundError),
        (lambda c, b: c.chmod("/proc/self/status", 0o777), SandboxPermissionError),
        (lambda c, b: c.read_file("relative/path"), UnsafePathError),
        (lambda c, b: c.read_file("/a\0b"), UnsafePathError),
    ],
)
def test_errors_are_typed(fs, call, error):
    c, base = fs
    (base / "file").write_text("x")
    with pytest.raises(error) as info:
        call(c, base)
    assert info.value.sandbox_id == "native"
    assert c.read_file(base / "file") == b"x"  # the connection pool is still in step


def test_upload_error_stops_early_and_keeps_the_connection(fs):
    c, base = fs
    (base / "file").write_text("x")
    with pytest.raises(SandboxNotADirectoryError):
        c.write_file(base / "file" / "sub" / "big", (b"\0" * (1 << 20) for _ in range(200)))
    assert c.read_file(base / "file") == b"x"


def test_100mb_roundtrip_with_bounded_memory(native_agent, fs):
    c, base = fs
    block = os.urandom(1 << 20)
    want = hashlib.sha256(block * 100).hexdigest()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    c.write_file(base / "big", (block for _ in range(100)))
    got = hashlib.sha256()
    for chunk in c.iter_read(base / "big"):
        got.update(chunk)
    assert got.hexdigest() == want
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before < 64 * 1024  # kB
    for pid in descendants(native_agent.pid):  # handler processes stay small too
        status = open(f"/proc/{pid}/status").read()
        hwm = int(status.split("VmHWM:")[1].split()[0])
        assert hwm < 16 * 1024, status
