"""Fractional CPU shares without a latency floor (issue 20), side by side in one run.

    .venv/bin/python -m benchmarks.bench_cpu [--quick] [--alternatives]

Three shapes of busybox sandbox through ``SandboxRuntime``, created in rotation (reversed
every other round) so load from elsewhere on the machine hits all alike:

- ``cpu=1``, the reference the ratios are against;
- ``cpu=0.1`` as before issue 20 (the baseline): a CFS quota with a 100 ms period from the
  boot on, no burst. Built here with ``cpu=None`` (so nothing is applied after the boot) and
  a spec_transform that puts the old limit in the spec;
- ``cpu=0.1`` now: the boot on one core, then the share with a 500 ms period and a burst of
  one quota (``bundle.apply_cpu_share``).

Rows per shape: create → first exec; exec ``/bin/true`` one every ``THINK_S`` (an agent's
step: a command, then the policy thinks); exec back to back for ``SUSTAIN_S`` right after
(a sandbox asking for more than its share waits: the share at work); ``python3 -c pass`` one
every ``PYTHON_THINK_S`` in a ``ray-sandbox/python`` sandbox; the cores a busy loop
gets over 10 s, counted from idle so the banked burst is in it. ``sandbox_cpu_ms_p50`` is the
CPU each step took in the sandbox's cgroup (for create → first exec: the boot's). The load
average goes with the results: wall-clock rows move with other work on the machine, the share
rows do not.

``--alternatives`` adds what was measured before choosing: a 10 ms period from the boot, and
the boot on one core, then a 100, 200 or 1000 ms period with a burst of one quota (written
by this benchmark once create returns).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks._harness import emit, summarize
from ray_sandbox.runtime import ImageStore, SandboxRuntime, procfs

BUSYBOX = "ray-sandbox/busybox"
PYTHON = "ray-sandbox/python"
THINK_S = 0.2
PYTHON_THINK_S = 1.0  # python3 -c pass takes ~45 ms of the sandbox's CPU: under half of 0.1
SUSTAIN_S = 2.0
WINDOW_S = 10.0
IDLE_S = 1.5  # before the busy loop: three of our periods, fifteen of the baseline's
OLD_PERIOD_US = 100_000


def _spec_limit(quota_us: int, period_us: int) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A spec_transform putting this CFS limit in the spec, so runsc applies it from the boot
    (with ``cpu=None`` the runtime applies nothing after it)."""
    def transform(spec: dict[str, Any]) -> dict[str, Any]:
        spec["linux"]["resources"]["cpu"] = {"quota": quota_us, "period": period_us}
        return spec
    return transform


class Shape(NamedTuple):
    opts: dict[str, Any]
    # a period for a 0.1 share with a burst of one quota, written once create returns
    after_boot_period_us: int | None = None


