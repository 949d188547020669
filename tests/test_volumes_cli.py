"""``ray-sandbox volume``: create, list, inspect, rm in a private home, with a sandbox
holding the volume so that rm is refused and inspect names it."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from ray_sandbox.cli import app


def test_volume_commands(runtime, monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_SANDBOX_HOME", str(runtime.home))
    cli = CliRunner()
    res = cli.invoke(app, ["volume", "create", "cli-ws", "--size", "16Mi", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)[0]["size"] == 16 << 20
    assert cli.invoke(app, ["volume", "create", "cli-ws", "--size", "16Mi"]).exit_code == 2
    (tmp_path / "src" / "sub").mkdir(parents=True)
    (tmp_path / "src" / "sub" / "f.txt").write_text("from the host")
    res = cli.invoke(app, ["volume", "fill", "cli-ws", str(tmp_path / "src"), "--path", "/in"])
    assert res.exit_code == 0, res.output
    sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi", volumes={"/w": "cli-ws:ro"})
    try:
        assert runtime.exec(sid, "cat /w/in/sub/f.txt").stdout == "from the host"
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
