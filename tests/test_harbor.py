"""The Harbor environment, end to end: ``harbor run`` (Python >= 3.12, in .venv-harbor) runs a
local task with Harbor's oracle and no-op agents through ``RaySandboxEnvironment``, on a local
Ray cluster that harbor's process starts, pulling the task image from a local registry."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ray_sandbox.runtime import procfs
from tests.fx_hostile import wait_until
from tests.fx_images import scratch_dir
from tests.fx_runtime import leftovers, leftovers_after_teardown

REPO = Path(__file__).resolve().parent.parent
HARBOR = REPO / ".venv-harbor" / "bin" / "harbor"

pytestmark = pytest.mark.skipif(
    not HARBOR.exists(),
    reason="Harbor needs Python >= 3.12 and .venv-harbor is not built: scripts/setup.sh "
    "builds it when a python3.12+ exists (a fresh Debian 12 has only 3.11)",
)

SOLVE = """#!/bin/sh
# The agent phase allowlists only the node's listener.
nc -w 10 {ip} {port} </dev/null && echo "listener: connected" || echo "listener: refused"
nc -w 10 1.1.1.1 53 </dev/null && echo "other: connected" || echo "other: refused"
mkdir -p /app && echo hello > /app/answer.txt
"""

TEST = """#!/bin/sh
# The verifier runs under the task's no-network baseline.
nc -w 10 {ip} {port} </dev/null && echo "listener: connected" || echo "listener: refused"
ok=1
[ "$(cat /app/answer.txt 2>/dev/null)" = hello ] || ok=0
[ -d /tests/fixtures/empty ] || {{ echo "upload lost the empty directory"; ok=0; }}
[ "$(readlink /tests/fixtures/link)" = ../test.sh ] || {{ echo "upload lost the symlink"; ok=0; }}
[ "$(stat -c %a /tests/fixtures/tool.sh)" = 750 ] || {{ echo "upload lost the mode"; ok=0; }}
mkdir -p /logs/verifier/tree/empty
ln -s ../reward.txt /logs/verifier/tree/link
printf x > /logs/verifier/tree/tool.sh && chmod 741 /logs/verifier/tree/tool.sh
echo $ok > /logs/verifier/reward.txt
"""


def write_task(root: Path, image: str, ip: str, port: int) -> Path:
    task = root / "hello"
    for d in ("environment", "solution", "tests/fixtures/empty"):
        (task / d).mkdir(parents=True)
    (task / "instruction.md").write_text("Write 'hello' to /app/answer.txt.\n")
    (task / "task.toml").write_text(f"""schema_version = "1.4"
