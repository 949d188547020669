"""Make this process a child subreaper and reap the runsc processes orphaned to it.

``runsc run --detach`` leaves the sandbox and gofer processes orphaned. Re-parented to the VM's
PID 1 they are reaped only every ~2 s, and ``runsc delete``/``kill``/``wait`` poll until the
zombie is gone, so each takes ~1.7 s (PLATFORM §9.1). As a subreaper we inherit them and reap
them at once. Processes started through :mod:`._proc` are left to their Popen, and children
this process started by other means are left alone.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time

from . import _proc, procfs

_PR_SET_CHILD_SUBREAPER = 36
_REAPABLE_COMM = frozenset({"exe", "runsc", "runsc-sandbox", "runsc-gofer", "slirp4netns", "pasta"})

_started = False
_lock = threading.Lock()


def ensure() -> None:
    """Idempotently turn on subreaping for this process."""
    global _started
    with _lock:
        if _started:
            return
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
        threading.Thread(target=_loop, name="ray-sandbox-subreaper", daemon=True).start()
        _started = True


def _children() -> list[int]:
    pids: list[int] = []
    try:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/children") as f:
                    pids += [int(p) for p in f.read().split()]
            except OSError:
                continue
    except OSError:
        pass
    return pids


def _zombie_comm(pid: int) -> str | None:
    st = procfs.stat(pid)
    return st.comm if st is not None and st.state == "Z" else None


def reap_orphans() -> int:
    """Reap exited runsc orphans now; returns how many were reaped."""
    n = 0
    for pid in _children():
        if _proc.is_own_child(pid):
            continue
        if _zombie_comm(pid) in _REAPABLE_COMM:
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    n += 1
            except ChildProcessError:
                pass
    return n


def _loop() -> None:
    while True:
        try:
            # Blocks until some child has exited, without collecting it.
            os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            time.sleep(0.05)  # no children at all yet
            continue
        except InterruptedError:
            continue
        if reap_orphans() == 0:
            # The exited child belongs to a Popen (or someone else); let its owner collect it.
            time.sleep(0.02)
