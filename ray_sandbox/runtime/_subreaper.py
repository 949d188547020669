"""Make this process a child subreaper and reap the runsc processes orphaned to it.

``runsc run --detach`` leaves the sandbox and gofer processes orphaned. Re-parented to the VM's
PID 1 they are reaped only every ~2 s, and ``runsc delete``/``kill``/``wait`` poll until the
zombie is gone, so each takes ~1.5 s (docs/platform.md, "Orphaned runsc processes"). As a
subreaper we inherit them and reap them at once. Processes started through :mod:`._proc` are
left to their Popen; any other exited child whose name is a runsc or helper name
(``_REAPABLE_COMM``) is reaped, even one this process started itself, so those are started only
through :mod:`._proc` (a plain ``subprocess.run`` of runsc may then see exit code 0). Other
children are left alone.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from . import _proc, procfs

_PR_SET_CHILD_SUBREAPER = 36
_LOOK_PAST_S = 1.0  # how long an exited child we may not reap can hide the others
# runsc's processes, the network helpers, and the DNS helper (network/dns.py names itself)
_REAPABLE_COMM = frozenset({"exe", "runsc", "runsc-sandbox", "runsc-gofer", "slirp4netns", "pasta",
                            "rsb-dns"})

_started = False
_lock = threading.Lock()


def ensure() -> None:
    """Idempotently turn on subreaping for this process."""
    global _started
    with _lock:
        if _started:
            return
        _set(True)
        threading.Thread(target=_loop, name="ray-sandbox-subreaper", daemon=True).start()
        _started = True


def _set(on: bool) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


@contextmanager
def paused() -> Iterator[None]:
    """Not a subreaper meanwhile: a process orphaned now goes to init (or a subreaper above
    us), so that it outlives this process's own exit (the runtime's keeper)."""
    with _lock:
        _set(False)
        try:
            yield
        finally:
            _set(_started)


def _children() -> list[int]:
    """Children that may be orphans we adopted. The kernel gives an orphan to the first live
    thread of the subreaper, its main thread while that runs: reading that one thread's list
    is enough, where reading every thread's cost a Ray host (max_concurrency 1024 threads)
    ~30 ms per scan. Should the main thread have exited, every thread is read."""
    me = os.getpid()
    st = procfs.stat(me)
    tids = [str(me)] if st is not None and st.state != "Z" else _tids()
    pids: list[int] = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:
            continue
    return pids


def _tids() -> list[str]:
    try:
        return os.listdir("/proc/self/task")
    except OSError:
        return []


def _zombie_comm(pid: int) -> str | None:
    st = procfs.stat(pid)
    return st.comm if st is not None and st.state == "Z" else None


def reap_orphans() -> int:
    """Reap exited runsc orphans now; returns how many were reaped."""
    return sum(_reap_one(pid) for pid in _children())


def _reap_one(pid: int) -> bool:
    """Reap ``pid`` if it is an exited runsc orphan; whether it was."""
    if _proc.is_own_child(pid) or _zombie_comm(pid) not in _REAPABLE_COMM:
        return False
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:
        return False


def _loop() -> None:
    # waitid names one exited child; reaping just that one keeps an exit O(1). Scanning every
    # child on each exit cost O(sandboxes) /proc reads: with 1,000 sandboxes (2,000 adopted
    # runsc processes) and a few subprocesses per create, that alone kept a core busy.
    blocked, since = 0, 0.0
    while True:
        try:
            # Blocks until some child has exited, without collecting it.
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            time.sleep(0.05)  # no children at all yet
            continue
        except InterruptedError:
            continue
        pid = info.si_pid if info is not None else 0
        if pid and _reap_one(pid):
            continue
        if pid and not _proc.is_own_child(pid):
            # Not ours to reap and no Popen of ours will collect it: it stays first in line
            # for good, so exits behind it are found by scanning, as before the fast path.
            reap_orphans()
            time.sleep(0.02)
            continue
        # A Popen's child, which its owner collects in a moment; should it stay first in
        # line (an owner that never waits), look past it once a second.
        now = time.monotonic()
        if pid != blocked:
            blocked, since = pid, now
        elif now - since >= _LOOK_PAST_S:
            reap_orphans()
            since = now
        time.sleep(0.002)
