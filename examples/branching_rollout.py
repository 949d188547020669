"""Branching rollout: share the first turns of an agent trajectory, then explore k branches.

    .venv/bin/python examples/branching_rollout.py

The "agent" here is a stand-in that writes code into the sandbox and runs it. The first
``BRANCH_AT`` turns (set up a project, install data) run once; the sandbox is then forked
``K`` ways (files, memory and running processes are copied) and each branch tries a different
next step. Every branch reseeds its own PRNG from the fresh per-copy seed the runtime writes.
"""

from __future__ import annotations

import ray

import ray_sandbox as sandbox
from ray_sandbox.actor.rollout import branching_rollout

TOTAL_TURNS, BRANCH_AT, K = 6, 4, 4

PREFIX = [
    "mkdir -p /app && cd /app && echo 'numbers = list(range(1, 101))' > data.py",
    "cd /app && echo 'from data import numbers' > solve.py",
    "cd /app && echo 'print(\"prefix sum\", sum(numbers))' >> solve.py",
    "cd /app && python3 solve.py",
]


def turn(sb, i: int, branch: int | None) -> str:
    if branch is None:
        cmd = PREFIX[i]
    elif i == BRANCH_AT:  # each branch takes its own step, with its own randomness
        cmd = ("cd /app && python3 -c \"import random; random.seed(open('/.rsb/run/seed').read());"
               f" print('branch {branch} draws', random.randint(1, 100))\" > draw.txt; "
               f"echo 'print(\"branch {branch}:\", sum(n ** {branch + 1} for n in numbers))'"
               " >> solve.py")
    else:
        cmd = "cd /app && cat draw.txt && python3 solve.py"
    return ray.get(sb.exec.remote(cmd)).stdout


def main() -> None:
    ray.init()
    sb = sandbox.create(image="ray-sandbox/python", cpu=0.25, memory="256Mi")
    try:
        tree = branching_rollout(sb, turn, total_turns=TOTAL_TURNS, branch_at=BRANCH_AT, k=K)
    finally:
        ray.get(sb.terminate.remote())
    for b, results in enumerate(tree.branches):
        print(f"--- branch {b}\n{results[-1]}")
    print(f"turns executed: {tree.turns_executed} (linear: {tree.linear_turns}, "
          f"saved {tree.turns_saved})")
    sandbox.shutdown()


if __name__ == "__main__":
    main()
