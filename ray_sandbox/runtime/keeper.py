"""Sandboxes that die with the process that made them, at once and however it dies.

A runtime's sandboxes outlive its process until something runs gc (the next runtime in the
home, a restarted Ray host, ``ray-sandbox gc``). That suits sandboxes a caller holds: the
caller deletes them, or its own death is noticed. Sandboxes only the process itself knows
of (a Ray host's stock) must go with it, also when it is SIGKILLed with its Ray cluster and
no gc follows. :func:`start` starts one keeper process that waits on a pidfd of its creator
and then deletes the creator's sandboxes that carry the given labels.

The keeper is nobody's child: Ray kills the direct children of a worker that exits
(``RAY_kill_child_processes_on_worker_exit``, on by default), which is exactly when the
keeper has its work to do. So it is started through ``setsid --fork`` while this process is
not a subreaper, and is adopted by init. It imports only the standard library and
``procfs`` while it waits (the creator's whole life): the runtime's modules (~40 MB) are
loaded after the death, to delete.
"""

from __future__ import annotations

import argparse
import os
import select
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from . import _proc, _subreaper, procfs

_START_TIMEOUT_S = 10.0  # setsid forks and returns at once


def start(home: Path, labels: Mapping[str, str]) -> None:
    """Start the keeper of this process's sandboxes in ``home`` labelled ``labels``."""
    me = procfs.stat(os.getpid())
    argv = ["setsid", "--fork", sys.executable, "-m", __name__, "--home", str(home),
            "--pid", str(os.getpid()), "--start", str(me.start if me else 0)]
    for k, v in labels.items():
        argv += ["--label", f"{k}={v}"]
    with _subreaper.paused():  # setsid's child is orphaned as setsid returns: init adopts it
        _proc.run(argv, timeout=_START_TIMEOUT_S, stdout=subprocess.DEVNULL, stderr=None,
                  what="starting the sandbox keeper")


def wait_for_death(pid: int, start: int) -> None:
    """Return once process ``pid`` (started at ``start`` ticks) has exited."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        if not procfs.is_running(pid, start):  # the pid was reused or it is a zombie
            return
        poll = select.poll()
        poll.register(fd, select.POLLIN)
        # No timeout: this process exists to wait for exactly this one event.
        while not poll.poll():
            pass
    finally:
        os.close(fd)


def reap(home: Path, pid: int, start: int, labels: Mapping[str, str]) -> list[str]:
    """Delete the sandboxes in ``home`` made by the dead process ``pid``/``start`` whose
    labels match; their ids. All are stopped first, then torn down in the background (the
    interpreter waits for that at exit)."""
    from .sandbox import SandboxRuntime  # late on purpose: see the module docstring

    rt = SandboxRuntime(home, reap=False)
    gone = []
    for sid in rt.list(all=True, labels=labels):
        rec = rt.records.read(sid)
        if rec is not None and (rec.owner_pid, rec.owner_start) == (pid, start):
            rt.delete(sid)
            gone.append(sid)
    return gone


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ray_sandbox.runtime.keeper")
    p.add_argument("--home", type=Path, required=True)
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--start", type=int, required=True)
    p.add_argument("--label", action="append", default=[], help="k=v, all must match")
    args = p.parse_args(argv)
    labels = dict(item.split("=", 1) for item in args.label)
    wait_for_death(args.pid, args.start)
    gone = reap(args.home, args.pid, args.start, labels)
    if gone:
        print(f"ray_sandbox keeper: process {args.pid} died; deleting {len(gone)} of its "
              f"sandboxes labelled {labels}", file=sys.stderr)


if __name__ == "__main__":
    main()
