"""Resource abuse by hostile code in real gVisor sandboxes: fork bombs, memory and CPU hogs,
disk fill, output floods, thousands of open files, zombie storms. Each must stay inside its
sandbox (reported in its status where it ends it) while a neighbour sandbox and the host stay
healthy. (Issue 10: hostile code, faults and load.)

On the ptrace platform every guest address space is a host process with one stub thread per
sentry thread that ran it, so guest processes cost host PIDs (kernel.pid_max is 32768 for the
whole machine). Abuse runs under :class:`TaskWatch`, which kills the abusive sandbox before it
could take a quarter of that; measured figures are printed (``pytest -s``) and quoted in
docs/security.md.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ray_sandbox.runtime import SandboxRuntime, SandboxState
from ray_sandbox.runtime.errors import SandboxDiedError, SandboxError
from tests.fx_hostile import (
    TASK_CAP,
    TaskWatch,
    answers,
    cgroup_value,
    exec_p50_ms,
    heavy,
    rss_bytes,
    sandbox_tasks,
    sentry_pid,
    settle_state,
    wait_until,
)

BOMB = "bomb() { bomb | bomb & }; bomb 2>/dev/null; sleep 60"


def _pids_limit(limit: int):
    def transform(spec: dict) -> None:
        spec["linux"].setdefault("resources", {})["pids"] = {"limit": limit}

    return transform


def _run_abuse(runtime: SandboxRuntime, sid: str, command: list[str] | str,
               timeout: float) -> tuple[object, TaskWatch]:
    """Run the abusive command under the task watchdog: its result or the error it raised."""
    with TaskWatch(runtime, sid) as watch:
        try:
            outcome: object = runtime.exec(sid, command, timeout=timeout)
        except SandboxError as exc:
            outcome = exc
        time.sleep(0.5)  # stragglers forked while the command was being killed
    return outcome, watch


# --- fork bombs ----------------------------------------------------------------------------------


def test_fork_bomb_is_contained_by_the_memory_limit(runtime, neighbour):
    # pids_limit as high as it was by default before 'auto': this test is about memory (the
    # default now stops the bomb at its pids limit first: test_default_pids_limit...)
    sid = runtime.create(image="ray-sandbox/busybox", memory="256Mi", cpu=0.5, pids_limit=4096)
    try:
        outcome, watch = _run_abuse(runtime, sid, BOMB, timeout=5)
        state = settle_state(runtime, sid, timeout=5)
        status = runtime.get_status(sid)
        print(f"\nfork bomb, memory=256Mi: peak {watch.peak} host tasks, {state} "
              f"({status.reason}), host tasks {watch.host_base} -> peak {watch.host_peak}")
        assert not watch.tripped and watch.peak < TASK_CAP
        if state == SandboxState.RUNNING:  # the timeout killed the whole tree
            assert getattr(outcome, "timed_out", False) and answers(runtime, sid)
        else:  # or the bomb ran into the memory limit, which ends only this sandbox
            assert isinstance(outcome, SandboxDiedError)
            assert (status.state, status.reason) == (SandboxState.ERROR, "OOMKilled")
        assert answers(runtime, neighbour)
    finally:
        runtime.delete(sid)
    # every host task of it is gone with its cgroup, once the killed tasks have exited and
    # delete's background teardown ran (a hang guard, not a speed claim)
    assert wait_until(lambda: sandbox_tasks(sid) == 0, 60)


def test_fork_bomb_is_capped_by_a_pids_limit(runtime, neighbour):
    limit = 1024
    sid = runtime.create(image="ray-sandbox/busybox", memory="512Mi", cpu=0.5,
                         spec_transform=_pids_limit(limit))
    try:
        outcome, watch = _run_abuse(runtime, sid, BOMB, timeout=5)
        status = runtime.get_status(sid)
        print(f"\nfork bomb, pids limit {limit}: peak {watch.peak} host tasks, "
              f"{status.state} ({status.reason})")
        assert watch.peak <= limit and not watch.tripped
        # Hitting the limit ends the sandbox (the sentry cannot make a thread); only it.
        assert isinstance(outcome, SandboxDiedError) or answers(runtime, sid)
        assert answers(runtime, neighbour)
    finally:
        runtime.delete(sid)


def test_pids_limit_kill_is_reported_with_a_reason(runtime):
    sid = runtime.create(image="ray-sandbox/busybox", memory="512Mi", cpu=0.5,
                         spec_transform=_pids_limit(256))
    try:
        _run_abuse(runtime, sid, BOMB, timeout=5)
        settle_state(runtime, sid, timeout=5)
        status = runtime.get_status(sid)
    finally:
        runtime.delete(sid)
    assert (status.state, status.reason) == (SandboxState.ERROR, "PidsLimit")


def test_default_sandbox_bounds_its_host_tasks(runtime, sandbox):
    assert cgroup_value("pids", sandbox, "pids.max") != "max"


# --- memory ------------------------------------------------------------------------------------


@pytest.mark.parametrize("hog", ["anon", "tmpfs"])
def test_memory_hog_is_oom_killed_alone(runtime, neighbour, hog):
    image = "ray-sandbox/python" if hog == "anon" else "ray-sandbox/busybox"
    sid = runtime.create(image=image, memory="128Mi", cpu=0.5)
    command = (["python3", "-c", "x = bytearray(1 << 30); x[::4096] = b'1' * len(x[::4096])"]
               if hog == "anon" else "dd if=/dev/zero of=/tmp/fill bs=1M count=1024")
    try:
        outcome, _ = _run_abuse(runtime, sid, command, timeout=60)
        assert isinstance(outcome, SandboxDiedError), outcome
        assert settle_state(runtime, sid) == SandboxState.ERROR
        assert runtime.get_status(sid).reason == "OOMKilled"
        assert answers(runtime, neighbour)
    finally:
        runtime.delete(sid)


# --- CPU -----------------------------------------------------------------------------------------


def test_cpu_spin_stays_within_quota_and_neighbour_answers(runtime, neighbour):
    sid = runtime.create(image="ray-sandbox/busybox", memory="128Mi", cpu=0.5)
    try:
        exec_p50_ms(runtime, neighbour, n=5)  # warm: pooled connection, page cache
        base_p50 = exec_p50_ms(runtime, neighbour)
        spinners = [runtime.spawn(sid, ["/bin/sh", "-c", "while :; do :; done"])
                    for _ in range(4)]
        time.sleep(1)
        usage0 = int(cgroup_value("cpuacct", sid, "cpuacct.usage"))
        t0 = time.monotonic()
        busy_p50 = exec_p50_ms(runtime, neighbour)
        time.sleep(max(0.0, 2 - (time.monotonic() - t0)))
        cores = (int(cgroup_value("cpuacct", sid, "cpuacct.usage")) - usage0) / 1e9 / (
            time.monotonic() - t0)
        print(f"\nCPU spin (4 spinners, cpu=0.5): spinner used {cores:.2f} cores; neighbour "
              f"exec p50 {base_p50:.1f} ms -> {busy_p50:.1f} ms ({busy_p50 / base_p50:.2f}x)")
        assert cores < 0.5 * 1.5  # the CFS quota holds (generous: accounting granularity)
        assert answers(runtime, neighbour)
        for p in spinners:
            p.close()
    finally:
        runtime.delete(sid)


# --- disk ----------------------------------------------------------------------------------------


def _filestore_bytes(runtime: SandboxRuntime, sid: str) -> int:
    """Bytes on the host disk behind a sandbox's private root (runsc's unlinked filestore)."""
    pid = sentry_pid(runtime, sid)
    total = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if "runsc-filestore" in target:
                total += os.stat(f"/proc/{pid}/fd/{fd}").st_blocks * 512
        except OSError:
            continue
    return total


def test_readonly_sandbox_cannot_write_its_root(runtime, sandbox):
    res = runtime.exec(sandbox, "dd if=/dev/zero of=/fill bs=1M count=8")
    assert res.exit_code != 0 and "Read-only file system" in res.stderr
    assert answers(runtime, sandbox)


def test_writable_root_fill_lands_on_host_disk_until_delete(runtime, neighbour):
    """What happens (measured, for docs/security.md): a readonly=False root is runsc's
    filestore, an unlinked file in <home>/sandboxes/<id>/overlay on the host disk. It is not
    charged to the memory limit; deleting files inside gives the space back (holes)."""
    sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi", cpu=0.5, readonly=False)
    try:
        before = _filestore_bytes(runtime, sid)
        res = runtime.exec(sid, "dd if=/dev/zero of=/fill bs=1M count=128 && sync", timeout=120)
        assert res.exit_code == 0, res.stderr
        written = _filestore_bytes(runtime, sid) - before
        runtime.exec(sid, "rm /fill && sync")
        after_rm = _filestore_bytes(runtime, sid) - before
        print(f"\nwritable root, memory=64Mi: 128 MiB written -> {written >> 20} MiB on host "
              f"disk, {after_rm >> 20} MiB after rm inside; state "
              f"{runtime.get_status(sid).state}")
        assert runtime.get_status(sid).state == SandboxState.RUNNING
        assert written >= 100 << 20  # on disk, not in (the 64Mi of) memory
        assert after_rm < written
        assert answers(runtime, neighbour)
    finally:
        runtime.delete(sid)
    # and gone with the sandbox, once delete's background teardown ran (a hang guard)
    assert wait_until(lambda: not (runtime.sandboxes_dir / sid).exists(), 60)


@pytest.mark.parametrize("where", ["root", "workdir"])
def test_disk_limit_is_enforced(runtime, where):
    cfg = {"readonly": False} if where == "root" else {"readonly": True, "workdir": "/w"}
    sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi", disk="16Mi", **cfg)
    target = "/fill" if where == "root" else "/w/fill"
    try:
        res = runtime.exec(sid, f"dd if=/dev/zero of={target} bs=1M count=48", timeout=120)
    finally:
        runtime.delete(sid)
    assert res.exit_code != 0 and "No space left" in res.stderr


# --- output --------------------------------------------------------------------------------------


@heavy  # 31 s in CI; the agent's and the host's output caps are also tested apart
def test_output_flood_is_capped_and_host_memory_bounded(runtime, sandbox):
    base = rss_bytes()
    res = runtime.exec(sandbox, "head -c 64000000 /dev/zero; head -c 32000000 /dev/zero >&2",
                       timeout=120)
    assert res.exit_code == 0 and res.truncated
    assert len(res.stdout_bytes) <= 16 << 20 and len(res.stderr_bytes) <= 16 << 20
    small = runtime.exec(sandbox, "yes", timeout=3, max_output_bytes=1 << 20)
    assert small.timed_out and small.truncated and len(small.stdout_bytes) <= 1 << 20
    # a streaming consumer that discards: unlimited output, memory still bounded
    seen = 0
    for item in runtime.exec_stream(sandbox, "head -c 128000000 /dev/zero", timeout=120):
        if hasattr(item, "data"):
            seen += len(item.data)
    assert seen == 128_000_000
    growth = rss_bytes() - base
    print(f"\noutput flood: host RSS +{growth >> 20} MiB after 96 MB captured + 128 MB streamed")
    assert growth < 96 << 20
    assert answers(runtime, sandbox)


# --- files and processes -------------------------------------------------------------------------

OPEN_MANY = """
import os, sys, time
files = []
try:
    for i in range(int(sys.argv[2])):
        files.append(open(f"{sys.argv[1]}{i}", "w"))
