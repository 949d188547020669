"""The agent's exec, spawn and process model, against a real agent running natively."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from ray_sandbox.runtime.agent import AgentClient, client, expected_version
from ray_sandbox.runtime.errors import (
    ConfigError,
    ExecError,
    SandboxDiedError,
    SandboxError,
    SandboxStateError,
)
from ray_sandbox.runtime.results import ExecResult, OutputChunk
from tests.fx_agent import descendants, proc_table, read_until, wait_gone
from tests.fx_hostile import wait_until


def marked(marker: str) -> list[int]:
    """Live host processes whose command line contains ``marker``."""
    return wait_gone([p for p, (_, cmd) in proc_table().items() if marker in cmd], timeout=0)


def test_ping_reports_the_version_of_the_sources(native_agent):
    assert native_agent.client.ping() == expected_version()


def test_exec_collects_exit_code_and_both_streams(native_agent):
    r = native_agent.client.exec(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (r.exit_code, r.stdout, r.stderr) == (3, "out\n", "err\n")
    assert not r.ok and not r.timed_out and r.signal is None


def test_binary_output_keeps_exact_bytes_and_exit_code(native_agent):
    r = native_agent.client.exec(["sh", "-c", r"printf '\377\376\000abc\200'; exit 5"])
    assert r.exit_code == 5
    assert r.stdout_bytes == b"\xff\xfe\x00abc\x80"


def test_missing_command_is_a_127_result(native_agent):
    r = native_agent.client.exec(["no-such-command-xyz"])
    assert r.exit_code == 127
    assert "not found" in r.stderr


def test_not_executable_is_a_126_result(native_agent):
    script = native_agent.dir / "plain.txt"
    script.write_text("echo hi\n")
    r = native_agent.client.exec([str(script)])
    assert r.exit_code == 126


def test_stdin_is_delivered(native_agent):
    data = os.urandom(3 * 1024 * 1024)  # beyond the inline limit: sent from a thread
    r = native_agent.client.exec(["sha256sum"], stdin=data)
    import hashlib

    assert r.stdout.split()[0] == hashlib.sha256(data).hexdigest()
    assert native_agent.client.exec(["cat"], stdin=b"hello").stdout == "hello"


def test_unread_stdin_does_not_block(native_agent):
    r = native_agent.client.exec(["true"], stdin=b"x" * (4 * 1024 * 1024))
    assert r.exit_code == 0
    assert native_agent.client.exec(["echo", "next"]).stdout == "next\n"  # connection in step


def test_env_is_exact_when_given_and_home_is_filled_in(native_agent):
    r = native_agent.client.exec(["/usr/bin/env"], env=["A=1", "B=x=y"])
    assert sorted(r.stdout.splitlines()) == ["A=1", "B=x=y", "HOME=/root"]


def test_env_none_inherits_the_agents_environment(native_agent):
    r = native_agent.client.exec(["sh", "-c", "echo $PATH"])
    assert r.stdout.strip() == os.environ["PATH"]


def test_cwd(native_agent):
    assert native_agent.client.exec(["pwd"], cwd="/tmp").stdout == "/tmp\n"


def test_missing_cwd_is_an_exec_error(native_agent):
    with pytest.raises(ExecError, match="No such file"):
        native_agent.client.exec(["true"], cwd="/no/such/dir")
    assert native_agent.client.exec(["true"]).ok  # the pooled connection still works


def test_user_by_name_number_and_group(native_agent):
    c = native_agent.client
    assert c.exec(["id", "-u"], user="nobody").stdout.strip() == "65534"
    assert c.exec(["id", "-u"], user="65534").stdout.strip() == "65534"
    assert c.exec(["id", "-g"], user="nobody:0").stdout.strip() == "0"
    unknown = c.exec(["sh", "-c", "id -u; id -g; echo $HOME"], user="12345", env=["PATH=/bin"])
    assert unknown.stdout.split() == ["12345", "0", "/"]  # like runc: gid 0, HOME=/


def test_unknown_user_is_an_exec_error(native_agent):
    with pytest.raises(ExecError, match="unknown user"):
        native_agent.client.exec(["true"], user="no-such-user")
    with pytest.raises(ExecError, match="unknown group"):
        native_agent.client.exec(["true"], user="root:no-such-group")


def test_nul_bytes_are_rejected_before_sending(native_agent):
    with pytest.raises(ConfigError):
        native_agent.client.exec(["echo", "a\0b"])
    with pytest.raises(ConfigError):
        native_agent.client.exec(["true"], env=["A=\0"])
    with pytest.raises(ConfigError):
        native_agent.client.exec("echo hi")  # type: ignore[arg-type]


def test_timeout_kills_the_whole_tree_and_keeps_partial_output(native_agent):
    script = (
        "echo partial; sleep 31.01 & setsid sleep 31.02 & "
        "(setsid sh -c 'sleep 31.03') & sleep 31.04"
    )
    start = time.monotonic()
    r = native_agent.client.exec(["sh", "-c", script], timeout=2)
    assert time.monotonic() - start < 10
    assert r.timed_out and r.exit_code == 137 and r.signal == signal.SIGKILL
    assert r.stdout == "partial\n"
    assert not marked("sleep 31.0")


def test_sleep_with_timeout_returns_and_leaves_nothing(native_agent):
    start = time.monotonic()
    r = native_agent.client.exec(["sleep", "30.5"], timeout=2)
    assert time.monotonic() - start < 10
    assert r.timed_out
    assert not marked("sleep 30.5")


def test_huge_output_is_capped_flagged_and_drained(native_agent):
    # The handler reports its own peak memory: the flood must not be buffered.
    script = "head -c 200000000 /dev/zero; grep VmHWM /proc/$PPID/status >&2"
    r = native_agent.client.exec(["sh", "-c", script], max_output_bytes=1 << 20)
    assert r.exit_code == 0 and r.truncated
    assert len(r.stdout_bytes) == 1 << 20
    assert int(r.stderr.split()[1]) < 16 * 1024  # kB


def test_slow_consumer_backpressures_instead_of_buffering(native_agent):
    script = "head -c 30000000 /dev/zero; grep VmHWM /proc/$PPID/status >&2"
    total, err = 0, b""
    for item in native_agent.client.exec_stream(["sh", "-c", script]):
        if isinstance(item, OutputChunk) and item.stream == "stdout":
            total += len(item.data)
            time.sleep(0.0005)
        elif isinstance(item, OutputChunk):
            err += item.data
    assert total == 30_000_000
    assert int(err.split()[1]) < 16 * 1024  # kB: the handler queued ~1 MiB at most


def test_background_setsid_grandchild_does_not_hang(native_agent):
    start = time.monotonic()
    r = native_agent.client.exec(["sh", "-c", "setsid sleep 32.5 & echo started"], timeout=20)
    assert time.monotonic() - start < 10
    assert r.stdout == "started\n" and not r.timed_out
    assert marked("sleep 32.5")  # survives the command, like docker exec
    assert native_agent.client.exec(["echo", "again"]).stdout == "again\n"


def test_streaming_delivers_output_while_running_in_order(native_agent):
    flag = native_agent.dir / "go"
    script = f"echo a; echo b >&2; while [ ! -e {flag} ]; do sleep 0.01; done; echo c"
    items = []
    for item in native_agent.client.exec_stream(["sh", "-c", script], timeout=30):
        items.append(item)
        if isinstance(item, OutputChunk) and item.data == b"b\n":
            flag.touch()  # only possible if "a" and "b" arrived before the command ended
    chunks = [(i.stream, i.data) for i in items if isinstance(i, OutputChunk)]
    assert chunks == [("stdout", b"a\n"), ("stderr", b"b\n"), ("stdout", b"c\n")]
    assert isinstance(items[-1], ExecResult) and items[-1].exit_code == 0


def test_slow_stream_consumer_is_not_a_hung_agent(native_agent, monkeypatch):
    monkeypatch.setattr(client, "HUNG_MARGIN", 0.2)
    stream = native_agent.client.exec_stream(["sh", "-c", "echo a; echo b"], timeout=1)
    first = next(stream)
    time.sleep(1.5)  # past the deadline, but the answer is already buffered
    *chunks, result = [first, *stream]
    assert b"".join(c.data for c in chunks) == b"a\nb\n" and result.exit_code == 0


def test_closing_the_stream_early_kills_the_command(native_agent):
    stream = native_agent.client.exec_stream(["sh", "-c", "echo go; exec sleep 33.5"])
    assert next(stream).data == b"go\n"
    stream.close()
    assert not wait_gone(marked("sleep 33.5"))


def test_spawn_streams_stdin_and_output(native_agent):
    with native_agent.client.spawn(["cat"]) as proc:
        assert proc.pid > 0
        proc.write_stdin(b"ping\n")
        got = b""
        while got != b"ping\n":
            got += proc.read(timeout=5)
        proc.close_stdin()
        result = proc.wait(timeout=10)
    assert result is not None and result.exit_code == 0


def test_spawn_signal_and_kill(native_agent):
    proc = native_agent.client.spawn(["sleep", "34.5"])
    assert proc.wait(timeout=0.2) is None
    proc.kill(signal.SIGTERM)
    result = proc.wait(timeout=10)
    assert result is not None and result.exit_code == 143 and result.signal == signal.SIGTERM
    with pytest.raises(SandboxStateError):
        proc.write_stdin(b"x")
    proc.close()


def test_a_spawned_process_timeout_kills_its_tree_with_nobody_reading(native_agent):
    proc = native_agent.client.spawn(["sh", "-c", "sleep 37.5 & exec sleep 37.6"], timeout=1)
    assert wait_until(lambda: marked("sleep 37.5") and marked("sleep 37.6"), 0.9)
    time.sleep(1.5)  # nobody waits or reads meanwhile: the agent enforces it
    result = proc.wait(timeout=10)
    assert result is not None and result.timed_out and result.signal == signal.SIGKILL
    assert not wait_gone(marked("sleep 37.5")) and not wait_gone(marked("sleep 37.6"))
    proc.close()


def test_kill_works_while_stdin_is_blocked(native_agent):
    proc = native_agent.client.spawn(["sleep", "36.5"])  # never reads stdin
    writer = threading.Thread(target=lambda: _ignore_errors(proc.write_stdin, b"x" * (8 << 20)))
    writer.start()
    time.sleep(0.3)  # let the pipe, the agent and the socket fill up
    proc.kill()
    result = proc.wait(timeout=10)
    writer.join(timeout=10)
    assert result is not None and result.exit_code == 137
    assert not wait_gone(marked("sleep 36.5"))
    proc.close()


def _ignore_errors(fn, *args) -> None:
    try:
        fn(*args)
    except SandboxError:
        pass


def test_pty_close_stdin_sends_eof(native_agent):
    with native_agent.client.spawn(["cat"], pty=(24, 80)) as cat:
        cat.write_stdin(b"line\n")
        read_until(cat, b"line")
        cat.close_stdin()
        result = cat.wait(timeout=10)
    assert result is not None and result.exit_code == 0


def test_spawn_close_kills_the_tree(native_agent):
    proc = native_agent.client.spawn(["sh", "-c", "setsid sleep 35.5 & exec sleep 35.6"])
    deadline = time.monotonic() + 5
    while len(marked("sleep 35.")) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.close()
    assert not wait_gone(marked("sleep 35."))


def test_spawn_errors_are_exec_errors(native_agent):
    with pytest.raises(ExecError):
        native_agent.client.spawn(["true"], cwd="/no/such/dir")


def test_pty_runs_an_interactive_shell_and_resizes(native_agent):
    with native_agent.client.spawn(["sh", "-i"], pty=(24, 80), env=["PS1=$ ", "TERM=dumb"]) as sh:
        sh.write_stdin(b"stty size; echo $((6*7))\n")
        out = read_until(sh, b"42")
        assert b"24 80" in out
        sh.resize(50, 132)
        sh.write_stdin(b"stty size\n")
        assert b"50 132" in read_until(sh, b"50 132")
        sh.write_stdin(b"exit 4\n")
        result = sh.wait(timeout=10)
    assert result is not None and result.exit_code == 4


def test_concurrent_callers_run_in_parallel(native_agent):
    """Every command waits until all 16 are running: serial execution would time out."""
    n, barrier = 16, native_agent.dir / "barrier"
    barrier.mkdir()
    script = (
        f'touch {barrier}/$0; i=0; while [ "$(ls {barrier} | wc -l)" -lt {n} ]; do '
        "i=$((i+1)); [ $i -gt 2000 ] && exit 1; sleep 0.01; done"
    )
    results: list[ExecResult] = []

    def call(i: int) -> None:
        results.append(native_agent.client.exec(["sh", "-c", script, str(i)], timeout=60))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.exit_code for r in results] == [0] * n
    # The pool keeps at most pool_size connections; handlers of the others exit on EOF.
    deadline = time.monotonic() + 5
    while True:
        kids = [p for p, (ppid, _) in proc_table().items() if ppid == native_agent.pid]
        handlers = wait_gone(kids, timeout=0)
        if len(handlers) <= 8 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(handlers) <= 8


def _wakeups(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return sum(int(line.split()[1]) for line in f
                   if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")))


def test_idle_agent_does_not_wake(native_agent):
    """An idle sandbox's init must sleep: a periodic poll, multiplied by 1,000 sandboxes on
    ptrace, took more than the node's 2 cores (docs/scale.md, "Density")."""
    native_agent.client.ping()
    before = _wakeups(native_agent.pid)
    time.sleep(2.5)  # the old 0.5 s poll woke 5 times in this
    assert _wakeups(native_agent.pid) - before <= 1


