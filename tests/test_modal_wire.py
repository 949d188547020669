"""Modal's own client (``modal`` 1.6 from PyPI, unmodified, in a venv without Ray) against
``ray-sandbox serve --modal-port`` on a real local Ray cluster with real gVisor sandboxes
(docs/modal.md). Each script is written from Modal's documented sandbox behaviour, as a
user would, and run with only MODAL_SERVER_URL, MODAL_TOKEN_ID and MODAL_TOKEN_SECRET set."""

from __future__ import annotations

import pytest

from tests import fx_modal_wire
from tests.fx_modal_wire import ModalService
from tests.fx_service import free_port

SERVICE_SETTINGS = {"modal_port": free_port(),
                    "modal_image_aliases": {"python:3.12-slim": "ray-sandbox/python:3.13"}}
SERVICE_QUOTAS = ("bob:sandboxes=2,cpu=2,memory=2Gi",)

pytestmark = pytest.mark.timeout(600)
modal_python = fx_modal_wire.modal_python  # the fixtures, for this module
modal_service = fx_modal_wire.modal_service


def test_create_exec_streams_stdin_and_wait(modal_service: ModalService, tmp_path):
    out = modal_service.ok("""
        import modal

        app = modal.App.lookup("wire-basics", create_if_missing=True)
        sb = modal.Sandbox.create(app=app, timeout=120)
        p = sb.exec("sh", "-c", "for i in 1 2 3; do echo line$i; sleep 0.2; done; echo err >&2")
        lines = [line for line in p.stdout]
        print("STDOUT", lines)
        print("STDERR", p.stderr.read())
        print("CODE", p.wait())

        p = sb.exec("sh", "-c", "read x; echo got:$x; exit 3")
        p.stdin.write(b"hello\\n")
        p.stdin.write_eof()
        p.stdin.drain()
        print("STDIN", p.stdout.read().strip(), p.wait())

        p = sb.exec("pwd", workdir="/tmp")
        print("PWD", p.stdout.read().strip())
        p = sb.exec("sh", "-c", "echo $A-$B", env={"A": "1"},
                    secrets=[modal.Secret.from_dict({"B": "2"})])
        print("ENV", p.stdout.read().strip())
        print("POLL", sb.poll())
        sb.terminate()
        print("RC", sb.wait(raise_on_termination=False), sb.returncode)
    """, tmp_path)
    assert "STDOUT ['line1\\n', 'line2\\n', 'line3\\n']" in out
    assert "STDERR err" in out
    assert "CODE 0" in out
    assert "STDIN got:hello 3" in out
    assert "PWD /tmp" in out
    assert "ENV 1-2" in out
    assert "POLL None" in out
    assert "RC None 137" in out  # wait() returns None; returncode 137 (terminated)
