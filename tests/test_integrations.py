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
import tomllib
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
from tests.fx_hostile import HEAVY, heavy
from tests.fx_runtime import leftovers, leftovers_after_teardown

REPO = Path(__file__).resolve().parent.parent
VENVS = Path(os.environ.get("RAY_SANDBOX_FRAMEWORK_VENVS")
             or Path.home() / ".cache" / "ray_sandbox" / "framework-venvs")
IMAGE = "ray-sandbox/python:latest"
MINI_SWE_AGENT = "mini-swe-agent==2.4.6"


# --- venvs of released frameworks ----------------------------------------------------------

def framework_venv(name: str, requirements: list[str], extras: str | None = "ray") -> Path:
    """A venv holding ``requirements`` from PyPI, this checkout (editable, ``extras``; not at
    all with None) and,
    with the ``ray`` extra, Ray of the test's version (so its driver joins the test's
    cluster); built once (under RAY_SANDBOX_HEAVY=1) and reused while what it holds is the
    same."""
    import ray

    spec = [*requirements, "-e", f"{REPO}[{extras}]"] if extras is not None else requirements
    if "ray" in (extras or "").split(","):
        spec.append(f"ray[default]=={ray.__version__}")
    key = hashlib.sha256(json.dumps([sys.version, spec, _declared(extras)]).encode()
                         ).hexdigest()[:12]
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


def _declared(extras: str | None) -> list[str]:
    """What this checkout's pyproject asks for with ``extras``: a change rebuilds the venv."""
    if extras is None:
        return []
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    optional = project.get("optional-dependencies", {})
    return [*project["dependencies"], *(d for e in extras.split(",") for d in optional.get(e, []))]


def package_dir(name: str, requirements: list[str]) -> Path:
    """``requirements`` alone (no dependencies) in a directory for sys.path, built once
    under RAY_SANDBOX_HEAVY=1 like :func:`framework_venv`."""
    key = hashlib.sha256(json.dumps([sys.version, requirements]).encode()).hexdigest()[:12]
    target = VENVS / f"{name}-{key}"
    if (target / "READY").exists():
        return target
    if not HEAVY:
        pytest.skip(f"{' '.join(requirements)} is not fetched: RAY_SANDBOX_HEAVY=1 fetches it")
    VENVS.mkdir(parents=True, exist_ok=True)
    with open(VENVS / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "READY").exists():
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                            "--target", str(target), *requirements], check=True, timeout=600)
            (target / "READY").write_text(" ".join(requirements))
    return target


def run_in_venv(venv: Path, script: str, *args: str, env: dict[str, str],
                timeout: float = 300) -> dict:
    """Run ``script`` with the venv's Python in its own process group; returns the JSON it
    printed after ``RESULT``."""
    out = run_output(venv, ["-c", script, *args], env=env, timeout=timeout)
    line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, out[-6000:]
    return json.loads(line[len("RESULT "):])