def test_socket_deleted_by_user_code_is_recreated(native_agent):
    native_agent.client.exec(["rm", str(native_agent.socket)])
    deadline = time.monotonic() + 5
    while not native_agent.socket.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    fresh = native_agent.new_client()
    assert fresh.ping() == expected_version()
    fresh.close()


def test_killed_handler_raises_died_and_agent_keeps_serving(native_agent):
    with pytest.raises(SandboxDiedError):
        native_agent.client.exec(["sh", "-c", "kill -9 $PPID; sleep 5"], timeout=30)
    assert native_agent.client.exec(["echo", "alive"]).stdout == "alive\n"


def test_pooled_connection_to_a_dead_handler_is_skipped(native_agent):
    c = native_agent.client
    c.exec(["true"])
    handler = next(p for p in descendants(native_agent.pid))
    os.kill(handler, signal.SIGKILL)
    wait_gone([handler])
    assert c.exec(["echo", "ok"]).stdout == "ok\n"


def test_unreachable_socket_raises_died_quickly():
    client = AgentClient("/nonexistent-rsb-dir/agent.sock", sandbox_id="gone")
    with pytest.raises(SandboxDiedError) as info:
        client.ping()
    assert info.value.sandbox_id == "gone"


def test_closed_client_refuses_calls(native_agent):
    c = native_agent.new_client()
    c.close()
    with pytest.raises(SandboxStateError):
        c.exec(["true"])
