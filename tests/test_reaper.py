"""No leaks: a process owning sandboxes is SIGKILLed; the reaper removes every trace."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from ray_sandbox.runtime import SandboxRuntime
from tests.fx_runtime import leftovers

OWNER = textwrap.dedent(
    """
    import sys, time
    from ray_sandbox.runtime import SandboxRuntime
    rt = SandboxRuntime(sys.argv[1])
    disk = "unlimited" if sys.argv[2] == "-" else sys.argv[2]
    ids = [rt.create(image="ray-sandbox/busybox", memory="64Mi", cpu=0.2,
                     readonly=(i % 2 == 0), workdir="/w", disk=disk) for i in range(5)]
    print(" ".join(ids), flush=True)
    time.sleep(600)
    """
)


@pytest.mark.parametrize("disk", ["-", "16Mi"])  # "-": no cap (no loop); else an ext4 each
def test_sigkilled_owner_is_reaped(rt_home, image_store, busybox_image, disk):
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(rt_home), disk],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "RAY_SANDBOX_IMAGES": str(image_store.root)})
    try:
        ids = proc.stdout.readline().split()
        assert len(ids) == 5
        assert all((rt_home / "sandboxes" / i).is_dir() for i in ids)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    left = leftovers(rt_home, set(ids))  # the dead owner left 5 running sandboxes
    assert set(ids) <= set(left["sandbox_dirs"])
    assert len(left["pins"]) == 5  # in the node's store, which the owner used
    loops = [loop for loop in left.get("loops", []) if any(i in loop for i in ids)]
    assert len(loops) == (0 if disk == "-" else 5)
    rt = SandboxRuntime(rt_home, images=image_store)  # the reaper runs at start
    assert leftovers(rt_home, set(ids)) == {}  # the pins too
    assert rt.gc() == []


def test_gc_removes_orphaned_runsc_container(rt_home, runtime):
    sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi")
    # Lose the sandbox's record as if its directory had been wiped: runsc still runs it.
    import shutil

    from ray_sandbox.runtime import _mount

    for point in _mount.mounts_under(rt_home / "sandboxes" / sid):
        _mount.unmount(point)
    shutil.rmtree(rt_home / "sandboxes" / sid)
    runtime.records.forget(sid)
    assert sid in [c.id for c in runtime.runsc.list()]
    assert sid in runtime.gc()
    assert sid not in [c.id for c in runtime.runsc.list()]