def run_output(venv: Path, argv: list[str], *, env: dict[str, str], timeout: float = 300
               ) -> str:
    """The output of the venv's Python with ``argv``, run in its own process group; it must
    succeed."""
    proc = subprocess.Popen([str(venv / "bin" / "python"), *argv],
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
    return out


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


def test_minisweagent_branching_example(ray_cluster, ray_home, mini_venv, default_image):
    out = run_output(mini_venv, [str(REPO / "examples" / "minisweagent_branching.py")],
                     env=ray_env(ray_cluster))
    rewards = [line.rsplit(" ", 1)[1] for line in out.splitlines()
               if line.startswith("branch ")]
    assert rewards == ["1.0", "0.0", "0.0", "1.0"], out[-3000:]
    assert_no_leftovers(ray_home)


# --- veRL uni-agent (not on PyPI) -------------------------------------------------------------

UNI_AGENT_SRC = "RAY_SANDBOX_UNI_AGENT_SRC"


def fetch(url: str, attempts: int = 40) -> bytes:
    """GET ``url``, waiting (bounded) for its server to come up."""
    for i in range(attempts):
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return r.read()
        except OSError:
            if i == attempts - 1:
                raise
            time.sleep(0.25)
    raise AssertionError("unreachable")


def test_uni_agent_provider_runs_commands_files_and_a_port(ray_cluster, ray_home, default_image,
                                                          tmp_path):
    checkout(UNI_AGENT_SRC, "uni_agent")
    from uni_agent.sandbox import SandboxBackend, SandboxConfig, build_sandbox

    from ray_sandbox.integrations import uni_agent as ours

    port = free_port()
    sb = build_sandbox(SandboxConfig(provider="ray_sandbox", image=IMAGE, runtime_timeout=600,
                                     sandbox_kwargs={"network": "sandbox",
                                                     "expose_ports": [port]}))
    assert isinstance(sb, ours.RaySandbox) and isinstance(sb, SandboxBackend)
    assert sb.config.ttl_seconds == 600

    async def main() -> None:
        async with sb:  # uni-agent's own lifecycle: start (with its retries), then stop
            r = await sb.exec_shell("echo $X; pwd; echo e >&2; exit 3", workdir="/tmp",
                                    env={"X": "y"})
            assert (r.exit_code, r.stdout, r.stderr) == (3, "y\n/tmp\n", "e\n")
            t = await sb.exec(["sh", "-c", "echo early; sleep 60"], timeout=1)
            assert (t.exit_code, t.stdout) == (-1, "early\n") and "timed out" in t.stderr
            data = bytes(range(256)) * 4
            await sb.write_file("/srv/d/blob.bin", data)
            assert await sb.read_file("/srv/d/blob.bin") == data
            with pytest.raises(SandboxFileNotFoundError):  # a FileNotFoundError, as local's
                await sb.read_file("/srv/none")
            (tmp_path / "up" / "sub").mkdir(parents=True)
            (tmp_path / "up" / "sub" / "f.txt").write_text("hello")
            await sb.upload(tmp_path / "up", "/srv/up")
            await sb.download("/srv/up", tmp_path / "down")
            await sb.download("/srv/d/blob.bin", tmp_path / "blob.bin")
            assert (tmp_path / "down" / "sub" / "f.txt").read_text() == "hello"
            assert (tmp_path / "blob.bin").read_bytes() == data

            # forked before the port serves: gVisor cannot save an open TCP connection
            (copy,) = await sb.fork(1)
            try:
                assert await copy.read_file("/srv/d/blob.bin") == data
                ray_cluster.get(copy.box.handle.terminate.remote())  # dies under uni-agent
                assert not await copy.is_alive()
                with pytest.raises(SandboxNotFoundError):  # exec re-raises when not alive
                    await copy.exec(["true"])
            finally:
                await copy.stop()

            await sb.exec_shell(f"cd /srv && (setsid python3 -m http.server {port} "
                                ">/dev/null 2>&1 &)")
            url = await sb.expose_port(port)
            assert fetch(f"{url}/d/blob.bin") == data
            with pytest.raises(ConfigError):
                await sb.expose_port(port + 1)
        assert not await sb.is_alive()

    asyncio.run(main())
    assert_no_leftovers(ray_home)


# --- rLLM (not on PyPI) -------------------------------------------------------------------------

RLLM_SRC = "RAY_SANDBOX_RLLM_SRC"


def harbor_style_task(root: Path) -> Path:
    task = root / "t1"
    (task / "solution").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "solution" / "solve.sh").write_text("#!/bin/sh\necho solved > answer.txt\n"
                                                "echo done\n")
    (task / "tests" / "test.sh").write_text(
        '#!/bin/sh\nif [ "$(cat /app/answer.txt)" = solved ]; then echo 1; else echo 0; fi'
        " > /logs/verifier/reward.txt\n")
    return task


def test_rllm_sandboxed_flow_runs_on_ours(ray_cluster, ray_home, default_image, tmp_path):
    checkout(RLLM_SRC, "rllm")
    from rllm.eval.script_evaluator import ShellScriptEvaluator
    from rllm.harnesses.oracle import OracleHarness
    from rllm.sandbox import sandboxed_flow
    from rllm.sandbox.protocol import Sandbox, _safe_exec
    from rllm.types import AgentConfig, Task

    from ray_sandbox.integrations import rllm as ours

    ours.install(max_output_bytes=4096)
    ours.install()  # idempotent
    with pytest.raises(ValueError, match="Unknown sandbox backend"):  # other names: rLLM's
        sandboxed_flow.create_sandbox("nope", name="x", image=IMAGE)
    sb = sandboxed_flow.create_sandbox("ray_sandbox", name="rllm-t1", image=IMAGE)
    assert isinstance(sb, ours.RLLMSandbox) and isinstance(sb, Sandbox)
    task = Task(id="t1", instruction="write solved to /app/answer.txt",
                metadata={"workdir": "/app"}, dataset_dir=tmp_path,
                sub_dir=harbor_style_task(tmp_path).relative_to(tmp_path))
    copies = []
    try:
        sb.exec("mkdir -p /app")
        config = AgentConfig(base_url="http://127.0.0.1:9/v1", model="none", session_uid="s")
        episode = OracleHarness().run(task, config, env=sb)  # rLLM's no-LLM flow
        assert "done" in episode.model_dump_json()
        # branch after the rollout: one copy keeps the answer, the other breaks it
        copies = good, bad = sb.fork(2)
        bad.exec("echo wrong > /app/answer.txt")
        rewards = [ShellScriptEvaluator(s).evaluate(task, episode).reward
                   for s in (good, bad, sb)]
        assert rewards == [1.0, 0.0, 1.0]

        with pytest.raises(RuntimeError, match=r"Command failed \(exit 3\)"):
            sb.exec("echo oops >&2; exit 3")
        assert "oops" in _safe_exec(sb, "echo oops >&2; exit 3")  # rLLM's own catch
        with pytest.raises(RuntimeError, match="timed out"):
            sb.exec("sleep 60", timeout=1)
        assert sb.exec("id -u", user="65534") == "65534\n"
        assert sb.exec("head -c 100000 /dev/zero | tr '\\0' a") == "a" * 4096
        ray_cluster.get(bad._require().handle.terminate.remote())  # dies under rLLM
        assert not bad.is_alive()
        with pytest.raises(SandboxNotFoundError):
            bad.exec("true")
    finally:
        for s in (*copies, sb):
            s.close()  # rLLM's cleanup path; closing twice is a no-op
        sb.close()
    assert not sb.is_alive()
    assert_no_leftovers(ray_home)


