"""Suspend in place and resume on the runtime (issue 36), with real gVisor: what a suspended
sandbox keeps (processes, files, a listening socket, its network address and published
port), idle suspend and the transparent resume of the next call, one resume for concurrent
callers, and a restore killed half-way (a typed error, the state kept for a retry)."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request

import pytest

from ray_sandbox.runtime import SandboxState, procfs
from ray_sandbox.runtime.config import make_config
from ray_sandbox.runtime.errors import ConfigError, ResumeError, SandboxStateError
from tests.fx_network import free_port

COUNTER = ["/bin/sh", "-c", "i=0; while true; do i=$((i+1)); echo $i > /tmp/c.tmp; "
           "mv /tmp/c.tmp /tmp/c; sleep 0.05; done"]


def _count(rt, sid) -> int:
    out = rt.exec(sid, "cat /tmp/c").stdout.strip()
    return int(out) if out else 0


def _runsc_pids(rt, sid) -> list[int]:
    marker = f"--root={rt.runsc.root}".encode()
    return [pid for pid, argv in procfs.cmdlines()
            if marker in argv and any(sid.encode() in a for a in argv)]


def _wait(cond, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def busy(runtime):
    """A busybox sandbox (writable root) running a counter, a file in / and in /tmp, and an
    HTTP server listening on 127.0.0.1:8000 inside."""
    sid = runtime.create(image="ray-sandbox/busybox", memory="128Mi", cpu=1, readonly=False)
    runtime.exec(sid, "echo root > /root/f; echo tmp > /tmp/t; mkdir /www; echo web > /www/i")
    runtime.spawn(sid, COUNTER)
    runtime.spawn(sid, "httpd -f -p 127.0.0.1:8000 -h /www")
    _wait(lambda: _count(runtime, sid) > 2, what="the counter")
    yield sid
    runtime.delete(sid)


def test_suspend_releases_the_container_and_keeps_processes_files_and_sockets(runtime, busy):
    rt, sid = runtime, busy
    before = _count(rt, sid)
    state = rt.suspensions.suspend(sid)
    assert state.size_bytes > 0
    st = rt.get_status(sid)
    assert st.state == SandboxState.SUSPENDED and st.reason == "Suspended"
    assert st.suspended_at is not None
    # no sentry, no gofer, no cgroup: its memory is the node's again
    assert _runsc_pids(rt, sid) == []
    assert procfs.memory_used(sid) is None
    assert rt.suspensions.usage() == (1, state.size_bytes)
    rt.suspensions.resume(sid)
    assert rt.get_status(sid).state == SandboxState.RUNNING
    after = _count(rt, sid)
    assert after >= before  # the counter went on from where it was
    _wait(lambda: _count(rt, sid) > after, what="the counter to go on")
    assert rt.exec(sid, "cat /root/f /tmp/t").stdout == "root\ntmp\n"
    assert rt.exec(sid, "wget -q -O- http://127.0.0.1:8000/i").stdout == "web\n"
    assert rt.suspensions.usage() == (0, 0)
    assert not (rt.records.sdir(sid).path / "suspend").exists()


def test_a_call_resumes_a_suspended_sandbox_and_concurrent_calls_resume_it_once(runtime, busy):
    rt, sid = runtime, busy
    rt.suspensions.suspend(sid)
    resumes = []
    real = rt.suspensions._resume

    def counted(*a, **kw):
        done = real(*a, **kw)
        resumes.append(done)
        return done

    rt.suspensions._resume = counted  # counts the real resumes; nothing is replaced
    try:
        results: list[str] = []
        threads = [threading.Thread(target=lambda: results.append(
            rt.exec(sid, "cat /root/f").stdout)) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        del rt.suspensions._resume
    assert results == ["root\n"] * 6
    assert resumes.count(True) == 1


def test_idle_suspend_then_the_next_call_resumes(runtime):
    rt = runtime
    sid = rt.create(image="ray-sandbox/busybox", memory="128Mi", cpu=1,
                    idle_suspend_seconds=1)
    try:
        rt.exec(sid, "echo kept > /tmp/k")
        _wait(lambda: rt.get_status(sid).state == SandboxState.SUSPENDED, what="idle suspend")
        assert rt.get_status(sid).reason == "Idle"
        assert rt.exec(sid, "cat /tmp/k").stdout == "kept\n"
        assert rt.get_status(sid).state == SandboxState.RUNNING
        # and again: the idle check is armed anew after a resume
        _wait(lambda: rt.get_status(sid).state == SandboxState.SUSPENDED, what="idle again")
    finally:
        rt.delete(sid)


def test_idle_suspend_and_idle_timeout_together(runtime):
    """Suspended first, then deleted once idle for the timeout (it counts while asleep)."""
    rt = runtime
    sid = rt.create(image="ray-sandbox/busybox", memory="128Mi", idle_suspend_seconds=1,
                    idle_timeout_seconds=4)
    _wait(lambda: rt.get_status(sid).state == SandboxState.SUSPENDED, what="idle suspend")
    _wait(lambda: rt.get_status(sid).state == SandboxState.TERMINATED, what="idle timeout")
    assert rt.get_status(sid).reason == "IdleTimeout"


def test_hostinet_networks_cannot_suspend():
    with pytest.raises(ConfigError, match="idle_suspend_seconds needs network"):
        make_config(network="public", idle_suspend_seconds=5)


def test_a_restore_killed_half_way_is_a_resume_error_and_a_retry_works(runtime, busy):
    rt, sid = runtime, busy
    rt.suspensions.suspend(sid)
    killed = []

    def kill_restore() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not killed:
            for pid, argv in procfs.cmdlines():
                if b"restore" in argv and any(sid.encode() in a for a in argv) and \
                        argv[0].endswith(b"runsc"):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                    return
            time.sleep(0.001)

    t = threading.Thread(target=kill_restore)
    t.start()
    with pytest.raises(ResumeError):
        rt.suspensions.resume(sid)
    t.join()
    assert killed
    # nothing half-started is left running, the checkpoint is kept, and it still says so
    assert rt.get_status(sid).state == SandboxState.SUSPENDED
    _wait(lambda: _runsc_pids(rt, sid) == [], what="the killed restore's processes")
    assert rt.suspensions.resume(sid)
    assert rt.exec(sid, "cat /root/f").stdout == "root\n"


def test_a_suspended_sandbox_is_deleted_with_everything(runtime, rt_home):
    from tests.fx_runtime import leftovers_after_teardown

    rt = runtime
    sid = rt.create(image="ray-sandbox/busybox", memory="128Mi", readonly=False)
    rt.suspensions.suspend(sid)
    rt.delete(sid)
    assert leftovers_after_teardown(rt_home, {sid}) == {}


def test_a_paused_sandbox_is_not_suspended(runtime, busy):
    runtime.pause(busy)
    try:
        with pytest.raises(SandboxStateError):
            runtime.suspensions.suspend(busy)
    finally:
        runtime.resume(busy)


def test_network_sandbox_keeps_its_address_and_published_port(runtime, clean_network):
    rt = runtime
    port = free_port()
    sid = rt.create(image="ray-sandbox/busybox", memory="128Mi", network="sandbox",
                    expose_ports=(port,), readonly=False)
    try:
        rt.exec(sid, "mkdir /www; echo hi > /www/i")
        rt.spawn(sid, f"httpd -f -p {port} -h /www")
        url = f"http://127.0.0.1:{port}/i"
        _wait(lambda: _get(url) == "hi\n", what="the published port")
        addr = rt.exec(sid, "ip -4 addr show eth0").stdout
        rt.suspensions.suspend(sid)
        assert _get(url) is None  # nothing answers while it sleeps
        rt.suspensions.resume(sid)
        assert rt.exec(sid, "ip -4 addr show eth0").stdout == addr
        _wait(lambda: _get(url) == "hi\n", what="the port after the resume")
    finally:
        rt.delete(sid, wait=True)


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.read().decode()
    except OSError:
        return None


def test_ps_and_doctor_count_suspended_sandboxes_and_their_disk(runtime, busy, rt_home):
    import json
    import subprocess
    import sys
    from pathlib import Path

    cli = str(Path(sys.executable).with_name("ray-sandbox"))
    env = {**os.environ, "RAY_SANDBOX_HOME": str(rt_home), "COLUMNS": "200"}
    state = runtime.suspensions.suspend(busy)
    ps = subprocess.run([cli, "ps", "--json"], env=env, capture_output=True, text=True,
                        timeout=120)
    (row,) = [r for r in json.loads(ps.stdout) if r["sandbox_id"] == busy]
    assert (row["state"], row["suspended_bytes"]) == ("SUSPENDED", state.size_bytes)
    table = subprocess.run([cli, "ps"], env=env, capture_output=True, text=True, timeout=120)
    assert "1 suspended," in table.stdout
    doctor = subprocess.run([cli, "doctor", "--json"], env=env, capture_output=True, text=True,
                            timeout=300)
    (check,) = [c for c in json.loads(doctor.stdout)["checks"] if c["name"] == "suspended"]
    assert check["detail"].startswith("1 sandbox(es) suspended")
