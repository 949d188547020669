"""Host-side file writes never follow what a sandbox made (issue 15, findings 1, 2, 14).

Real sandboxes: the sandbox's code plants links and huge files; the host's downloads must
land exactly where the caller asked, nowhere else, and within their size bound."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

import pytest

from ray_sandbox.runtime.errors import SandboxError, SandboxFileError, UnsafePathError


@pytest.fixture(scope="module")
def sandbox(runtime):
    sid = runtime.create(image="ray-sandbox/busybox", memory="128Mi")
    yield sid
    runtime.delete(sid)


def _outside(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if p.name != "dest")


def test_download_file_never_writes_through_a_planted_temp_link(runtime, sandbox, tmp_path):
    """The critical hole: a link at the download's old temp name sent root's write anywhere."""
    dest = tmp_path / "dest"
    dest.mkdir()
    os.symlink("../victim", dest / ".result.txt.rsb-tmp")  # planted by an earlier download
    assert runtime.exec(sandbox, ["/bin/sh", "-c", "echo owned > /tmp/res.txt"]).exit_code == 0
    runtime.download_file(sandbox, "/tmp/res.txt", dest / "result.txt")
    assert _outside(tmp_path) == [], "the host wrote outside the destination"
    st = os.lstat(dest / "result.txt")
    assert stat.S_ISREG(st.st_mode) and (dest / "result.txt").read_bytes() == b"owned\n"


def test_download_dir_then_file_cannot_write_outside(runtime, sandbox, tmp_path):
    """The reproduction as reported: the link chain arrives through ``download_dir``."""
    dest = tmp_path / "dest"
    plant = ("rm -rf /tmp/o && mkdir -p /tmp/o/d && cd /tmp/o && ln -s .. d/l &&"
             " ln -s d/l/../victim .result.txt.rsb-tmp && echo owned > /tmp/res.txt &&"
             " chmod 777 /tmp/res.txt")
    assert runtime.exec(sandbox, ["/bin/sh", "-c", plant]).exit_code == 0
    with contextlib.suppress(UnsafePathError):
        runtime.download_dir(sandbox, "/tmp/o", dest)
    runtime.download_file(sandbox, "/tmp/res.txt", dest / "result.txt")
    assert _outside(tmp_path) == [], "the host wrote outside the destination"
    assert (dest / "result.txt").read_bytes() == b"owned\n"
    assert os.stat(dest / "result.txt").st_mode & 0o777 == 0o777


@pytest.mark.parametrize("link", ["d/l/..", "d/l/../x", "d/m/../..", "e/.."])
def test_download_dir_leaves_no_link_that_resolves_outside(runtime, sandbox, tmp_path, link):
    """Each link passes a lexical check alone; through the archive's other links it escapes."""
    dest = tmp_path / "dest"
    plant = ("rm -rf /tmp/o && mkdir -p /tmp/o/d && cd /tmp/o && ln -s .. d/l && ln -s l d/m &&"
             f" ln -s d/l e && ln -s {link} x && echo keep > kept")
    assert runtime.exec(sandbox, ["/bin/sh", "-c", plant]).exit_code == 0
    with pytest.raises(UnsafePathError):
        runtime.download_dir(sandbox, "/tmp/o", dest)
    real = dest.resolve()
    for p in dest.rglob("*"):
        if p.is_symlink():
            assert Path(os.path.realpath(p)).is_relative_to(real), f"{p} -> {os.readlink(p)}"
    assert (dest / "kept").read_bytes() == b"keep\n"  # what was safe is not lost


def test_download_keeps_a_link_inside_the_target(runtime, sandbox, tmp_path):
    dest = tmp_path / "dest"
    plant = ("rm -rf /tmp/o && mkdir -p /tmp/o/d/e && cd /tmp/o && echo hi > d/e/f &&"
             " ln -s e d/link && ln -s d/link/f top && ln -s d/link/.. up")
    assert runtime.exec(sandbox, ["/bin/sh", "-c", plant]).exit_code == 0
    runtime.download_dir(sandbox, "/tmp/o", dest)
    assert (dest / "top").read_bytes() == b"hi\n"
    assert os.readlink(dest / "up") == "d/link/.."


def test_read_file_is_bounded(runtime, sandbox):
    """An 8 GiB sparse file costs the sandbox nothing; reading it must not cost the host."""
    assert runtime.exec(sandbox, ["/bin/sh", "-c", "truncate -s 8G /tmp/huge && "
                                  "echo 12345678 > /tmp/small"]).exit_code == 0
    with pytest.raises(SandboxFileError, match="max_bytes"):
        runtime.read_file(sandbox, "/tmp/huge")
    with pytest.raises(SandboxFileError, match="max_bytes"):
        runtime.read_file(sandbox, "/tmp/small", max_bytes=4)
    assert runtime.read_file(sandbox, "/tmp/small", max_bytes=9) == b"12345678\n"


def test_download_file_is_bounded_and_leaves_nothing(runtime, sandbox, tmp_path):
    dest = tmp_path / "dest"
    dest.mkdir()
    assert runtime.exec(sandbox, ["/bin/sh", "-c", "truncate -s 8G /tmp/huge"]).exit_code == 0
    with pytest.raises(SandboxError, match="max_bytes"):
        runtime.download_file(sandbox, "/tmp/huge", dest / "got", max_bytes=1 << 20)
    assert list(dest.iterdir()) == []  # no partial file, no temp file
