"""A sandbox's CPU share (docs/runtime.md, "CPU"): runsc boots it on at least one core, then
the host narrows its cgroup to the share with a burst of one quota. A CPU-bound loop still
gets no more than its share over 10 s. Real runsc, real cgroups."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ray_sandbox.runtime.bundle import CPU_PERIOD_US
from tests.fx_hostile import heavy

CGROUP = Path("/sys/fs/cgroup")
WINDOW_S = 10.0


def _bandwidth(sid: str) -> tuple[int, ...]:
    """(period, quota, burst) of the sandbox's cpu cgroup, in µs."""
    return tuple(int((CGROUP / "cpu" / sid / f"cpu.cfs_{name}_us").read_text())
                 for name in ("period", "quota", "burst"))


def test_boot_runs_on_one_core_then_the_cgroup_carries_the_share(runtime):
    sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi", cpu=0.1)
    try:
        spec = json.loads((runtime.sandboxes_dir / sid / "bundle" / "config.json").read_text())
        assert spec["linux"]["resources"]["cpu"] == {"quota": CPU_PERIOD_US,
                                                     "period": CPU_PERIOD_US}
        share = CPU_PERIOD_US // 10
        assert _bandwidth(sid) == (CPU_PERIOD_US, share, share)
        # A copy boots from the source's spec and gets the share in the same way.
        (copy,) = runtime.fork(sid)
        try:
            assert _bandwidth(copy) == (CPU_PERIOD_US, share, share)
        finally:
            runtime.delete(copy)
    finally:
        runtime.delete(sid)


@heavy  # a 10-second measurement; the cgroup's quota is checked by the tests above
def test_busy_loop_gets_at_most_its_share_over_10s(runtime):
    sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi", cpu=0.1)
    usage = CGROUP / "cpuacct" / sid / "cpuacct.usage"
    try:
        # Idle for a few periods first: the whole burst is banked, the worst case for the bound.
        time.sleep(3 * CPU_PERIOD_US / 1e6)
        u0, t0 = int(usage.read_text()), time.monotonic()
        loop = runtime.spawn(sid, ["/bin/sh", "-c", "while :; do :; done"])
        time.sleep(max(0.0, WINDOW_S - (time.monotonic() - t0)))
        cores = (int(usage.read_text()) - u0) / 1e9 / (time.monotonic() - t0)
        loop.close()
        print(f"\nbusy loop at cpu=0.1: {cores:.3f} cores over {WINDOW_S:g} s")
        assert 0.01 < cores <= 0.12  # it ran, and within its share (+ the banked burst)
    finally:
        runtime.delete(sid)
