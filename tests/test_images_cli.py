"""``ray-sandbox image`` commands through typer's CliRunner, against a real registry."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from ray_sandbox.cli.images import app
from ray_sandbox.runtime.images import ImageStore

runner = CliRunner()


def invoke(store: ImageStore, *args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["--root", str(store.root), *args], env={"COLUMNS": "200"})
    return result.exit_code, result.stdout


def test_pull_ls_inspect_rm_prune(temp_store: ImageStore, pushed_busybox: str) -> None:
    code, out = invoke(temp_store, "pull", pushed_busybox, "--json")
    assert code == 0, out
    (pulled,) = json.loads(out)
    assert pulled["ref"] == f"docker://{pushed_busybox}" and pulled["pins"] == []
    assert pulled["config"]["cmd"] == ["/bin/sh"]

    code, out = invoke(temp_store, "ls", "--json")
    assert code == 0 and [i["digest"] for i in json.loads(out)] == [pulled["digest"]]
    code, out = invoke(temp_store, "ls")
    assert code == 0 and pushed_busybox in out and pulled["digest"][:19] in out

    temp_store.pin(pulled["digest"], "sandbox-x")
    code, out = invoke(temp_store, "inspect", pulled["digest"])
    assert code == 0 and json.loads(out)["pins"] == ["sandbox-x"]
    code, out = invoke(temp_store, "rm", pushed_busybox)
    assert code == 2  # pinned: refused, message on stderr
    temp_store.unpin(pulled["digest"], "sandbox-x")
    code, out = invoke(temp_store, "rm", pushed_busybox, "--json")
    assert code == 0 and json.loads(out) == {"removed": [pulled["digest"]]}
    code, out = invoke(temp_store, "prune", "--all", "--json")
    assert code == 0 and json.loads(out) == {"removed": []}


def test_build_and_errors(temp_store: ImageStore, registry: str) -> None:
    code, out = invoke(temp_store, "build", "busybox", "--json")
    assert code == 0, out
    assert json.loads(out)[0]["ref"] == "ray-sandbox/busybox:latest"
    assert invoke(temp_store, "pull", f"{registry}/lab/absent:v1")[0] == 2
    assert invoke(temp_store, "pull", "Not A Ref")[0] == 2
    assert invoke(temp_store, "inspect", "python:3")[0] == 2
    assert invoke(temp_store, "build", "nope")[0] == 2


def test_help_renders() -> None:
    for command in ([], ["pull"], ["build"], ["ls"], ["inspect"], ["rm"], ["prune"]):
        result = runner.invoke(app, [*command, "--help"])
        assert result.exit_code == 0, result.output
