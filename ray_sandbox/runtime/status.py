"""A sandbox's state, derived from what runsc reports and the kernel's cgroup counters,
never from bookkeeping: a sandbox that died is seen as dead, with the reason."""

from __future__ import annotations

from . import procfs
from .records import SandboxRecord
from .results import SandboxState


def derive(rec: SandboxRecord, runsc_status: str | None) -> tuple[SandboxState, str | None]:
    """The state and reason of a sandbox whose runsc container is ``runsc_status`` (None:
    runsc has no such container)."""
    if rec.phase == "suspended":  # in place, its container gone (suspension.py)
        return SandboxState.SUSPENDED, None
    if runsc_status is None:
        if rec.phase == "creating":
            return SandboxState.PENDING, None
        return SandboxState.ERROR, "ContainerMissing"
    if runsc_status in ("creating", "created"):
        return SandboxState.PENDING, None
    if runsc_status == "running":
        return SandboxState.RUNNING, None
    if runsc_status == "paused":
        return SandboxState.PAUSED, None
    if procfs.oom_killed(rec.sandbox_id):
        return SandboxState.ERROR, "OOMKilled"
    if procfs.pids_exhausted(rec.sandbox_id):
        return SandboxState.ERROR, "PidsLimit"
    return SandboxState.ERROR, "SandboxExited"
