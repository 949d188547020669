"""Sandbox demand scales a Ray cluster up from zero worker nodes, and back down when idle.

A head with no CPUs and Ray's autoscaler (fake multi-node provider: every "node" is a set of
Ray processes on this machine) start empty. More sandboxes are requested than any node holds;
each one's CPU and memory reservation is pending demand, the autoscaler launches nodes for it,
every sandbox runs its code on a worker node, and once all are terminated the idle nodes go.

    .venv/bin/python examples/autoscaling_demo.py [--sandboxes 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import ray
from fake_autoscaling_cluster import fake_autoscaling_cluster
from rich.console import Console
from rich.table import Table

import ray_sandbox as sandbox

NODE_TYPE = "sandbox-node"
# An episode: some work, then a few seconds of waiting (on a model, a test suite, ...), so
# the sandboxes overlap and the cluster has to hold them all at once.
CODE = ("import platform, sys, time; n = sum(i * i for i in range(200_000)); "
        "time.sleep(float(sys.argv[1])); print(n, platform.release())")


def _workers() -> list[str]:
    return [n["NodeID"] for n in ray.nodes()
            if n["Alive"] and n["Resources"].get("CPU", 0) > 0]


class Timeline:
    """Worker-node count and sandboxes running, sampled every half second."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.samples: list[tuple[float, int, int]] = []
        self.running = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.sample()

    def sample(self) -> int:
        n = len(_workers())
        with self._lock:
            self.samples.append((round(time.monotonic() - self.t0, 1), n, self.running))
        return n

    def add_running(self, d: int) -> None:
        with self._lock:
            self.running += d

    def first(self, pred, after: float = 0.0) -> float | None:
        """When ``pred(workers, running)`` first held after ``after`` seconds."""
        with self._lock:
            return next((t for t, w, r in self.samples if t >= after and pred(w, r)), None)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run_one(i: int, timeline: Timeline, args: argparse.Namespace) -> dict:
    t0 = time.monotonic()
    sb = sandbox.create(image=args.image, cpu=args.cpu, memory=args.memory, timeout=300)
    timeline.add_running(1)
    try:
        res = ray.get(sb.exec.remote(["python3", "-c", CODE, str(args.work_seconds)],
                                    timeout=60 + args.work_seconds), timeout=120)
        return {"i": i, "sandbox_id": sb.sandbox_id, "node": sb.node_id,
                "exit_code": res.exit_code,
                "stdout": res.stdout.strip(), "wait_s": round(time.monotonic() - t0, 2)}
    finally:
        ray.get(sb.terminate.remote(), timeout=120)
        timeline.add_running(-1)


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sandboxes", type=int, default=8)
    p.add_argument("--cpu", type=float, default=1.0)
    p.add_argument("--memory", default="256Mi")
    p.add_argument("--node-cpus", type=int, default=2)
    p.add_argument("--max-nodes", type=int, default=4)
    p.add_argument("--work-seconds", type=float, default=4.0, help="each sandbox's episode")
    p.add_argument("--idle-timeout", type=float, default=6.0,
                   help="seconds an idle node lives before the autoscaler removes it")
    p.add_argument("--image", default="ray-sandbox/python")
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args()
    console = Console()
    node_type = {"resources": {"CPU": args.node_cpus, "memory": 4 * 2**30,
                               "object_store_memory": 100 * 2**20},
                 "max_workers": args.max_nodes}
    # A node's sandbox host leaves after this long without sandboxes (default 60 s), so the
    # autoscaler sees the node idle; the cluster's processes inherit it from here.
    os.environ.setdefault("RAY_SANDBOX_HOST_IDLE_S", "2")
    with fake_autoscaling_cluster({NODE_TYPE: node_type},
                                  idle_timeout_s=args.idle_timeout) as cluster:
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            result = scenario(args, console)
        finally:
            try:
                sandbox.shutdown()
            finally:
                ray.shutdown()
    result["temp_dir"] = cluster.temp_dir
    report(result, console)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def scenario(args: argparse.Namespace, console: Console) -> dict:
    start_workers = len(_workers())
    console.print(f"cluster up: {start_workers} worker nodes; requesting {args.sandboxes} "
                  f"sandboxes of {args.cpu} CPU / {args.memory} "
                  f"(a node holds {int(args.node_cpus // args.cpu)})")
    timeline = Timeline()
    with ThreadPoolExecutor(max_workers=args.sandboxes) as ex:
        runs = list(ex.map(lambda i: run_one(i, timeline, args), range(args.sandboxes)))
    all_done = time.monotonic() - timeline.t0
    console.print(f"all {len(runs)} sandboxes ran in {all_done:.1f}s; waiting for scale-down")
    deadline = time.monotonic() + 120 + 10 * args.idle_timeout
    while timeline.sample() and time.monotonic() < deadline:
        time.sleep(0.5)
    timeline.stop()
    return {
        "sandboxes": args.sandboxes,
        "start_workers": start_workers,
        "peak_workers": max(w for _, w, _ in timeline.samples),
        "end_workers": timeline.samples[-1][1],
        "first_node_s": timeline.first(lambda w, r: w > 0),
        "all_ran_s": round(all_done, 1),
        "nodes_used": len({r["node"] for r in runs}),
        "scaled_down_s": timeline.first(lambda w, r: w == 0, after=all_done),
        "runs": runs,
        "timeline": timeline.samples,
    }


def report(result: dict, console: Console) -> None:
    table = Table(title="autoscaling on sandbox demand")
    for col in ("t (s)", "worker nodes", "sandboxes running"):
        table.add_column(col, justify="right")
    last = None
    for t, w, r in result["timeline"]:
        if (w, r) != last:
            table.add_row(f"{t:.1f}", str(w), str(r))
            last = (w, r)
    console.print(table)
    ok = sum(1 for r in result["runs"] if r["exit_code"] == 0)
    console.print(
        f"{ok}/{result['sandboxes']} sandboxes succeeded on {result['nodes_used']} nodes; workers "
        f"{result['start_workers']} -> peak {result['peak_workers']} -> {result['end_workers']}; "
        f"first node {result['first_node_s']}s, all ran {result['all_ran_s']}s, "
        f"scaled down {result['scaled_down_s']}s")


if __name__ == "__main__":
    main()
