"""Warm Python contexts, driven through a native agent with the host's python3."""

from __future__ import annotations

import shutil
import time

import pytest

from ray_sandbox.runtime.agent import PythonContext

pytestmark = pytest.mark.skipif(not shutil.which("python3"), reason="needs python3")


@pytest.fixture
def ctx(native_agent):
    with PythonContext(native_agent.client) as context:
        yield context


def test_state_persists_and_trailing_expression_is_returned(ctx):
    assert ctx.run("x = 20").ok
    r = ctx.run("x += 1\nx * 2")
    assert r.exit_code == 0 and r.value == "42" and r.exception is None
    assert ctx.run("None").value is None


def test_stdout_stderr_and_fd_level_output_are_captured(ctx):
    r = ctx.run(
        "import os, sys\nprint('hi')\nprint('oops', file=sys.stderr)\nos.system('echo sub')"
    )
    assert r.stdout == "hi\nsub\n" and r.stderr == "oops\n"
    assert ctx.run("print('next')").stdout == "next\n"  # capture resets between runs


def test_exception_gives_traceback_and_keeps_state(ctx):
    ctx.run("y = 1")
    r = ctx.run("def f():\n    raise ValueError('bad')\nf()")
    assert r.exit_code == 1 and "ValueError: bad" in r.exception and "ValueError" in r.stderr
    assert 'File "<cell>"' in r.exception
    assert ctx.run("y").value == "1"
    assert ctx.run("1 +").exit_code == 1  # syntax errors too


def test_stdin_reads_eof_instead_of_the_protocol(ctx):
    assert "EOFError" in ctx.run("input()").exception


def test_timeout_kills_and_the_next_run_starts_fresh(ctx):
    ctx.run("z = 5")
    start = time.monotonic()
    r = ctx.run("import time\ntime.sleep(30)", timeout=1)
    assert time.monotonic() - start < 10
    assert r.timed_out and r.exit_code == 137
    after = ctx.run("'z' in globals()")
    assert after.ok and after.value == "False"  # state was reset


def test_crash_restarts_transparently(ctx):
    first = ctx.pid
    r = ctx.run("import os\nos._exit(3)")
    assert r.exit_code == 3 and not r.timed_out
    assert ctx.run("1 + 1").value == "2"
    assert ctx.pid != first


def test_contexts_are_separate_interpreters(native_agent):
    with PythonContext(native_agent.client) as a, PythonContext(native_agent.client) as b:
        a.run("v = 'a'")
        assert b.run("'v' in globals()").value == "False"
        assert a.run("v").value == "'a'"


def test_output_is_capped(native_agent):
    with PythonContext(native_agent.client, max_output_bytes=1000) as ctx:
        r = ctx.run("print('x' * 100000)")
    assert r.truncated and len(r.stdout_bytes) == 1000


def test_missing_interpreter_is_a_127_result(native_agent):
    with PythonContext(native_agent.client, python="no-such-python") as ctx:
        r = ctx.run("1")
    assert r.exit_code == 127 and "not found" in r.stderr
