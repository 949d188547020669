"""The main job: an RL-style rollout on a local Ray cluster.

Dozens of model-style solutions to a few small tasks — correct, wrong, crashing, endless,
network-probing, fork-storming — are each run against the task's tests in their own gVisor
sandbox, concurrently, from a warm pool. Prints a progress bar and a final table.

    .venv/bin/python examples/rollout_demo.py [--solutions 48] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

import ray
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from rich.table import Table

import ray_sandbox as sandbox

TASKS = {
    "fizzbuzz": (
        "def solve(n):\n    return ['FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else "
        "'Buzz' if i % 5 == 0 else str(i) for i in range(1, n + 1)]\n",
        "assert solve(15)[-1] == 'FizzBuzz' and solve(5) == ['1', '2', 'Fizz', '4', 'Buzz']\n",
    ),
    "is_prime": (
        "def solve(n):\n    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))\n",
        "assert [x for x in range(30) if solve(x)] == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]\n",
    ),
    "reverse_words": (
        "def solve(s):\n    return ' '.join(reversed(s.split()))\n",
        "assert solve('the quick brown fox') == 'fox brown quick the'\n",
    ),
}

BEHAVIOURS = {
    "correct": lambda good: good,
    "wrong": lambda good: "def solve(*a):\n    return None\n",
    "crashing": lambda good: "def solve(*a):\n    raise RuntimeError('model bug')\n",
    "endless": lambda good: "def solve(*a):\n    while True:\n        pass\n",
    "network-probing": lambda good: (
        "import socket\ntry:\n    socket.create_connection(('169.254.169.254', 80), timeout=2)\n"
        "    print('LEAK: reached metadata endpoint')\nexcept OSError as e:\n"
        "    print('blocked:', e)\n" + good
    ),
    "fork-storm": lambda good: (
        "import os, time\nkids = []\nfor _ in range(64):\n    pid = os.fork()\n"
        "    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n    kids.append(pid)\n"
        + good
    ),
}
WEIGHTS = {"correct": 6, "wrong": 2, "crashing": 1, "endless": 1, "network-probing": 1,
           "fork-storm": 1}


@dataclass
class Outcome:
    task: str
    behaviour: str
    passed: bool
    timed_out: bool
    exit_code: int
    seconds: float


def run_one(sb: sandbox.SandboxHandle, item: tuple[str, str, str], timeout: float) -> Outcome:
    task, behaviour, code = item
    t0 = time.perf_counter()
    ray.get(sb.write_file.remote("/work/solution.py", code))
    ray.get(sb.write_file.remote("/work/test_solution.py",
                                 "from solution import solve\n" + TASKS[task][1]))
    try:
        res = ray.get(sb.exec.remote("python3 test_solution.py", timeout=timeout, cwd="/work"))
    except sandbox.SandboxDiedError:  # e.g. it hit its memory or pids limit: a failed episode
        return Outcome(task, behaviour, False, False, 137, time.perf_counter() - t0)
    return Outcome(task, behaviour, res.exit_code == 0 and not res.timed_out, res.timed_out,
                   res.exit_code, time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--solutions", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--image", default="ray-sandbox/python")
    args = ap.parse_args()

    rng = random.Random(7)
    kinds = [k for k, w in WEIGHTS.items() for _ in range(w)]
    items = []
    for i in range(args.solutions):
        task = list(TASKS)[i % len(TASKS)]
        behaviour = list(WEIGHTS)[i] if i < len(WEIGHTS) else rng.choice(kinds)
        items.append((task, behaviour, BEHAVIOURS[behaviour](TASKS[task][0])))

    console = Console()
    ray.init(include_dashboard=False, log_to_driver=False)
    pool = sandbox.SandboxPool(image=args.image, size=2 * args.concurrency, cpu=0.2,
                               memory="256Mi", workdir="/work")
    console.print(f"warming {args.concurrency} sandboxes of {args.image} …")
    pool.wait_warm(args.concurrency, timeout=300)
    outcomes: list[Outcome] = []
    t0 = time.perf_counter()
    with Progress("[progress.description]{task.description}", BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=console) as progress:
        bar = progress.add_task("rollout", total=len(items))
        for out in pool.map(lambda sb, it: run_one(sb, it, args.timeout), items,
                            concurrency=args.concurrency):
            outcomes.append(out)
            progress.advance(bar)
    wall = time.perf_counter() - t0
    stats = pool.stats()
    pool.close()
    sandbox.shutdown()
    ray.shutdown()

    table = Table(title=f"{len(outcomes)} solutions, {args.concurrency} in flight")
    for col in ("behaviour", "runs", "passed", "timeouts", "p50 s", "p99 s"):
        table.add_column(col, justify="left" if col == "behaviour" else "right")
    for b in WEIGHTS:
        rows = [o for o in outcomes if o.behaviour == b]
        if not rows:
            continue
        lat = sorted(o.seconds for o in rows)
        table.add_row(b, str(len(rows)), str(sum(o.passed for o in rows)),
                      str(sum(o.timed_out for o in rows)), f"{statistics.median(lat):.2f}",
                      f"{lat[min(len(lat) - 1, int(0.99 * len(lat)))]:.2f}")
    console.print(table)
    lat = sorted(o.seconds for o in outcomes)
    console.print(
        f"pass rate {sum(o.passed for o in outcomes) / len(outcomes):.0%} · "
        f"latency p50 {statistics.median(lat):.2f}s p99 {lat[int(0.99 * (len(lat) - 1))]:.2f}s · "
        f"timeouts {sum(o.timed_out for o in outcomes)} · "
        f"{len(outcomes) / wall:.1f} sandboxes/s · pool hits {stats['hits']} misses "
        f"{stats['misses']}"
    )
    wrong_pass = [o for o in outcomes if o.passed and o.behaviour not in
                  ("correct", "network-probing", "fork-storm")]
    if wrong_pass:
        raise SystemExit(f"incorrect solutions passed: {wrong_pass}")


if __name__ == "__main__":
    main()
