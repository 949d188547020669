"""Harbor with a task that has only ``environment/Dockerfile`` (issue 19): ``harbor run``
(in .venv-harbor) builds it once on the node inside gVisor (``docker.build_image``), runs
the oracle and the no-op agent on the built image, and maps ``storage_mb`` to ``disk=``."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from tests.fx_hostile import heavy, wait_until
from tests.fx_images import scratch_dir
from tests.fx_runtime import leftovers, leftovers_after_teardown
from tests.test_harbor import HARBOR, processes_mentioning, trials

pytestmark = pytest.mark.skipif(
    not HARBOR.exists(), reason="Harbor needs Python >= 3.12 and .venv-harbor is not built")

SOLVE = """#!/bin/sh
cat /app/seed.txt > /app/answer.txt
"""

TEST = """#!/bin/sh
ok=1
[ "$(cat /app/answer.txt 2>/dev/null)" = "seed-from-dockerfile" ] || { echo "no answer"; ok=0; }
# storage_mb = 64: the sandbox's writable root is a 64 MiB filesystem
if dd if=/dev/zero of=/app/big bs=1M count=100 2>/dev/null; then echo "no disk cap"; ok=0; fi
rm -f /app/big
echo $ok > /logs/verifier/reward.txt
"""


def write_task(root: Path) -> Path:
    task = root / "built"
    for d in ("environment", "solution", "tests"):
        (task / d).mkdir(parents=True)
    (task / "instruction.md").write_text("Copy /app/seed.txt to /app/answer.txt.\n")
    (task / "environment/Dockerfile").write_text(  # the comment makes every run a new build
        f"FROM ray-sandbox/busybox:latest\n# run {secrets.token_hex(8)}\n"
        "RUN mkdir -p /app /logs/verifier && echo seed-from-dockerfile > /app/seed.txt\n")
    (task / "task.toml").write_text("""schema_version = "1.4"
