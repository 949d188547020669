"""mini-swe-agent episodes through ray_sandbox's environment beside its own ``local``
environment (no isolation: the floor), on the same tasks, in one run.

    pip install -e '.[minisweagent,ray]'     # a venv with mini-swe-agent (tests keep one)
    python -m benchmarks.bench_minisweagent [--episodes 64] [--workers 4]

Each episode is mini-swe-agent's ``DefaultAgent`` with its ``DeterministicModel`` fixing a
small bug (write a module and its test, run the test, fix, submit: 4 steps), in a fresh
environment: for ray_sandbox that is a sandbox created through Ray (the hosts' stock on, as
by default) and deleted by ``cleanup()``; for ``local`` a fresh temporary directory.
``--workers`` episodes run at once (threads, as mini-swe-agent's batch runners do), each
sandbox reserving ``--cpu`` cores in Ray (0.5: four fit on two cores). Rows:
episodes/s over the whole run, and p50/p90 of one step (``env.execute``) and of one episode
(environment made to cleaned up). Ray runs in a private local cluster and sandbox home.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks._harness import emit, summarize

STEPS = [
    ("write the module", "printf 'def add(a, b):\\n    return a - b\\n' > calc.py && "
     "printf 'from calc import add\\nassert add(2, 3) == 5\\n' > test_calc.py"),
    ("run its test", "python3 test_calc.py"),
    ("fix it", "sed -i 's/a - b/a + b/' calc.py"),
    ("submit", "python3 test_calc.py && echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat calc.py"),
]
ENV = {"PYTHONDONTWRITEBYTECODE": "1"}


def episode(make_env: Callable[[], Any], steps_ms: list[float], lock: threading.Lock) -> float:
    """One episode; returns its milliseconds, appends each step's."""
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.models.test_models import DeterministicModel, make_output

    t0 = time.perf_counter()
    env = make_env()
    execute = env.execute

    def timed(action: dict, cwd: str = "", **kw: Any) -> dict:
        s = time.perf_counter()
        try:
            return execute(action, cwd, **kw)
        finally:
            with lock:
                steps_ms.append((time.perf_counter() - s) * 1000)

    env.execute = timed
    try:
        model = DeterministicModel(outputs=[make_output(t, [{"command": c}]) for t, c in STEPS])
        agent = DefaultAgent(model, env, system_template="You fix bugs.",
                             instance_template="{{task}}", step_limit=10, cost_limit=0)
        result = agent.run("make add() add")
        if result.get("exit_status") != "Submitted":
            raise RuntimeError(f"episode did not submit: {result}")
    finally:
        cleanup = getattr(env, "cleanup", None)
        if cleanup is not None:
            cleanup()
    return (time.perf_counter() - t0) * 1000


def run(label: str, make_env: Callable[[], Any], episodes: int, workers: int) -> dict:
    steps_ms: list[float] = []
    lock = threading.Lock()
    for _ in range(min(2, episodes)):  # warm-up, not counted
        episode(make_env, [], lock)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        ep_ms = list(pool.map(lambda _: episode(make_env, steps_ms, lock), range(episodes)))
    wall = time.perf_counter() - t0
    step = summarize("step", steps_ms)
    row = summarize(label, ep_ms)
    return {"label": label, "episodes": episodes, "workers": workers,
            "episodes_per_s": round(episodes / wall, 2), "wall_s": round(wall, 1),
            "step_p50_ms": step["p50_ms"], "step_p90_ms": step["p90_ms"],
            "episode_p50_ms": row["p50_ms"], "episode_p90_ms": row["p90_ms"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--cpu", type=float, default=0.5,
                    help="cores each sandbox reserves and may use (Ray queues what does not fit)")
    args = ap.parse_args()
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")

    import ray
    from minisweagent.environments.local import LocalEnvironment

    from ray_sandbox.integrations.minisweagent import RaySandboxEnvironment
    from ray_sandbox.runtime.paths import images

    dirs: list[str] = []

    def local_env() -> Any:
        d = tempfile.mkdtemp(prefix="bench-mswea-")
        dirs.append(d)
        return LocalEnvironment(cwd=d, env=ENV, timeout=30)

    def sandbox_env() -> Any:
        return RaySandboxEnvironment(image="ray-sandbox/python:latest", cwd="/tmp", env=ENV,
                                     timeout=30, cpu=args.cpu)

    start_load = os.getloadavg()
    home = tempfile.mkdtemp(prefix="bench-mswea-home-")
    os.environ["RAY_SANDBOX_IMAGES"] = str(images())  # the node's image cache
    os.environ["RAY_SANDBOX_HOME"] = home
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        rows = [run("local (no isolation)", local_env, args.episodes, args.workers),
                run("ray_sandbox (Ray)", sandbox_env, args.episodes, args.workers)]
    finally:
        import ray_sandbox

        ray_sandbox.shutdown()
        ray.shutdown()
        for d in [*dirs, home]:
            shutil.rmtree(d, ignore_errors=True)
    end_load = os.getloadavg()
    emit("minisweagent", rows, notes=(
        f"load average (1/5/15 min) at the start {' '.join(f'{x:.2f}' for x in start_load)}, "
        f"at the end {' '.join(f'{x:.2f}' for x in end_load)}; {os.cpu_count()} CPUs; "
        f"sandboxes of {args.cpu} CPU"))


if __name__ == "__main__":
    main()
