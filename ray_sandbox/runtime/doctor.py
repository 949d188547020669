"""What this node can and cannot do for sandboxes, checked rather than assumed."""

from __future__ import annotations

import os
import resource
import shutil
from pathlib import Path
from typing import NamedTuple

from pydantic import BaseModel

from . import disk, paths, reaper
from .config import node_pid_max, node_pids_limit
from .errors import SandboxError
from .images import ImageStore
from .images.pins import GRACE_S
from .procfs import CGROUP_ROOT
from .runsc import TARGET_VERSION, Runsc


class Check(BaseModel):
    name: str
    ok: bool
    detail: str


# --- the node's sandbox ceiling --------------------------------------------------------------


class SandboxCost(NamedTuple):
    """What one idle sandbox made through ``ray_sandbox.create()`` holds on its node."""

    tasks: float  # host tasks (threads), each one a PID and one of kernel.threads-max
    memory: int  # bytes of MemAvailable it takes
    files: int  # open files node-wide (fs.file-max)
    mounts: int  # mounts in the host's mount namespace (fs.mount-max)
    host_fds: int  # fds the node's host actor keeps open for it (its RLIMIT_NOFILE)


# Measured on this project's VM (2 vCPU, 24 GiB, kernel 6.18, runsc 0.0~20240729 ptrace,
# cgroup v1) on 2026-12-02 with 200 idle busybox sandboxes at once, each made by
# ``ray_sandbox.create(image="ray-sandbox/busybox", cpu=0.1, memory="32Mi")`` (network none,
# writable root on the default disk="4Gi") and answering exec; rounded up.
# ``python -m benchmarks.bench_scale --only density-ray`` measures them again (docs/scale.md,
# "Density").
#
# - tasks 56 (52.9 measured with 200 sandboxes, 55.0 with 20; + 1): the threads of every
#   process under the sandbox's runsc-sandbox and runsc-gofer (/proc/PID/status ``Threads``),
#   the ptrace platform's 4 stub processes included (the runsc processes' own ~30 threads are
#   only half of it), plus the one kernel thread the disk= ext4 mount adds
#   (``kworker/R-ext4-rsv-conversion``, its rescuer). Each task is a PID and one of
#   kernel.threads-max: a stock pid_max of 32768 stops a node at ~580 sandboxes, threads-max
#   (RAM / 128 KiB by default) at ~3,400 on 24 GiB.
# - memory 16 MiB (15.3 measured): the MemAvailable drop per sandbox, the runsc processes'
#   PSS (12.7 MiB, stubs included) plus the kernel's part: thread stacks 0.8, page tables 0.5,
#   unreclaimable slab 1.2 MiB. System-wide, so other tenants' load is in it.
# - files 100 (94.8 measured): fs/file-nr delta; the runsc processes' fd tables are ~90.
# - mounts 3 (3.03 measured): the overlay root, the disk= ext4 and a 256k tmpfs ``run``.
# - host_fds 1: the agent connection the host actor keeps per sandbox.
#
# Not counted: vm.max_map_count is per process (an idle sentry maps ~35 areas) and caps no
# sandbox count; the per-sandbox ``pids_limit`` caps one sandbox, not how many fit.
IDLE_SANDBOX = SandboxCost(tasks=56, memory=16 * 2**20, files=100, mounts=3, host_fds=1)
# fds the host actor holds before its first sandbox (Ray's own sockets, logs, pipes)
HOST_BASE_FDS = 128
# Above this a cgroup memory limit or a RLIMIT is "unlimited".
_UNLIMITED = 2**62


class NodeLimits(BaseModel):
    """The node-wide limits an idle sandbox uses up, and how much of each is in use now."""

    pid_max: int
    threads_max: int
    tasks: int  # tasks on the node now (threads included; /proc/loadavg)
    mem_available: int
    file_max: int
    files: int  # allocated file handles (fs/file-nr)
    mount_max: int
    mounts: int  # mounts in our mount namespace
    host_nofile: int  # the RLIMIT_NOFILE a Ray worker (the host actor) gets here
    cgroup_pids_max: int | None = None  # limits of the cgroup above the sandboxes' cgroups
    cgroup_pids: int = 0
    cgroup_memory_max: int | None = None
    cgroup_memory: int = 0
    nproc: int | None = None  # RLIMIT_NPROC when not root (root is exempt)
    nproc_used: int = 0