# --- open-instruct (not on PyPI) ----------------------------------------------------------------

OPEN_INSTRUCT_SRC = "RAY_SANDBOX_OPEN_INSTRUCT_SRC"


def open_instruct_backends(src: Path):
    """open-instruct's real ``environments/backends.py``. The package's ``__init__`` imports
    the GPU stack (torch, vllm-side modules), so the subpackage is entered without it; the
    module's own dependency, Docker's SDK, must be importable."""
    target = package_dir("docker-sdk", ["docker==7.1.0"])  # its deps are the test venv's
    if str(target) not in sys.path:
        sys.path.insert(0, str(target))
    import open_instruct

    name = "open_instruct.environments"
    if name not in sys.modules:
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(src / "open_instruct" / "environments")]
        sys.modules[name] = pkg
        open_instruct.environments = pkg
    from open_instruct.environments import backends

    return backends


def test_open_instruct_backend_contract(ray_cluster, ray_home, default_image):
    backends = open_instruct_backends(checkout(OPEN_INSTRUCT_SRC, "open_instruct"))
    from ray_sandbox.integrations import open_instruct as ours

    ours.install()
    b = backends.create_backend("ray_sandbox", image=IMAGE, timeout=2, mem_limit="512m")
    assert isinstance(b, backends.SandboxBackend)
    assert b.config.memory == 512 * 2**20
    with pytest.raises(RuntimeError, match="not started"):
        b.run_command("true")
    with pytest.raises(ValueError, match="Unknown backend type"):  # other names: theirs
        backends.create_backend("nope")
    b.start()
    copy = None
    try:
        r = b.run_command("echo out; echo err >&2; exit 4")
        assert isinstance(r, backends.ExecutionResult)
        assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 4)
        t = b.run_command("echo partial; sleep 60")
        assert (t.exit_code, t.stdout) == (124, "partial\n")
        assert t.stderr.startswith("Command timed out after 2s.")
        h = b.run_command("head -c 1500000 /dev/zero | tr '\\0' a")
        assert h.exit_code == 0 and h.stdout == "a" * 1_000_000
        b.write_file("/testbed/input/a.txt", "héllo")
        assert b.read_file("/testbed/input/a.txt") == "héllo"
        assert b.read_file("/testbed/input/a.txt", binary=True) == "héllo".encode()
        with pytest.raises(FileNotFoundError):  # DockerBackend's; ours is one
            b.read_file("/testbed/none")
        with pytest.raises(SandboxIsADirectoryError) as err:
            b.read_file("/testbed")
        assert isinstance(err.value, IsADirectoryError)  # DockerBackend's
        (copy,) = b.fork(1)
        assert copy.read_file("/testbed/input/a.txt") == "héllo"
        ray_cluster.get(copy._require().handle.terminate.remote())  # dies under it
        with pytest.raises(SandboxNotFoundError):
            copy.run_command("true")
    finally:
        for x in (copy, b, b):
            if x is not None:
                x.close()
    assert_no_leftovers(ray_home)


# --- SkyRL, through Harbor --------------------------------------------------------------------

