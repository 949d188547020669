"""Modal's sandbox examples (modal-labs/modal-examples, ``13_sandboxes/``) as the project
understands them from their documented behaviour, written anew here (not copied), with only
``import modal`` changed: ``simple_code_interpreter.py``, ``safe_code_execution.py`` (its
image built from Modal's DSL) and the sandbox part of ``codelangchain`` (the LLM, its GPU and
its secrets are Modal's cloud and stay out).

``safe_code_execution``'s image is the module's one DSL build (~2-4 min here: Debian's
nodejs, ruby and php under gVisor); the other tests use the default image."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import ray_sandbox.modal as modal  # was: import modal
from tests.fx_hostile import heavy

pytestmark = pytest.mark.usefixtures("built_images")


# --- simple_code_interpreter.py --------------------------------------------------------------
# A long-lived Python "driver" in the sandbox reads one JSON command per line on stdin, runs
# its code with exec() in one globals dict that lives across commands, and answers one JSON
# line with what the code printed on stdout and stderr.

DRIVER = r"""
import contextlib, io, json, sys, traceback
scope = {}
for line in sys.stdin:
    command = json.loads(line)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            exec(command["code"], scope)
        except Exception:
            traceback.print_exc()
    print(json.dumps({"stdout": out.getvalue(), "stderr": err.getvalue()}), flush=True)
"""


def run_code(p: modal.container_process.ContainerProcess, code: str) -> dict:
    p.stdin.write(json.dumps({"code": code}))
    p.stdin.write("\n")
    p.stdin.drain()
    return json.loads(next(iter(p.stdout)))


def test_simple_code_interpreter(app):
    sb = modal.Sandbox.create(app=app)
    try:
        p = sb.exec("python", "-c", DRIVER)
        assert run_code(p, "print('hello')") == {"stdout": "hello\n", "stderr": ""}
        run_code(p, "x = 10")
        assert run_code(p, "print(x + 1)")["stdout"] == "11\n"  # state kept between calls
        failed = run_code(p, "raise ValueError('bad input')")
        assert failed["stdout"] == "" and "ValueError: bad input" in failed["stderr"]
        assert run_code(p, "print(x * 2)")["stdout"] == "20\n"  # the driver lives on
        p.stdin.write_eof()
        p.stdin.drain()
        assert p.wait() == 0
    finally:
        sb.terminate()


# --- safe_code_execution.py ------------------------------------------------------------------

image = modal.Image.debian_slim(python_version="3.11").apt_install("nodejs", "ruby", "php")


@heavy  # its image's first build (nodejs, ruby, php) took 284-444 s here; cached after
@pytest.mark.timeout(1200)
def test_safe_code_execution(app, capsys, tmp_path):
    marker = tmp_path / "host-file"
    marker.write_text("still here")
    with modal.enable_output():
        sb = modal.Sandbox.create(app=app, image=image)
    shown = capsys.readouterr().err  # the build, or the cache's answer, as it happened
    assert "Building image modal-dsl/" in shown and "Built image modal-dsl/" in shown
    assert "Step" not in shown or "apt-get install -y nodejs ruby php" in shown
    try:
        hello = {
            ("bash", "-c", "echo hello from bash"): "hello from bash\n",
            ("python", "-c", "print('hello from python')"): "hello from python\n",
            ("node", "-e", 'console.log("hello from node")'): "hello from node\n",
            ("ruby", "-e", "puts 'hello from ruby'"): "hello from ruby\n",
            ("php", "-r", "echo 'hello from php';"): "hello from php",
        }
        for argv, expected in hello.items():
            p = sb.exec(*argv)
            assert (p.stdout.read(), p.wait()) == (expected, 0), argv

        # one language's output is another's input: Python's random numbers summed by Node
        p = sb.exec("bash", "-c", "python -c 'import random\nfor _ in range(5): "
                    "print(random.randint(1, 9))' | node -e '"
                    'let s = ""; process.stdin.on("data", d => s += d); '
                    'process.stdin.on("end", () => console.log("sum", s.trim().split("\\n")'
                    ".map(Number).reduce((a, b) => a + b)))'")
        words = p.stdout.read().split()
        assert p.wait() == 0 and words[0] == "sum" and 5 <= int(words[1]) <= 45

        # a slow program's lines come as it prints them, not at its end
        p = sb.exec("ruby", "-e", "4.times { |i| puts i; STDOUT.flush; sleep 0.5 }", bufsize=1)
        seen = []
        for line in p.stdout:
            seen.append((line, time.monotonic()))
        assert [line for line, _ in seen] == ["0\n", "1\n", "2\n", "3\n"]
        assert seen[-1][1] - seen[0][1] > 1.0  # spread over the run
        assert p.wait() == 0

        # what untrusted code does to the sandbox stays in it
        sb.exec("rm", "-rf", "--no-preserve-root", "/").wait()
        assert marker.read_text() == "still here" and Path("/etc/hostname").exists()
    finally:
        sb.terminate()


@heavy  # it follows test_safe_code_execution's build; alone it is that build (235 s in CI)
@pytest.mark.timeout(600)
def test_the_same_chain_again_is_not_built_again(app, capsys):
    again = modal.Image.debian_slim(python_version="3.11").apt_install("nodejs", "ruby", "php")
    with modal.enable_output():
        sb = modal.Sandbox.create(app=app, image=again)
    try:
        assert "Step" not in capsys.readouterr().err  # the builder's cache answered
        assert sb.exec("node", "--version").wait() == 0
        assert again.object_id == image.object_id  # one image, the same reference
    finally:
        sb.terminate()


# --- codelangchain: the agent's sandbox ------------------------------------------------------
# The agent runs code it generated in one long-lived sandbox (``python -c``) and reads its
# output and exit code; its evaluation step runs a snippet as a sandbox's command and looks
# at the return code.


def run(code: str, sb: modal.Sandbox) -> tuple[str, str, int]:
    p = sb.exec("python", "-c", code, timeout=60)
    stdout, stderr = p.stdout.read(), p.stderr.read()
    return stdout, stderr, p.wait()


def test_codelangchain_runs_generated_code(app):
    sb = modal.Sandbox.create(app=app, image=modal.Image.debian_slim(python_version="3.11"),
                              timeout=600)
    try:
        assert run("print(sum(range(10)))", sb) == ("45\n", "", 0)
        out, err, code = run("import nonexistent_module", sb)
        assert (out, code) == ("", 1) and "ModuleNotFoundError" in err
    finally:
        sb.terminate()

    ok = modal.Sandbox.create("python", "-c", "print('evaluated')", app=app, timeout=60)
    ok.wait()
    assert (ok.returncode, ok.stdout.read()) == (0, "evaluated\n")
    bad = modal.Sandbox.create("python", "-c", "1/0", app=app, timeout=60)
    bad.wait()
    assert bad.returncode == 1 and "ZeroDivisionError" in bad.stderr.read()
