"""``ray-sandbox run`` and ``create``: every sandbox option through ``--opt KEY=VALUE``, run as
the real entry point on real gVisor sandboxes, in a runtime home of the test's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ray_sandbox.runtime import ImageStore
from tests.fx_hostile import cgroup_value
from tests.fx_runtime import leftovers

CLI = str(Path(sys.executable).parent / "ray-sandbox")
BUSYBOX = ["--image", "ray-sandbox/busybox", "--memory", "64Mi"]


@pytest.fixture
def cli(tmp_path: Path, image_store: ImageStore, busybox_image) -> Iterator:
    """Runs ``ray-sandbox ARGS`` -> (exit code, stdout, stderr); nothing may be left behind."""
    env = {**os.environ, "RAY_SANDBOX_HOME": str(tmp_path),
           "RAY_SANDBOX_IMAGES": str(image_store.root), "COLUMNS": "400"}

    def run(*args: str) -> tuple[int, str, str]:
        proc = subprocess.run([CLI, *args], env=env, capture_output=True, text=True,
                              timeout=300)
        return proc.returncode, proc.stdout, proc.stderr

    yield run
    assert leftovers(tmp_path) == {}, leftovers(tmp_path)


def test_run_takes_any_option(cli) -> None:
    code, out, err = cli("run", *BUSYBOX, "--opt", 'capabilities=["CAP_KILL"]',
                         "--opt", "pids-limit=256", "-e", "A=b", "--",
                         "sh", "-c", "grep CapEff /proc/self/status; echo $A; exit 3")
    assert code == 3, err
    assert out == f"CapEff:\t{1 << 5:016x}\nb\n"  # CAP_KILL is bit 5, and nothing else


def test_create_sets_a_limit_that_has_no_flag(cli) -> None:
    code, out, err = cli("create", *BUSYBOX, "--opt", "pids_limit=256",
                         "--opt", "directfs=false", "--json")
    assert code == 0, err
    sid = json.loads(out)["sandbox_id"]
    try:
        assert cgroup_value("pids", sid, "pids.max") == "256"
        assert cli("exec", sid, "--", "echo", "ok")[:2] == (0, "ok\n")
    finally:
        assert cli("rm", sid)[0] == 0


@pytest.mark.parametrize(("args", "message"), [
    (["--opt", "nope=1"], "unknown sandbox option 'nope'"),
    (["--opt", "pids_limit=12"], "pids_limit: "),
    (["--memory", "1Gi", "--opt", "memory=2Gi"], "memory set both by a flag and by --opt"),
    (["--env", "A"], "--env needs KEY=VALUE"),
])
def test_a_bad_option_fails_naming_it(cli, args: list[str], message: str) -> None:
    for command in ("run", "create"):
        extra = ["--", "true"] if command == "run" else []
        code, out, err = cli(command, *BUSYBOX, *args, *extra)
        assert (code, out) == (2, ""), err
        assert message in err


def _commands(cmd: Any, path: list[str]) -> Iterator[list[str]]:
    yield path
    for name, sub in (getattr(cmd, "commands", None) or {}).items():
        yield from _commands(sub, [*path, name])


def test_every_help_reads_whole_at_80_columns() -> None:
    """Docstrings are rendered as they are (no RST ``literals``), and no help text is cut
    with an ellipsis on an 80-column terminal."""
    import typer
    from typer.testing import CliRunner

    from ray_sandbox.cli import app

    runner = CliRunner()
    paths = list(_commands(typer.main.get_command(app), []))
    assert ["serve"] in paths and ["image", "build"] in paths
    for path in paths:
        res = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
        assert res.exit_code == 0, res.output
        bad = [ln for ln in res.output.splitlines()
               if "``" in ln or "\u2026" in ln or len(ln) > 80]
        assert bad == [], (path, bad)
