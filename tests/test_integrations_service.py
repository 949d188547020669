"""Framework backends over the HTTP service (ray_sandbox.client): tinker-cookbook's own
Harbor RL tools (``HarborBashTool`` and the code-grading ``HarborReward``) drive sandboxes of
a real service from a venv of the released tinker-cookbook that has no Ray at all.

The venv (tinker-cookbook 0.5.8 with the CPU build of torch, ~1.6 GB) is built under
RAY_SANDBOX_HEAVY=1 and reused after (tests/test_integrations.py, ``framework_venv``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fx_service import TOKENS, Service
from tests.test_integrations import IMAGE, REPO, framework_venv, run_in_venv, run_output

# 0.6.1, the newest, needs tml-renderers>=0.4.1, which PyPI does not have; torch's CPU build
# keeps the venv ~1.6 GB instead of ~6 GB of CUDA wheels
TINKER = ["tinker-cookbook==0.5.8", "torch==2.13.0+cpu"]

TINKER_SCRIPT = r"""
import asyncio, importlib.util, json, sys
from pathlib import Path
from tinker_cookbook.recipes.harbor_rl.harbor_tools import HarborBashTool, HarborReward
from tinker_cookbook.sandbox import SandboxInterface, SandboxTerminatedError
from tinker_cookbook.tool_use.types import ToolInput
from ray_sandbox.integrations.tinker_cookbook import harbor_factory

async def main(image, task):
    task = Path(task)
    sb = await harbor_factory(image=image)(task / "environment", 600)  # the recipe's call
    out = {"has_ray": importlib.util.find_spec("ray") is not None,
           "protocol": isinstance(sb, SandboxInterface)}
    tool = HarborBashTool(sb, command_timeout=3)

    async def bash(cmd):
        r = await tool.bash.run(ToolInput(arguments={"command": cmd}))
        return json.loads(r.messages[0]["content"])

    good = bad = None
    try:
        out["solve"] = await bash("mkdir -p /app && echo hello > /app/answer.txt; echo ok; pwd")
        out["timeout"] = await bash("echo early; sleep 60")
        out["huge"] = await bash("head -c 100000 /dev/zero | tr '\\0' a")
        good, bad = await sb.fork(2)  # branch the rollout before grading
        await bad.run_command("echo wrong > /app/answer.txt")
        out["rewards"] = [(await HarborReward(task / "tests", s)([]))[0] for s in (sb, good, bad)]
        out["missing"] = (await sb.read_file("/nope")).exit_code
        out["head"] = (await sb.read_file("/app/answer.txt", max_bytes=3)).stdout
        w = await sb.write_file("/app/x/run.sh", "#!/bin/sh\necho ran\n", executable=True)
        out["written"] = w.exit_code
        out["ran"] = (await sb.run_command("./x/run.sh", workdir="/app")).stdout
        await sb.send_heartbeat()
        bad._box.sandbox.terminate()  # the sandbox dies under tinker-cookbook
        for call in (bad.send_heartbeat(), bad.run_command("true")):
            try:
                await call
                out.setdefault("dead", []).append("no error")
            except SandboxTerminatedError:
                out.setdefault("dead", []).append("SandboxTerminatedError")
    finally:
        for s in (sb, good, bad):
            if s is not None:
                await s.cleanup()  # the framework's cleanup path
    print("RESULT " + json.dumps(out))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def harbor_task(root: Path) -> Path:
    task = root / "hello"
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "tests" / "test.sh").write_text(
        '#!/bin/sh\nif [ "$(cat /app/answer.txt)" = hello ]; then echo 1; else echo 0; fi'
        " > /logs/verifier/reward.txt\n")
    return task


@pytest.fixture(scope="module")
def tinker_venv() -> Path:
    return framework_venv("tinker-cookbook", TINKER, extras="client")


def test_tinker_cookbook_grades_rollouts_through_the_service(service: Service, tinker_venv,
                                                              default_image, tmp_path):
    out = run_in_venv(tinker_venv, TINKER_SCRIPT, IMAGE, str(harbor_task(tmp_path)), env={
        "RAY_SANDBOX_URL": service.url, "RAY_SANDBOX_API_TOKEN": TOKENS["alice"]})
    assert out["has_ray"] is False and out["protocol"] is True
    assert out["solve"] == {"exit_code": 0, "stdout": "ok\n/\n", "stderr": ""}
    # a timeout kills the command: timeout(1)'s code, the output so far, a note
    t = out["timeout"]
    assert (t["exit_code"], t["stdout"]) == (124, "early\n") and "timed out" in t["stderr"]
    # the tool asks for 16 KiB of output; the host keeps no more
    assert out["huge"]["stdout"] == "a" * 16384
    # the code-grading path on a branched rollout: the broken branch scores 0
    assert out["rewards"] == [1.0, 1.0, 0.0]
    assert out["missing"] != 0 and out["head"] == "hel"
    assert (out["written"], out["ran"]) == (0, "ran\n")
    assert out["dead"] == ["SandboxTerminatedError", "SandboxTerminatedError"]
    with service.client() as c:  # everything the run made is gone
        assert c.get("/sandboxes").json()["sandboxes"] == []


def test_tinker_cookbook_grading_example(service: Service, tinker_venv, default_image):
    out = run_output(tinker_venv, [str(REPO / "examples" / "tinker_cookbook_grading.py")],
                     env={"RAY_SANDBOX_URL": service.url,
                          "RAY_SANDBOX_API_TOKEN": TOKENS["alice"]})
    rewards = [line.rsplit(" ", 1)[1] for line in out.splitlines()
               if line.startswith("rollout ")]
    assert rewards == ["1.0", "0.0", "0.0", "1.0"], out[-3000:]
    with service.client() as c:
        assert c.get("/sandboxes").json()["sandboxes"] == []
