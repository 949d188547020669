"""Framework backends (ray_sandbox/integrations, docs/integrations.md), each driven by the
framework's own released code against real sandboxes of the module's Ray cluster.

Frameworks on PyPI run in a venv of their own (:func:`framework_venv`: the framework's
release, this checkout and the test's own Ray, built once and kept under
``~/.cache/ray_sandbox/framework-venvs``), in a subprocess whose Ray driver joins the
module's cluster. Building one needs the network and ~1-2 GB, so it happens under
``RAY_SANDBOX_HEAVY=1``; a venv built before is used by every run. Frameworks that are not
on PyPI (uni-agent, rLLM, open-instruct) run from a checkout named by an environment
variable, in this process, and are skipped without one (the skip says which).
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import types
import urllib.request
from pathlib import Path

import pytest

from ray_sandbox.runtime.errors import (
    ConfigError,
    SandboxFileNotFoundError,
    SandboxIsADirectoryError,
    SandboxNotFoundError,
)
from tests.fx_hostile import HEAVY
from tests.fx_runtime import leftovers, leftovers_after_teardown

REPO = Path(__file__).resolve().parent.parent
VENVS = Path(os.environ.get("RAY_SANDBOX_FRAMEWORK_VENVS")
             or Path.home() / ".cache" / "ray_sandbox" / "framework-venvs")
IMAGE = "ray-sandbox/python:latest"
MINI_SWE_AGENT = "mini-swe-agent==2.4.6"


# --- venvs of released frameworks ----------------------------------------------------------

def framework_venv(name: str, requirements: list[str], extras: str = "ray") -> Path:
    """A venv holding ``requirements`` from PyPI, this checkout (editable, ``extras``) and
    Ray of the test's version (so its driver joins the test's cluster); built once (under
    RAY_SANDBOX_HEAVY=1) and reused while what it holds is the same."""
    import ray

    spec = [*requirements, "-e", f"{REPO}[{extras}]", f"ray[default]=={ray.__version__}"]
    key = hashlib.sha256(json.dumps([sys.version, spec]).encode()).hexdigest()[:12]
    venv = VENVS / f"{name}-{key}"
    if (venv / "READY").exists():
        return venv
    if not HEAVY:
        pytest.skip(f"the {name} venv ({' '.join(requirements)}) is not built: "
                    "RAY_SANDBOX_HEAVY=1 builds it once (from PyPI, ~1-2 GB)")
    VENVS.mkdir(parents=True, exist_ok=True)
    with open(VENVS / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another run building it: wait, then use it
        if (venv / "READY").exists():
            return venv
        subprocess.run(["rm", "-rf", str(venv)], check=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *spec],
                           capture_output=True, text=True, timeout=1500)
        if r.returncode != 0:
            subprocess.run(["rm", "-rf", str(venv)], check=True)
            pytest.fail(f"pip install {' '.join(spec)} failed:\n{r.stderr[-3000:]}")
        (venv / "READY").write_text(" ".join(spec))
    return venv


def run_in_venv(venv: Path, script: str, *args: str, env: dict[str, str],
                timeout: float = 300) -> dict:
    """Run ``script`` with the venv's Python in its own process group; returns the JSON it
    printed after ``RESULT``."""
    proc = subprocess.Popen([str(venv / "bin" / "python"), "-c", script, *args],
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out = proc.communicate(timeout=timeout)[0].decode(errors="replace")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this test started
            proc.wait()
    assert proc.returncode == 0, out[-6000:]
    line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, out[-6000:]
    return json.loads(line[len("RESULT "):])


def ray_env(ray) -> dict[str, str]:
    """What a subprocess needs to drive the module's cluster."""
    return {"RAY_ADDRESS": ray.get_runtime_context().gcs_address}


def checkout(variable: str, package: str) -> Path:
    """The source checkout of a framework that is not on PyPI, put on sys.path."""
    src = os.environ.get(variable)
    if not src or not (Path(src) / package).is_dir():
        pytest.skip(f"{package} is not on PyPI: set {variable} to a checkout of its "
                    "repository to run this test")
    if src not in sys.path:
        sys.path.insert(0, src)
    return Path(src)


def assert_no_leftovers(home: Path) -> None:
    assert leftovers_after_teardown(home) == {}, leftovers(home)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- mini-swe-agent ---------------------------------------------------------------------------

