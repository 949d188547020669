"""The client's pure protocol pieces (ray_sandbox/client/_ops.py): error codes back to the
error tree, NDJSON lines to OutputChunk/ExecResult, base URLs, and an operation driven by
hand-made responses (its behaviour against the real service is tests/test_service_client.py)."""

from __future__ import annotations

import json

import httpx
import pytest

import ray_sandbox
from ray_sandbox.client import _ops
from ray_sandbox.runtime.results import ExecResult, OutputChunk


def test_error_codes_become_the_error_trees_classes():
    assert _ops.error_class("sandbox_not_found") is ray_sandbox.SandboxNotFoundError
    assert _ops.error_class("sandbox_file_not_found") is ray_sandbox.SandboxFileNotFoundError
    assert _ops.error_class("image_not_found") is ray_sandbox.ImageNotFoundError
    assert _ops.error_class("quota_exceeded") is ray_sandbox.CapacityError
    assert _ops.error_class("invalid_request") is ray_sandbox.ConfigError
    for unknown in ["bad_gateway", "nonsense", "__class__", ""]:
        assert _ops.error_class(unknown) is ray_sandbox.SandboxError


def test_check_raises_the_body_error_or_a_plain_one():
    ok = httpx.Response(200, json={})
    assert _ops.check(ok) is ok
    with pytest.raises(ray_sandbox.SandboxNotFoundError, match="sandbox_not_found: gone"):
        _ops.check(httpx.Response(404, json={"error": {"code": "sandbox_not_found",
                                                      "message": "gone"}}))
    with pytest.raises(ray_sandbox.SandboxError, match="HTTP 502"):
        _ops.check(httpx.Response(502, text="<html>proxy</html>"))


def test_stream_lines_become_chunks_then_the_result():
    assert _ops.stream_item(json.dumps({"type": "start", "exec_id": "x"}), "s") is None
    assert _ops.stream_item(json.dumps({"type": "keepalive"}), "s") is None
    assert _ops.stream_item("", "s") is None
    chunk = _ops.stream_item(json.dumps({"type": "stdout", "data": "hé"}), "s")
    assert chunk == OutputChunk(stream="stdout", data="hé".encode())
    end = _ops.stream_item(json.dumps({"type": "exit", "exit_code": 3, "stdout": "", "stderr":
                                       "e", "timed_out": False, "signal": None}), "s")
    assert isinstance(end, ExecResult) and (end.exit_code, end.stderr) == (3, "e")
    with pytest.raises(ray_sandbox.SandboxDiedError):
        _ops.stream_item(json.dumps({"type": "error", "code": "sandbox_died",
                                     "message": "oom"}), "s")


def test_base_urls_end_in_the_api_prefix():
    for base in ["http://h:8000", "http://h:8000/", "http://h:8000/api/v1",
                 "http://h:8000/api/v1/"]:
        assert _ops.api_url(base) == "http://h:8000/api/v1"


def test_an_exec_posts_then_long_polls_until_done():
    op = _ops.run("sid", _ops.exec_body(["echo", "x"], {"timeout": 5, "env": {"A": "b"},
                                                        "cwd": "/tmp", "stdin": b"in"}))
    post = next(op)
    assert (post.method, post.path) == ("POST", "/sandboxes/sid/execs")
    assert post.json == {"command": ["echo", "x"], "timeout_seconds": 5.0, "env": {"A": "b"},
                         "cwd": "/tmp", "stdin": "in"}
    poll = op.send(httpx.Response(202, json={"exec_id": "e1"}))
    assert poll.path == "/sandboxes/sid/execs/e1" and poll.params["wait_seconds"] > 0
    again = op.send(httpx.Response(200, json={"status": "running"}))
    assert again.path == poll.path
    with pytest.raises(StopIteration) as done:
        op.send(httpx.Response(200, json={"status": "completed", "exit_code": 0,
                                          "stdout": "x\n", "stderr": ""}))
    assert done.value.value.stdout == "x\n"
