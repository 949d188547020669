"""The Ray-free client against the real service (a Serve app on a real local Ray cluster with
gVisor sandboxes): sync and async, errors as the Ray layer's classes, cleanup on exit, and a
venv with only the client's dependencies, where ``import ray`` fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest

import ray_sandbox
from ray_sandbox.client import AsyncSandboxClient, SandboxClient
from ray_sandbox.runtime.results import ExecResult, OutputChunk
from tests.fx_service import TOKENS, Service

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"image": "ray-sandbox/busybox", "cpu": 0.25, "memory": "128Mi"}


def test_sync_client_mirrors_the_handle_and_cleans_up(service: Service):
    with SandboxClient(service.url.removesuffix("/api/v1"), TOKENS["alice"]) as c:
        assert c.health()
        sb = c.create(**SMALL, labels={"suite": "client"}, env={"W": "x"})
        res = sb.exec(["sh", "-c", "echo $W; echo e >&2; exit 3"])
        assert (res.exit_code, res.stdout, res.stderr, res.ok) == (3, "x\n", "e\n", False)
        assert sb.exec("cat", stdin="in").stdout == "in"
        assert sb.exec("sleep 2", timeout=0.3).timed_out
        sb.write_file("/tmp/f", "hello")
        assert sb.read_file("/tmp/f") == b"hello"
        with pytest.raises(ray_sandbox.SandboxFileNotFoundError):
            sb.read_file("/tmp/none")
        assert [s.sandbox_id for s in c.list({"suite": "client"})] == [sb.sandbox_id]
        snap = sb.snapshot()
        sb.write_file("/tmp/f", "changed")
        (copy,) = c.restore(snap)
        (fork,) = sb.fork()
        assert (copy.read_file("/tmp/f"), fork.read_file("/tmp/f")) == (b"hello", b"changed")
        c.delete_snapshot(snap)
        sb.write_file("/root/kept", "files")
        image = sb.snapshot_filesystem()
        assert c.filesystem_images() == [image]
        from_image = c.create(**{**SMALL, "image": image})
        assert from_image.read_file("/root/kept") == b"files"
        with pytest.raises(ray_sandbox.ImageInUseError):
            c.delete_filesystem_image(image)
        from_image.terminate()
        c.delete_filesystem_image(image)
        assert c.filesystem_images() == []
        sb.write_file("/tmp/f", "hello")
        assert c.get(sb.sandbox_id).status()["status"] == "running"
        kept = c.create(**SMALL)
        kept.terminate()  # terminated by hand: not deleted again on exit
    with SandboxClient(service.url, TOKENS["alice"]) as c:
        # the first client deleted what it made on exit, copies included
        assert c.list({"suite": "client"}) == []
        with pytest.raises(ray_sandbox.SandboxNotFoundError):
            c.get(sb.sandbox_id)


def test_clients_link_one_sandbox_to_a_port_of_another(service: Service):
    with SandboxClient(service.url, TOKENS["alice"]) as c:
        server, client = (c.create(**SMALL, network="sandbox") for _ in range(2))
        server.exec("nc -ll -p 8080 -e echo hi </dev/null >/dev/null 2>&1 &")
        link = client.link(server, 8080)
        assert (link.to, link.port) == (server.sandbox_id, 8080)
        assert client.exec(f"nc -w 3 {link.host} 8080 </dev/null").stdout == "hi\n"
        client.unlink(server.sandbox_id, 8080)
        assert client.exec(f"nc -w 3 {link.host} 8080 </dev/null").stdout == ""

    async def main() -> str:
        async with AsyncSandboxClient(service.url, TOKENS["alice"]) as a:
            server, client = [await a.create(**SMALL, network="sandbox") for _ in range(2)]
            await server.exec("nc -ll -p 8080 -e echo hi </dev/null >/dev/null 2>&1 &")
            link = await client.link(server, 8080)
            out = (await client.exec(f"nc -w 3 {link.host} 8080 </dev/null")).stdout
            await client.unlink(server, 8080)
            return out

    assert anyio.run(main) == "hi\n"


def test_client_streams_output_and_moves_directories(service: Service, tmp_path):
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f.txt").write_text("inside")
    (src / "ln").symlink_to("d/f.txt")
    with SandboxClient(service.url, TOKENS["alice"]) as c:
        sb = c.create(**SMALL)
        items = list(sb.exec_stream("echo one; echo two >&2; exit 2"))
        chunks, result = items[:-1], items[-1]
        assert isinstance(result, ExecResult) and result.exit_code == 2
        def streamed(name: str) -> str:
            return "".join(x.text for x in chunks if x.stream == name)

        assert all(isinstance(x, OutputChunk) for x in chunks)
        assert streamed("stdout") + result.stdout == "one\n"
        assert streamed("stderr") + result.stderr == "two\n"
        sb.upload_dir(src, "/opt/up")
        assert sb.exec("cat /opt/up/ln").stdout == "inside"
        sb.download_dir("/opt/up", tmp_path / "back")
        assert (tmp_path / "back" / "d" / "f.txt").read_text() == "inside"
        assert (tmp_path / "back" / "ln").is_symlink()
        with pytest.raises(ray_sandbox.SandboxNotFoundError):
            sb.download_dir("/opt/none", tmp_path / "none")


@pytest.mark.xfail(strict=False, reason=(
    "intermittent (failed in 2 of 6 runs on 2026-12-02, both after the module's other "
    "tests; passed alone): the same Serve problem as "
    "test_service.py::test_a_caller_that_goes_away_takes_its_streamed_command_with_it; Serve "
    "does not always pass the client's disconnect on to the replica (docs/service.md, "
    "'Known problems')"))
def test_leaving_a_stream_early_kills_its_command(service: Service):
    with SandboxClient(service.url, TOKENS["alice"]) as c:
        sb = c.create(**SMALL)
        for chunk in sb.exec_stream("echo go; sleep 654"):
            assert chunk.text == "go\n"
            break
        for _ in range(60):
            if "sleep 654" not in sb.exec("ps -o args").stdout:
                break
            time.sleep(0.5)
        else:
            raise AssertionError("the abandoned command still runs")


def test_client_errors_are_the_ray_layers_classes(service: Service):
    with SandboxClient(service.url, TOKENS["bob"]) as bob:
        with pytest.raises(ray_sandbox.ConfigError, match="unknown field"):
            bob.create(**SMALL, nonsense=1)
        with pytest.raises(ray_sandbox.CapacityError, match="quota"):
            bob.create(**{**SMALL, "cpu": 4})
        with pytest.raises(ray_sandbox.ImageNotFoundError, match="failed to start"):
            bob.create(image="ray-sandbox/no-such-image")
        assert bob.list() == []  # the failed one was deleted too
    with SandboxClient(service.url, "wrong-token-0123456789") as anon:
        with pytest.raises(ray_sandbox.ConfigError, match="unauthorized"):
            anon.list()


def test_async_client_runs_concurrent_execs_and_cleans_up(service: Service):
    async def main() -> list[str]:
        async with AsyncSandboxClient(service.url, TOKENS["alice"]) as c:
            sb = await c.create(**SMALL, labels={"suite": "async"})
            results = [None] * 4

            async def one(i: int) -> None:
                results[i] = (await sb.exec(f"echo {i}")).stdout

            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(one, i)
            streamed = [x async for x in sb.exec_stream("echo s")]
            assert streamed[-1].exit_code == 0 and b"".join(
                x.data for x in streamed[:-1]) + streamed[-1].stdout_bytes == b"s\n"
            await sb.write_file("/tmp/a", b"\x00\x01")
            assert await sb.read_file("/tmp/a") == b"\x00\x01"
            assert [s.sandbox_id for s in await c.list({"suite": "async"})] == [sb.sandbox_id]
            return results

    assert anyio.run(main) == ["0\n", "1\n", "2\n", "3\n"]
    with SandboxClient(service.url, TOKENS["alice"]) as c:
        assert c.list({"suite": "async"}) == []


CLIENT_SCRIPT = textwrap.dedent("""
    import json, sys
    try:
        import ray  # noqa: F401
        has_ray = True
    except ImportError:
        has_ray = False
    from ray_sandbox.client import SandboxClient
    import ray_sandbox
    url, token = sys.argv[1], sys.argv[2]
    with SandboxClient(url, token) as c:
        sb = c.create(image="ray-sandbox/busybox", cpu=0.25, memory="128Mi",
                      labels={"suite": "no-ray"})
        out = sb.exec("echo from a venv without ray").stdout
        sb.write_file("/tmp/x", b"y")
        back = sb.read_file("/tmp/x").decode()
        try:
            sb.read_file("/nope")
            missing = None
        except ray_sandbox.SandboxFileNotFoundError as exc:
            missing = type(exc).__name__
    try:
        ray_sandbox.create
        ray_layer = "importable"
    except ImportError as exc:  # says what to install
        ray_layer = str(exc)
    print(json.dumps({"has_ray": has_ray, "out": out, "back": back, "missing": missing,
                      "ray_imported": "ray" in sys.modules, "ray_layer": ray_layer}))
