"""Helper processes of a sandbox's network (slirp4netns, the DNS helper): recorded by PID and
start time so a later process stops exactly these and never a recycled PID."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from subprocess import Popen

from pydantic import BaseModel

from .. import _proc, procfs
from .dns import MODULE
from .settings import PREFIX

_TAG_IN_ARG = re.compile(rf"(?:^|/)({PREFIX}-[0-9a-f]{{12}})$")
_popens: dict[int, Popen[bytes]] = {}  # children of this process, so stopping them also reaps them


class ProcRef(BaseModel):
    pid: int
    start: int  # clock ticks after boot (/proc/PID/stat field 22)
    what: str


def _stat(pid: int) -> tuple[str, int] | None:
    st = procfs.stat(pid)
    return None if st is None else (st.state, st.start)


def track(proc: Popen[bytes], what: str) -> ProcRef:
    _popens[proc.pid] = proc
    st = _stat(proc.pid)
    return ProcRef(pid=proc.pid, start=st[1] if st else 0, what=what)


def alive(ref: ProcRef) -> bool:
    st = _stat(ref.pid)
    return st is not None and st[1] == ref.start and st[0] != "Z"


def stop(ref: ProcRef, grace: float = 2.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds; reap it if it is our child."""
    proc = _popens.pop(ref.pid, None)
    if alive(ref):
        _signal(ref.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while alive(ref) and time.monotonic() < deadline:
            time.sleep(0.005)
        if alive(ref):
            _signal(ref.pid, signal.SIGKILL)
    if proc is not None:
        proc.wait()
        _proc.forget(proc)


def signal_if_alive(ref: ProcRef, sig: int) -> None:
    if alive(ref):
        _signal(ref.pid, sig)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def ours() -> dict[int, str]:
    """PID -> tag of every running slirp4netns / DNS helper this package started."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if not argv or not (argv[0].endswith("slirp4netns") or MODULE in argv):
            continue
        st = _stat(int(entry.name))
        if st is None or st[0] == "Z":
            continue
        for arg in argv:
            if m := _TAG_IN_ARG.search(arg):
                found[int(entry.name)] = m.group(1)
                break
    return found


def kill_tagged(pid: int) -> None:
    """Stop a process found by :func:`ours` (used by gc; it is not our child)."""
    st = _stat(pid)
    if st is not None:
        stop(ProcRef(pid=pid, start=st[1], what="leftover"))
