"""The keeper's wait for its creator's death (runtime/keeper.py)."""

from __future__ import annotations

import subprocess
import threading

from ray_sandbox.runtime import keeper, procfs


def _waiter(pid: int, start: int) -> threading.Thread:
    t = threading.Thread(target=keeper.wait_for_death, args=(pid, start), daemon=True)
    t.start()
    return t


def test_waits_while_the_process_lives_and_returns_when_it_exits():
    p = subprocess.Popen(["sleep", "30"])
    try:
        t = _waiter(p.pid, procfs.stat(p.pid).start)
        t.join(0.5)
        assert t.is_alive()
        p.kill()
        p.wait()
        t.join(10)  # a hang guard
        assert not t.is_alive()
    finally:
        p.kill()


def test_a_reused_pid_counts_as_dead():
    p = subprocess.Popen(["sleep", "30"])
    try:
        t = _waiter(p.pid, procfs.stat(p.pid).start + 1)  # another process's start time
        t.join(10)
        assert not t.is_alive()
    finally:
        p.kill()
        p.wait()


def test_a_gone_process_returns_at_once():
    p = subprocess.Popen(["true"])
    p.wait()
    t = _waiter(p.pid, 0)
    t.join(10)
    assert not t.is_alive()
