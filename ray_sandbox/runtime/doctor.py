"""What this node can and cannot do for sandboxes, checked rather than assumed."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from pydantic import BaseModel

from . import disk
from .config import node_pid_max, node_pids_limit
from .errors import SandboxError
from .runsc import TARGET_VERSION, Runsc


class Check(BaseModel):
    name: str
    ok: bool
    detail: str


class Report(BaseModel):
    checks: list[Check]
    not_enforced: list[str]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)


def _tool(name: str, why: str) -> Check:
    path = shutil.which(name)
    return Check(name=name, ok=path is not None, detail=path or f"missing ({why})")


def diagnose() -> Report:
    checks: list[Check] = []
    not_enforced: list[str] = []
    try:
        v = Runsc(Path("/nonexistent")).version
        ok = v.version.startswith(TARGET_VERSION)
        detail = f"{v.version}" + ("" if ok else f" (target {TARGET_VERSION}: "
                                   + "; ".join(v.limitations()) + ")")
        checks.append(Check(name="runsc", ok=ok, detail=detail))
    except SandboxError as exc:
        checks.append(Check(name="runsc", ok=False, detail=str(exc)))
    for name, why in [
        ("umoci", "unpacking images"), ("skopeo", "pulling images"),
        ("slirp4netns", "network='public'"), ("nft", "egress policy"), ("ip", "network modes"),
        ("mmdebstrap", "building the default python image"),
    ]:
        checks.append(_tool(name, why))
    agent = Path(__file__).resolve().parent / "agent" / "rsb-agent"
    built = agent.is_file()
    checks.append(Check(name="agent", ok=built,
                        detail=str(agent) if built else "not built: run scripts/setup.sh"))
    v1 = Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists()
    v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    cg = "v1" if v1 else "v2" if v2 else None
    checks.append(Check(name="cgroups", ok=cg is not None,
                        detail=f"cgroup {cg}: memory and CPU limits enforced" if cg
                        else "no cgroup controllers: limits not enforced"))
    if os.geteuid() != 0:
        not_enforced.append("not root: sandboxes run rootless without cgroups (no memory/CPU "
                            "limits), network='sandbox' unavailable")
    if cg is None:
        not_enforced.append("memory and CPU limits (no cgroup controllers)")
    # Optional (only disk= needs it), so its absence is reported, not counted as a failure.
    disk_missing = disk.unavailable()
    if disk_missing is None:
        mkfs = shutil.which("mkfs.ext4")
        checks.append(Check(name="disk", ok=True,
                            detail=f"disk= enforced: loop devices + ext4 ({mkfs})"))
    else:
        not_enforced.append(f"disk=: {disk_missing}; creating a sandbox with disk= fails")
    kvm = "kvm-pvm" if _nested_pvm() else ("present" if Path("/dev/kvm").exists() else "absent")
    checks.append(Check(name="platform", ok=True,
                        detail=f"ptrace (default), systrap available; KVM {kvm} — not used"))
    if _has_pids_controller():
        checks.append(Check(name="pids", ok=True, detail=(
            f"pids_limit enforced; 'auto' (the default) is {node_pids_limit()} per sandbox "
            f"here: half of pid_max {node_pid_max()} over RAY_SANDBOX_PLANNED_DENSITY sandboxes")))
    else:
        not_enforced.append("pids_limit: no pids cgroup controller (fork bombs are bounded "
                            "only by memory)")
    return Report(checks=checks, not_enforced=not_enforced)


def _has_pids_controller() -> bool:
    root = Path("/sys/fs/cgroup")
    if (root / "pids").is_dir():  # cgroup v1
        return True
    try:
        return "pids" in (root / "cgroup.controllers").read_text().split()
    except OSError:
        return False


def _nested_pvm() -> bool:
    try:
        return "kvm_pvm" in Path("/proc/modules").read_text()
    except OSError:
        return False
