"""The Ray layer's overhead and density, side by side with SandboxRuntime in the same run.

    .venv/bin/python -m benchmarks.bench_ray [--quick] [--idle 300]

Rows: create()→first exec via Ray vs SandboxRuntime.create + exec on the same warm node, and
a warm SandboxPool's acquire→first exec;
``ray.get(sb.exec.remote("true"))`` and ``sb.run("true")`` (the node-local channel) vs runtime
exec; then ``--idle`` idle busybox sandboxes created through ``create()`` on this one node
(count alive, RAM per sandbox, create rate).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ray

import ray_sandbox as sandbox
from benchmarks._harness import emit, measure, summarize
from ray_sandbox.runtime import SandboxRuntime


def _mem_available_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    raise RuntimeError("no MemAvailable")


@ray.remote(num_cpus=0.01)
class _Probe:
    def pid(self) -> int:
        import os

        return os.getpid()


def _actor_per_sandbox_cost(n: int) -> dict:
    """The rejected design: one Ray actor (a worker process) per sandbox. Time to a first call
    and the RSS of each such worker, measured on this node."""
    import psutil

    lat, rss, actors = [], [], []
    for _ in range(n):
        t0 = time.perf_counter()
        a = _Probe.remote()
        pid = ray.get(a.pid.remote())
        lat.append((time.perf_counter() - t0) * 1000)
        rss.append(psutil.Process(pid).memory_info().rss / 2**20)
        actors.append(a)
    for a in actors:
        ray.kill(a)
    return summarize("actor per sandbox: new worker to first call (no sandbox)", lat,
                     worker_rss_mib=round(sorted(rss)[len(rss) // 2], 1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--idle", type=int, default=300)
    args = ap.parse_args()
    n = 8 if args.quick else 20
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="rsb-bench-ray-") as tmp:
        import os

        os.environ["RAY_SANDBOX_HOME"] = str(Path(tmp) / "home")
        # fresh boots, comparable with earlier runs: bench_stock measures creates the stock serves
        os.environ["RAY_SANDBOX_STOCK_MAX"] = "0"
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            # Warm the node: host actor up, image unpacked.
            # cpu=1: a small CFS quota throttles the sandbox's own boot and every exec
            # (bench_scale: cpu 0.1 -> 1 s creates), which would measure the quota, not us.
            warm = sandbox.create(image="ray-sandbox/busybox", cpu=1, memory="128Mi")
            ray.get(warm.exec.remote("true"))

            ray_made: list = []

            def ray_create_exec() -> None:
                sb = sandbox.create(image="ray-sandbox/busybox", cpu=0.5, memory="48Mi")
                ray.get(sb.exec.remote(["/bin/true"]))
                ray_made.append(sb)

            rt = SandboxRuntime(Path(tmp) / "rt")

            rt_made: list[str] = []

            def rt_create_exec() -> None:
                rt_made.append(rt.create(image="ray-sandbox/busybox", cpu=0.5, memory="48Mi"))
                rt.exec(rt_made[-1], ["/bin/true"])

            # Deletes happen outside the timed part: a placement group's release reaches the
            # scheduler asynchronously, and on a full node the next create would wait for it.
            rows.append(_actor_per_sandbox_cost(n))
            for label, fn, made, drop in (
                ("create→first exec (ray create())", ray_create_exec, ray_made,
                 lambda sb: ray.get(sb.terminate.remote())),
                ("create→first exec (SandboxRuntime)", rt_create_exec, rt_made, rt.delete),
            ):
                samples = []
                for _ in range(n):
                    t0 = time.perf_counter()
                    fn()
                    samples.append((time.perf_counter() - t0) * 1000)
                    drop(made.pop())
                    time.sleep(0.2)
                rows.append(summarize(label, samples))
            # The same sandbox from a warm pool: acquire (a hit) -> first exec. Release and
            # re-warming stay outside the timed part, as the deletes above do.
            with sandbox.SandboxPool(image="ray-sandbox/busybox", cpu=0.5, memory="48Mi",
                                     size=2) as pool:
                samples = []
                for _ in range(n):
                    pool.wait_warm(2, timeout=120)
                    t0 = time.perf_counter()
                    sb = pool.acquire()
                    ray.get(sb.exec.remote(["/bin/true"]))
                    samples.append((time.perf_counter() - t0) * 1000)
                    pool.release(sb)
                hits = pool.stats()["hits"]
                rows.append(summarize("acquire→first exec (SandboxPool, warm)", samples,
                                      hits=hits))
            sid = rt.create(image="ray-sandbox/busybox", cpu=1, memory="128Mi")
            rows.append(measure("exec true (ray.get(sb.exec.remote))",
                                lambda: ray.get(warm.exec.remote(["/bin/true"])), n * 10))
            rows.append(measure("exec true (sb.run: node-local channel)",
                                lambda: warm.run(["/bin/true"]), n * 10))
            rows.append(measure("exec true (SandboxRuntime.exec)",
                                lambda: rt.exec(sid, ["/bin/true"]), n * 10))
            # Ray's own cost of one actor call: what exec through a handle adds at least
            rows.append(measure("no-op call to the host actor (Ray's floor)",
                                lambda: ray.get(warm._host.ping.remote()), n * 10))
            rt.delete(sid)
            rt.close()
            ray.get(warm.terminate.remote())

            idle = sandbox.make_template(image="ray-sandbox/busybox", cpu=None, memory="40Mi",
                                         resources={"CPU": 0.005})
            before = _mem_available_kib()
            t0 = time.perf_counter()
            lat: list[float] = []

            def one(_: int):
                s = time.perf_counter()
                # Idle sandboxes: no CFS quota (a tiny one would throttle their boot), a
                # tiny Ray reservation so 300 fit the node's 2 CPUs.
                sb = sandbox.create_from_template(idle)
                lat.append((time.perf_counter() - s) * 1000)
                return sb

            with ThreadPoolExecutor(8) as ex:
                handles = list(ex.map(one, range(args.idle)))
            wall = time.perf_counter() - t0
            time.sleep(5)  # let the idle sandboxes settle before reading memory
            alive = sum(
                r.exit_code == 0
                for r in ray.get([h.exec.remote(["/bin/true"]) for h in handles])
            )
            used_mib = (before - _mem_available_kib()) / 1024
            rows.append(summarize(f"create() of {args.idle} idle sandboxes, 8 in flight", lat,
                                  alive=alive, per_s=round(args.idle / wall, 1),
                                  ram_per_sandbox_mib=round(used_mib / max(alive, 1), 1)))
            with ThreadPoolExecutor(8) as ex:
                list(ex.map(lambda h: ray.get(h.terminate.remote()), handles))
        finally:
            sandbox.shutdown()
            ray.shutdown()
    emit("ray", rows)


if __name__ == "__main__":
    main()
