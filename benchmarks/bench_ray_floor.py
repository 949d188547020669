"""What a Ray actor call costs by itself, for a call as short as an exec (issue 20: exec
through a handle should be within 1 ms of the runtime's). No sandboxes: plain actors.

    .venv/bin/python -m benchmarks.bench_ray_floor [--n 200]

Rows: a no-op call, and a call that sleeps 6 ms (an exec of ``true`` takes ~6 ms here), on a
threaded actor (the host's kind, max_concurrency 1024), a single-threaded one and an async
one; and the 6 ms call collected three ways (``ray.get`` at once, after a 7.5 ms sleep,
polling ``ray.wait``), to tell the caller's wait from the call's own cost.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import ray

from benchmarks._harness import emit, measure

SLEEP_S = 0.006


class _Calls:
    def noop(self) -> None:
        return None

    def sleep6(self) -> None:
        time.sleep(SLEEP_S)


class _AsyncCalls:
    async def noop(self) -> None:
        return None

    async def sleep6(self) -> None:
        await asyncio.sleep(SLEEP_S)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    n = ap.parse_args().n
    load = os.getloadavg()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        actors = {
            "threaded, max_concurrency 1024": ray.remote(_Calls).options(
                num_cpus=0, max_concurrency=1024).remote(),
            "single-threaded": ray.remote(_Calls).options(num_cpus=0).remote(),
            "async": ray.remote(_AsyncCalls).options(num_cpus=0).remote(),
        }
        for kind, a in actors.items():
            rows.append(measure(f"no-op call, {kind}", lambda a=a: ray.get(a.noop.remote()), n))
            rows.append(measure(f"6 ms call, {kind}", lambda a=a: ray.get(a.sleep6.remote()), n))
        a = actors["threaded, max_concurrency 1024"]

        def sleep_then_get() -> None:
            ref = a.sleep6.remote()
            time.sleep(0.0075)
            ray.get(ref)

        def poll() -> None:
            ref = a.sleep6.remote()
            while not ray.wait([ref], timeout=0)[0]:
                time.sleep(0.0002)

        rows.append(measure("6 ms call, threaded, got after a 7.5 ms sleep", sleep_then_get, n))
        rows.append(measure("6 ms call, threaded, ray.wait(timeout=0) every 0.2 ms", poll, n))
    finally:
        ray.shutdown()
    emit("ray_floor", rows, notes=f"load average before {load[0]:.1f}; no sandboxes")


if __name__ == "__main__":
    main()
