"""delete() in two phases: it returns once the sandbox can no longer run or be reached (its
processes are SIGKILLed, its id is gone for every process), and the rest of the teardown
follows in the background. A process killed between the phases, or half-way through the
rest, leaves it to the next gc(); an id used again waits for its old teardown; many deletes
at once use a bounded number of threads. Nothing of any of them is left afterwards."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ray_sandbox.runtime import SandboxRuntime, SandboxState, procfs
from ray_sandbox.runtime.errors import SandboxNotFoundError
from ray_sandbox.runtime.launch import TEARDOWN_WORKERS
from ray_sandbox.runtime.runsc import Runsc
from tests.fx_hostile import wait_until
from tests.fx_runtime import leftovers, leftovers_after_teardown

HANG_GUARD_S = 60.0


def _host_processes(sid: str) -> dict[int, int]:
    """PID -> start time of every host process of the sandbox (sentry, gofer, the ptrace
    stubs its user processes run in): its pids cgroup's members."""
    pids = Path(f"/sys/fs/cgroup/pids/{sid}/cgroup.procs").read_text().split()
    return {int(p): st.start for p in pids if (st := procfs.stat(int(p))) is not None}


def _gone(processes: dict[int, int]) -> bool:
    return not any(procfs.is_running(pid, start) for pid, start in processes.items())


def test_delete_returns_unreachable_and_the_rest_follows(runtime, image_store):
    sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi", readonly=False,
                         disk="16Mi")
    runtime.spawn(sid, "sleep 1000")
    processes = _host_processes(sid)
    assert len(processes) >= 3
    other = SandboxRuntime(runtime.home, images=image_store, reap=False)  # another process's view
    runtime.delete(sid)
    for rt in (runtime, other):
        with pytest.raises(SandboxNotFoundError):
            rt.exec(sid, "true")
        with pytest.raises(SandboxNotFoundError):
            rt.record(sid)
        assert sid not in rt.list(all=True)
    assert runtime.get_status(sid).state == SandboxState.TERMINATED
    assert wait_until(lambda: _gone(processes), HANG_GUARD_S)
    assert leftovers_after_teardown(runtime.home, {sid}) == {}
    runtime.delete(sid)  # still idempotent
    assert leftovers_after_teardown(runtime.home, {sid}) == {}


def test_create_and_delete_in_a_loop_leaves_nothing(runtime):
    ids = []
    for i in range(6):  # an RL loop: a sandbox per episode
        sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi")
        assert runtime.exec(sid, f"echo {i}").stdout == f"{i}\n"
        if i == 3:
            runtime.pause(sid)  # a paused sandbox is stopped the same way
        runtime.delete(sid)
        ids.append(sid)
    assert leftovers_after_teardown(runtime.home, set(ids)) == {}


def test_a_teardown_that_failed_part_way_is_finished_by_gc_not_leaked(runtime, monkeypatch):
    """A background teardown that raised part-way (here an unexpected OSError from the
    network's detach) left mounts, cgroups and its tombstone, and gc() left them to their
    owner, alive: a long-lived host leaked them until it ended."""
    from ray_sandbox.runtime import launch

    sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi", readonly=False)
    real, failed = launch.network.detach, []

    def detach_fails_once(sandbox_id, *args, **kw):
        if sandbox_id == sid and not failed:
            failed.append(sandbox_id)
            raise OSError(16, "Device or resource busy (injected)")
        return real(sandbox_id, *args, **kw)

    monkeypatch.setattr(launch.network, "detach", detach_fails_once)
    runtime.delete(sid)
    assert wait_until(lambda: failed and runtime._launcher._teardowns.drain(0), HANG_GUARD_S)
    assert sid in runtime.records.buried()  # left part-way, its tombstone kept
    assert leftovers(runtime.home, {sid})
    assert runtime.gc() == [sid]
    assert leftovers_after_teardown(runtime.home, {sid}) == {}
    assert sid not in runtime.records.buried()


def test_an_id_used_again_waits_for_its_old_teardown(runtime):
    """Suspend and resume in the Ray layer delete a sandbox and restore it under its id."""
    sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi", readonly=False)
    runtime.write_file(sid, "/kept", b"kept\n")
    snap = runtime.snapshot(sid)
    try:
        for _ in range(3):
            runtime.delete(sid)
            assert runtime.restore(snap, sandbox_ids=[sid]) == [sid]
            assert not (runtime.sandboxes_dir / f"{sid}.tombstone").exists()
            assert runtime.read_file(sid, "/kept") == b"kept\n"
        assert runtime.get_status(sid).state == SandboxState.RUNNING
    finally:
        runtime.delete(sid)
        runtime.snapshots.delete(snap)
    assert leftovers_after_teardown(runtime.home, {sid}) == {}


