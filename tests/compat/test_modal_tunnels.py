"""The port-forwarding snippet of Modal's networking guide (an HTTP server started as the
sandbox's command, published with ``encrypted_ports``, fetched through ``tunnels()``), with
only ``import modal`` changed. Encrypted ports go through ``ray-sandbox serve``
(``RAY_SANDBOX_SERVICE_APP``, docs/compat.md); how long such a URL keeps working is another
test's (tests/test_service.py): here it works once."""

from __future__ import annotations

import time

import httpx
import pytest

import ray_sandbox.modal as modal  # was: import modal
from tests.fx_service import free_port


@pytest.fixture
def through_the_service(service, monkeypatch):
    monkeypatch.setenv("RAY_SANDBOX_SERVICE_APP", "ray-sandbox")
    return service


def test_networking_forwarding_ports(app, through_the_service):
    port = free_port()
    sb = modal.Sandbox.create("python", "-m", "http.server", str(port), app=app,
                              encrypted_ports=[port], timeout=120)
    try:
        tunnel = sb.tunnels()[port]
        deadline = time.monotonic() + 60
        while True:  # the server takes a moment to listen
            r = httpx.get(tunnel.url, timeout=10)
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert r.status_code == 200 and "Directory listing" in r.text
    finally:
        sb.terminate()
