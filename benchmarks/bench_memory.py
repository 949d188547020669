"""Host memory a sandbox keeps per process it ran (gVisor's sentry; docs/runtime.md, "Limits").

    .venv/bin/python -m benchmarks.bench_memory [--n 200]

Rows (busybox, memory=256Mi so nothing is OOM-killed, ptrace and systrap): the sandbox's
memory cgroup usage before, after ``n`` execs through our agent, after ``n`` ``runsc exec``
(no agent: the baseline), and after ``n`` fork+exec by a shell loop inside one exec, with
the KiB it grew per process. Not a speed figure: memory, so the load does not matter.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks._harness import emit
from ray_sandbox.runtime import SandboxRuntime


def _mib(sid: str) -> float:
    return int(Path(f"/sys/fs/cgroup/memory/{sid}/memory.usage_in_bytes").read_text()) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    n = ap.parse_args().n
    rows = []
    loop = f"i=0; while [ $i -lt {n} ]; do /bin/true; i=$((i+1)); done"
    ways = {
        "agent exec": lambda sid: [rt.exec(sid, ["/bin/true"]) for _ in range(n)],
        "runsc exec (baseline)": lambda sid: [
            rt.runsc.exec(sid, ["/bin/true"], timeout=30) for _ in range(n)],
        "fork+exec in one sh": lambda sid: rt.exec(sid, ["sh", "-c", loop],
                                                   timeout=300),
    }
    with tempfile.TemporaryDirectory(prefix="rsb-bench-mem-") as tmp, \
            SandboxRuntime(Path(tmp) / "home") as rt:
        for platform in ("ptrace", "systrap"):
            sid = rt.create(image="ray-sandbox/busybox", cpu=1, memory="256Mi",
                            platform=platform)
            for label, run in ways.items():
                before = _mib(sid)
                run(sid)
                after = _mib(sid)
                rows.append({"label": f"{label} ({platform})", "processes": n,
                             "before_mib": round(before, 1), "after_mib": round(after, 1),
                             "kib_per_process": round((after - before) * 1024 / n, 1)})
            rt.delete(sid)
    emit("memory", rows, notes="memory cgroup usage of one sandbox, runsc as installed")


if __name__ == "__main__":
    main()
