"""verifiers' ``ModalRuntime`` (verifiers 0.4, unmodified, with the real ``modal`` client, in a
venv of its own without Ray) against ``ray-sandbox serve --modal-port``: the runtime its
environments' rollouts use, driven through its own methods (start, run, write/read, expose,
prepare_execution with an allow-list, stop). A whole rollout also needs ``uv`` and PyPI inside
the sandbox and a model endpoint reachable from it (docs/modal.md, "verifiers")."""

from __future__ import annotations

import fcntl
import subprocess
import sys

import pytest

from tests import fx_modal_wire
from tests.fx_hostile import heavy
from tests.fx_modal_wire import CACHE, ModalService
from tests.fx_service import free_port

SERVICE_SETTINGS = {"modal_port": free_port(), "port_host_suffix": "ports.test",
                    "modal_image_aliases": {"python:3.11-slim": "ray-sandbox/python:3.11"}}
SERVICE_QUOTAS = ()
VERIFIERS_SPEC = "verifiers[modal]==0.4.0"
pytestmark = pytest.mark.timeout(1200)
modal_python = fx_modal_wire.modal_python
modal_service = fx_modal_wire.modal_service

SCRIPT = """
import asyncio
from verifiers.v1.runtimes.modal import ModalConfig, ModalRuntime


async def main():
    rt = ModalRuntime(ModalConfig(image="python:3.11-slim", allow=["api.example.com"]),
                      name="vf-probe")
    await rt.start()
    try:
        res = await rt.run(["sh", "-c", "echo $(pwd) $GREETING; echo oops >&2; exit 3"],
                           {"GREETING": "hi"})
        print("RUN", res.exit_code, res.stdout.strip(), res.stderr.strip())
        await rt.write("out/answer.txt", b"42")
        print("READ", await rt.read("out/answer.txt"))
        url = await rt.expose(8000)
        print("EXPOSE", url.startswith("https://"))
        await rt.prepare_execution(["https://api.example.com/v1"])
        print("EGRESS applied")
        print("ALIVE", await rt.alive())
    finally:
        await rt.stop()
    print("STOPPED")


asyncio.run(main())
"""


@pytest.fixture(scope="module")
def verifiers_python() -> str:
    venv = CACHE / "verifiers-0.4"
    marker = venv / ".installed"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "verifiers.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not marker.is_file() or marker.read_text() != VERIFIERS_SPEC:
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True,
                           timeout=300)
            res = subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "-q",
                                  VERIFIERS_SPEC], capture_output=True, text=True,
                                 timeout=1200)
            if res.returncode != 0:
                pytest.skip(f"verifiers does not install here: {res.stderr[-500:]}")
            marker.write_text(VERIFIERS_SPEC)
    return str(venv / "bin/python")


@heavy
def test_verifiers_modal_runtime(modal_service: ModalService, verifiers_python: str, tmp_path):
    service = ModalService(modal_service.service, modal_service.url, verifiers_python)
    out = service.ok(SCRIPT, tmp_path)
    assert "RUN 3 /app hi oops" in out
    assert "READ b'42'" in out
    assert "EXPOSE True" in out
    assert "EGRESS applied" in out
    assert "ALIVE True" in out
    assert "STOPPED" in out
