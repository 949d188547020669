"""Property tests: host-side extraction and download never reach outside their target, for
generated trees of link chains (issue 15, findings 1 and 2)."""

from __future__ import annotations

import io
import os
import tarfile
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from ray_sandbox.runtime import archive, hostfs
from ray_sandbox.runtime.errors import SandboxError

_names = st.sampled_from(["a", "b", "c", ".rsb-tmp"])
_paths = st.lists(_names, min_size=1, max_size=3).map("/".join)
_targets = st.lists(st.sampled_from(["a", "b", "c", "..", "."]), min_size=1,
                    max_size=5).map("/".join)
_members = st.lists(
    st.one_of(
        st.tuples(st.just("dir"), _paths, st.just("")),
        st.tuples(st.just("file"), _paths, st.just("")),
        st.tuples(st.just("link"), _paths, _targets),
    ),
    max_size=12,
)


def _tar(members: list[tuple[str, str, str]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for kind, name, target in members:
            info = tarfile.TarInfo(name)
            data = b""
            if kind == "dir":
                info.type = tarfile.DIRTYPE
            elif kind == "link":
                info.type, info.linkname = tarfile.SYMTYPE, target
            else:
                data = b"payload"
                info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _state(top: Path, skip: Path) -> dict[str, str]:
    """Everything under ``top`` except ``skip``: kind and content, links unresolved."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if here / d != skip]
        for n in dirnames + filenames:
            p = here / n
            out[str(p)] = (f"link:{os.readlink(p)}" if p.is_symlink()
                           else "dir" if p.is_dir() else p.read_bytes().decode())
    return out


def _links_inside(dest: Path) -> list[str]:
    real = dest.resolve()
    bad = []
    for dirpath, dirnames, filenames in os.walk(dest):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            if p.is_symlink() and not Path(os.path.realpath(p)).is_relative_to(real):
                bad.append(f"{p.relative_to(dest)} -> {os.readlink(p)}")
    return bad


@settings(max_examples=300, deadline=None)
@given(first=_members, second=_members)
def test_extraction_never_leaves_dest(first, second):
    """Two downloads into the same directory (the second meets the first one's links)."""
    with tempfile.TemporaryDirectory() as top_s:
        top = Path(top_s)
        (top / "sibling").mkdir()
        (top / "sibling/keep").write_bytes(b"host")
        dest = top / "x" / "dest"
        dest.parent.mkdir()
        before = _state(top, dest)
        for members in (first, second):
            try:
                archive.extract_local([_tar(members)], dest)
            except SandboxError:
                pass
        assert _state(top, dest) == before, "extraction wrote outside dest"
        assert _links_inside(dest) == []


@settings(max_examples=200, deadline=None)
@given(members=_members, name=_names)
def test_download_lands_only_at_its_path(members, name):
    """Whatever a sandbox left in the destination directory, a download writes a regular
    file at exactly the path asked for and nothing else."""
    with tempfile.TemporaryDirectory() as top_s:
        top = Path(top_s)
        dest = top / "x" / "dest"
        dest.parent.mkdir()
        dest.mkdir()
        for kind, rel, target in members:  # planted as-is: links may point anywhere
            p = dest / rel.split("/")[-1]
            if kind == "link" and not p.exists() and not p.is_symlink():
                os.symlink(f"../{target}", p)
        before = _state(top, dest)
        local = dest / name
        if local.is_dir() and not local.is_symlink():
            return
        hostfs.write_atomic(local, [b"new"], 0o4777)
        assert _state(top, dest) == before
        assert not local.is_symlink() and local.read_bytes() == b"new"
        assert os.stat(local).st_mode & 0o7777 == 0o777  # never setuid from a sandbox
        assert sorted(p.name for p in dest.iterdir() if ".rsb-tmp" in p.name
                      and not p.is_symlink()) == sorted(
                          n for n in [name] if ".rsb-tmp" in n)
