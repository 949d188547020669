"""Tar streams: round trips keep modes/symlinks/empty dirs; escapes are refused."""

import io
import os
import tarfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_sandbox.runtime import archive
from ray_sandbox.runtime.errors import UnsafePathError


def _tree(root: Path) -> None:
    (root / "a/b").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "a/b/data.bin").write_bytes(bytes(range(256)) * 1000)
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(root / "run.sh", 0o755)
    os.symlink("a/b/data.bin", root / "link")


def _snapshot(root: Path) -> dict:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            rel = str(p.relative_to(root))
            st_ = os.lstat(p)
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir", st_.st_mode & 0o777)
            else:
                out[rel] = ("file", st_.st_mode & 0o777, p.read_bytes())
    return out


def test_round_trip(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    _tree(src)
    archive.extract_local(archive.pack_local(src), dst)
    assert _snapshot(src) == _snapshot(dst)


def _tar(members: list[tuple[tarfile.TarInfo, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for info, data in members:
            t.addfile(info, io.BytesIO(data) if data else None)
    return buf.getvalue()


def _member(name, kind=tarfile.REGTYPE, data=b"x", link=""):
    i = tarfile.TarInfo(name)
    i.type = kind
    i.size = len(data) if kind == tarfile.REGTYPE else 0
    i.linkname = link
    return i, data if kind == tarfile.REGTYPE else b""


@pytest.mark.parametrize(
    "members",
    [
        [_member("/etc/evil")],
        [_member("../evil")],
        [_member("a/../../evil")],
        [_member("l", tarfile.SYMTYPE, link="/etc"), _member("l/passwd")],
        [_member("l", tarfile.SYMTYPE, link="../../"), _member("l/evil")],
        [_member("h", tarfile.LNKTYPE, link="/etc/passwd")],
        [_member("dev", tarfile.CHRTYPE)],
    ],
)
def test_malicious_archives_never_write_outside(tmp_path, members):
    dst = tmp_path / "dst"
    outside_before = set(os.listdir(tmp_path))
    with pytest.raises(UnsafePathError):
        archive.extract_local([_tar(members)], dst)
    assert set(os.listdir(tmp_path)) == outside_before | {"dst"}


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=40))
def test_member_path_never_escapes(name):
    try:
        rel = archive.member_path(name)
    except UnsafePathError:
        return
    assert not rel.startswith("/") and rel != ".." and not rel.startswith("../")


@pytest.mark.parametrize(
    ("member", "target", "ok"),
    [("a/l", "b", True), ("a/l", "../b", True), ("a/l", "../../b", False), ("l", "/etc", False)],
)
def test_link_target_ok(member, target, ok):
    assert archive.link_target_ok(member, target) is ok


@pytest.mark.parametrize("member,links,hit", [
    ("x/y/z", {"x/y"}, "x/y"),
    ("x/y", {"x/y"}, None),  # replacing the link itself is not writing through it
    ("x/yy/z", {"x/y"}, None),
    ("a/b/c/d", {"a/b/c", "a"}, "a"),
    ("top", {"top"}, None),
])
def test_through_link(member, links, hit):
    assert archive.through_link(member, links) == hit