MINI_SCRIPT = r"""
import json, os, sys
import ray
from minisweagent.agents.default import DefaultAgent
from minisweagent.environments import get_environment
from minisweagent.models.test_models import DeterministicModel, make_output

ENV = "ray_sandbox.integrations.minisweagent.RaySandboxEnvironment"
env = get_environment({"environment_class": ENV, "image": sys.argv[1], "cwd": "/tmp",
                       "timeout": 20, "env": {"GREETING": "hi", "PYTHONDONTWRITEBYTECODE": "1"},
                       "forward_env": ["FROM_HOST"],
                       "max_output_bytes": 65536})
out = {"type": env.serialize()["info"]["config"]["environment_type"]}
steps = [
    ("write the module", "mkdir -p /tmp/proj && cd /tmp/proj && "
     "printf 'def add(a, b):\n    return a - b\n' > calc.py && "
     "printf 'from calc import add\nassert add(2, 3) == 5\n' > test_calc.py"),
    ("run its test", "cd /tmp/proj && python3 test_calc.py"),
    ("fix it", "cd /tmp/proj && sed -i 's/a - b/a + b/' calc.py"),
    ("submit", "cd /tmp/proj && python3 test_calc.py && "
     "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat calc.py"),
]
model = DeterministicModel(outputs=[make_output(t, [{"command": c}]) for t, c in steps])
agent = DefaultAgent(model, env, system_template="You fix bugs.", instance_template="{{task}}",
                     step_limit=10, cost_limit=0)
out["run"] = agent.run("make add() add")
out["saw_failure"] = any("AssertionError" in json.dumps(m) for m in agent.messages)

x = env.execute
out["plain"] = x({"command": "echo out; echo err >&2; echo $GREETING $FROM_HOST; pwd"})
out["cwd"] = x({"command": "pwd"}, cwd="/tmp/proj")
out["timeout"] = x({"command": "echo started; sleep 60"}, timeout=2)
out["huge"] = x({"command": "head -c 1000000 /dev/zero | tr '\\0' a"})
out["bad_cwd"] = x({"command": "true"}, cwd="/nonexistent")

x({"command": "echo base > /tmp/state"})
a, b = env.fork(2)
a.config.user = "65534"
out["fork_a"] = a.execute({"command": "cat /tmp/state; id -u"})
out["fork_b"] = b.execute({"command": "cat /tmp/state; echo b > /tmp/state; cat /tmp/state"})
out["trunk"] = x({"command": "cat /tmp/state"})
ray.get(b._box.handle.terminate.remote())  # the sandbox dies under the environment
out["dead"] = b.execute({"command": "true"})
for e in (env, a, b, env):  # the framework's cleanup path; a second call is a no-op
    e.cleanup()
out["after_cleanup"] = env.execute({"command": "true"})
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def mini_venv() -> Path:
    return framework_venv("mini-swe-agent", [MINI_SWE_AGENT], extras="ray,minisweagent")


def test_minisweagent_agent_solves_a_task_in_our_environment(ray_cluster, ray_home, mini_venv,
                                                             default_image):
    out = run_in_venv(mini_venv, MINI_SCRIPT, IMAGE, env={
        **ray_env(ray_cluster), "FROM_HOST": "host", "MSWEA_SILENT_STARTUP": "1"})
    assert out["type"] == "ray_sandbox.integrations.minisweagent.RaySandboxEnvironment"
    # mini-swe-agent's own loop: the failing test was seen, the fix submitted
    assert out["run"]["exit_status"] == "Submitted", out["run"]
    assert out["run"]["submission"] == "def add(a, b):\n    return a + b\n"
    assert out["saw_failure"]
    # stderr folded into output in order; env and forward_env; the config's cwd
    assert out["plain"] == {"output": "out\nerr\nhi host\n/tmp\n", "returncode": 0,
                            "exception_info": ""}
    assert out["cwd"]["output"] == "/tmp/proj\n"
    # a timeout is returncode -1 with the output so far, as mini-swe-agent's envs give it
    t = out["timeout"]
    assert (t["returncode"], t["output"]) == (-1, "started\n"), t
    assert "timed out after 2 seconds" in t["exception_info"]
    assert t["extra"]["exception_type"] == "TimeoutError"
    # output past max_output_bytes is dropped on the host and said so
    h = out["huge"]
    assert h["returncode"] == 0 and h["extra"]["truncated"] is True
    assert h["output"].startswith("a" * 65536) and "truncated" in h["output"][65536:]
    # a command that cannot start is an error result naming ours
    assert out["bad_cwd"]["returncode"] == -1
    assert out["bad_cwd"]["extra"]["exception_type"] == "ExecError", out["bad_cwd"]
    # forks branch the sandbox: each copy sees the trunk's state and changes only its own
    assert out["fork_a"]["output"] == "base\n65534\n"
    assert out["fork_b"]["output"] == "base\nb\n"
    assert out["trunk"]["output"] == "base\n"
    # a dead sandbox and a cleaned-up environment are error results, not hangs
    assert out["dead"]["returncode"] == -1
    assert out["dead"]["extra"]["exception_type"] == "SandboxNotFoundError", out["dead"]
    assert out["after_cleanup"]["returncode"] == -1
    assert_no_leftovers(ray_home)