[environment]
cpus = 1
memory_mb = 256
storage_mb = 64
network_mode = "no-network"
[agent]
timeout_sec = 120
[verifier]
timeout_sec = 120
""")
    for rel, text in (("solution/solve.sh", SOLVE), ("tests/test.sh", TEST)):
        (task / rel).write_text(text)
        (task / rel).chmod(0o755)
    return task


def run_in_harbor_venv(argv: list[str], work: Path, images: Path,
                       timeout: float = 300) -> str:
    """tests/test_harbor.py's runner, with the node's image store instead of a private one
    (the Docker image the build needs is built once per node and cached there)."""
    home = work / "home"
    env = {**os.environ, "RAY_SANDBOX_HOME": str(home), "RAY_SANDBOX_IMAGES": str(images),
           "RAY_TMPDIR": str(work / "ray"), "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    proc = subprocess.Popen(argv, env=env, cwd=work, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out = proc.communicate(timeout=timeout)[0].decode(errors="replace")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this test started
            proc.wait()
    assert proc.returncode == 0, out[-4000:]
    for h in (home, home / "harbor-builds"):  # the trials' home and the builder's
        assert leftovers_after_teardown(h) == {}, leftovers(h)
    assert wait_until(lambda: not processes_mentioning(str(home)), 30, interval=0.2), \
        processes_mentioning(str(home))
    assert processes_mentioning(str(work / "ray")) == []
    return out


def forget_new_builds(image_store, before: set[Path]) -> None:
    """Remove the builds (archives, their store images, lock files) made since ``before``."""
    builds = image_store.root.parent / "builds"
    for path in (set(builds.iterdir()) - before) if builds.is_dir() else ():
        built = path / "built.json"
        if built.is_file():
            image_store.remove(json.loads(built.read_text())["digest"])
            shutil.rmtree(path)
        elif path.is_file():
            path.unlink(missing_ok=True)


def builds_now(image_store) -> set[Path]:
    builds = image_store.root.parent / "builds"
    return set(builds.iterdir()) if builds.is_dir() else set()


@heavy  # 23 s: a docker build in gVisor, then a trial; test_docker.py builds one too
def test_dockerfile_task_is_built_in_gvisor_and_trialled(docker_image, image_store):
    builds = image_store.root.parent / "builds"
    before = builds_now(image_store)
    with scratch_dir("rsb-harbor-docker-") as work:
        task = write_task(work)
        config = {
            "job_name": "rsb", "jobs_dir": str(work / "jobs"), "n_concurrent_trials": 2,
            "quiet": True,
            "environment": {"import_path": "ray_sandbox.harbor:RaySandboxEnvironment"},
            "agents": [{"name": "oracle"}, {"name": "nop"}],
            "tasks": [{"path": str(task)}],
        }
        (work / "job.json").write_text(json.dumps(config))
        try:
            # The node's store: ray-sandbox/docker is built there once per node.
            run_in_harbor_venv([str(HARBOR), "run", "-c", str(work / "job.json"), "-y"], work,
                               images=image_store.root)
            job = work / "jobs" / "rsb"
            stats = json.loads((job / "result.json").read_text())["stats"]
            assert stats["n_errored_trials"] == 0, stats
            rewards = {agent: json.loads((d / "result.json").read_text())["verifier_result"]
                       for agent, d in trials(job).items()}
            assert rewards == {"oracle": {"rewards": {"reward": 1.0}},
                               "nop": {"rewards": {"reward": 0.0}}}, rewards
            made = set(builds.iterdir()) - before
            # both trials, started together, shared one build (its lock file and its dir)
            assert len([p for p in made if p.is_dir()]) == 1, made
        finally:
            forget_new_builds(image_store, before)


TASKS = Path(__file__).resolve().parent.parent / "examples" / "harbor_tasks"


def _oracle_and_nop_job(name: str, work: Path, n: int, tasks: list[Path]) -> dict:
    """A harbor job config: the oracle and nop agents over ``tasks`` on our environment."""
    return {
        "job_name": name, "jobs_dir": str(work / "jobs"), "n_concurrent_trials": n,
        "quiet": True,
        "environment": {"import_path": "ray_sandbox.harbor:RaySandboxEnvironment"},
        "agents": [{"name": "oracle"}, {"name": "nop"}],
        "tasks": [{"path": str(t)} for t in tasks],
    }


@heavy
def test_offline_task_set_oracle_1_nop_0_at_concurrency_4(docker_image, default_image,
                                                          image_store):
    """``harbor run`` of examples/harbor_tasks (8 Dockerfile and 2 Compose tasks FROM the
    offline images)
    with the oracle and the no-op agent at ``n_concurrent_trials=4``: every oracle trial
    scores 1.0, every nop trial 0.0, and each Dockerfile task was built once. Measured
    2026-12-02: 182 s for the 20 trials and 8 builds on the shared 2-core VM at load average
    6-15 (other work)."""
    tasks = sorted(p for p in TASKS.iterdir() if (p / "task.toml").is_file())
    before = builds_now(image_store)
    with scratch_dir("rsb-harbor-set-") as work:
        config = _oracle_and_nop_job("set", work, 4, tasks)
        (work / "job.json").write_text(json.dumps(config))
        try:
            run_in_harbor_venv([str(HARBOR), "run", "-c", str(work / "job.json"), "-y"], work,
                               images=image_store.root, timeout=1200)
            results = [json.loads(p.read_text()) for p in (work / "jobs" / "set").glob(
                "*/result.json")]
            got = {(r["task_name"], r["agent_info"]["name"]):
                   (r.get("verifier_result") or {}).get("rewards", {}).get("reward")
                   for r in results}
            want = {(t.name, agent): 1.0 if agent == "oracle" else 0.0
                    for t in tasks for agent in ("oracle", "nop")}
            assert got == want
            made = [p for p in builds_now(image_store) - before if p.is_dir()]
            compose = [t for t in tasks if (t / "environment/docker-compose.yaml").is_file()]
            assert len(compose) == 2
            assert len(made) == len(tasks) - len(compose)  # compose tasks build in the trial
        finally:
            forget_new_builds(image_store, before)


@heavy
def test_compose_task_reaches_its_services_from_main(docker_image, default_image,
                                                     image_store):
    """A Compose task (examples/harbor_tasks/compose-web): the services run with Docker in
    the trial's sandbox, Harbor's exec and file calls reach ``main``, and ``main`` reaches
    the ``web`` service by its name; oracle 1.0, nop 0.0."""
    with scratch_dir("rsb-harbor-compose-") as work:
        config = _oracle_and_nop_job("compose", work, 2, [TASKS / "compose-web"])
        (work / "job.json").write_text(json.dumps(config))
        run_in_harbor_venv([str(HARBOR), "run", "-c", str(work / "job.json"), "-y"], work,
                           images=image_store.root)
        rewards = {agent: json.loads((d / "result.json").read_text())["verifier_result"]
                   for agent, d in trials(work / "jobs" / "compose").items()}
        assert rewards == {"oracle": {"rewards": {"reward": 1.0}},
                           "nop": {"rewards": {"reward": 0.0}}}, rewards


REWRITE_CHECK = """
from ray_sandbox.harbor import _compose

out = _compose.rewrite({"version": "3", "networks": {"n": {}}, "services": {
    "main": {"build": ".", "networks": ["n"], "ports": ["80:80"]},
    "db": {"image": "ray-sandbox/python:latest", "extra_hosts": {"x": "1.2.3.4"}}}})
