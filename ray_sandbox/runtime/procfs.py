"""The host's /proc and cgroup files: the one parser of ``/proc/PID/stat``, the cgroup
counters a sandbox's status is derived from, and the one cgroup write (a sandbox's CPU
bandwidth once it is booted). Cgroup paths come from the sandbox id, never from anything
the sandbox controls."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from .errors import SandboxCreationError

CGROUP_ROOT = Path("/sys/fs/cgroup")


class ProcStat(NamedTuple):
    comm: str
    state: str  # R, S, D, Z, ...
    start: int  # clock ticks after boot (field 22): tells a reused PID apart


def stat(pid: int) -> ProcStat | None:
    """``/proc/PID/stat`` of ``pid``, or None if it is gone. The command name may contain
    spaces and parentheses, so fields are counted from the last ``)``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
        close = raw.rindex(")")
        fields = raw[close + 2 :].split()
        return ProcStat(raw[raw.index("(") + 1 : close], fields[0], int(fields[19]))
    except (OSError, ValueError, IndexError):
        return None


def cgroup_dirs(sandbox_id: str) -> list[Path]:
    """The sandbox's cgroup directory under every controller that has one."""
    if not CGROUP_ROOT.is_dir():
        return []
    return [c / sandbox_id for c in CGROUP_ROOT.iterdir() if (c / sandbox_id).is_dir()]


def cgroup_counted(key: str, *files: Path) -> bool:
    """True if the first readable of ``files`` (a cgroup v1 path, then its v2 twin; v2 is not
    verified on this cgroup-v1 machine) has a ``key N`` line with N > 0."""
    for path in files:
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            k, _, v = line.partition(" ")
            if k == key and v.strip() not in ("", "0"):
                return True
    return False


def set_cpu_bandwidth(sandbox_id: str, *, period_us: int, quota_us: int, burst_us: int) -> None:
    """Set the CFS bandwidth of the cpu cgroup runsc made for the sandbox. In this order: the
    kernel checks each write against the values in place (burst <= quota)."""
    v1 = CGROUP_ROOT / "cpu" / sandbox_id
    if v1.is_dir():
        writes = [(v1 / "cpu.cfs_period_us", str(period_us)),
                  (v1 / "cpu.cfs_quota_us", str(quota_us)),
                  (v1 / "cpu.cfs_burst_us", str(burst_us))]
    else:  # cgroup v2 (not verified on this cgroup-v1 machine)
        v2 = CGROUP_ROOT / sandbox_id
        writes = [(v2 / "cpu.max", f"{quota_us} {period_us}"),
                  (v2 / "cpu.max.burst", str(burst_us))]
    try:
        for path, value in writes:
            path.write_text(value)
    except OSError as exc:
        raise SandboxCreationError(f"setting the sandbox's CPU limit failed: {exc}",
                                   sandbox_id=sandbox_id) from None


def oom_killed(sandbox_id: str) -> bool:
    """The kernel OOM-killed something in the sandbox's memory cgroup."""
    return cgroup_counted("oom_kill", CGROUP_ROOT / "memory" / sandbox_id / "memory.oom_control",
                          CGROUP_ROOT / sandbox_id / "memory.events")


def pids_exhausted(sandbox_id: str) -> bool:
    """A fork was refused by the sandbox's pids limit (``pids.events``: ``max N``)."""
    return cgroup_counted("max", CGROUP_ROOT / "pids" / sandbox_id / "pids.events",
                          CGROUP_ROOT / sandbox_id / "pids.events")


def memory_used(sandbox_id: str) -> int | None:
    """Bytes the sandbox's memory cgroup charges now (cgroup v1, then v2); None without one."""
    for path in (CGROUP_ROOT / "memory" / sandbox_id / "memory.usage_in_bytes",
                 CGROUP_ROOT / sandbox_id / "memory.current"):
        try:
            with open(path, "rb") as f:
                return int(f.read(64).strip() or 0)
        except (OSError, ValueError):
            continue
    return None


def is_running(pid: int, start: int | None) -> bool:
    """Whether ``pid`` still names the process that started at ``start`` ticks. A zombie
    counts as gone: its parent (e.g. a subreaper that does not collect it) may never reap."""
    st = stat(pid)
    return st is not None and st.start == start and st.state != "Z"


def cmdlines() -> Iterator[tuple[int, list[bytes]]]:
    """``(pid, argv)`` of every process of the node that can still be read (one that exits
    meanwhile is skipped): the one scan of /proc's command lines, for the reaper's and the
    tests' searches alike."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        yield int(entry.name), raw.rstrip(b"\0").split(b"\0")
