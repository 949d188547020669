"""The examples run as users run them (their own ``ray.init``, a private sandbox home) and do
what they say, and so does the README's first snippet. The rollout and autoscaling demos have
their own tests."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ray_sandbox.runtime import ImageStore, SandboxRuntime
from ray_sandbox.runtime.paths import images
from tests.fx_hostile import heavy
from tests.fx_runtime import leftovers

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
README = EXAMPLES.parent / "README.md"


def _run(tmp_path: Path, script: str | Path, *args: str, cwd: Path | None = None,
         env: dict[str, str] | None = None) -> str:
    home = tmp_path / "home"
    env = {**os.environ, "RAY_SANDBOX_HOME": str(home), "RAY_SANDBOX_IMAGES": str(images()),
           **(env or {})}
    try:
        proc = subprocess.run([sys.executable, str(EXAMPLES / script), *args], env=env,
                              cwd=cwd, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
    finally:
        SandboxRuntime(home, images=ImageStore(images()))  # reap what a failed run left
    assert leftovers(home) == {}, leftovers(home)
    return proc.stdout


@pytest.mark.timeout(300)
@heavy  # 13 s in CI; test_rollout_demo_main_job runs the pool path
def test_custom_pool_actor_example(tmp_path, default_image):
    out = _run(tmp_path, "custom_pool_actor.py", "--sandboxes", "2", "--jobs", "6")
    lines = out.splitlines()
    assert [ln.split()[-1] for ln in lines[:5]] == ["0", "1", "4", "9", "16"], out
    assert lines[5].startswith("while True") and lines[5].endswith("timed out"), out
    served = {re.search(r"sandbox (\w+)", ln).group(1) for ln in lines[:6]}
    assert len(served) == 2  # both sandboxes served jobs
    assert lines[-1] == "closed 2 sandboxes"


@pytest.mark.timeout(300)
@heavy  # 11 s in CI; tests/test_agent_files.py covers transfers
def test_file_transfer_example(tmp_path, default_image):
    out = _run(tmp_path, "file_transfer.py", "--workdir", str(tmp_path / "work"))
    assert "Training complete" in out
    result = ast.literal_eval(out.strip().splitlines()[-1])
    assert result["exit_code"] == 0 and result["round_trip_identical"] is True
    assert result["outputs"] == ["metrics.json", "weights.bin"]


@pytest.mark.timeout(400)
def test_rollout_demo_main_job(tmp_path, default_image):
    """The README's main command, smaller: every behaviour runs once or more; correct
    solutions pass, wrong/crashing/endless ones do not (the demo exits non-zero if one did)."""
    out = _run(tmp_path, "rollout_demo.py", "--solutions", "12", "--concurrency", "4")
    rows = {m.group(1): (int(m.group(2)), int(m.group(3)), int(m.group(4)))
            for m in re.finditer(r"│ ([\w-]+)\s+│\s+(\d+) │\s+(\d+) │\s+(\d+) │", out)}
    assert set(rows) == {"correct", "wrong", "crashing", "endless", "network-probing",
                         "fork-storm"}, out
    runs, passed, _ = rows["correct"]
    assert passed == runs
    assert rows["wrong"][1] == rows["crashing"][1] == rows["endless"][1] == 0
    assert rows["endless"][2] == rows["endless"][0]  # every endless one timed out
    assert "pass rate" in out


def _readme_snippet(section: str) -> str:
    """The first Python block under the README's ``## section``."""
    body = README.read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"```python\n(.*?)```", body, re.S)
    assert found, f"no Python snippet under '## {section}'"
    return found.group(1)


@pytest.mark.timeout(300)
def test_readme_first_snippet_runs_as_written(tmp_path, default_image):
    """Copied into a file of its own and run in an empty directory, on a Ray cluster of its
    own (``ray.init()`` with ``RAY_ADDRESS=local``: never one another test runs)."""
    script, cwd = tmp_path / "readme_use.py", tmp_path / "cwd"
    script.write_text(_readme_snippet("Use"))
    cwd.mkdir()
    out = _run(tmp_path, script, cwd=cwd, env={"RAY_ADDRESS": "local"})
    assert out.splitlines()[0].startswith("3."), out  # sys.version inside the sandbox
    assert "step,loss\n1,0.5\n" in out, out  # the bundle's file, read inside the sandbox
