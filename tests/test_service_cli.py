"""``ray-sandbox serve``: the real command joins this module's Ray cluster, serves the API
until SIGINT, then removes its Serve app; the sandboxes it made outlive it (detached)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from ray_sandbox.client import SandboxClient
from tests.fx_service import free_port, wait_healthy

CLI = str(Path(sys.executable).parent / "ray-sandbox")
TOKEN = "cli-token-0123456789"


def test_serve_refuses_to_start_without_a_token(tmp_path):
    """One line naming the three ways to give tokens, not pydantic's report."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SANDBOX_API_")}
    env["COLUMNS"] = "80"
    out = subprocess.run([CLI, "serve"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    (line,) = out.stderr.splitlines()
    assert line.startswith("error: no API token")
    for way in ("RAY_SANDBOX_API_TOKEN=", "RAY_SANDBOX_API_TOKENS=", "--tokens-file"):
        assert way in line
    # a config the service refuses is one line too, in its own words
    short = tmp_path / "tokens"
    short.write_text("ops=short\n")
    out = subprocess.run([CLI, "serve", "--tokens-file", str(short)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.splitlines() == ["error: tokens: tokens must be at least 8 characters"]


def test_serve_runs_the_api_until_interrupted(ray_cluster, tmp_path):
    import ray_sandbox
    from ray_sandbox.service._entry import TENANT_LABEL

    port = free_port()
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# the CLI's tenant\nops={TOKEN}\n")
    address = ray_cluster.get_runtime_context().gcs_address
    proc = subprocess.Popen(
        [CLI, "serve", "--port", str(port), "--address", address, "--tokens-file",
         str(tokens), "--quota", "ops:sandboxes=2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def alive() -> None:
            assert proc.poll() is None, proc.stderr.read()

        wait_healthy(f"{url}/api/v1", alive)
        c = SandboxClient(url, TOKEN)
        sb = c.create(image="ray-sandbox/busybox", cpu=0.25, memory="64Mi")
        assert sb.exec("echo via-cli").stdout == "via-cli\n"
        # the CLI's sandbox commands over --url list this tenant's sandboxes
        remote = [CLI, "--url", url, "--token", TOKEN]
        env = {**os.environ, "COLUMNS": "200"}
        table = subprocess.run([*remote, "ps"], env=env, capture_output=True, text=True,
                               timeout=120)
        assert table.returncode == 0, table.stderr
        assert sb.sandbox_id[:12] in table.stdout and "running" in table.stdout
        listed = subprocess.run([*remote, "ps", "--json"], env=env, capture_output=True,
                                text=True, timeout=120)
        assert listed.returncode == 0, listed.stderr
        (row,) = json.loads(listed.stdout)
        assert (row["sandbox_id"], row["state"]) == (sb.sandbox_id, "running")
        assert datetime.fromisoformat(row["created_at"]).tzinfo is not None
        with pytest.raises(ray_sandbox.CapacityError):  # --quota applies
            for _ in range(2):
                c.create(image="ray-sandbox/busybox", cpu=0.25, memory="64Mi")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
        # it said how a Ray script (the Modal facade) joins its cluster
        assert f'ray.init(address="{address}")' in proc.stderr.read()
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/api/v1/health", timeout=5)
        # the service's sandboxes are detached: still there until deleted
        left = ray_sandbox.list({TENANT_LABEL: "ops"})
        assert {h.name for h in left} >= {sb.sandbox_id}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        import ray

        ray.get([h.terminate.remote() for h in ray_sandbox.list({TENANT_LABEL: "ops"})],
                timeout=120)


# After the serve test: this module's service fixture deploys the same Serve app.
def test_a_streamed_exec_ends_with_its_real_duration(service):
    from tests.fx_service import TOKENS

    with SandboxClient(service.url, TOKENS["alice"]) as c:
        sb = c.create(image="ray-sandbox/busybox", cpu=0.25, memory="64Mi")
        *_, last = sb.exec_stream("sleep 0.2; echo done")
        assert last.exit_code == 0
        assert last.duration_seconds > 0  # not the 0.0 of a field nobody filled


def test_the_client_and_the_cli_get_a_port_url(service):
    """Neither the client nor the CLI could get a port URL (Modal's tunnel URL)."""
    import httpx

    from tests.fx_service import TOKENS

    port = 18082
    with SandboxClient(service.url, TOKENS["alice"]) as c:
        sb = c.create(image="ray-sandbox/busybox", cpu=0.25, memory="64Mi",
                      network="public", expose_ports=[port])
        sb.exec(f"mkdir /srv && echo -n hi > /srv/index.html && httpd -p {port} -h /srv")
        url = sb.port_url(port, ttl_seconds=60)
        assert not url.endswith("/") and httpx.get(url + "/index.html").text == "hi"
        env = {**os.environ, "RAY_SANDBOX_API_TOKEN": TOKENS["alice"]}
        out = subprocess.run([CLI, "--url", service.url, "port-url", sb.sandbox_id, str(port)],
                             env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert httpx.get(out.stdout.strip() + "/index.html").text == "hi"