[environment]
docker_image = "{image}"
cpus = 1
memory_mb = 256
network_mode = "no-network"
[agent]
timeout_sec = 120
network_mode = "allowlist"
allowed_hosts = ["{ip}"]
[verifier]
timeout_sec = 120
""")
    files = {"solution/solve.sh": (SOLVE, 0o755), "tests/test.sh": (TEST, 0o755),
             "tests/fixtures/tool.sh": ("#!/bin/sh\n", 0o750)}
    for rel, (text, mode) in files.items():
        (task / rel).write_text(text.format(ip=ip, port=port))
        (task / rel).chmod(mode)
    (task / "tests/fixtures/link").symlink_to("../test.sh")
    return task


@pytest.fixture
def node_listener() -> Iterator[tuple[str, int]]:
    """A TCP listener on the node's own address, which only an allowlist lets sandboxes
    reach; it accepts and closes connections."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("1.1.1.1", 53))  # sends nothing: only picks the node's source address
        ip = probe.getsockname()[0]
    server = socket.create_server((ip, 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                server.accept()[0].close()
            except TimeoutError:
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield ip, server.getsockname()[1]
    stop.set()
    thread.join()
    server.close()


def processes_mentioning(text: str) -> list[str]:
    return [str(pid) for pid, argv in procfs.cmdlines() if text.encode() in b"\0".join(argv)]


def run_in_harbor_venv(argv: list[str], work: Path) -> str:
    """Run a command of .venv-harbor in its own process group, with a private sandbox home
    and image store, and Ray's files under ``work``; returns its output."""
    home = work / "home"
    env = {
        **os.environ,
        "RAY_SANDBOX_HOME": str(home),
        "RAY_SANDBOX_IMAGES": str(home / "images"),  # a private store: pulled, then removed
        "RAY_TMPDIR": str(work / "ray"),  # the Ray cluster the process starts, findable
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # offline: no model price list download
    }
    proc = subprocess.Popen(argv, env=env, cwd=work, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out = proc.communicate(timeout=240)[0].decode(errors="replace")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this test started
            proc.wait()
    assert proc.returncode == 0, out[-4000:]
    # the host's stock dies with it: its keeper deletes it after the process is gone
    assert leftovers_after_teardown(home) == {}, leftovers(home)
    assert wait_until(lambda: not processes_mentioning(str(home)), 30, interval=0.2), \
        processes_mentioning(str(home))  # no runsc, slirp4netns, DNS helper or keeper
    assert processes_mentioning(str(work / "ray")) == []  # the Ray cluster ended too
    return out


def run_harbor(work: Path, task: Path) -> Path:
    """``harbor run`` of the task with the oracle and the no-op agent; returns the job dir."""
    config = {
        "job_name": "rsb", "jobs_dir": str(work / "jobs"), "n_concurrent_trials": 2,
        "quiet": True,
        "environment": {"import_path": "ray_sandbox.harbor:RaySandboxEnvironment"},
        "agents": [{"name": "oracle"}, {"name": "nop"}],
        "tasks": [{"path": str(task)}],
    }
    (work / "job.json").write_text(json.dumps(config))
    run_in_harbor_venv([str(HARBOR), "run", "-c", str(work / "job.json"), "-y"], work)
    return work / "jobs" / "rsb"


def trials(job: Path) -> dict[str, Path]:
    """Trial directory per agent name."""
    out = {}
    for result in job.glob("*/result.json"):
        out[json.loads(result.read_text())["agent_info"]["name"]] = result.parent
    return out


def test_oracle_scores_1_and_nop_scores_0(pushed_busybox: str,
                                          node_listener: tuple[str, int]) -> None:
    with scratch_dir("rsb-harbor-") as work:
        task = write_task(work, pushed_busybox, *node_listener)
        job = run_harbor(work, task)

        stats = json.loads((job / "result.json").read_text())["stats"]
        assert stats["n_errored_trials"] == 0, stats
        by_agent = trials(job)
        rewards = {agent: json.loads((d / "result.json").read_text())["verifier_result"]
                   for agent, d in by_agent.items()}
        verifier_out = (by_agent["oracle"] / "verifier/test-stdout.txt").read_text()
        assert rewards == {"oracle": {"rewards": {"reward": 1.0}},
                           "nop": {"rewards": {"reward": 0.0}}}, verifier_out

        # The network policy switched per phase: the agent's allowlist, then no network.
        agent_out = (by_agent["oracle"] / "agent/oracle.txt").read_text()
        assert {"listener: connected", "other: refused"} <= set(agent_out.splitlines()), agent_out
        assert "listener: refused" in verifier_out, verifier_out

        # download_dir kept the empty directory, the symlink and the mode.
        tree = by_agent["oracle"] / "verifier/tree"
        assert (tree / "empty").is_dir() and not any((tree / "empty").iterdir())
        assert os.readlink(tree / "link") == "../reward.txt"
        assert (tree / "tool.sh").stat().st_mode & 0o7777 == 0o741


# Drives the environment directly, as Harbor's agents do, and prints what it saw as JSON.
EXEC_CONTRACT = """
import asyncio, json, os, sys
from pathlib import Path
from harbor.models.task.config import EnvironmentConfig
from harbor.models.trial.paths import TrialPaths
from ray_sandbox.harbor import RaySandboxEnvironment

async def main(image: str, work: Path) -> None:
    paths = TrialPaths(work / "trial")
    paths.mkdir()
    (work / "env").mkdir()
    env = RaySandboxEnvironment(
        environment_dir=work / "env", environment_name="t", session_id="t__contract__env",
        trial_paths=paths, task_env_config=EnvironmentConfig(docker_image=image, workdir="/w"),
        sandbox={"pids_limit": 256})
    chunks = []

    async def collect(text, stream):
        chunks.append([stream, text])

    await env.start(force_build=False)
    try:
        sid = env._require().sandbox_id
        pids_max = Path(f"/sys/fs/cgroup/pids/{sid}/pids.max").read_text().strip()
        out = {"exec": await env.exec("echo $FOO; pwd; id -u; exit 3", env={"FOO": "bar"},
                                      user="nobody"),
               "timeout": await env.exec("echo started; sleep 60", timeout_sec=1)}
        with env.scoped_output_callback(collect):
            out["streamed"] = await env.exec("echo one; echo two >&2")
        (work / "tool.sh").write_text("#!/bin/sh")
        os.chmod(work / "tool.sh", 0o750)
        await env.upload_file(work / "tool.sh", "/w/deep/tool.sh")
        await env.download_file("/w/deep/tool.sh", work / "back/tool.sh")
        out = {k: v.model_dump() for k, v in out.items()}
        out["chunks"] = chunks
        out["mode"] = oct((work / "back/tool.sh").stat().st_mode & 0o7777)
        out["pids_max"] = pids_max
    finally:
        await env.stop(delete=True)
    print("RESULT " + json.dumps(out))

asyncio.run(main(sys.argv[1], Path(sys.argv[2])))
"""


def test_exec_and_file_contract(pushed_busybox: str) -> None:
    with scratch_dir("rsb-harbor-") as work:
        python = str(HARBOR.parent / "python")
        out = run_in_harbor_venv([python, "-c", EXEC_CONTRACT, pushed_busybox, str(work)], work)
        seen = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
        # A non-zero exit is a result; env, user and the task's workdir apply.
        assert seen["exec"] == {"stdout": "bar\n/w\n65534\n", "stderr": "", "return_code": 3}
        # A timeout kills the command and answers like timeout(1), with the output so far.
        assert seen["timeout"]["return_code"] == 124
        assert seen["timeout"]["stdout"] == "started\n"
        assert "timed out after 1 s" in seen["timeout"]["stderr"]
        # Harbor's output callback sees the output while the full result still comes back.
        assert seen["streamed"] == {"stdout": "one\n", "stderr": "two\n", "return_code": 0}
        assert sorted(map(tuple, seen["chunks"])) == [("stderr", "two\n"), ("stdout", "one\n")]
        assert seen["mode"] == "0o750"
        # A SandboxConfig field given as the `sandbox` option reached the sandbox.
        assert seen["pids_max"] == "256"


OPTIONS = """
import sys
from ray_sandbox.harbor import RaySandboxEnvironment
for sandbox in ({"nope": 1}, {"image": "busybox"}):
    try:
        RaySandboxEnvironment.parse_options({"sandbox": sandbox})
    except Exception as exc:
        print(" ".join(str(exc).split()))
"""


def test_a_bad_sandbox_option_fails_naming_it() -> None:
    out = subprocess.run([str(HARBOR.parent / "python"), "-c", OPTIONS], capture_output=True,
                         text=True, check=True, timeout=120).stdout
    unknown, owned = out.splitlines()
    assert "unknown sandbox option(s) nope" in unknown
    assert "sandbox option(s) image come from the task" in owned
