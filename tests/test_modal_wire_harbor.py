"""Harbor's own ``modal`` environment (Harbor 0.26 in .venv-harbor, unmodified, with the real
``modal`` client) against ``ray-sandbox serve --modal-port``: the offline task set in
examples/harbor_tasks with the oracle and the no-op agents at ``n_concurrent_trials=4``.
Harbor builds each task's Dockerfile with ``Image.from_dockerfile``, which the service builds
inside gVisor; only MODAL_SERVER_URL, MODAL_TOKEN_ID and MODAL_TOKEN_SECRET point Harbor at it
(docs/modal.md, "Harbor")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests import fx_modal_wire
from tests.fx_hostile import heavy
from tests.fx_images import scratch_dir
from tests.fx_modal_wire import ModalService
from tests.fx_service import TOKENS, free_port
from tests.test_harbor import HARBOR

pytestmark = [pytest.mark.skipif(
    not HARBOR.exists(), reason="Harbor needs Python >= 3.12 and .venv-harbor is not built"),
    pytest.mark.timeout(1800)]

TASKS = Path(__file__).resolve().parent.parent / "examples" / "harbor_tasks"
# The operator's settings for this service: a 512 MiB disk unless a sandbox asks (the
# disk-cap task checks that a 1 GiB write fails: Harbor's modal environment sends no
# storage_mb), the documentation range the allowlist task names may be allowed, and the
# busybox tasks' base booted as the Python image: Harbor's modal environment runs every
# command with bash, which busybox lacks (its own environment uses sh there).
SERVICE_SETTINGS = {"modal_port": free_port(),
                    "modal_image_aliases": {"ray-sandbox/busybox:latest":
                                            "ray-sandbox/python:latest"},
                    "policies": {"*": {"disk_default": "512Mi",
                                       "egress_cidrs": ["192.0.2.0/24"]}}}
SERVICE_QUOTAS = ()
modal_python = fx_modal_wire.modal_python
modal_service = fx_modal_wire.modal_service


def _harbor_has_modal() -> bool:
    python = HARBOR.parent / "python"
    return subprocess.run([str(python), "-c", "import modal"], capture_output=True,
                          timeout=120).returncode == 0


@heavy
def test_harbor_modal_environment_runs_the_offline_task_set(modal_service: ModalService):
    if not _harbor_has_modal():
        pytest.skip("modal is not installed in .venv-harbor (scripts/setup.sh installs "
                    "ray_sandbox[harbor,modal] there)")
    tasks = sorted(p for p in TASKS.iterdir() if (p / "task.toml").is_file()
                   and not (p / "environment/docker-compose.yaml").is_file())
    assert len(tasks) == 8
    with scratch_dir("rsb-harbor-modal-") as work:
        config = {
            "job_name": "modal", "jobs_dir": str(work / "jobs"), "n_concurrent_trials": 4,
            "quiet": True, "environment": {"type": "modal"},
            "agents": [{"name": "oracle"}, {"name": "nop"}],
            "tasks": [{"path": str(t)} for t in tasks],
        }
        (work / "job.json").write_text(json.dumps(config))
        env = {"PATH": os.environ["PATH"], "HOME": str(work),
               "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # offline: no price list download
               "MODAL_SERVER_URL": modal_service.url, "MODAL_TOKEN_ID": "alice",
               "MODAL_TOKEN_SECRET": TOKENS["alice"]}
        proc = subprocess.Popen([str(HARBOR), "run", "-c", str(work / "job.json"), "-y"],
                                env=env, cwd=work, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out = proc.communicate(timeout=1500)[0].decode(errors="replace")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the group this test started
                proc.wait()
        assert proc.returncode == 0, out[-4000:]
        results = [json.loads(p.read_text()) for p in (work / "jobs/modal").glob(
            "*/result.json")]
        got = {(r["task_name"], r["agent_info"]["name"]):
               (r.get("verifier_result") or {}).get("rewards", {}).get("reward")
               for r in results}
        errors = {(r["task_name"], r["agent_info"]["name"]): r.get("exception_info")
                  for r in results if r.get("exception_info")}
        want = {(t.name, agent): 1.0 if agent == "oracle" else 0.0
                for t in tasks for agent in ("oracle", "nop")}
        assert got == want, json.dumps(errors, indent=1)[:6000]
