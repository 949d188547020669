"""mini-swe-agent on ray_sandbox, with a rollout that branches (docs/integrations.md).

    pip install -e '.[minisweagent,ray]'
    python examples/minisweagent_branching.py [--branches 4]

mini-swe-agent's own ``DefaultAgent`` runs with its scripted ``DeterministicModel`` (no LLM
here) in ``RaySandboxEnvironment``, chosen by import path as any environment is. The shared
prefix of the trajectory (write a module with a bug and its test, run the test) runs once;
the environment is then forked ``--branches`` ways (files, processes and memory copied) and
each branch's "policy" tries its own fix and submits. The test outcome is each branch's
reward: a group of rollouts from one state, as GRPO-style training wants, without replaying
the prefix. Each copy reserves the source's resources in Ray (a quarter core here, so that a
laptop-sized local cluster holds the trunk and its branches; a fork waits for room like any
create).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")

from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.environments import get_environment  # noqa: E402
from minisweagent.models.test_models import DeterministicModel, make_output  # noqa: E402

ENV = "ray_sandbox.integrations.minisweagent.RaySandboxEnvironment"
PREFIX = [
    ("write the module and its test", "mkdir -p /work && cd /work && "
     "printf 'def add(a, b):\\n    return a - b\\n' > calc.py && "
     "printf 'from calc import add\\nassert add(2, 3) == 5\\n' > test_calc.py"),
    ("run the test", "cd /work && python3 test_calc.py"),
]
# what each branch's policy tries: only "+" fixes it
FIXES = ["a + b", "a * b", "b - a", "a + b + 0"]
SUBMIT = ("cd /work && python3 test_calc.py >/dev/null 2>&1 && "
          "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat calc.py || echo FAILED")


def agent(env, steps: list[tuple[str, str]], step_limit: int) -> DefaultAgent:
    model = DeterministicModel(outputs=[make_output(t, [{"command": c}]) for t, c in steps])
    return DefaultAgent(model, env, system_template="You fix bugs.",
                        instance_template="{{task}}", step_limit=step_limit, cost_limit=0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--branches", type=int, default=4)
    args = ap.parse_args()

    env = get_environment({"environment_class": ENV, "image": "ray-sandbox/python:latest",
                           "cwd": "/", "timeout": 30, "cpu": 0.25,
                           "env": {"PYTHONDONTWRITEBYTECODE": "1"}})
    branches = []
    try:
        prefix = agent(env, PREFIX, step_limit=len(PREFIX))
        print("prefix:", prefix.run("make add() add")["exit_status"])  # LimitsExceeded
        branches = env.fork(args.branches)
        for i, branch in enumerate(branches):
            fix = FIXES[i % len(FIXES)]
            steps = [(f"try {fix}", f"cd /work && sed -i 's/a - b/{fix}/' calc.py"),
                     ("submit", SUBMIT), ("give up", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")]
            result = agent(branch, steps, step_limit=3).run("make add() add")
            reward = 1.0 if "return a +" in result.get("submission", "") else 0.0
            print(f"branch {i}: {fix!r:12} -> {result['exit_status']}, reward {reward}")
    finally:
        for e in (*branches, env):
            e.cleanup()


if __name__ == "__main__":
    main()