""")


def test_the_client_works_in_a_venv_without_ray(service: Service, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
           "--disable-pip-version-check"]
    # the client extra as a user installs it: it must not bring Ray
    subprocess.run([*pip, f"{ROOT}[client]"], check=True, timeout=300, capture_output=True)
    out = subprocess.run([str(venv / "bin" / "python"), "-c", CLIENT_SCRIPT, service.url,
                          TOKENS["alice"]], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)  # not the checkout: the installed package is used
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert "ray_sandbox[ray]" in got.pop("ray_layer")
    assert got == {"has_ray": False, "out": "from a venv without ray\n", "back": "y",
                   "missing": "SandboxFileNotFoundError", "ray_imported": False}
    with SandboxClient(service.url, TOKENS["alice"]) as c:
        assert c.list({"suite": "no-ray"}) == []


def test_the_cli_drives_a_service_with_url_and_token(service: Service, tmp_path):
    cli = str(Path(sys.executable).parent / "ray-sandbox")
    env = {**os.environ, "RAY_SANDBOX_URL": service.url, "RAY_SANDBOX_API_TOKEN":
           TOKENS["alice"]}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([cli, *args], env=env, capture_output=True, text=True,
                              timeout=300, cwd=tmp_path)

    made = run("create", "--image", "ray-sandbox/busybox", "--cpu", "0.25", "--memory",
               "64Mi", "-e", "WHO=cli", "--json")
    assert made.returncode == 0, made.stderr
    sid = json.loads(made.stdout)["sandbox_id"]
    try:
        out = run("exec", sid, "--", "sh", "-c", "echo $WHO; exit 3")
        assert (out.returncode, out.stdout) == (3, "cli\n"), out.stderr
        (tmp_path / "up").mkdir()
        (tmp_path / "up" / "a.txt").write_text("dir file")
        (tmp_path / "one.txt").write_text("one file")
        for src, dst in (("up", f"{sid}:/tmp/up"), ("one.txt", f"{sid}:/tmp/one.txt"),
                         (f"{sid}:/tmp/up", "down"), (f"{sid}:/tmp/one.txt", "back.txt")):
            cp = run("cp", src, dst)
            assert cp.returncode == 0, (src, dst, cp.stderr)
        assert (tmp_path / "down" / "a.txt").read_text() == "dir file"
        assert (tmp_path / "back.txt").read_text() == "one file"
        listed = json.loads(run("ps", "--json").stdout)
        assert [r["state"] for r in listed if r["sandbox_id"] == sid] == ["running"]
        gc = run("gc")
        assert gc.returncode == 2 and "works on this node only" in gc.stderr
        volume = run("volume", "ls")  # node-only groups refuse a URL too
        assert volume.returncode == 2 and "works on this node only" in volume.stderr
    finally:
        assert run("rm", sid).returncode == 0
    assert run("rm", sid).returncode == 0  # idempotent, as the service's DELETE is
    with SandboxClient(service.url, TOKENS["alice"]) as c:
        assert sid not in {sb.sandbox_id for sb in c.list()}
    # run: a fresh sandbox for one command, deleted after it
    once = run("run", "--image", "ray-sandbox/busybox", "--memory", "64Mi", "--", "echo", "x")
    assert (once.returncode, once.stdout) == (0, "x\n"), once.stderr
    with SandboxClient(service.url, TOKENS["alice"]) as c:
        assert c.list() == []
    no_token = subprocess.run([cli, "--url", service.url, "ps"], capture_output=True,
                              text=True, timeout=120,
                              env={k: v for k, v in env.items() if k != "RAY_SANDBOX_API_TOKEN"})
    assert no_token.returncode == 2 and "needs a token" in no_token.stderr
