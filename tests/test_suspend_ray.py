"""Idle suspend and transparent resume through Ray (issue 36), with real gVisor and a real
local Ray cluster: the reservation released while suspended, state kept (a counter process,
files, a listening socket), every kind of call resuming it (one resume for concurrent
callers), a port URL of the service waking it, the host's process killed during a suspend
or a resume (no leak, no half sandbox). Two nodes (a resume on the other one, the disk
budget): tests/test_suspend_multinode.py."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

import ray_sandbox as sandbox
from ray_sandbox.runtime import SandboxState, procfs
from ray_sandbox.runtime.errors import SandboxNotFoundError
from tests.fx_ray import host_pid
from tests.fx_service import Service, free_port

COUNTER = ("setsid sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/c.tmp; "
           "mv /tmp/c.tmp /tmp/c; sleep 0.05; done' >/dev/null 2>&1 &")


def _wait(cond, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _state(ray, sb) -> SandboxState:
    return ray.get(sb.status.remote()).state


def _count(sb) -> int:
    out = sb.run("cat /tmp/c").stdout.strip()
    return int(out) if out else 0


def _cpu(ray) -> float:
    return ray.available_resources().get("CPU", 0.0)


def _stats(ray, sb) -> dict:
    return ray.get(sb._host.suspended.remote())


def test_idle_suspend_frees_the_reservation_and_keeps_processes_files_and_sockets(
        ray_cluster):
    ray = ray_cluster
    total = ray.cluster_resources()["CPU"]
    sb = sandbox.create(image="ray-sandbox/busybox", cpu=1, memory="128Mi",
                        idle_suspend_seconds=1)
    try:
        sb.run("mkdir /www && echo web > /www/i && echo kept > /root/f")
        sb.run("setsid httpd -p 127.0.0.1:8000 -h /www")
        sb.run(COUNTER)
        _wait(lambda: _count(sb) > 2, what="the counter")
        _wait(lambda: _state(ray, sb) == SandboxState.SUSPENDED, what="the idle suspend")
        status = ray.get(sb.status.remote())
        assert status.reason == "Idle" and status.suspended_at is not None
        # the slot is free: its block is given back once idle (RAY_SANDBOX_BLOCK_IDLE_S=2)
        _wait(lambda: _cpu(ray) == total, what="the reservation to be released")
        stats = _stats(ray, sb)
        assert stats["suspended"] == 1 and stats["bytes"] > 0
        before = int(ray.get(sb.read_file.remote("/tmp/c")).decode() or 0)  # wakes it
        assert _state(ray, sb) == SandboxState.RUNNING
        assert _cpu(ray) == total - 1
        _wait(lambda: _count(sb) > before, what="the counter to go on")
        assert sb.run("cat /root/f").stdout == "kept\n"
        assert sb.run("wget -q -O- http://127.0.0.1:8000/i").stdout == "web\n"
    finally:
        ray.get(sb.terminate.remote())


def test_every_kind_of_call_resumes_and_concurrent_calls_resume_once(ray_cluster, tmp_path):
    ray = ray_cluster
    sb = sandbox.create(image="ray-sandbox/busybox", cpu=0.5, memory="64Mi")
    try:
        sb.run("echo one > /tmp/f")
        calls = {
            "exec_stream": lambda: b"".join(c.data for c in ray.get(list(
                sb.exec_stream.remote("cat /tmp/f")))[:-1]) == b"one\n",
            "read_file": lambda: ray.get(sb.read_file.remote("/tmp/f")) == b"one\n",
            "download_file": lambda: (ray.get(sb.download_file.remote(
                "/tmp/f", str(tmp_path / "f"))), (tmp_path / "f").read_text())[1] == "one\n",
            "upload_file": lambda: (ray.get(sb.upload_file.remote(
                str(tmp_path / "f"), "/tmp/g")), sb.run("cat /tmp/g").stdout)[1] == "one\n",
            "run (node-local channel)": lambda: sb.run("cat /tmp/f").stdout == "one\n",
            "resume (the verb)": lambda: ray.get(sb.resume.remote()) is None,
        }
        for what, call in calls.items():
            ray.get(sb.suspend.remote())
            assert _state(ray, sb) == SandboxState.SUSPENDED, what
            assert call(), what
            assert _state(ray, sb) == SandboxState.RUNNING, what
        ray.get(sb.suspend.remote())
        before = _stats(ray, sb)["resumes"]
        refs = [sb.exec.remote("cat /tmp/f") for _ in range(8)]
        assert [r.stdout for r in ray.get(refs)] == ["one\n"] * 8
        assert _stats(ray, sb)["resumes"] == before + 1
        # api.resume of a running sandbox returns it as it is
        assert sandbox.resume(sb).sandbox_id == sb.sandbox_id
    finally:
        ray.get(sb.terminate.remote())


def test_a_suspended_sandbox_is_listed_found_by_name_and_deleted(ray_cluster):
    ray = ray_cluster
    sb = sandbox.create(image="ray-sandbox/busybox", cpu=0.5, memory="64Mi", name="dozy")
    ray.get(sb.suspend.remote())
    assert sandbox.get("dozy").sandbox_id == sb.sandbox_id
    assert sb.sandbox_id in {h.sandbox_id for h in sandbox.list()}
    ray.get(sb.terminate.remote())
    with pytest.raises(SandboxNotFoundError):
        sandbox.get("dozy")
    assert _stats(ray, sb)["suspended"] == 0
    # the name is free again
    again = sandbox.create(image="ray-sandbox/busybox", cpu=0.5, memory="64Mi", name="dozy")
    ray.get(again.terminate.remote())


def _runsc_procs(home: Path, sid: str) -> list[int]:
    marker = f"--root={home / 'runsc'}".encode()
    return [pid for pid, argv in procfs.cmdlines()
            if marker in argv and any(sid.encode() in a for a in argv)]


def _kill_when(pred, pid: int, timeout: float = 60.0) -> bool:
    """SIGKILL ``pid`` as soon as a runsc process whose argv ``pred`` accepts runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for _, argv in procfs.cmdlines():
            if pred(argv):
                os.kill(pid, signal.SIGKILL)
                return True
        time.sleep(0.001)
    return False