class Limit(BaseModel):
    name: str
    value: int  # the limit
    used: int  # in use now
    per_sandbox: float
    room: int  # idle sandboxes it leaves room for
    unit: str = ""  # "bytes" for memory limits

    def describe(self) -> str:
        if self.unit == "bytes":
            free = f"{_gib(self.value - self.used)} free"
            each = f"{self.per_sandbox / 2**20:g} MiB"
        else:
            free = f"{self.value:,}, {self.used:,} in use"
            each = f"{self.per_sandbox:g}"
        return f"{self.name}: {free}, {each} per sandbox → {self.room:,}"


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


class Ceiling(BaseModel):
    """How many more idle sandboxes this node can hold, and which limit sets that."""

    sandboxes: int
    limit: str
    limits: list[Limit]  # every limit considered, tightest first

    def summary(self) -> str:
        nxt = f"; next: {self.limits[1].describe()}" if len(self.limits) > 1 else ""
        return (f"room for {self.sandboxes:,} more idle sandboxes, set by "
                f"{self.limits[0].describe()}{nxt}")


# Linux keeps PIDs below 300 for the kernel's own threads once pid_max wraps (RESERVED_PIDS).
_RESERVED_PIDS = 300


def ceiling(node: NodeLimits, cost: SandboxCost = IDLE_SANDBOX) -> Ceiling:
    """The sandbox ceiling of ``node`` for sandboxes costing ``cost`` each: pure arithmetic,
    each limit's free amount over what one sandbox uses of it, the smallest wins."""
    b = "bytes"
    rows = [
        ("kernel.pid_max", node.pid_max - _RESERVED_PIDS, node.tasks, cost.tasks, ""),
        ("kernel.threads-max", node.threads_max, node.tasks, cost.tasks, ""),
        ("MemAvailable", node.mem_available, 0, cost.memory, b),
        ("fs.file-max", node.file_max, node.files, cost.files, ""),
        ("fs.mount-max", node.mount_max, node.mounts, cost.mounts, ""),
        ("host actor RLIMIT_NOFILE", node.host_nofile, HOST_BASE_FDS, cost.host_fds, ""),
    ]
    if node.cgroup_pids_max is not None:
        rows.append(("cgroup pids.max", node.cgroup_pids_max, node.cgroup_pids, cost.tasks, ""))
    if node.cgroup_memory_max is not None:
        rows.append(("cgroup memory limit", node.cgroup_memory_max, node.cgroup_memory,
                     cost.memory, b))
    if node.nproc is not None:
        rows.append(("RLIMIT_NPROC", node.nproc, node.nproc_used, cost.tasks, ""))
    limits = [Limit(name=n, value=v, used=u, per_sandbox=c, unit=unit,
                    room=max(0, int((v - u) // c)) if c > 0 else _UNLIMITED)
              for n, v, u, c, unit in rows]
    limits.sort(key=lambda lim: lim.room)
    return Ceiling(sandboxes=limits[0].room, limit=limits[0].name, limits=limits)


def node_limits() -> NodeLimits:
    """This node's values of the limits :func:`ceiling` weighs."""
    meminfo = _meminfo()
    file_nr = _ints("/proc/sys/fs/file-nr")
    soft, hard = (_UNLIMITED if x == resource.RLIM_INFINITY else x
                  for x in resource.getrlimit(resource.RLIMIT_NOFILE))
    # ray.init and ray start raise the soft limit to min(hard, 65536); workers inherit it
    host_nofile = max(soft, min(hard, 65536))
    node = NodeLimits(
        pid_max=node_pid_max(),
        threads_max=_int("/proc/sys/kernel/threads-max", 2**30),
        tasks=_loadavg_tasks(),
        mem_available=meminfo.get("MemAvailable", 0),
        file_max=min(_int("/proc/sys/fs/file-max", _UNLIMITED), _UNLIMITED),
        files=file_nr[0] if file_nr else 0,
        mount_max=_int("/proc/sys/fs/mount-max", 100_000),
        mounts=_lines("/proc/self/mountinfo"),
        host_nofile=host_nofile,
    )
    # runsc puts each sandbox's cgroup at the top of the hierarchy we see: a limit there (a
    # container's own cgroup under cgroup namespaces) caps all sandboxes together. The host's
    # real root has no such files.
    v2 = (CGROUP_ROOT / "cgroup.controllers").exists()
    pids_dir = CGROUP_ROOT if v2 else CGROUP_ROOT / "pids"
    pids_max = _cg_limit(pids_dir / "pids.max")
    if pids_max is not None:
        node.cgroup_pids_max = pids_max
        node.cgroup_pids = _int(str(pids_dir / "pids.current"), 0)
    mem_max = _cg_limit(CGROUP_ROOT / "memory.max" if v2
                        else CGROUP_ROOT / "memory" / "memory.limit_in_bytes")
    if mem_max is not None:
        node.cgroup_memory_max = mem_max
        node.cgroup_memory = _int(str(CGROUP_ROOT / "memory.current" if v2 else
                                      CGROUP_ROOT / "memory" / "memory.usage_in_bytes"), 0)
    if os.geteuid() != 0:
        nproc, _ = resource.getrlimit(resource.RLIMIT_NPROC)
        if nproc != resource.RLIM_INFINITY:
            node.nproc = nproc
            node.nproc_used = _user_tasks(os.geteuid())
    return node


class RunscUsage(NamedTuple):
    """What the runsc processes of one ``--root`` hold now, their descendants included."""

    processes: int  # runsc-sandbox and runsc-gofer (and any runsc command still running)
    tasks: int  # threads of those processes and every descendant (the ptrace stubs)
    pss: int  # bytes, summed over the same processes


def runsc_usage(runsc_root: Path) -> RunscUsage:
    """Measure the host tasks and PSS of every runsc process started with
    ``--root=<runsc_root>`` and of their descendants, from /proc: how the ``tasks`` and PSS
    figures behind :data:`IDLE_SANDBOX` are taken (``benchmarks/bench_scale.py``,
    ``tests/test_density.py``). Kernel threads (the disk's ext4 rescuer) are not in it."""
    marker = f"\0--root={runsc_root}\0".encode()  # a whole argument, not a prefix
    parent: dict[int, int] = {}
    threads: dict[int, int] = {}
    roots: set[int] = set()
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        pid = int(p.name)
        try:
            status = (p / "status").read_text()
            if marker in b"\0" + (p / "cmdline").read_bytes():
                roots.add(pid)
        except OSError:
            continue  # exited while we looked
        for line in status.splitlines():
            key, _, value = line.partition(":")
            if key == "PPid":
                parent[pid] = int(value)
            elif key == "Threads":
                threads[pid] = int(value)
    ours = set()
    for pid in parent:
        up, hops = pid, 0
        while up > 1 and hops < 64:
            if up in roots:
                ours.add(pid)
                break
            up, hops = parent.get(up, 0), hops + 1
    pss = 0
    for pid in ours:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
                        break
        except (OSError, ValueError):
            continue
    return RunscUsage(len(roots), sum(threads.get(p, 0) for p in ours), pss)


def _int(path: str, default: int) -> int:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def _ints(path: str) -> list[int]:
    try:
        with open(path) as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def _lines(path: str) -> int:
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except (OSError, ValueError):
        pass
    return out


def _loadavg_tasks() -> int:
    """Tasks (processes and threads) on the node: ``/proc/loadavg``'s ``running/total``."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[1])
    except (OSError, ValueError, IndexError):
        return 0


def _cg_limit(path: Path) -> int | None:
    """A cgroup limit file's value, None if absent or unlimited (``max`` or ~2**63)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _UNLIMITED else value


def _user_tasks(uid: int) -> int:
    n = 0
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if p.stat().st_uid == uid:
                    n += len(os.listdir(p / "task"))
            except OSError:
                continue
    return n


class Report(BaseModel):
    checks: list[Check]
    not_enforced: list[str]
    ceiling: Ceiling | None = None

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
    ceil = ceiling(node_limits())
    checks.append(Check(name="ceiling", ok=ceil.sandboxes > 0, detail=ceil.summary()))
    if (pins := image_pins()) is not None:
        checks.append(pins)
    return Report(checks=checks, not_enforced=not_enforced, ceiling=ceil)


def image_pins(home: Path | None = None, root: Path | None = None) -> Check | None:
    """Pins in the node's image store (``root``, default ``paths.images()``) that keep images
    for sandboxes no home has any more (``ray-sandbox gc`` removes them), and old pins that
    name no home; None without a store."""
    home = home or paths.home()
    root = root or paths.images(home)
    if not (root / "sha256").is_dir():
        return None
    store = ImageStore(root)
    pins = store.pin_list()
    stale = reaper.stale_pins(store, home)
    unknown = [p for p in reaper.stale_pins(store, home, unknown=True) if p not in stale]
    detail = (f"{len(pins)} pin(s) in {root}; " + (
        f"stale: {len(stale)}, of sandboxes that no home has any more, keeping "
        f"{len({p.digest for p in stale})} image(s) from eviction and removal "
        "(`ray-sandbox gc` removes them)" if stale else "none stale"))
    if unknown:
        detail += (f"; {len(unknown)} older than {GRACE_S:g}s name no home (written by an "
                   "older version) and are kept: `ray-sandbox gc --unknown-pins` removes them "
                   "once no runtime of that version uses this store")
    return Check(name="image pins", ok=not stale, detail=detail)


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