SHAPES = {
    "cpu=1": Shape({"cpu": 1}),
    "cpu=0.1 (baseline: before issue 20)": Shape(
        {"cpu": None, "spec_transform": _spec_limit(OLD_PERIOD_US // 10, OLD_PERIOD_US)}),
    "cpu=0.1 (ours)": Shape({"cpu": 0.1}),
}
# --alternatives: what else was measured before choosing (docs/runtime.md, "CPU")
ALTERNATIVES = {
    "cpu=0.1, 10 ms period from the boot": Shape(
        {"cpu": None, "spec_transform": _spec_limit(1_000, 10_000)}),
    **{f"cpu=0.1, boot on 1 core, then {p // 1000} ms period + burst": Shape(
        {"cpu": None, "spec_transform": _spec_limit(p, p)}, p)
       for p in (100_000, 200_000, 1_000_000)},
}


def _create(rt: SandboxRuntime, shape: Shape, image: str = BUSYBOX) -> str:
    sid = rt.create(image=image, memory="128Mi", **shape.opts)
    if shape.after_boot_period_us:
        p = shape.after_boot_period_us
        procfs.set_cpu_bandwidth(sid, period_us=p, quota_us=p // 10, burst_us=p // 10)
    return sid


FIRST = "create→first exec"
PACED = f"exec true every {THINK_S * 1000:g} ms"
SUSTAINED = f"exec true back to back {SUSTAIN_S:g} s"
PYTHON_STARTS = f"python3 -c pass every {PYTHON_THINK_S:g} s"
PYTHON_PER_ROUND = 2  # in a fresh python sandbox per round: one sandbox's noise is large


Sample = tuple[float, float]  # wall ms, and CPU ms of the sandbox's cgroup


def _usage_ms(sid: str) -> float:
    """CPU the sandbox's runsc processes used so far (its cpuacct cgroup), in ms."""
    return int(Path(f"/sys/fs/cgroup/cpuacct/{sid}/cpuacct.usage").read_text()) / 1e6


def _exec(rt: SandboxRuntime, sid: str, argv: list[str]) -> Sample:
    c0, t0 = _usage_ms(sid), time.perf_counter()
    rt.exec(sid, argv)
    return (time.perf_counter() - t0) * 1000, _usage_ms(sid) - c0


def _round(rt: SandboxRuntime, shape: Shape, paced: int) -> dict[str, list[Sample]]:
    """One sandbox: create → first exec (its CPU: the boot's), paced execs, then back-to-back
    execs; deleted."""
    t0 = time.perf_counter()
    sid = _create(rt, shape)
    try:
        rt.exec(sid, ["/bin/true"])
        out = {FIRST: [((time.perf_counter() - t0) * 1000, _usage_ms(sid))],
               PACED: [], SUSTAINED: []}
        for _ in range(paced):
            time.sleep(THINK_S)
            out[PACED].append(_exec(rt, sid, ["/bin/true"]))
        stop = time.monotonic() + SUSTAIN_S
        while time.monotonic() < stop:
            out[SUSTAINED].append(_exec(rt, sid, ["/bin/true"]))
    finally:
        rt.delete(sid)
    return out


def _python_starts(rt: SandboxRuntime, shape: Shape, n: int) -> list[Sample]:
    """``python3 -c pass`` one every PYTHON_THINK_S in a python sandbox."""
    sid = _create(rt, shape, PYTHON)
    try:
        out = []
        for _ in range(n):
            time.sleep(PYTHON_THINK_S)
            out.append(_exec(rt, sid, ["python3", "-c", "pass"]))
    finally:
        rt.delete(sid)
    return out


def _busy_loop_cores(rt: SandboxRuntime, shape: Shape) -> float:
    """Cores a CPU-bound loop gets over WINDOW_S, from the sandbox's cpuacct cgroup."""
    sid = _create(rt, shape)
    try:
        time.sleep(IDLE_S)
        c0, t0 = _usage_ms(sid), time.monotonic()
        loop = rt.spawn(sid, ["/bin/sh", "-c", "while :; do :; done"])
        time.sleep(max(0.0, WINDOW_S - (time.monotonic() - t0)))
        cores = (_usage_ms(sid) - c0) / 1000 / (time.monotonic() - t0)
        loop.close()
    finally:
        rt.delete(sid)
    return cores


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--alternatives", action="store_true",
                    help="also the other periods measured before choosing")
    args = ap.parse_args()
    rounds, paced = (4, 5) if args.quick else (10, 10)
    shapes = {**SHAPES, **(ALTERNATIVES if args.alternatives else {})}
    load_before = os.getloadavg()
    samples: dict[str, dict[str, list[Sample]]] = {name: {} for name in shapes}
    cores: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="rsb-bench-") as tmpd, SandboxRuntime(
        Path(tmpd) / "home", images=ImageStore()  # the node's image cache
    ) as rt:
        for i in range(rounds + 1):  # the first round is warmup
            order = list(shapes.items())
            for name, shape in order if i % 2 else order[::-1]:
                times = _round(rt, shape, paced)
                times[PYTHON_STARTS] = _python_starts(rt, shape, PYTHON_PER_ROUND)
                if i:
                    for what, got in times.items():
                        samples[name].setdefault(what, []).extend(got)
        for name, shape in shapes.items():
            cores[name] = _busy_loop_cores(rt, shape)
    load_after = os.getloadavg()

    rows = []
    ref = {what: summarize(what, [ms for ms, _ in got])["p50_ms"]
           for what, got in samples["cpu=1"].items()}
    for name in shapes:
        for what, got in samples[name].items():
            row = summarize(f"{what}, {name}", [ms for ms, _ in got])
            row["p50_vs_cpu1"] = round(row["p50_ms"] / ref[what], 2)
            row["sandbox_cpu_ms_p50"] = round(statistics.median(c for _, c in got), 1)
            rows.append(row)
        rows.append({"label": f"busy loop {WINDOW_S:g} s from idle, {name}",
                     "cores": round(cores[name], 3)})
    load = (f"load average (1, 5, 15 min) before {', '.join(f'{x:.2f}' for x in load_before)}; "
            f"after {', '.join(f'{x:.2f}' for x in load_after)}")
    emit("cpu", rows, notes=load)


if __name__ == "__main__":
    main()