except OSError as e:
    print("stopped", e.errno)
print("opened", len(files), flush=True)
"""


@heavy  # 11 s in CI, a flood
def test_thousands_of_open_files_are_contained(runtime, neighbour):
    sid = runtime.create(image="ray-sandbox/python", memory="512Mi", cpu=1)
    try:
        res = runtime.exec(sid, ["python3", "-c", OPEN_MANY, "/tmp/f", "50000"], timeout=120)
        # tmpfs files cost the sentry no host fds; the per-process limit stops it
        assert "opened" in res.stdout and "stopped 24" in res.stdout, res.stdout + res.stderr
        walk = ("import os\nfs = []\nfor d, _, names in os.walk('/usr'):\n"
                "    for n in names:\n"
                "        p = os.path.join(d, n)\n"
                "        if len(fs) < 2000 and os.path.isfile(p) and not os.path.islink(p):\n"
                "            fs.append(open(p, 'rb'))\n"
                "print('opened', len(fs))\n")
        res = runtime.exec(sid, ["python3", "-c", walk], timeout=120)
        assert res.stdout.strip() == "opened 2000", res.stdout + res.stderr
        fds = len(os.listdir(f"/proc/{sentry_pid(runtime, sid)}/fd"))
        print(f"\nopen files: 50000 in tmpfs stopped by EMFILE; 2000 image files opened; "
              f"sentry holds {fds} host fds afterwards")
        assert answers(runtime, sid) and answers(runtime, neighbour)
    finally:
        runtime.delete(sid)


@heavy
@pytest.mark.xfail(strict=True, reason=(
    "each guest file open on a host-backed mount (workdir bind, image files) costs the sentry "
    "~2 host fds; ~10000 opens exhaust its RLIMIT_NOFILE (20000) and wedge it: runsc state "
    "hangs (get_status takes 30 s), then delete fails after 3 x 30 s, and _destroy removes the "
    "runsc state and the sandbox dir while the sentry, gofer and cgroups live on (gc kills the "
    "processes by marker but leaves the cgroup dirs). Fix: when runsc delete fails, SIGKILL "
    "every pid in the sandbox's cgroup.procs, then delete again and rmdir the cgroups; never "
    "unlink runsc state of a live container; consider a lower RLIMIT_NOFILE in the spec"))
def test_open_files_on_host_backed_dir_cannot_wedge_delete(runtime):
    sid = runtime.create(image="ray-sandbox/python", memory="1Gi", cpu=1, workdir="/w")
    procs: list[int] = []
    try:
        proc = runtime.spawn(sid, ["python3", "-c", OPEN_MANY + "time.sleep(600)\n",
                                   "/w/f", "12000"])
        out = bytearray()

        def opened() -> bool:
            out.extend(proc.read())
            return b"opened" in out

        assert wait_until(opened, 60, 0.5)
        procs = [int(p) for p in cgroup_value("pids", sid, "cgroup.procs").split()]
        t0 = time.monotonic()
        try:  # status (runsc state) after the sentry ran out of host fds ...
            runtime.get_status(sid)
        except SandboxError:
            pass
        status_took = time.monotonic() - t0
        t0 = time.monotonic()
        try:  # ... and delete
            runtime.delete(sid)
        except SandboxError:
            pass
        delete_took = time.monotonic() - t0
        alive = [p for p in procs if Path(f"/proc/{p}").exists()]
    finally:
        _kill_and_remove_cgroups(sid, procs)
    print(f"\nwedged sentry: status {status_took:.0f} s, delete {delete_took:.0f} s, "
          f"{len(alive)} processes left")
    # what counts is that nothing of the sandbox outlives delete; the times are printed
    # for the record only (how long a wedged sentry takes is no claim of ours)
    assert not alive


def _kill_and_remove_cgroups(sid: str, pids: list[int]) -> None:
    """Clean up after a wedged sandbox: its own processes by PID, then its cgroup dirs."""
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    time.sleep(1)
    for ctrl in Path("/sys/fs/cgroup").iterdir():
        d = ctrl / sid
        if d.is_dir():
            wait_until(lambda d=d: not (d / "cgroup.procs").read_text().strip(), 10)
            d.rmdir()


def test_zombie_storm_is_reaped(runtime, neighbour):
    sid = runtime.create(image="ray-sandbox/python", memory="512Mi", cpu=1)
    count = ("import os\nprint(sum(1 for p in os.listdir('/proc') if p.isdigit()))\n")
    try:
        baseline = int(runtime.exec(sid, ["python3", "-c", count]).stdout)
        storm = ("import os, time\nfor i in range(300):\n    if os.fork() == 0:\n"
                 "        os._exit(0)\ntime.sleep(1)\n"
                 "print(sum(1 for p in os.listdir('/proc') if p.isdigit()))\n")
        with TaskWatch(runtime, sid) as watch:
            res = runtime.exec(sid, ["python3", "-c", storm], timeout=120)
        assert res.exit_code == 0 and int(res.stdout) >= 300  # the zombies existed
        # the parent exited: the agent (a child subreaper) reaped every one of them
        assert wait_until(
            lambda: int(runtime.exec(sid, ["python3", "-c", count]).stdout) <= baseline, 10)
        print(f"\nzombie storm (300): peak {watch.peak} host tasks, "
              f"{sandbox_tasks(sid)} after reaping")
        assert not watch.tripped and answers(runtime, neighbour)
    finally:
        runtime.delete(sid)


@heavy
@pytest.mark.xfail(strict=True, reason=(
    "gVisor's sentry grows ~0.1 MiB of anonymous memory per exec of an image binary, up to "
    "~150 MiB (plateau after ~2500 execs), charged to the sandbox's memory limit: a long-lived "
    "sandbox with memory=128Mi is OOMKilled after ~1200 commands although each one is tiny. "
    "Fix: reject or warn on memory < 256Mi for long-lived sandboxes (document the sentry "
    "overhead), or add that overhead to the cgroup limit the runtime sets"))
def test_small_sandbox_survives_many_short_commands(runtime):
    sid = runtime.create(image="ray-sandbox/busybox", memory="128Mi", cpu=0.5)
    try:
        res = runtime.exec(sid, "i=0; while [ $i -lt 2000 ]; do /bin/true; i=$((i+1)); done",
                           timeout=300)
        assert res.exit_code == 0
    except SandboxError:
        pass
    finally:
        state = runtime.get_status(sid).state
        runtime.delete(sid)
    assert state == SandboxState.RUNNING

