"""The node-local channel (``actor/channel.py``): ``handle.run()`` from the sandbox's node
skips Ray's actor call, gives what ``exec`` gives, and falls back to Ray whenever the channel
cannot take the call. The host trusts only token holders and bounds what they hold. Real Ray,
real runsc."""

from __future__ import annotations

import os
import signal
import socket
import struct
import time

import pytest

import ray_sandbox as sandbox
from ray_sandbox.actor import channel
from ray_sandbox.runtime.errors import ConfigError, SandboxNotFoundError
from tests.fx_hostile import wait_until
from tests.fx_ray import host_pid


@pytest.fixture(scope="module")
def sb(ray_cluster):
    ray = ray_cluster
    handle = sandbox.create(image="ray-sandbox/busybox", cpu=0.5, memory="64Mi")
    yield handle
    ray.get(handle.terminate.remote())


def _connect(path: str, token: bytes) -> socket.socket | None:
    """A raw connection the host accepted (token checked, slot given), else None."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    try:
        s.connect(path)
        s.sendall(struct.pack(">I", len(token)) + token)
        if s.recv(1) == b"\x01":
            return s
    except OSError:  # refused before the token was read: the pipe is broken
        pass
    s.close()
    return None


def _restarted(ray, host, old_pid: int) -> bool:
    """The host answers from a new process (the old one's sockets are closed by then: Ray
    restarts an actor once its worker's connections are gone)."""
    try:
        return host_pid(ray, host) != old_pid
    except ray.exceptions.RayActorError:
        return False


def test_run_goes_through_the_channel_and_matches_exec(ray_cluster, sb):
    ray = ray_cluster
    channel.forget(sb._host)
    assert channel.client_for(sb._host) is not None  # the driver is on the node
    for cmd in (["sh", "-c", "printf '\\377\\000x'; echo err >&2; exit 3"], "echo $X",):
        direct = sb.run(cmd, env={"X": "y"})
        via_ray = ray.get(sb.exec.remote(cmd, env={"X": "y"}))
        assert (direct.exit_code, direct.stdout_bytes, direct.stderr_bytes) == \
            (via_ray.exit_code, via_ray.stdout_bytes, via_ray.stderr_bytes)
    assert sb.run(["sh", "-c", "printf '\\377\\000x'"]).stdout_bytes == b"\xff\x00x"


def test_a_timeout_through_the_channel_kills_the_command(sb):
    t0 = time.monotonic()
    res = sb.run("sleep 30 & sleep 30", timeout=1)
    assert res.timed_out and time.monotonic() - t0 < 10
    assert "sleep" not in sb.run("ps -o comm").stdout


def test_errors_through_the_channel_keep_their_type(ray_cluster):
    ray = ray_cluster
    other = sandbox.create(image="ray-sandbox/busybox", cpu=0.5, memory="64Mi")
    ray.get(other.terminate.remote())
    with pytest.raises(SandboxNotFoundError) as err:
        other.run("true")
    assert err.value.sandbox_id == other.sandbox_id
    with pytest.raises(ConfigError, match="no_such_option: unknown option"):
        other.run("true", no_such_option=1)  # checked at the caller, before anything is sent


def test_a_caller_on_another_node_uses_ray(ray_cluster, sb):
    channel.forget(sb._host)
    assert channel.client_for(sb._host) is not None
    node, client = channel._clients[sb._host._actor_id.hex()]
    channel._clients[sb._host._actor_id.hex()] = ("f" * len(node), client)  # as seen elsewhere
    try:
        assert channel.client_for(sb._host) is None
        assert sb.run("echo via-ray").stdout == "via-ray\n"
    finally:
        channel.forget(sb._host)


def test_handles_from_list_and_get_use_it_too(ray_cluster, sb):
    found = next(h for h in sandbox.list() if h.sandbox_id == sb.sandbox_id)
    assert found.node_id == sb.node_id  # list() names the node (ask_hosts)
    channel.forget(found._host)
    assert channel.client_for(found._host) is not None
    assert found.run("echo listed").stdout == "listed\n"


def test_the_host_serves_token_holders_only_and_bounds_them(ray_cluster, sb):
    ray = ray_cluster
    _, path, token = ray.get(sb._host.channel.remote())
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert _connect(path, b"x" * len(token)) is None  # closed without an answer
    big = _connect(path, token)
    assert big is not None
    big.sendall(struct.pack(">I", channel.MAX_REQUEST + (2 << 16)))
    assert big.recv(1) == b""  # an oversized frame ends that connection only
    big.close()
    assert sb.run("echo still").stdout == "still\n"

    # every slot held by someone else: the next caller is refused and run() still works
    channel.forget(sb._host)  # this process's pooled connection is dropped
    held = []
    try:
        while len(held) < channel.MAX_CONNECTIONS:
            s = _connect(path, token)
            if s is None:  # a dropped pooled connection whose slot is not back yet
                time.sleep(0.05)
                continue
            held.append(s)
        assert _connect(path, token) is None
        assert sb.run("echo over-ray").stdout == "over-ray\n"
        # refused as full, not as a stranger: the channel is kept for the next call
        assert sb._host._actor_id.hex() in channel._clients
    finally:
        for s in held:
            s.close()
    # the slots come back
    assert wait_until(lambda: _connect(path, token) is not None, 10)


def test_a_restarted_host_is_reached_again_and_the_old_token_refused(ray_cluster):
    ray = ray_cluster
    victim = sandbox.create(image="ray-sandbox/busybox", cpu=0.5, memory="64Mi")
    _, path, old_token = ray.get(victim._host.channel.remote())
    assert victim.run("true").exit_code == 0  # a pooled connection to this incarnation
    pid = host_pid(ray, victim._host)
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: _restarted(ray, victim._host, pid), 60)
    # the dead incarnation's sandboxes are reaped by the new one: run() reports that
    # through Ray (the pooled connection is closed, the new host refuses the old token)
    with pytest.raises(SandboxNotFoundError):
        victim.run("true")
    assert _connect(path, old_token) is None
    fresh = sandbox.create(image="ray-sandbox/busybox", cpu=0.5, memory="64Mi")
    try:
        assert fresh.run("echo back").stdout == "back\n"
        _, new_path, new_token = ray.get(fresh._host.channel.remote())
        assert new_path == path and new_token != old_token
        assert channel.client_for(fresh._host) is not None
    finally:
        ray.get(fresh.terminate.remote())


def test_a_pooled_connection_is_checked_past_fd_1023():
    """select() cannot watch fds over 1023; a busy worker has that many open."""
    a, b = socket.socketpair()
    high = socket.socket(fileno=os.dup2(a.fileno(), 1500))
    try:
        assert channel._open(high)
        b.close()  # the host went away
        assert not channel._open(high)
    finally:
        high.close()
        a.close()
