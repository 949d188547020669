"""What an exec asks the agent for, derived from the record and the call's request (pure: no
sandbox)."""

from __future__ import annotations

import pytest

from ray_sandbox.runtime.errors import ConfigError, ExecError
from ray_sandbox.runtime.exec_request import stdin_bytes
from ray_sandbox.runtime.records import SandboxRecord
from ray_sandbox.runtime.verbs import ExecRequest


def exec_args(rec: SandboxRecord, command, **kw) -> dict:
    """What the runtime's exec asks the agent for: the request made from the call, then
    completed from the record."""
    return ExecRequest.of((command,), kw, sandbox_id=rec.sandbox_id).agent_args(rec)


@pytest.fixture
def rec(tmp_path) -> SandboxRecord:
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "sh").touch()
    return SandboxRecord(
        sandbox_id="a" * 32, image="img", image_digest="sha256:x", rootfs="/r",
        image_rootfs=str(tmp_path), image_env=["PATH=/bin", "LANG=C"], image_user="app",
        image_workdir="/srv", created_at=0.0,
        config={"env": {"LANG": "en", "MODE": "sb"}, "timeout_seconds": 30.0},
    )


def test_a_string_runs_through_the_shell_and_a_list_as_argv(rec):
    assert exec_args(rec, "echo hi")["argv"] == ["/bin/sh", "-c", "echo hi"]
    assert exec_args(rec, ["ls", 1])["argv"] == ["ls", "1"]


def test_a_missing_shell_names_the_image(rec):
    with pytest.raises(ExecError, match="image img has no /bin/bash"):
        exec_args(rec, "true", shell="/bin/bash")


def test_env_layers_image_then_sandbox_then_call(rec):
    env = exec_args(rec, ["x"], env={"MODE": "call"})["env"]
    assert "PATH=/bin" in env and "LANG=en" in env and "MODE=call" in env
    assert "LANG=C" not in env and "MODE=sb" not in env


def test_tool_bundles_end_path_and_set_nothing_else(rec):
    rec = rec.model_copy(update={"config": {**rec.config, "volumes": {
        "/opt/tools": {"name": "t", "readonly": True, "tools": True},
        "/data": {"name": "d", "readonly": True, "tools": False}}}})
    env = exec_args(rec, ["x"])["env"]
    assert [e for e in env if e.startswith("PATH=")] == ["PATH=/bin:/opt/tools/bin"]
    # a caller's own PATH gets them too, after its directories
    env = exec_args(rec, ["x"], env={"PATH": "/mine"})["env"]
    assert [e for e in env if e.startswith("PATH=")] == ["PATH=/mine:/opt/tools/bin"]


def test_defaults_come_from_the_config_then_the_image(rec):
    args = exec_args(rec, ["x"])
    assert (args["cwd"], args["user"], args["timeout"]) == ("/srv", "app", 30.0)
    args = exec_args(rec, ["x"], cwd="/tmp", user="root", timeout=1.5)
    assert (args["cwd"], args["user"], args["timeout"]) == ("/tmp", "root", 1.5)


@pytest.mark.parametrize(("command", "env", "error"), [
    ([], None, ExecError),
    (["a\0b"], None, ExecError),
    (42, None, ConfigError),
    (["x"], ["A=1"], ConfigError),
    (["x"], {"A": 1}, ConfigError),
    (["x"], {"A=B": "1"}, ExecError),
    (["x"], {"": "1"}, ExecError),
    (["x"], {"A": "1\0"}, ExecError),
])
def test_bad_input_is_a_typed_error_naming_the_sandbox(rec, command, env, error):
    with pytest.raises(error) as info:
        exec_args(rec, command, env=env)
    assert info.value.sandbox_id == rec.sandbox_id


def test_stdin_text_is_utf8_and_bytes_pass_through():
    assert stdin_bytes("é", "s") == "é".encode()
    assert stdin_bytes(b"\xff", "s") == b"\xff" and stdin_bytes(None, "s") is None
    with pytest.raises(ExecError, match="UTF-8"):
        stdin_bytes("\udc80", "s")
