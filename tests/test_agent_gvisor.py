"""The agent as PID 1 of real gVisor sandboxes (hand-made bundles, see tests/fx_agent.py)."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import pytest

from benchmarks._harness import measure
from ray_sandbox.runtime.agent import AgentClient, PythonContext, expected_version
from ray_sandbox.runtime.errors import SandboxDiedError, SandboxFileError
from ray_sandbox.runtime.results import ExecResult
from tests.fx_agent import read_until


def inside_processes(box) -> str:
    return box.client.exec(["ps", "-o", "pid,ppid,args"]).stdout


def test_agent_is_pid1_small_and_current(busybox_box):
    assert busybox_box.client.ping() == expected_version()
    status = busybox_box.runsc_exec("cat", "/proc/1/status")
    assert "rsb-agent" in busybox_box.runsc_exec("cat", "/proc/1/cmdline")
    rss_kb = int(status.split("VmRSS:")[1].split()[0])
    print(f"agent PID 1 VmRSS inside gVisor: {rss_kb} kB")
    assert rss_kb < 8 * 1024


def test_exec_results_users_and_binary_output(busybox_box):
    c = busybox_box.client
    r = c.exec(["sh", "-c", r"printf '\377\000ok'; echo err >&2; exit 9"])
    assert (r.exit_code, r.stdout_bytes, r.stderr) == (9, b"\xff\x00ok", "err\n")
    assert c.exec(["nope"]).exit_code == 127
    tester = c.exec(["sh", "-c", "id; echo $HOME; pwd"], user="tester", cwd="/tmp", env=[])
    assert tester.stdout.splitlines() == [
        "uid=1000(tester) gid=1000(tester) groups=1000(tester),2000(extra)",
        "/home/tester",
        "/tmp",
    ]


def test_flood_is_capped_and_stdin_delivered_inside(busybox_box):
    c = busybox_box.client
    r = c.exec(["head", "-c", "50000000", "/dev/zero"], max_output_bytes=1 << 20, timeout=60)
    assert r.exit_code == 0 and r.truncated and len(r.stdout_bytes) == 1 << 20
    data = os.urandom(2 << 20)
    r = c.exec(["sha256sum"], stdin=data, timeout=60)
    assert r.stdout.split()[0] == hashlib.sha256(data).hexdigest()


def test_timeout_kills_the_tree_inside(busybox_box):
    c = busybox_box.client
    script = (
        "sleep 41.1 & setsid sleep 41.2 & (setsid sh -c 'sleep 41.3 & sleep 41.4') & sleep 41.5"
    )
    start = time.monotonic()
    r = c.exec(["sh", "-c", script], timeout=2)
    assert time.monotonic() - start < 10
    assert r.timed_out and r.exit_code == 137
    assert "sleep 41" not in inside_processes(busybox_box)


def test_background_grandchild_reparents_to_init(busybox_box):
    c = busybox_box.client
    r = c.exec(["sh", "-c", "setsid sleep 42.5 & echo $!"], timeout=20)
    assert r.ok and not r.timed_out
    pid = r.stdout.strip()
    deadline = time.monotonic() + 5  # the retiring handler exits, then init adopts it
    while time.monotonic() < deadline:
        ppid = c.exec(["sh", "-c", f"cut -d' ' -f4 /proc/{pid}/stat"]).stdout.strip()
        if ppid == "1":
            break
        time.sleep(0.05)
    assert ppid == "1"
    assert c.exec(["kill", "-9", pid]).ok
    gone = f"i=0; while [ -e /proc/{pid} ]; do i=$((i+1)); [ $i -gt 99 ] && exit 1; sleep .05; done"
    assert c.exec(["sh", "-c", gone]).ok  # init reaped it: no zombie left


def test_pty_shell_with_resize(busybox_box):
    with busybox_box.client.spawn(["sh", "-i"], pty=(24, 80), env=["PS1=$ "]) as sh:
        sh.write_stdin(b"stty size; echo $((6*7))\n")
        out = read_until(sh, b"42")
        assert b"24 80" in out
        sh.resize(40, 100)
        sh.write_stdin(b"stty size\n")
        read_until(sh, b"40 100")
        sh.write_stdin(b"exit 3\n")
        result = sh.wait(timeout=10)
    assert result is not None and result.exit_code == 3


def test_files_inside(busybox_box):
    c = busybox_box.client
    name = os.fsdecode(b"/tmp/files/\xe9t\xe9.bin")
    c.write_file(name, b"\x00\xff" * 10, mode=0o600)
    info = c.stat(name)
    assert (info.size, info.mode, info.name) == (20, 0o600, os.fsdecode(b"\xe9t\xe9.bin"))
    assert c.read_file(name) == b"\x00\xff" * 10
    assert [i.path for i in c.walk("/tmp/files")] == [os.fsdecode(b"\xe9t\xe9.bin")]
    with pytest.raises(SandboxFileError, match="Read-only"):
        c.write_file("/etc/new", b"x")  # root.readonly
    c.remove("/tmp/files", recursive=True)


def test_100mb_roundtrip_inside(busybox_box):
    c = busybox_box.client
    block = os.urandom(1 << 20)
    c.write_file("/tmp/big", (block for _ in range(100)))
    digest = hashlib.sha256()
    size = 0
    for chunk in c.iter_read("/tmp/big"):
        digest.update(chunk)
        size += len(chunk)
    assert size == 100 << 20
    assert digest.hexdigest() == hashlib.sha256(block * 100).hexdigest()
    assert c.exec(["sha256sum", "/tmp/big"]).stdout.split()[0] == digest.hexdigest()
    c.remove("/tmp/big")


def test_sixteen_concurrent_callers(busybox_box):
    c, n = busybox_box.client, 16
    c.mkdir("/tmp/barrier")
    script = (
        f'touch /tmp/barrier/$0; i=0; while [ "$(ls /tmp/barrier | wc -l)" -lt {n} ]; do '
        "i=$((i+1)); [ $i -gt 2000 ] && exit 1; sleep 0.01; done"
    )
    results: list[ExecResult] = []
    threads = [
        threading.Thread(target=lambda i=i: results.append(c.exec(["sh", "-c", script, str(i)])))
        for i in range(n)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.exit_code for r in results] == [0] * n
    c.remove("/tmp/barrier", recursive=True)


def test_agent_survives_socket_deletion_kill_9_and_dead_handlers(busybox_box):
    c = busybox_box.client
    c.exec(["rm", "/.rsb/run/agent.sock"])
    sock = busybox_box.run_dir / "agent.sock"
    deadline = time.monotonic() + 5
    while not sock.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    fresh = AgentClient(sock, sandbox_id=busybox_box.id)
    assert fresh.ping() == expected_version()
    for sig in ("TERM", "INT", "HUP", "QUIT", "USR1", "SEGV", "ABRT", "BUS", "ALRM", "TSTP"):
        fresh.exec(["kill", f"-{sig}", "1"])  # ignored (gVisor cannot shield KILL and STOP)
    with pytest.raises(SandboxDiedError):
        fresh.exec(["sh", "-c", "kill -9 $PPID; sleep 5"], timeout=30)
    assert fresh.exec(["echo", "alive"]).stdout == "alive\n"
    assert "rsb-agent init" in busybox_box.runsc_exec("cat", "/proc/1/cmdline").replace("\0", " ")
    fresh.close()


def test_image_without_shell(static_box):
    c = static_box.client
    r = c.exec(["/hello", "x"])
    assert (r.exit_code, r.stdout) == (7, "hello 2\n")
    assert c.exec(["hello"], env=["PATH=/"]).stdout == "hello 1\n"
    assert c.exec(["sh", "-c", "true"]).exit_code == 127
    c.write_file("/tmp/f", b"data")
    assert c.read_file("/tmp/f") == b"data"
    assert {i.name for i in c.list_dir("/")} >= {"hello", "proc", "tmp"}


def test_warm_python_inside(python_box):
    with PythonContext(python_box.client, python="/usr/bin/python3") as ctx:
        assert ctx.run("import sys\nn = 6").ok
        r = ctx.run("print(sys.version_info[0]); n * 7")
        assert (r.stdout, r.value) == ("3\n", "42")


@pytest.mark.skipif(not os.environ.get("RAY_SANDBOX_HEAVY"), reason="RAY_SANDBOX_HEAVY=1")
def test_print_performance(busybox_box, static_box, python_box):
    """Numbers for the report (printed, never asserted): run with -s."""
    c = busybox_box.client

    def p50(fn, n: int = 200) -> float:
        return measure("", fn, n)["p50_ms"]

    rows = {
        "runsc exec true": p50(lambda: busybox_box.runsc_exec("true"), 30),
        "agent exec true": p50(lambda: c.exec(["true"])),
        "agent exec /hello (small static binary)": p50(lambda: static_box.client.exec(["/hello"])),
        "agent ping": p50(c.ping),
    }
    c.write_file("/tmp/k", os.urandom(1024))
    rows["read 1 KiB"] = p50(lambda: c.read_file("/tmp/k"))
    rows["write 1 KiB"] = p50(lambda: c.write_file("/tmp/k", b"x" * 1024))
    block = os.urandom(1 << 20)
    rows["upload 100 MB"] = p50(lambda: c.write_file("/tmp/b", (block for _ in range(100))), 5)
    rows["download 100 MB"] = p50(lambda: sum(len(x) for x in c.iter_read("/tmp/b")), 5)
    c.remove("/tmp/b")
    for n in (1, 4, 16):

        def burst(n: int = n, per_thread: int = 50) -> None:
            ts = [
                threading.Thread(target=lambda: [c.exec(["true"]) for _ in range(per_thread)])
                for _ in range(n)
            ]
            for t in ts:
                t.start()
            for t in ts:
                t.join()

        t0 = time.perf_counter()
        burst()
        rows[f"exec true x{n} threads, per s"] = round(n * 50 / (time.perf_counter() - t0))
    with PythonContext(python_box.client, python="/usr/bin/python3") as ctx:
        rows["python first run (interpreter start)"] = round(_time(lambda: ctx.run("1")), 3)
        rows["python warm print(1)"] = p50(lambda: ctx.run("print(1)"))
    rows["agent VmRSS kB"] = int(
        busybox_box.runsc_exec("cat", "/proc/1/status").split("VmRSS:")[1].split()[0]
    )
    for k, v in rows.items():
        print(f"{k:36} {v}")


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1000