assert "networks" not in out and out["version"] == "3.8"
main, db = out["services"]["main"], out["services"]["db"]
assert main["network_mode"] == db["network_mode"] == "host"
assert main["pid"] == "host"  # docker exec cannot enter a PID namespace under runsc
assert "ports" not in main and "networks" not in main
assert main["build"] == {"context": ".", "network": "host"}
assert db["extra_hosts"] == ["x:1.2.3.4", "db:127.0.0.1", "main:127.0.0.1"]
try:
    _compose.rewrite({"services": {"web": {}}})
    raise AssertionError("a compose file without main was accepted")
except ValueError as exc:
    assert "main" in str(exc)
assert _compose.build_bases(
    {"services": {"main": {"build": "."}, "db": {"image": "ray-sandbox/busybox:latest"}}},
    lambda ctx, name: "FROM ray-sandbox/python:latest\\n") == [
        "ray-sandbox/python:latest", "ray-sandbox/busybox:latest"]
cmd = _compose.exec_command("c1", "echo hi", shell="bash", cwd="/app", env={"A": "1 2"},
                           user="7", timeout=30)
assert cmd == ("docker exec -i -w /app -e 'A=1 2' -u 7 c1 timeout -k 5 30 bash -c "
               "'echo hi'"), cmd
print("ok")
"""


def test_compose_rewrite_puts_services_on_the_sandbox_network_by_name():
    """The compose rewrite (pure; ray_sandbox.harbor imports Harbor, so it runs in
    .venv-harbor)."""
    res = subprocess.run([str(HARBOR.parent / "python"), "-c", REWRITE_CHECK],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]


COMPOSE_CONTRACT = """
import asyncio, json, os, shutil, sys
from pathlib import Path
from harbor.models.task.config import EnvironmentConfig
from harbor.models.trial.paths import TrialPaths
from ray_sandbox.harbor import RaySandboxEnvironment

async def main(task: Path, work: Path) -> None:
    paths = TrialPaths(work / "trial")
    paths.mkdir()
    shutil.copytree(task / "environment", work / "env")
    env = RaySandboxEnvironment(
        environment_dir=work / "env", environment_name="c", session_id="c__contract__env",
        trial_paths=paths,
        task_env_config=EnvironmentConfig(workdir="/app", memory_mb=1024, storage_mb=2048))
    await env.start(force_build=False)
    try:
        out = {"exec": await env.exec("echo $FOO; pwd; id -u; exit 3", env={"FOO": "bar"},
                                      user="nobody"),
               "web": await env.exec("python3 -c \\"import urllib.request, time; "
                                     "time.sleep(1); print(urllib.request.urlopen("
                                     "'http://web:8080/secret.txt').read().decode())\\""),
               "timeout": await env.exec("echo started; sleep 60", timeout_sec=2)}
        count = ("python3 -c \\"import os, sys; print(sum(b' '.join(open(f'/proc/{p}/cmdline', "
                 "'rb').read().split(bytes(1))).strip() == sys.argv[1].encode() "
                 "for p in os.listdir('/proc') if p.isdigit()))\\" ")
        out["left"] = await env.exec(count + "'sleep 60'")
        await env.exec("sleep 61 >/dev/null 2>&1 &")  # the control: a process that stays
        out["control"] = await env.exec(count + "'sleep 61'")
        (work / "tool.sh").write_text("#!/bin/sh")
        os.chmod(work / "tool.sh", 0o750)
        await env.upload_file(work / "tool.sh", "/app/deep/tool.sh")
        await env.download_file("/app/deep/tool.sh", work / "back/tool.sh")
        out = {k: v.model_dump() for k, v in out.items()}
        out["mode"] = oct((work / "back/tool.sh").stat().st_mode & 0o7777)
    finally:
        await env.stop(delete=True)
    print("RESULT " + json.dumps(out))

asyncio.run(main(Path(sys.argv[1]), Path(sys.argv[2])))
"""


@heavy
def test_compose_exec_and_file_contract(docker_image, default_image, image_store):
    """Harbor's calls on a Compose task reach main: env, user, cwd, exit codes, a timeout
    that kills the command inside main (not only the docker exec client), names of the
    other services, and files in and out with their mode."""
    with scratch_dir("rsb-harbor-compose-") as work:
        python = str(HARBOR.parent / "python")
        out = run_in_harbor_venv([python, "-c", COMPOSE_CONTRACT,
                                  str(TASKS / "compose-web"), str(work)], work,
                                 images=image_store.root)
        seen = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
        assert seen["exec"] == {"stdout": "bar\n/app\n65534\n", "stderr": "",
                                "return_code": 3}, seen["exec"]
        assert seen["web"]["stdout"].strip() == "compose-secret-7", seen["web"]
        assert seen["timeout"]["return_code"] == 124, seen["timeout"]
        assert seen["timeout"]["stdout"] == "started\n"
        assert seen["control"]["stdout"].strip() == "1", seen["control"]  # the count works
        assert seen["left"]["stdout"].strip() == "0", seen["left"]  # killed inside main
        assert seen["mode"] == "0o750"
