"""rLLM's sandboxed flow on ray_sandbox, graded on branches of one rollout.

    # rLLM is not on PyPI: put a checkout of github.com/rllm-org/rllm on PYTHONPATH
    PYTHONPATH=/path/to/rllm python examples/rllm_oracle_flow.py

``install()`` adds the backend name ``ray_sandbox`` to rLLM's ``create_sandbox`` (what
``--sandbox-backend ray_sandbox`` selects); rLLM's ``OracleHarness`` (its no-LLM flow) runs
a Harbor-style task's ``solution/solve.sh`` in it, and rLLM's ``ShellScriptEvaluator`` runs
``tests/test.sh``. The rollout's sandbox is forked before grading and one branch is broken
on purpose: each copy is graded on its own state.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from rllm.eval.script_evaluator import ShellScriptEvaluator
from rllm.harnesses.oracle import OracleHarness
from rllm.sandbox.sandboxed_flow import create_sandbox  # noqa: F401 - replaced by install()
from rllm.types import AgentConfig, Task

from ray_sandbox.integrations import rllm as ray_sandbox_rllm


def task_dir(root: Path) -> Path:
    task = root / "t1"
    (task / "solution").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "solution" / "solve.sh").write_text("#!/bin/sh\necho solved > answer.txt\n")
    (task / "tests" / "test.sh").write_text(
        '#!/bin/sh\nif [ "$(cat /app/answer.txt)" = solved ]; then echo 1; else echo 0; fi'
        " > /logs/verifier/reward.txt\n")
    return task


def main() -> None:
    ray_sandbox_rllm.install(cpu=0.25)
    from rllm.sandbox import sandboxed_flow

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        task = Task(id="t1", instruction="write 'solved' to /app/answer.txt",
                    metadata={"workdir": "/app"}, dataset_dir=root,
                    sub_dir=task_dir(root).relative_to(root))
        sb = sandboxed_flow.create_sandbox("ray_sandbox", name="rllm-t1",
                                           image="ray-sandbox/python:latest")
        branches = []
        try:
            sb.exec("mkdir -p /app")
            config = AgentConfig(base_url="http://127.0.0.1:9/v1", model="none", session_uid="s")
            episode = OracleHarness().run(task, config, env=sb)
            branches = sb.fork(2)
            branches[1].exec("echo wrong > /app/answer.txt")
            for name, s in [("rollout", sb), ("branch 0", branches[0]),
                            ("branch 1 (broken)", branches[1])]:
                print(f"{name}: reward {ShellScriptEvaluator(s).evaluate(task, episode).reward}")
        finally:
            for s in (*branches, sb):
                s.close()


if __name__ == "__main__":
    main()
