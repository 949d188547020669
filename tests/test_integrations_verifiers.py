"""verifiers' ``ModalRuntime`` (its own code and Modal's own client, unmodified, from PyPI)
against the service's implementation of Modal's wire API (docs/integrations.md,
"verifiers"): verifiers has no plugin path for runtimes, so this is how it reaches
ray_sandbox. Skipped until the service serves that API (``ServiceConfig.modal_port``)."""

from __future__ import annotations

import socket

import pytest

from ray_sandbox.service import ServiceConfig
from tests.fx_service import TOKENS, Service
from tests.test_integrations import IMAGE, framework_venv, run_in_venv

pytestmark = pytest.mark.skipif(
    "modal_port" not in ServiceConfig.model_fields,
    reason="verifiers reaches ray_sandbox through the service's Modal wire API "
    "(ServiceConfig.modal_port), which this tree's service does not have")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MODAL_PORT = _free_port()
# the module's service (tests/fx_service.py) also serves Modal's API; verifiers' default
# image name boots ray_sandbox's python image
SERVICE_SETTINGS = {"modal_port": MODAL_PORT,
                    "modal_image_aliases": {"python:3.11-slim": IMAGE}}
VERIFIERS = ["verifiers==0.4.0", "modal>=1.6,<1.7"]

SCRIPT = r"""
import asyncio, json
from verifiers.v1.errors import SandboxError
from verifiers.v1.runtimes.modal import ModalConfig, ModalRuntime

async def main():
    rt = ModalRuntime(ModalConfig(cpu=0.5, memory=0.5))
    await rt.start()
    out = {}
    try:
        r = await rt.run(["sh", "-c", "echo out; echo err >&2; pwd; exit 3"], {"X": "y"})
        out["run"] = [r.exit_code, r.stdout, r.stderr]
        out["env"] = (await rt.run(["sh", "-c", "echo $X"], {"X": "y"})).stdout
        await rt.write("notes/a.txt", b"hello")
        out["read"] = (await rt.read("notes/a.txt")).decode()
        try:
            await rt.read("/nope")
            out["missing"] = "no error"
        except SandboxError:
            out["missing"] = "SandboxError"
        out["alive"] = await rt.alive()
    finally:
        await rt.stop()
    out["alive_after"] = await rt.alive()
    print("RESULT " + json.dumps(out))

asyncio.run(main())
"""


def test_verifiers_modal_runtime_runs_on_the_service(service: Service, default_image):
    venv = framework_venv("verifiers", VERIFIERS, extras=None)  # no ray_sandbox, no Ray
    out = run_in_venv(venv, SCRIPT, env={
        "MODAL_SERVER_URL": f"http://127.0.0.1:{MODAL_PORT}", "MODAL_TOKEN_ID": "alice",
        "MODAL_TOKEN_SECRET": TOKENS["alice"]})
    assert out["run"] == [3, "out\n/app\n", "err\n"]  # verifiers' workdir is /app
    assert out["env"] == "y\n"
    assert out["read"] == "hello" and out["missing"] == "SandboxError"
    assert out["alive"] is True and out["alive_after"] is False
    with service.client() as c:  # stop() deleted it
        assert c.get("/sandboxes").json()["sandboxes"] == []
