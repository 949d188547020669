"""The Ray layer trusts nothing a sandbox controls (issue 15): downloads through a handle
never follow planted links and are bounded, on a real local Ray cluster."""

from __future__ import annotations

import os
import stat

import pytest

import ray_sandbox as sandbox
from ray_sandbox.runtime.errors import FileTooLargeError


@pytest.fixture(scope="module")
def sb(ray_cluster):
    handle = sandbox.create(image="ray-sandbox/busybox", cpu=0.1, memory="128Mi")
    yield handle
    ray_cluster.get(handle.terminate.remote())


def test_handle_download_never_writes_through_a_planted_link(ray_cluster, sb, tmp_path):
    ray = ray_cluster
    dest = tmp_path / "dest"
    plant = ("rm -rf /tmp/o && mkdir -p /tmp/o/d && cd /tmp/o && ln -s .. d/l &&"
             " ln -s d/l/../victim .result.txt.rsb-tmp && echo owned > /tmp/res.txt &&"
             " chmod 4755 /tmp/res.txt")
    assert ray.get(sb.exec.remote(["/bin/sh", "-c", plant])).exit_code == 0
    try:
        ray.get(sb.download_dir.remote("/tmp/o", dest))
    except sandbox.UnsafePathError:
        pass
    # whatever the archive check left, a link at the old temp name must not be followed
    if not os.path.lexists(dest / ".result.txt.rsb-tmp"):
        os.symlink("../victim2", dest / ".result.txt.rsb-tmp")
    ray.get(sb.download_file.remote("/tmp/res.txt", dest / "result.txt"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest"], "wrote outside dest"
    st = os.lstat(dest / "result.txt")
    assert stat.S_ISREG(st.st_mode) and st.st_mode & 0o7777 == 0o755  # mode kept, no setuid
    assert (dest / "result.txt").read_bytes() == b"owned\n"


def test_handle_reads_are_bounded(ray_cluster, sb, tmp_path):
    ray = ray_cluster
    assert ray.get(sb.exec.remote(["/bin/sh", "-c", "truncate -s 8G /tmp/huge"])).exit_code == 0
    with pytest.raises(FileTooLargeError):
        ray.get(sb.read_file.remote("/tmp/huge"))
    with pytest.raises(FileTooLargeError):
        ray.get(sb.download_file.remote("/tmp/huge", tmp_path / "got", max_bytes=8 << 20))
    assert list(tmp_path.iterdir()) == []


def test_default_writable_root_has_a_bounded_disk(ray_cluster, ray_home):
    """Through Ray the root is writable by default; it used to be unbounded, so one rollout
    could fill the node's disk (2 GiB at ~860 MiB/s in the finding, #13)."""
    from tests.fx_runtime import loops_backed_by

    handle = sandbox.create(image="ray-sandbox/busybox", cpu=0.1, memory="128Mi")
    try:
        assert ray_cluster.get(handle.exec.remote("touch /written")).exit_code == 0
        record = (ray_home / "sandboxes" / handle.sandbox_id / "record.json").read_text()
        assert '"disk":4294967296' in record.replace(" ", ""), record[:400]
        assert loops_backed_by(ray_home / "sandboxes" / handle.sandbox_id), "no capped fs"
    finally:
        ray_cluster.get(handle.terminate.remote())


def test_an_unplaceable_create_says_what_it_waits_for(ray_cluster, monkeypatch, caplog):
    """A create that cannot be placed used to wait without a word (a cpu=1 fork on a
    2-CPU laptop just hung). It now logs the shortfall while it waits, and a timeout names
    it."""
    monkeypatch.setenv("RAY_SANDBOX_WAIT_REPORT_S", "0.5")
    with caplog.at_level("WARNING", logger="ray_sandbox.actor.placement"):
        with pytest.raises(sandbox.SandboxCreationError, match="no live node is big enough.*CPU"):
            sandbox.create(image="ray-sandbox/busybox", cpu=64, memory="64Mi", timeout=2)
    waits = [r.getMessage() for r in caplog.records if "waiting" in r.getMessage()]
    assert waits and "largest" in waits[0], caplog.text