# The keys of SkyRL's harbor_trial_config/default.yaml (examples/train_integrations/harbor/ of
# NovaSky-AI/SkyRL) that reach the environment, with its values; HarborGenerator adds the task.
SKYRL_DEFAULTS = {
    "timeout_multiplier": 1.0,
    "agent": {"name": "oracle", "override_timeout_sec": 120},
    "environment": {"type": "daytona", "override_cpus": 1, "override_memory_mb": 1024,
                    "override_storage_mb": 1024, "suppress_override_warnings": True,
                    "kwargs": {"auto_stop_interval_mins": 30}},
    "verifier": {"disable": False},
}

SKYRL_SCRIPT = r"""
import asyncio, copy, json, sys
from harbor.models.trial.config import TrialConfig
from harbor.trial.trial import Trial
from ray_sandbox.integrations.skyrl import IMPORT_PATH, trial_config

async def main(defaults, task, trials):
    defaults = json.loads(defaults)
    defaults["trials_dir"] = trials
    out = {}
    # only the import path set, as a command-line override can: the Daytona key is refused
    unfixed = copy.deepcopy(defaults)
    unfixed["environment"]["import_path"] = IMPORT_PATH
    unfixed["task"] = {"path": task}
    try:
        await (await Trial.create(TrialConfig.model_validate(unfixed))).run()
        out["unfixed"] = "accepted"
    except Exception as exc:
        out["unfixed"] = f"{type(exc).__name__}: {exc}"
    config = trial_config(defaults)
    config["task"] = {"path": task}  # what HarborGenerator does per trajectory
    result = await (await Trial.create(TrialConfig.model_validate(config))).run()
    out["rewards"] = result.verifier_result.rewards if result.verifier_result else None
    out["exception"] = str(result.exception_info) if result.exception_info else None
    print("RESULT " + json.dumps(out))

asyncio.run(main(*sys.argv[1:]))
"""


@heavy  # ~70 s (a Ray cluster of Harbor's process); tests/test_harbor.py covers the environment
def test_skyrl_harbor_trial_config_selects_ray_sandbox(pushed_busybox):
    from ray_sandbox.integrations.skyrl import IMPORT_PATH, trial_config
    from tests.fx_images import scratch_dir
    from tests.test_harbor import HARBOR, run_in_harbor_venv, write_task

    if not HARBOR.exists():
        pytest.skip("Harbor needs Python >= 3.12 and .venv-harbor is not built")
    config = trial_config(SKYRL_DEFAULTS, network="public")
    assert config["environment"]["import_path"] == IMPORT_PATH
    assert config["environment"]["kwargs"] == {"network": "public"}
    assert SKYRL_DEFAULTS["environment"]["kwargs"] == {"auto_stop_interval_mins": 30}
    with scratch_dir("rsb-skyrl-") as work:
        task = write_task(work, pushed_busybox, "127.0.0.1", 9)
        out = run_in_harbor_venv([str(HARBOR.parent / "python"), "-c", SKYRL_SCRIPT,
                                  json.dumps(SKYRL_DEFAULTS), str(task), str(work / "trials")],
                                 work)
    seen = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    assert "auto_stop_interval_mins" in seen["unfixed"], seen["unfixed"]
    assert seen["exception"] is None, seen["exception"]
    assert seen["rewards"] == {"reward": 1.0}


# --- options, before any sandbox -----------------------------------------------------------

def test_adapter_options_are_checked_before_any_sandbox(monkeypatch):
    from ray_sandbox.integrations._box import Transport, make_config
    from ray_sandbox.integrations.open_instruct import RaySandboxBackend, docker_size
    from ray_sandbox.integrations.rllm import RLLMSandbox
    from ray_sandbox.integrations.skyrl import trial_config

    # a field the framework sets cannot also come from the sandbox options
    with pytest.raises(ConfigError, match="image"):
        make_config({"image": "other"}, image=IMAGE)
    with pytest.raises(ConfigError, match="unknown|invalid"):
        make_config({"cpus": 1})
    with pytest.raises(ConfigError, match="invalid"):
        RLLMSandbox(image=IMAGE, memory="1Mi")
    # the service needs a token, which only the environment carries
    monkeypatch.delenv("RAY_SANDBOX_API_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="RAY_SANDBOX_API_TOKEN"):
        Transport(service_url="http://127.0.0.1:9").open(make_config({}))
    # Docker's binary units for open-instruct's mem_limit
    assert [docker_size(v) for v in ("4g", "512m", "1024", 7)] == [4 << 30, 512 << 20, 1024, 7]
    with pytest.raises(ConfigError):
        RaySandboxBackend(mem_limit="4 gigs")
    # SkyRL's config is rewritten, not changed in place
    original = {"environment": {"type": "daytona", "kwargs": {"auto_stop_interval_mins": 30}}}
    assert trial_config(original)["environment"]["kwargs"] == {}
    assert original["environment"]["kwargs"] == {"auto_stop_interval_mins": 30}
