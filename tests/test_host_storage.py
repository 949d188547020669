"""What a sandbox writes to the node's disk gains nothing on the host: the directory it
writes to (a read-only root's workdir, a writable root's filestore) is on a filesystem
mounted nosuid,nodev, inside a sandbox directory no other host user can enter. A hostile
sandbox planted setuid-root files in a plain host directory that other host users could
reach before."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.fx_runtime import leftovers_after_teardown

NOBODY = {"user": 65534, "group": 65534, "extra_groups": []}  # another host user


def _mount_options(path: Path) -> set[str]:
    """The options of the mount ``path`` lives on (the longest mount point above it)."""
    best, options = "", set()
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        point = fields[4].encode().decode("unicode_escape")
        if (str(path) == point or str(path).startswith(point.rstrip("/") + "/")) \
                and len(point) >= len(best):
            best, options = point, set(fields[5].split(","))
    return options


@pytest.mark.parametrize("disk", [None, "unlimited"])
def test_setuid_files_and_device_nodes_mean_nothing_on_the_host(runtime, disk):
    kw = {} if disk is None else {"disk": disk}
    sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi", workdir="/w", **kw)
    try:
        res = runtime.exec(sid, "cp /bin/busybox /w/suid && chmod 4755 /w/suid && ls -ln /w")
        assert res.exit_code == 0, res.stderr
        # gVisor refuses a character device (EPERM) today; should it ever make one, the
        # host must still refuse it
        runtime.exec(sid, "mknod /w/mem c 1 1")
        sdir = runtime.sandboxes_dir / sid
        found = {p.name: p for p in sdir.rglob("*") if p.name in ("suid", "mem")}
        assert "suid" in found, sorted(map(str, sdir.rglob("*")))[:50]
        assert found["suid"].stat().st_mode & 0o4000  # the sandbox did set it...
        for path in found.values():  # ...but the host gives it no meaning
            assert {"nosuid", "nodev"} <= _mount_options(path), path
        if "mem" in found:
            with pytest.raises(PermissionError):  # nodev: no device through this file
                os.open(found["mem"], os.O_RDONLY)
        assert sdir.stat().st_mode & 0o777 == 0o700
        for argv in (["stat", str(found["suid"])], ["cat", str(found["suid"])]):
            other = subprocess.run(argv, capture_output=True, timeout=30, **NOBODY)
            assert other.returncode != 0, other.stdout  # another host user cannot reach it
            assert b"ermission denied" in other.stderr, other.stderr
    finally:
        runtime.delete(sid)
    assert leftovers_after_teardown(runtime.home, {sid}) == {}
