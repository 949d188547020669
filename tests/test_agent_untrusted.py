"""The host survives a hostile agent, in real gVisor sandboxes: root inside a sandbox replaces
the agent with its own server, or freezes the agent's handlers with SIGSTOP."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from ray_sandbox.runtime import errors
from ray_sandbox.runtime.agent import AgentClient

MiB = 1 << 20

# Runs as root in the sandbox. The hold file makes the real init close its listener and
# remove the socket (and not re-create it while the file exists), the planted server binds
# the same path (--host-uds=create makes it a host socket, like the agent's), and killing the
# real handlers breaks the host's pooled connections, so every later call reaches the fake.
# Each reply floods output (1 MiB frames) or file data (256 KiB frames, the default chunk)
# until the client hangs up, at most 192 MiB, so that a client without bounds fails the test
# rather than the machine.
FAKE_AGENT = r"""
import os, socket, struct, threading, time
RUN = "/.rsb/run"
SOCK = RUN + "/agent.sock"
HDR = struct.Struct(">IB")
FLOOD = 192

def frame(ftype, payload=b""):
    return HDR.pack(len(payload), ftype) + payload

def tlv_int(tag, value):
    return struct.pack(">BIq", tag, 8, value)

def recv_exact(c, n):
    buf = b""
    while len(buf) < n:
        got = c.recv(n - len(buf))
        if not got:
            raise OSError("hung up")
        buf += got
    return buf

def serve(c):
    try:
        while True:
            length, ftype = HDR.unpack(recv_exact(c, 5))
            recv_exact(c, length)
            if ftype == 0x01:  # ping
                c.sendall(frame(0x40, struct.pack(">BI", 39, 4) + b"fake"))
            elif ftype == 0x02:  # exec: STARTED, endless STDOUT
                c.sendall(frame(0x42, tlv_int(32, 7)))
                blob = frame(0x43, b"x" * (1 << 20))
                for _ in range(FLOOD):
                    c.sendall(blob)
                c.sendall(frame(0x45, tlv_int(33, 0)))
            elif ftype == 0x03:  # read: endless DATA of the default chunk, 256 KiB
                blob = frame(0x20, b"\0" * (256 << 10))
                for _ in range(FLOOD * 4):
                    c.sendall(blob)
                c.sendall(frame(0x40))
            elif ftype not in (0x20, 0x21):  # stdin frames need no answer
                c.sendall(frame(0x40))
    except OSError:
        pass
    finally:
        c.close()

open(RUN + "/checkpoint.hold", "w").close()
while os.path.exists(SOCK):
    time.sleep(0.01)
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(SOCK)
srv.listen(64)
for pid in os.listdir("/proc"):
    if pid.isdigit() and int(pid) not in (1, os.getpid()):
        try:
            if b"rsb-agent" in open(f"/proc/{pid}/cmdline", "rb").read():
                os.kill(int(pid), 9)
        except OSError:
            pass
open(RUN + "/fake.ready", "w").close()
while True:
    threading.Thread(target=serve, args=(srv.accept()[0],), daemon=True).start()
