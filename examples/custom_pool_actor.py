"""A user-written pool actor that embeds ``SandboxRuntime`` directly: the pattern for teams that
want their own scheduling inside one Ray actor instead of ``ray_sandbox.create``.

    .venv/bin/python examples/custom_pool_actor.py [--sandboxes 4] [--jobs 16]

The actor owns a few sandboxes on its node and runs jobs on them round-robin; its sandboxes
die with it (the runtime's reaper deletes them if the actor process is killed).
"""

from __future__ import annotations

import argparse
import itertools
import threading

import ray

from ray_sandbox.runtime import SandboxRuntime


@ray.remote(num_cpus=1, max_concurrency=8)
class SandboxPoolActor:
    def __init__(self, n: int, image: str = "ray-sandbox/python") -> None:
        self.runtime = SandboxRuntime()
        self.ids = [self.runtime.create(image=image, memory="512Mi") for _ in range(n)]
        self._next = itertools.cycle(range(n))
        self._lock = threading.Lock()

    def run(self, code: str, timeout: float = 10.0) -> dict:
        with self._lock:
            sid = self.ids[next(self._next)]
        res = self.runtime.exec(sid, ["python3", "-c", code], timeout=timeout)
        return {"sandbox": sid[:8], "exit_code": res.exit_code, "stdout": res.stdout,
                "timed_out": res.timed_out}

    def close(self) -> int:
        for sid in self.ids:
            self.runtime.delete(sid)
        return len(self.ids)


def main() -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sandboxes", type=int, default=4)
    p.add_argument("--jobs", type=int, default=16)
    args = p.parse_args()
    ray.init(log_to_driver=False)
    try:
        pool = SandboxPoolActor.remote(args.sandboxes)
        jobs = [f"print({i} * {i})" for i in range(args.jobs - 1)]
        jobs.append("while True: pass")  # one endless job: killed by its timeout
        results = ray.get([pool.run.remote(code, timeout=5) for code in jobs])
        for code, r in zip(jobs, results, strict=True):
            print(f"{code:<20} sandbox {r['sandbox']}  exit {r['exit_code']:>4}  "
                  f"{'timed out' if r['timed_out'] else r['stdout'].strip()}")
        print(f"closed {ray.get(pool.close.remote())} sandboxes")
        return results
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
