"""``ray-sandbox volume``: create, list, inspect, rm in a private home, with a sandbox
holding the volume so that rm is refused and inspect names it."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from ray_sandbox.cli import app


def test_volume_commands(runtime, monkeypatch):
    monkeypatch.setenv("RAY_SANDBOX_HOME", str(runtime.home))
    cli = CliRunner()
    res = cli.invoke(app, ["volume", "create", "cli-ws", "--size", "16Mi", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)[0]["size"] == 16 << 20
    assert cli.invoke(app, ["volume", "create", "cli-ws", "--size", "16Mi"]).exit_code == 2
    sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi", volumes={"/w": "cli-ws:ro"})
    try:
        info = json.loads(cli.invoke(app, ["volume", "inspect", "cli-ws"]).output)
        assert info["mounts"] == [{"sandbox_id": sid, "readonly": True}]
        res = cli.invoke(app, ["volume", "rm", "cli-ws"])
        assert res.exit_code == 2 and "mounted by" in res.output
        listed = cli.invoke(app, ["volume", "list"])
        assert listed.exit_code == 0 and "cli-ws" in listed.output
    finally:
        runtime.delete(sid, wait=True)
    res = cli.invoke(app, ["volume", "rm", "cli-ws"])
    assert res.exit_code == 0 and "deleted cli-ws" in res.output
    assert json.loads(cli.invoke(app, ["volume", "ls", "--json"]).output) == []
    assert cli.invoke(app, ["volume", "inspect", "cli-ws"]).exit_code == 2
