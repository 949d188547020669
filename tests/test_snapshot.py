"""Pause, resume, snapshot, restore and fork on the runtime, with real gVisor.
(Issue 7: pause, resume, snapshot, fork and suspend.)"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from ray_sandbox.runtime import SandboxRuntime, SandboxState
from ray_sandbox.runtime.errors import (
    SandboxCreationError,
    SandboxNotFoundError,
    SandboxStateError,
    SnapshotCorruptError,
    SnapshotNotFoundError,
    ToolMissingError,
)
from ray_sandbox.runtime.runsc import Runsc
from tests.fx_images import scratch_dir
from tests.fx_runtime import pids_inside

# Written to a temp file and renamed, so a read never sees the truncated file.
COUNTER = ["/bin/sh", "-c",
           "i=0; while true; do i=$((i+1)); echo $i > /tmp/counter.tmp; "
           "mv /tmp/counter.tmp /tmp/counter; echo $i; sleep 0.05; done"]


@pytest.fixture(scope="module")
def snap_rt(runtime, rt_home):
    """The module runtime; at the end no snapshot may be left on disk."""
    yield runtime
    runtime.gc()
    assert sorted(p.name for p in (rt_home / "snapshots").iterdir()) == []


@pytest.fixture
def box(snap_rt):
    """A copy-on-write Debian+python sandbox with a counter process started by spawn."""
    sid = snap_rt.create(image="ray-sandbox/python", memory="256Mi", cpu=1, readonly=False)
    snap_rt.exec(sid, "echo root > /root/f && echo tmp > /tmp/t")
    proc = snap_rt.spawn(sid, COUNTER)
    _wait_counter(snap_rt, sid, 3)
    yield sid
    proc.close()
    snap_rt.delete(sid)


def _counter(rt: SandboxRuntime, sid: str) -> int:
    out = rt.exec(sid, "cat /tmp/counter").stdout.strip()
    return int(out) if out else 0


def _wait_counter(rt: SandboxRuntime, sid: str, above: int, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while (n := _counter(rt, sid)) <= above:
        assert time.monotonic() < deadline, f"counter stuck at {n}"
        time.sleep(0.05)
    return n


def test_pause_freezes_and_exec_is_refused(snap_rt, box):
    snap_rt.pause(box)
    try:
        assert snap_rt.get_status(box).state == SandboxState.PAUSED
        with pytest.raises(SandboxStateError, match="paused"):
            snap_rt.exec(box, "true")
        with pytest.raises(SandboxStateError):
            snap_rt.snapshot(box)
        with pytest.raises(SandboxStateError):
            snap_rt.pause(box)
    finally:
        snap_rt.resume(box)
    assert snap_rt.get_status(box).state == SandboxState.RUNNING
    before = _counter(snap_rt, box)
    assert _wait_counter(snap_rt, box, before) > before
    with pytest.raises(SandboxStateError):
        snap_rt.resume(box)


def test_counter_does_not_advance_while_paused(snap_rt, box):
    first = _counter(snap_rt, box)
    snap_rt.pause(box)
    time.sleep(1.0)
    snap_rt.resume(box)
    # Only the ticks around the pause and resume calls, not 1 s worth (~20 unpaused).
    assert _counter(snap_rt, box) - first < 10


def test_fork_keeps_files_and_processes_and_children_diverge(snap_rt, box):
    kids = snap_rt.fork(box, 2)
    try:
        assert len(set(kids)) == 2 and box not in kids
        for k in kids:
            res = snap_rt.exec(k, "cat /root/f /tmp/t")
            assert res.stdout == "root\ntmp\n", res
        # The counter process survived in the parent and runs on in each child.
        at_fork = [_counter(snap_rt, k) for k in kids]
        for k, n in zip(kids, at_fork, strict=True):
            assert n > 0
            assert _wait_counter(snap_rt, k, n) > n
        parent_now = _wait_counter(snap_rt, box, _counter(snap_rt, box))
        assert parent_now > 0
        # Writes stay private: each child, and the parent, sees only its own.
        snap_rt.exec(kids[0], "echo a > /root/f; echo a > /tmp/t")
        snap_rt.exec(kids[1], "echo b > /root/f")
        assert snap_rt.exec(box, "cat /root/f /tmp/t").stdout == "root\ntmp\n"
        assert snap_rt.exec(kids[0], "cat /root/f /tmp/t").stdout == "a\na\n"
        assert snap_rt.exec(kids[1], "cat /root/f /tmp/t").stdout == "b\ntmp\n"
        # Nothing writable is shared on the host: own dirs, own cgroups, own runsc ids.
        dirs = {Path(snap_rt.record(i).rootfs).parent for i in [box, *kids]}
        assert len(dirs) == 3
        assert {c.id for c in snap_rt.runsc.list()} >= {box, *kids}
        for k in kids:
            assert Path("/sys/fs/cgroup/memory", k).is_dir()
    finally:
        for k in kids:
            snap_rt.delete(k)


def test_snapshot_restores_many_times_and_readonly_workdir(snap_rt):
    sid = snap_rt.create(image="ray-sandbox/busybox", memory="128Mi", cpu=0.5, readonly=True,
                         workdir="/work")
    try:
        snap_rt.exec(sid, "echo w > /work/w; echo t > /tmp/t")
        snap = snap_rt.snapshot(sid)
        assert snap.size_bytes > 0 and Path(snap.path, "work", "w").read_text() == "w\n"
        snap_rt.exec(sid, "echo later > /work/w")  # after the snapshot: not in it
        kids = snap_rt.restore(snap, 1) + snap_rt.restore(snap, 1)
        try:
            for k in kids:
                assert snap_rt.exec(k, "cat /work/w /tmp/t").stdout == "w\nt\n"
            snap_rt.exec(kids[0], "echo mine > /work/w")
            assert snap_rt.exec(kids[1], "cat /work/w").stdout == "w\n"
            assert snap_rt.exec(sid, "cat /work/w").stdout == "later\n"
        finally:
            for k in kids:
                snap_rt.delete(k)
        snap_rt.snapshots.delete(snap)
        assert not Path(snap.path).exists()
        with pytest.raises(SnapshotNotFoundError):
            snap_rt.restore(snap)
    finally:
        snap_rt.delete(sid)


def test_children_get_fresh_seed_but_same_process_prng(snap_rt):
    sid = snap_rt.create(image="ray-sandbox/python", memory="256Mi", cpu=1, readonly=False)
    try:
        # A process that prints a random number for every line it reads from a FIFO.
        snap_rt.exec(sid, "mkfifo /tmp/in")
        snap_rt.spawn(sid, ["python3", "-c",
                            "import random\nrandom.seed()\nopen('/tmp/seeded', 'w')\n"
                            "for line in open('/tmp/in'):\n"
                            "    open('/tmp/r', 'a').write(f'{random.random()}\\n')"])
        deadline = time.monotonic() + 30
        while not snap_rt.exists(sid, "/tmp/seeded"):  # seeded before the snapshot
            assert time.monotonic() < deadline
            time.sleep(0.05)
        snap = snap_rt.snapshot(sid)
        kids = snap_rt.restore(snap, 2, on_restore="cat /.rsb/run/seed > /tmp/seed-copy")
        snap_rt.snapshots.delete(snap)
        try:
            seeds = [snap_rt.exec(k, "cat /tmp/seed-copy").stdout for k in kids]
            assert seeds[0] != seeds[1] and len(seeds[0].strip()) == 64
            urandom = [snap_rt.exec(k, "head -c16 /dev/urandom | od -x").stdout for k in kids]
            assert urandom[0] != urandom[1]
            for k in kids:
                snap_rt.exec(k, "exec 3>/tmp/in; echo x >&3; sleep 0.3; exec 3>&-")
            draws = [snap_rt.exec(k, "cat /tmp/r").stdout for k in kids]
            assert draws[0] and draws[0] == draws[1], draws  # identical PRNG state
        finally:
            for k in kids:
                snap_rt.delete(k)
    finally:
        snap_rt.delete(sid)


def test_bad_input_and_corrupt_snapshots(snap_rt, sandbox):
    with pytest.raises(SandboxNotFoundError):
        snap_rt.snapshot("0" * 32)
    with pytest.raises(SnapshotNotFoundError):
        snap_rt.restore("f" * 32)
    snap = snap_rt.snapshot(sandbox)
    try:
        pages = Path(snap.path, "image", "pages.img")
        data = pages.read_bytes()
        pages.write_bytes(data[: len(data) // 2])
        with pytest.raises(SnapshotCorruptError, match="pages.img"):
            snap_rt.restore(snap)
        pages.write_bytes(data)
        ckpt = Path(snap.path, "image", "checkpoint.img")
        size = ckpt.stat().st_size
        ckpt.write_bytes(b"\0" * size)
        with pytest.raises(SnapshotCorruptError, match="damaged"):
            snap_rt.restore(snap)
    finally:
        snap_rt.snapshots.delete(snap)


def test_failed_restore_leaves_nothing(snap_rt, sandbox, rt_home):
    before = {p.name for p in (rt_home / "sandboxes").iterdir()}
    snap = snap_rt.snapshot(sandbox)
    try:
        with pytest.raises(SandboxCreationError, match="on_restore exited 3"):
            snap_rt.restore(snap, 3, on_restore="test -e /nonexistent || exit 3")
    finally:
        snap_rt.snapshots.delete(snap)
    # nothing new; what was there may have gone meanwhile (earlier tests' background teardowns)
    assert {p.name for p in (rt_home / "sandboxes").iterdir()} <= before
    assert snap_rt.exec(sandbox, "echo alive").stdout == "alive\n"


def test_old_runsc_is_refused_by_name(snap_rt, sandbox):
    """Needs the 20221219 package from Debian (fetched with apt-get download, removed after)."""
    with scratch_dir("rsb-old-runsc-") as work:
        got = subprocess.run(["apt-get", "download", "runsc=0.0~20221219.0-2+b3"], cwd=work,
                             capture_output=True, timeout=120)
        debs = list(work.glob("runsc_*.deb"))
        if got.returncode != 0 or not debs:
            pytest.skip(f"cannot fetch the old runsc package: {got.stderr[-300:]!r}")
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(work / "x")], check=True,
                       timeout=60)
        old = Runsc(snap_rt.runsc.root, binary=str(work / "x/usr/bin/runsc"))
        current = snap_rt.runsc
        snap_rt.runsc = old
        try:
            with pytest.raises(ToolMissingError, match="0.0~20221219"):
                snap_rt.snapshot(sandbox)
        finally:
            snap_rt.runsc = current
        shutil.rmtree(work / "x")


def test_spawned_handle_is_detached_and_warm_python_restarts(snap_rt, sandbox, py_sandbox):
    proc = snap_rt.spawn(sandbox, ["/bin/sh", "-c", "echo started; sleep 1000"])
    assert proc.read(timeout=10) == b"started\n"
    assert snap_rt.run_python(py_sandbox, "x = 41").ok
    snap_rt.snapshots.delete(snap_rt.snapshot(sandbox))
    snap_rt.snapshots.delete(snap_rt.snapshot(py_sandbox))
    with pytest.raises(SandboxStateError, match="detached"):
        proc.wait(timeout=10)
    assert "sleep 1000" in snap_rt.exec(sandbox, "ps").stdout  # still running inside
    res = snap_rt.run_python(py_sandbox, "x")
    assert "NameError" in (res.exception or "")  # a fresh interpreter
    # Only the new interpreter: the old one was stopped before the checkpoint (its handler
    # kills it when the connection closes, so allow it a moment to go).
    deadline = time.monotonic() + 10
    while True:
        pys = [c for c in pids_inside(snap_rt, py_sandbox) if c.startswith("python3 -u")]
        if len(pys) == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(pys) == 1