@pytest.mark.parametrize("during", ["suspend", "resume"])
def test_killing_the_host_during_a_suspend_or_resume_leaves_no_half_sandbox(
        ray_cluster, ray_home, during):
    ray = ray_cluster
    sb = sandbox.create(image="ray-sandbox/busybox", cpu=0.5, memory="64Mi",
                        lifetime="detached")
    sid = sb.sandbox_id
    sb.run("echo kept > /root/f")
    if during == "resume":
        ray.get(sb.suspend.remote())
    pid = host_pid(ray, sb._host)
    verb = b"checkpoint" if during == "suspend" else b"restore"
    killer = threading.Thread(target=_kill_when, args=(
        lambda argv: verb in argv and any(sid.encode() in a for a in argv), pid))
    killer.start()
    try:
        ray.get(sb.suspend.remote() if during == "suspend" else sb.exec.remote("true"))
    except Exception:  # noqa: BLE001 - the host died under the call
        pass
    killer.join()
    # the host restarts (max_restarts=-1): the sandbox is suspended whole (it resumes and
    # has its file) or gone whole (reaped with its dead owner); nothing of it runs half
    _wait(lambda: _host_answers(ray, sb), what="the restarted host")
    try:
        state = _state(ray, sb)
    except SandboxNotFoundError:
        state = SandboxState.TERMINATED
    if state == SandboxState.SUSPENDED:
        assert _runsc_procs(ray_home, sid) == []
        assert sb.run("cat /root/f").stdout == "kept\n"
        ray.get(sb.terminate.remote())
    else:
        assert state == SandboxState.TERMINATED, state
        _wait(lambda: _runsc_procs(ray_home, sid) == [], what="its processes to go")
        assert not (ray_home / "sandboxes" / sid).exists()


def _host_answers(ray, sb) -> bool:
    try:
        ray.get(sb._host.ping.remote(), timeout=5)
        return True
    except Exception:  # noqa: BLE001 - still restarting
        return False


def test_a_port_url_request_wakes_the_sandbox(service: Service):
    port = free_port()
    with service.client() as c:
        r = c.post("/sandboxes", json={"image": "ray-sandbox/busybox", "cpu": 0.5,
                                       "memory": "64Mi", "network": "sandbox",
                                       "expose_ports": [port], "idle_suspend_seconds": 1})
        assert r.status_code == 202, r.text
        sid = r.json()["sandbox_id"]
        try:
            _wait(lambda: c.get(f"/sandboxes/{sid}").json()["status"] == "running",
                  what="running")
            c.put(f"/sandboxes/{sid}/files", params={"path": "/srv/index.html"},
                  content=b"awake")
            r = c.post(f"/sandboxes/{sid}/execs", json={"command": f"httpd -p {port} -h /srv"})
            assert r.status_code == 202, r.text
            url = c.post(f"/sandboxes/{sid}/ports/{port}/url", json={}).json()["url"]
            _wait(lambda: httpx.get(url + "/index.html").text == "awake", what="the port")
            _wait(lambda: c.get(f"/sandboxes/{sid}").json()["status"] == "suspended",
                  what="the idle suspend")
            got = httpx.get(url + "/index.html", timeout=60)  # wakes it, then is forwarded
            assert (got.status_code, got.text) == (200, "awake")
            assert c.get(f"/sandboxes/{sid}").json()["status"] == "running"
        finally:
            c.delete(f"/sandboxes/{sid}")
