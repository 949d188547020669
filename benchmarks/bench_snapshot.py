"""Snapshot, fork and restore speed, with create as the baseline in the same run.

    .venv/bin/python -m benchmarks.bench_snapshot [--n 5] [--no-ray]

One node, an idle Debian+python sandbox (``ray-sandbox/python``, readonly=False):
- parent pause: the longest stall seen by a 1 ms tick loop inside the parent during
  ``snapshot()`` (baseline: the longest stall over the same time without a snapshot), plus
  the ``runsc checkpoint`` call (the freeze is inside it) and the whole ``snapshot()``;
- fork k=8 until all children answer exec (baseline: 8 concurrent ``create()``);
- checkpoint and restore of a sandbox whose Python process holds 256 MB;
- with Ray (two-node local cluster, separate homes): fork k=1 to the same vs the other node.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks._harness import emit, summarize
from ray_sandbox.runtime import SandboxRuntime
from ray_sandbox.runtime.paths import images

IMAGE = "ray-sandbox/python"
TICKER = """
import time
last = time.monotonic()
while True:
    time.sleep(0.001)
    now = time.monotonic()
    if now - last > 0.02:
        with open('/tmp/gaps', 'a') as f:
            f.write(f'{now - last}\\n')
    last = now
"""
HOLD_256 = "import os, time\nb = bytearray(os.urandom(256 << 20))\nopen('/tmp/ready','w')\n" \
           "time.sleep(10**9)"


def _timed(samples: list[float], fn: Callable) -> Callable:
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            samples.append((time.perf_counter() - t0) * 1000)
    return wrapper


def _max_gap_ms(rt: SandboxRuntime, sid: str) -> float:
    out = rt.exec(sid, "cat /tmp/gaps 2>/dev/null; rm -f /tmp/gaps").stdout.split()
    return max((float(x) * 1000 for x in out), default=0.0)


def bench_pause(rt: SandboxRuntime, n: int) -> list[dict]:
    sid = rt.create(image=IMAGE, memory="512Mi", cpu=1, readonly=False)
    try:
        rt.spawn(sid, ["python3", "-c", TICKER])
        time.sleep(1.0)
        ckpt: list[float] = []
        rt.runsc.checkpoint = _timed(ckpt, rt.runsc.checkpoint)
        total, gaps, idle_gaps = [], [], []
        for _ in range(n):
            _max_gap_ms(rt, sid)
            time.sleep(0.3)
            idle_gaps.append(_max_gap_ms(rt, sid))  # baseline: same window, no snapshot
            t0 = time.perf_counter()
            snap = rt.snapshot(sid)
            total.append((time.perf_counter() - t0) * 1000)
            time.sleep(0.3)
            gaps.append(_max_gap_ms(rt, sid))
            rt.snapshots.delete(snap)
        del rt.runsc.checkpoint
        return [
            summarize("parent stall during snapshot (tick loop)", gaps, goal_ms=200),
            summarize("baseline: stall without snapshot (same window)", idle_gaps),
            summarize("runsc checkpoint --leave-running (freeze inside)", ckpt),
            summarize("snapshot() total (hold, checkpoint, copies)", total),
        ]
    finally:
        rt.delete(sid)


def bench_fork(rt: SandboxRuntime, n: int, k: int = 8) -> list[dict]:
    sid = rt.create(image=IMAGE, memory="256Mi", cpu=0.5, readonly=False)
    fork_ms, create_ms = [], []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            kids = rt.fork(sid, k)
            fork_ms.append((time.perf_counter() - t0) * 1000)
            for c in kids:
                rt.delete(c)
            with ThreadPoolExecutor(k) as pool:
                t0 = time.perf_counter()
                fresh = list(pool.map(lambda _: rt.create(image=IMAGE, memory="256Mi",
                                                          cpu=0.5, readonly=False), range(k)))
                create_ms.append((time.perf_counter() - t0) * 1000)
            for c in fresh:
                rt.delete(c)
    finally:
        rt.delete(sid)
    return [summarize(f"fork k={k} until all exec-ready", fork_ms, goal_ms=2000),
            summarize(f"baseline: {k} concurrent create()", create_ms)]


def bench_256mb(rt: SandboxRuntime, n: int) -> list[dict]:
    sid = rt.create(image=IMAGE, memory="1Gi", cpu=1, readonly=False)
    ckpt: list[float] = []
    snap_ms, restore_ms, sizes, create_ms = [], [], [], []
    try:
        rt.spawn(sid, ["python3", "-c", HOLD_256])
        while not rt.exists(sid, "/tmp/ready"):
            time.sleep(0.1)
        rt.runsc.checkpoint = _timed(ckpt, rt.runsc.checkpoint)
        for _ in range(n):
            t0 = time.perf_counter()
            snap = rt.snapshot(sid)
            snap_ms.append((time.perf_counter() - t0) * 1000)
            sizes.append(snap.size_bytes / 2**20)
            t0 = time.perf_counter()
            (kid,) = rt.restore(snap)
            restore_ms.append((time.perf_counter() - t0) * 1000)
            rt.delete(kid)
            rt.snapshots.delete(snap)
            t0 = time.perf_counter()
            fresh = rt.create(image=IMAGE, memory="1Gi", cpu=1, readonly=False)
            create_ms.append((time.perf_counter() - t0) * 1000)
            rt.delete(fresh)
        del rt.runsc.checkpoint
    finally:
        rt.delete(sid)
    mb = round(statistics.median(sizes))
    return [summarize("256 MB: runsc checkpoint", ckpt, goal_ms=1500, snapshot_mb=mb),
            summarize("256 MB: snapshot() total", snap_ms, snapshot_mb=mb),
            summarize("256 MB: restore() until exec-ready", restore_ms, goal_ms=1500),
            summarize("baseline: create() of an empty sandbox", create_ms)]


def bench_ray(n: int) -> list[dict]:
    import ray
    from ray.cluster_utils import Cluster

    from ray_sandbox.actor import api

    homes = [Path(tempfile.mkdtemp(prefix=f"rsb-bench-node{i}-")) for i in range(2)]
    os.environ["RAY_SANDBOX_IMAGES"] = str(images())  # one image cache: same digests
    c = Cluster()
    try:
        for i, home in enumerate(homes):
            os.environ["RAY_SANDBOX_HOME"] = str(home)
            c.add_node(num_cpus=2, resources={f"node{i}": 1},
                       object_store_memory=200 * 2**20, include_dashboard=False)
        ray.init(address=c.address, log_to_driver=False)
        by = {next(r for r in nd["Resources"] if r.startswith("node") and r[4:].isdigit()):
              nd["NodeID"] for nd in ray.nodes() if nd["Alive"]}  # fmt: skip
        sb = api.create(image=IMAGE, cpu=0.2, memory="256Mi", node_id=by["node0"])
        same, other = [], []
        for _ in range(n):
            for placement, out in (("local", same), (by["node1"], other)):
                t0 = time.perf_counter()
                (kid,) = sb.fork(1, placement=placement)
                ray.get(kid.exec.remote("true"))
                out.append((time.perf_counter() - t0) * 1000)
                ray.get(kid.terminate.remote())
        ray.get(sb.terminate.remote())
    finally:
        if ray.is_initialized():
            api.shutdown()
            ray.shutdown()
        c.shutdown()
        for home in homes:
            SandboxRuntime(home, reap=True)
            shutil.rmtree(home, ignore_errors=True)
    return [summarize("Ray fork k=1, same node", same),
            summarize("Ray fork k=1, other node (files shipped)", other)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--no-ray", action="store_true")
    args = ap.parse_args()
    load0 = os.getloadavg()
    os.environ.setdefault("RAY_SANDBOX_IMAGES", str(images()))  # the node's image cache
    home = Path(tempfile.mkdtemp(prefix="rsb-bench-snap-"))
    rows: list[dict] = []
    with SandboxRuntime(home) as rt:
        rows += bench_pause(rt, args.n)
        rows += bench_fork(rt, args.n)
        rows += bench_256mb(rt, max(3, args.n // 2))
    shutil.rmtree(home, ignore_errors=True)
    if not args.no_ray:
        rows += bench_ray(args.n)
    load1 = os.getloadavg()
    emit("bench_snapshot", rows, notes=f"load average (1/5/15 min) at start {load0}, "
                                       f"at end {load1}; 2 vCPUs shared with other work")


if __name__ == "__main__":
    main()
