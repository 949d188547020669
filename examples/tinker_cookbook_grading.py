"""tinker-cookbook's Harbor RL grading on ray_sandbox, for a group of branched rollouts.

    pip install -e '.[tinker-cookbook,ray]'      # or [tinker-cookbook,client] for a service
    python examples/tinker_cookbook_grading.py [--group 4]

The recipe's own tools run unchanged: ``HarborBashTool`` executes the "policy's" commands
(scripted here: this machine has no model) and ``HarborReward`` uploads ``tests/``, runs
``test.sh`` and reads the reward, all through ``SandboxInterface``. The sandbox comes from
``harbor_factory``, the recipe's ``sandbox_factory`` hook; after a shared first turn it is
forked into the group, so every rollout of the group starts from the same state. With
``RAY_SANDBOX_URL`` and ``RAY_SANDBOX_API_TOKEN`` set, sandboxes come from the service
instead of Ray.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from tinker_cookbook.recipes.harbor_rl.harbor_tools import HarborBashTool, HarborReward
from tinker_cookbook.tool_use.types import ToolInput

from ray_sandbox.integrations.tinker_cookbook import harbor_factory

TEST_SH = """#!/bin/sh
if [ "$(cat /app/answer.txt)" = 42 ]; then echo 1; else echo 0; fi > /logs/verifier/reward.txt
"""
ANSWERS = ["42", "41", "6*7", "42"]  # what each rollout of the group writes


async def bash(sandbox, command: str) -> dict:
    result = await HarborBashTool(sandbox, command_timeout=30).bash.run(
        ToolInput(arguments={"command": command}))
    return json.loads(result.messages[0]["content"])


async def main(group: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        task = Path(tmp) / "answer"
        (task / "environment").mkdir(parents=True)
        (task / "tests").mkdir()
        (task / "tests" / "test.sh").write_text(TEST_SH)
        make = harbor_factory(image="ray-sandbox/python:latest", cpu=0.25)
        trunk = await make(task / "environment", 600)  # what the recipe's env builder calls
        rollouts = []
        try:
            print("turn 1:", await bash(trunk, "mkdir -p /app && echo 'notes' > /app/notes.txt"))
            rollouts = await trunk.fork(group)
            for i, sb in enumerate(rollouts):
                answer = ANSWERS[i % len(ANSWERS)]
                await bash(sb, f"echo '{answer}' > /app/answer.txt")
                reward, metrics = await HarborReward(task / "tests", sb)([])
                print(f"rollout {i}: answered {answer!r:6} reward {reward}")
        finally:
            for sb in (*rollouts, trunk):
                await sb.cleanup()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--group", type=int, default=4)
    asyncio.run(main(ap.parse_args().group))
