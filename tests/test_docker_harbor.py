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
        archive = path / "image.docker.tar"
        if archive.is_file():
            image_store.remove(f"docker-archive:{archive}")
            shutil.rmtree(path)
        elif path.is_file():
            path.unlink(missing_ok=True)


def builds_now(image_store) -> set[Path]:
    builds = image_store.root.parent / "builds"
    return set(builds.iterdir()) if builds.is_dir() else set()


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


@heavy
def test_offline_task_set_oracle_1_nop_0_at_concurrency_4(docker_image, default_image,
                                                          image_store):
    """``harbor run`` of examples/harbor_tasks (8 Dockerfile tasks FROM the offline images)
    with the oracle and the no-op agent at ``n_concurrent_trials=4``: every oracle trial
    scores 1.0, every nop trial 0.0, and each task was built once. Measured 2026-12-02: 150 s
    for the 16 trials and 8 builds on the shared 2-core VM at load average ~3.7."""
    tasks = sorted(p for p in TASKS.iterdir() if (p / "task.toml").is_file())
    before = builds_now(image_store)
    with scratch_dir("rsb-harbor-set-") as work:
        config = {
            "job_name": "set", "jobs_dir": str(work / "jobs"), "n_concurrent_trials": 4,
            "quiet": True,
            "environment": {"import_path": "ray_sandbox.harbor:RaySandboxEnvironment"},
            "agents": [{"name": "oracle"}, {"name": "nop"}],
            "tasks": [{"path": str(t)} for t in tasks],
        }
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
            assert len(made) == len(tasks)
        finally:
            forget_new_builds(image_store, before)