"""


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def peak_traced(call):
    """(result or exception, peak bytes Python allocated during ``call``)."""
    tracemalloc.start()
    try:
        try:
            out = call()
        except Exception as exc:  # noqa: BLE001 - returned to the test to assert on
            out = exc
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.timeout(300)
def test_planted_fake_agent_is_bounded_and_other_sandboxes_keep_answering(
    runtime, py_sandbox, sandbox
):
    runtime.write_file(py_sandbox, "/tmp/fake_agent.py", FAKE_AGENT)
    runtime.exec(py_sandbox, "python3 /tmp/fake_agent.py </dev/null >/dev/null 2>&1 &")
    ready = runtime.sandboxes_dir / py_sandbox / "run" / "fake.ready"
    wait_for(ready.exists)

    r, peak = peak_traced(lambda: runtime.exec(py_sandbox, ["true"], max_output_bytes=MiB))
    assert not isinstance(r, Exception), r
    assert len(r.stdout_bytes) == MiB and r.truncated and r.exit_code == 137
    assert peak < 16 * MiB

    err, peak = peak_traced(lambda: runtime.read_file(py_sandbox, "/etc/hostname",
                                                      max_bytes=4 * MiB))
    assert isinstance(err, errors.FileTooLargeError), err
    assert err.sandbox_id == py_sandbox
    assert peak < 16 * MiB

    assert runtime.exec(sandbox, ["echo", "ok"]).stdout == "ok\n"
    assert runtime.read_file(sandbox, "/etc/hostname")


@pytest.mark.timeout(120)
def test_sigstopped_handlers_make_uploads_time_out(busybox_box):
    client = AgentClient(busybox_box.run_dir / "agent.sock", sandbox_id=busybox_box.id,
                         io_timeout=2.0)
    # The pooled connection's handler is the parent of the command it runs.
    handler = client.exec(["sh", "-c", "echo $PPID"]).stdout.strip()
    busybox_box.runsc_exec("kill", "-STOP", handler, "1")
    try:
        with pytest.raises(errors.AgentTimeoutError) as info:
            client.write_file("/tmp/big", bytes(64 * MiB))
        assert info.value.sandbox_id == busybox_box.id
    finally:
        busybox_box.runsc_exec("kill", "-CONT", handler, "1")
    # The frozen connection was dropped: the next call gets a fresh handler.
    assert client.exec(["sh", "-c", "echo $PPID"]).stdout.strip() != handler
    assert not client.exists("/tmp/big")  # a cut upload leaves nothing
    client.close()


# The planted server's READ answers one byte every 0.1 s, for ten minutes: within any
# per-frame deadline, but far below the rate a reply stream must keep.
TRICKLE_AGENT = FAKE_AGENT.replace(
    """blob = frame(0x20, b"\\0" * (256 << 10))
                for _ in range(FLOOD * 4):
                    c.sendall(blob)""",
    """for _ in range(6000):
                    c.sendall(frame(0x20, b"x"))
                    time.sleep(0.1)""")


@pytest.mark.timeout(120)
def test_a_trickled_reply_stream_times_out(runtime, py_sandbox):
    assert TRICKLE_AGENT != FAKE_AGENT
    runtime.write_file(py_sandbox, "/tmp/fake_agent.py", TRICKLE_AGENT)
    runtime.exec(py_sandbox, "python3 /tmp/fake_agent.py </dev/null >/dev/null 2>&1 &")
    run = runtime.sandboxes_dir / py_sandbox / "run"
    wait_for((run / "fake.ready").exists)
    client = AgentClient(run / "agent.sock", sandbox_id=py_sandbox, io_timeout=2.0)
    t0 = time.monotonic()
    with pytest.raises(errors.AgentTimeoutError) as info:
        client.read_file("/etc/hostname")
    assert info.value.sandbox_id == py_sandbox
    assert time.monotonic() - t0 < 30  # a hang guard: 2 s of budget plus what 20 bytes buy
    client.close()


# The planted server drains everything at ~1 MiB/s and answers a WRITE only once its CLOSE
# came: each 1 MiB frame is taken within the per-frame deadline, but the whole upload is slow.
DRAIN_AGENT = FAKE_AGENT.replace(
    "got = c.recv(n - len(buf))",
    "got = c.recv(min(n - len(buf), 65536))\n        time.sleep(len(got) / (1 << 20))",
).replace(
    "elif ftype not in (0x20, 0x21):  # stdin frames need no answer",
    "elif ftype not in (0x04, 0x20):  # a WRITE is answered at its CLOSE",
)


@pytest.mark.timeout(120)
def test_a_slowly_drained_upload_times_out(runtime, py_sandbox):
    assert DRAIN_AGENT.count("65536") == 1 and "0x04, 0x20" in DRAIN_AGENT
    runtime.write_file(py_sandbox, "/tmp/fake_agent.py", DRAIN_AGENT)
    runtime.exec(py_sandbox, "python3 /tmp/fake_agent.py </dev/null >/dev/null 2>&1 &")
    run = runtime.sandboxes_dir / py_sandbox / "run"
    wait_for((run / "fake.ready").exists)
    # 4 MiB/s asked, ~1 MiB/s given: the budget runs out after a few frames
    client = AgentClient(run / "agent.sock", sandbox_id=py_sandbox, io_timeout=2.0,
                         min_rate=4 * MiB)
    t0 = time.monotonic()
    with pytest.raises(errors.AgentTimeoutError) as info:
        client.write_file("/tmp/big", bytes(32 * MiB))
    assert info.value.sandbox_id == py_sandbox
    assert time.monotonic() - t0 < 20  # the whole upload would take ~32 s
    client.close()