def test_many_deletes_at_once_stay_bounded(runtime):
    ids = [runtime.create(image="ray-sandbox/busybox", memory="64Mi", cpu=0.1)
           for _ in range(12)]
    threads: list[int] = []
    done = threading.Event()

    def count_teardown_threads() -> None:
        while not done.is_set():
            threads.append(sum(t.name == "ray-sandbox-teardown" for t in threading.enumerate()))
            time.sleep(0.002)

    sampler = threading.Thread(target=count_teardown_threads)
    sampler.start()
    try:
        with ThreadPoolExecutor(len(ids)) as pool:
            list(pool.map(runtime.delete, ids))
        for sid in ids:
            with pytest.raises(SandboxNotFoundError):
                runtime.exec(sid, "true")
        left = leftovers_after_teardown(runtime.home, set(ids))
    finally:
        done.set()
        sampler.join()
    assert left == {}
    assert 0 < max(threads) <= TEARDOWN_WORKERS


# Creates a sandbox, deletes it, and dies (SIGKILL, from itself) at the given point.
CRASHING_DELETER = textwrap.dedent("""
    import os, sys, time
    from ray_sandbox.runtime import SandboxRuntime, _mount, launch
    home, point, detach = sys.argv[1], sys.argv[2], sys.argv[3] == "detach"
    rt = SandboxRuntime(home)
    sid = rt.create(image="ray-sandbox/busybox", memory="64Mi", readonly=False, disk="16Mi",
                    detach=detach)
    print(sid, flush=True)

    def die(*args, **kwargs):
        os.kill(os.getpid(), 9)

    if point == "stopped":  # the fast phase returned; nothing of the rest ran
        launch.Teardowns.submit = die
    else:  # the rest died after its first unmount: runsc state, cgroups gone
        real = _mount.unmount

        def unmount_then_die(target):
            real(target)
            die()

        _mount.unmount = unmount_then_die
    rt.delete(sid)
    time.sleep(120)
""")


@pytest.mark.parametrize(("point", "detach"), [("stopped", "owned"), ("stopped", "detach"),
                                               ("half torn down", "owned")])
def test_deleter_killed_between_the_phases_leaves_it_to_gc(tmp_path, image_store, busybox_image,
                                                           point, detach):
    home = tmp_path / "home"
    env = {**os.environ, "RAY_SANDBOX_IMAGES": str(image_store.root)}
    proc = subprocess.run([sys.executable, "-c", CRASHING_DELETER, str(home), point, detach],
                          env=env, stdout=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    sid = proc.stdout.split()[0]
    left = leftovers(home, {sid})
    assert f"{sid}.tombstone" in left["sandbox_dirs"] and left["mounts"]
    # The sandbox was stopped before the deleter died: no process of it runs on.
    assert wait_until(lambda: "processes" not in leftovers(home, {sid}), HANG_GUARD_S)
    with pytest.raises(SandboxNotFoundError, match="deleted"):  # for every process
        SandboxRuntime(home, images=image_store, reap=False).record(sid)
    rt = SandboxRuntime(home, images=image_store)  # the reaper runs at start
    assert leftovers(home, {sid}) == {}
    assert not any(sid in pin for pin in image_store.pins(busybox_image.digest))
    assert rt.gc() == []


def test_a_forged_state_file_gets_no_process_killed(tmp_path):
    """kill_sandbox signals only a process whose command line names our root and the id,
    whatever PIDs runsc's state file claims."""
    runsc = Runsc(tmp_path)
    mine, other = "a" * 32, "b" * 32
    # stand-ins with a runsc sandbox's command line: one of another sandbox of this root, one
    # of this id under another root
    stand_ins = [subprocess.Popen(["runsc-sandbox", "-c", "import time; time.sleep(60)",
                                   f"--root={root}", sid], executable=sys.executable)
                 for root, sid in ((tmp_path, other), (tmp_path / "elsewhere", mine))]
    try:
        bystander = os.getpid()
        state = {"goferPid": bystander, "sandbox": {"pid": stand_ins[0].pid}}
        (tmp_path / f"{mine}_sandbox:{mine}.state").write_text(json.dumps(state))
        assert runsc.kill_sandbox(mine) == []
        assert all(p.poll() is None for p in stand_ins)
        # no state file: the /proc scan finds the process of this root that names the id
        assert runsc.kill_sandbox(other) == [stand_ins[0].pid]
        assert stand_ins[0].wait(10) == -signal.SIGKILL
        assert stand_ins[1].poll() is None
    finally:
        for p in stand_ins:
            p.kill()
            p.wait()


@pytest.mark.parametrize("mode", ["public", "sandbox"])
def test_a_port_is_published_again_right_after_its_sandbox_is_deleted(runtime, mode):
    """The deleted sandbox's teardown (which releases its port) ran in the background, so a
    create publishing the same port right after failed "already in use" for a while; it is
    finished first now, as an image's pins are."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kw = {"image": "ray-sandbox/busybox", "memory": "32Mi", "network": mode,
          "expose_ports": [port]}
    ids = []
    for _ in range(3):
        ids.append(runtime.create(**kw))
        runtime.delete(ids[-1])
    assert leftovers_after_teardown(runtime.home, set(ids)) == {}
