"""The MCP server, end to end: the SDK's in-process client, a real stdio subprocess and a real
streamable-HTTP server, all on real gVisor sandboxes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from typer.testing import CliRunner

from ray_sandbox.cli.mcp import app as mcp_cli
from ray_sandbox.mcp import MCPServerConfig, SandboxMCPServer
from ray_sandbox.runtime import ImageStore, SandboxRuntime
from tests.fx_hostile import cgroup_value, heavy
from tests.fx_images import scratch_dir

TOOLS = {"run_python", "run_shell", "read_file", "write_file", "list_dir", "reset_sandbox"}
VENV_BIN = Path(sys.executable).parent
TOKEN = "s3cret-token"


def run(main: Callable[[], Awaitable[None]]) -> None:
    anyio.run(main)


async def call(client: Client, tool: str, **args: Any) -> dict[str, Any]:
    """A successful tool call's structured result."""
    res = await client.call_tool(tool, args)
    assert not res.is_error, res.content
    assert res.structured_content is not None
    return res.structured_content


async def call_error(client: Client, tool: str, **args: Any) -> str:
    res = await client.call_tool(tool, args)
    assert res.is_error, res.structured_content
    return res.content[0].text  # type: ignore[union-attr]


async def every_tool(client: Client) -> None:
    """Call each tool once, checking what it returns."""
    assert {t.name for t in (await client.list_tools()).tools} == TOOLS
    wrote = await call(client, "write_file", path="notes/a.txt", content="héllo\n")
    assert wrote["path"] == "/workspace/notes/a.txt" and wrote["size"] == 7
    read = await call(client, "read_file", path="/workspace/notes/a.txt")
    assert (read["content"], read["encoding"], read["truncated"]) == ("héllo\n", "utf-8", False)
    listing = await call(client, "list_dir", path="notes")
    assert [(e["name"], e["type"], e["mode"]) for e in listing["entries"]] == [
        ("a.txt", "file", "0644")]
    shell = await call(client, "run_shell", command="cat notes/a.txt; echo oops >&2; exit 3")
    assert (shell["exit_code"], shell["stdout"], shell["stderr"]) == (3, "héllo\n", "oops\n")
    assert not shell["timed_out"] and not shell["truncated"]
    await call(client, "run_python", code="import os\ncount = len(os.listdir('notes'))")
    py = await call(client, "run_python", code="print('out'); count + 41")
    assert (py["value"], py["stdout"], py["exit_code"]) == ("42", "out\n", 0)
    failed = await call(client, "run_python", code="1 / 0")
    assert failed["exit_code"] == 1 and "ZeroDivisionError" in failed["stderr"]
    assert "No such file" in await call_error(client, "read_file", path="absent.txt")
    ended = await call(client, "reset_sandbox")
    assert ended == {"session": shell["session"], "ended": True}
    # The next call starts a fresh session: the file is gone.
    fresh = await call(client, "list_dir")
    assert fresh["entries"] == [] and fresh["session"] != shell["session"]


@pytest.fixture
def server(runtime: SandboxRuntime) -> Iterator[SandboxMCPServer]:
    yield SandboxMCPServer(MCPServerConfig(max_output_bytes=1000, max_file_bytes=1500), runtime)
    assert runtime.list() == [], "a session's sandbox outlived the client"


def test_in_process_client_calls_every_tool(server: SandboxMCPServer) -> None:
    async def main() -> None:
        async with Client(server.mcp) as client:
            await every_tool(client)
            binary = await call(client, "run_shell",
                                command="printf '\\377\\376' > b.bin; head -c 5000 /dev/zero")
            assert binary["truncated"] and len(binary["stdout"]) == 1000
            read = await call(client, "read_file", path="b.bin")
            assert (read["encoding"], read["content"]) == ("base64", "//4=")
            await call(client, "run_shell", command="head -c 5000 /dev/zero | tr '\\0' a > big")
            big = await call(client, "read_file", path="big")
            assert (big["content"], big["size"], big["truncated"]) == ("a" * 1500, 5000, True)
            assert (await call(client, "read_file", path="b.bin"))["size"] == 2  # still served

    run(main)


def test_two_sessions_cannot_see_each_others_files(server: SandboxMCPServer) -> None:
    async def main() -> None:
        async with Client(server.mcp) as alice, Client(server.mcp) as bob:
            a = await call(alice, "write_file", path="/tmp/secret", content="alice's")
            b = await call(bob, "run_shell", command="ls /tmp; cat /tmp/secret")
            assert b["exit_code"] != 0 and "secret" not in b["stdout"]
            assert "No such file" in await call_error(bob, "read_file", path="/tmp/secret")
            assert a["session"] != b["session"] and len(server.runtime.list()) == 2
            # A handle does not cross clients by accident: each default session is its own.
            assert (await call(alice, "read_file", path="/tmp/secret"))["content"] == "alice's"

    run(main)


def test_endless_python_times_out_and_the_server_keeps_serving(
        server: SandboxMCPServer) -> None:
    async def main() -> None:
        async with Client(server.mcp) as client:
            timed_out = await call(client, "run_python", code="while True: pass", timeout=2)
            assert timed_out["timed_out"] and timed_out["exit_code"] != 0
            assert (await call(client, "run_python", code="6 * 7"))["value"] == "42"

            # While one call loops forever, the same session is still served; ending the
            # session stops the loop.
            async def endless() -> None:
                msg = await call_error(client, "run_python", code=(
                    "open('/workspace/started', 'w').close()\nwhile True: pass"))
                assert "next call starts a fresh sandbox" in msg

            async with anyio.create_task_group() as tg:
                tg.start_soon(endless)
                seen = await call(client, "run_shell", timeout=120, command=(
                    "while [ ! -e started ]; do sleep 0.05; done; echo running"))
                assert seen["stdout"] == "running\n"
                assert (await call(client, "reset_sandbox"))["ended"]
            assert (await call(client, "run_shell", command="echo alive"))["stdout"] == "alive\n"

    run(main)


def test_a_python_timeout_returns_what_was_printed_before_it(server: SandboxMCPServer) -> None:
    """As run_shell does (docs/mcp.md): the output before the timeout is the caller's clue."""
    async def main() -> None:
        async with Client(server.mcp) as client:
            await call(client, "run_python", code="kept = 1")
            res = await call(client, "run_python", timeout=2, code=(
                "import sys, time\nprint('started', flush=True)\n"
                "print('to stderr', file=sys.stderr)\nwhile True: time.sleep(0.05)"))
            assert res["timed_out"] and res["exit_code"] != 0
            assert (res["stdout"], res["stderr"]) == ("started\n", "to stderr\n")
            busy = await call(client, "run_python", timeout=2,
                              code="print('spinning')\nwhile True: pass")
            assert busy["timed_out"] and busy["stdout"] == "spinning\n"
            # the interpreter was restarted, as documented: its state is gone
            gone = await call(client, "run_python", code="'kept' in globals()")
            assert gone["value"] == "False"

    run(main)


def test_a_workspace_volume_survives_reset_and_ends_with_the_connection(
    runtime: SandboxRuntime,
) -> None:
    server = SandboxMCPServer(MCPServerConfig(workspace_volume="32Mi"), runtime)

    async def main() -> None:
        async with Client(server.mcp) as alice, Client(server.mcp) as bob:
            first = await call(alice, "write_file", path="kept.txt", content="across resets")
            await call(alice, "write_file", path="/tmp/gone", content="sandbox-only")
            await call(alice, "reset_sandbox")
            again = await call(alice, "read_file", path="kept.txt")
            assert again["content"] == "across resets" and again["session"] != first["session"]
            assert "No such file" in await call_error(alice, "read_file", path="/tmp/gone")
            # another connection has its own workspace
            assert "No such file" in await call_error(bob, "read_file", path="kept.txt")
            assert len(runtime.volumes.list()) == 2
        assert runtime.volumes.list() == [] and runtime.list() == []

    run(main)


def test_idle_session_is_ended(runtime: SandboxRuntime) -> None:
    server = SandboxMCPServer(MCPServerConfig(idle_timeout=1), runtime)

    async def main() -> None:
        async with Client(server.mcp) as client:
            first = await call(client, "run_shell", command="true")
            assert runtime.list()
            with anyio.fail_after(120):
                while runtime.list():
                    await anyio.sleep(0.2)
            assert (await call(client, "run_shell", command="true"))["session"] != first["session"]
        assert runtime.list() == []

    run(main)


def test_session_limit_and_unknown_handle(runtime: SandboxRuntime) -> None:
    server = SandboxMCPServer(MCPServerConfig(max_sessions=1), runtime)

    async def main() -> None:
        async with Client(server.mcp) as first, Client(server.mcp) as second:
            await call(first, "run_shell", command="true")
            assert "limit" in await call_error(second, "run_shell", command="true")
            assert "unknown or ended" in await call_error(first, "list_dir", session="nope")
            assert (await call(second, "reset_sandbox")) == {"session": None, "ended": False}

    run(main)


# --- real server processes ----------------------------------------------------------------------


def cli_mounted() -> bool:
    from ray_sandbox.cli import app

    return any(g.name == "mcp" for g in app.registered_groups)


LAUNCHERS = {
    "entry-point": [str(VENV_BIN / "ray-sandbox"), "mcp"],
    "module": [sys.executable, "-m", "ray_sandbox.mcp"],
}


@pytest.fixture(params=sorted(LAUNCHERS))
def launcher(request: pytest.FixtureRequest) -> list[str]:
    if request.param == "entry-point" and not cli_mounted():
        pytest.skip("ray_sandbox/cli/__init__.py does not mount the mcp sub-app yet")
    return LAUNCHERS[request.param]


@pytest.fixture
def server_env(rt_home: Path, image_store: ImageStore) -> dict[str, str]:
    """The environment of a server process: the test's runtime home, the node's images."""
    return {**os.environ, "RAY_SANDBOX_HOME": str(rt_home),
            "RAY_SANDBOX_IMAGES": str(image_store.root)}


def sandbox_dirs(rt_home: Path) -> list[str]:
    return sorted(p.name for p in (rt_home / "sandboxes").iterdir())


def test_stdio_subprocess_calls_every_tool(launcher: list[str], server_env: dict[str, str],
                                           rt_home: Path, runtime: SandboxRuntime) -> None:
    params = StdioServerParameters(command=launcher[0], env=server_env, args=[
        *launcher[1:], "serve", "--transport", "stdio", "--idle-timeout", "600"])

    async def main() -> None:
        async with Client(params) as client:
            await every_tool(client)
            assert len(sandbox_dirs(rt_home)) == 1
        # The client closed stdin and the server process exited: its session was deleted.
        assert sandbox_dirs(rt_home) == []

    run(main)


def test_serve_takes_any_sandbox_option(server_env: dict[str, str], rt_home: Path,
                                        runtime: SandboxRuntime) -> None:
    """Options without a flag of their own reach every session's sandbox through --opt."""
    params = StdioServerParameters(command=sys.executable, env=server_env, args=[
        "-m", "ray_sandbox.mcp", "serve", "--opt", "pids_limit=256",
        "--opt", 'capabilities=["CAP_KILL"]'])

    async def main() -> None:
        async with Client(params) as client:
            shell = await call(client, "run_shell", command="grep CapEff /proc/self/status")
            assert shell["stdout"] == f"CapEff:\t{1 << 5:016x}\n"  # CAP_KILL alone
            (sid,) = sandbox_dirs(rt_home)
            assert cgroup_value("pids", sid, "pids.max") == "256"

    run(main)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def http_server(server_env: dict[str, str], rt_home: Path,
                runtime: SandboxRuntime) -> Iterator[str]:
    """URL of a real ``serve --transport http`` process, stopped by PID at teardown, which
    must delete every sandbox it still had."""
    port = free_port()
    with scratch_dir("rsb-mcp-http-") as logs:
        log = open(logs / "server.log", "wb")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(
            [*LAUNCHERS["module"], "serve", "--transport", "http", "--port", str(port)],
            env={**server_env, "RAY_SANDBOX_MCP_TOKEN": TOKEN},
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, (logs / "server.log").read_text()
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline, "the HTTP server did not start"
                    time.sleep(0.1)
            yield f"http://127.0.0.1:{port}/mcp"
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
        # uvicorn re-raises the SIGTERM once its graceful shutdown is done.
        assert proc.returncode == -signal.SIGTERM, (logs / "server.log").read_text()
        assert sandbox_dirs(rt_home) == []


def post_initialize(url: str, headers: dict[str, str]) -> int:
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {},
        "clientInfo": {"name": "t", "version": "0"}}}).encode()
    req = urllib.request.Request(url, data=body, method="POST", headers={
        "content-type": "application/json",
        "accept": "application/json, text/event-stream", **headers})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def http_client(url: str, token: str = TOKEN, mode: str = "auto") -> Client:
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"},
                              timeout=httpx2.Timeout(60, read=300))
    return Client(streamable_http_client(url, http_client=http), mode=mode)


def test_http_requires_the_token(http_server: str) -> None:
    assert post_initialize(http_server, {}) == 401
    assert post_initialize(http_server, {"authorization": "Bearer wrong"}) == 401
    assert post_initialize(http_server, {"authorization": f"Basic {TOKEN}"}) == 401
    assert post_initialize(http_server, {"authorization": f"Bearer {TOKEN}"}) == 200

    async def main() -> None:
        with pytest.raises(Exception):  # noqa: B017 - the SDK wraps the 401 its own way
            async with http_client(http_server, token="wrong") as client:
                await client.list_tools()

    run(main)


def test_http_sessions(http_server: str, rt_home: Path) -> None:
    async def sandboxes_become(count: int) -> None:
        """A DELETE ending a protocol session is answered before its sandbox is deleted."""
        with anyio.fail_after(60):
            while len(sandbox_dirs(rt_home)) != count:
                await anyio.sleep(0.1)

    async def main() -> None:
        # 2025-era clients: one sandbox per protocol session, deleted when it is deleted.
        async with http_client(http_server, mode="legacy") as a:
            await every_tool(a)
            await call(a, "write_file", path="mine", content="a")
            async with http_client(http_server, mode="legacy") as b:
                assert "No such file" in await call_error(b, "read_file", path="mine")
                assert len(sandbox_dirs(rt_home)) == 2
            await sandboxes_become(1)
            assert (await call(a, "read_file", path="mine"))["content"] == "a"
        await sandboxes_become(0)

        # 2026-07-28 clients have no protocol session: the handle names the sandbox.
        async with http_client(http_server) as client:
            first = await call(client, "write_file", path="kept", content="k")
            handle = first["session"]
            kept = await call(client, "read_file", path="kept", session=handle)
            assert kept["content"] == "k" and kept["session"] == handle
            other = await call(client, "list_dir")
            assert other["session"] != handle and other["entries"] == []
            assert len(sandbox_dirs(rt_home)) == 2
            assert (await call(client, "reset_sandbox", session=other["session"]))["ended"]
            # The other one is left running: the server's shutdown deletes it.
            assert len(sandbox_dirs(rt_home)) == 1

    run(main)


@heavy  # 26 s in CI
def test_http_results_fit_the_clients_event_limit(http_server: str, rt_home: Path) -> None:
    """The official client refuses SSE events over 1 MiB; a result is sent twice (structured
    and as text) and JSON escapes control characters six-fold. Big or hostile files and
    outputs come back truncated, never as a client error (issue 15 #15), and the server
    gives every session a bounded disk (#8)."""

    async def main() -> None:
        async with http_client(http_server, mode="legacy") as client:
            plain = await call(client, "run_python", code=(
                "open('big.txt', 'w').write('a' * 700_000);"
                "open('ctl.txt', 'w').write(chr(1) * 300_000)"))
            assert plain["exit_code"] == 0, plain["stderr"]
            for name in ("ctl.txt", "big.txt"):
                got = await call(client, "read_file", path=name, session=plain["session"])
                assert got["truncated"] and got["size"] in (700_000, 300_000)
                assert 0 < len(got["content"]) < got["size"]
            loud = await call(client, "run_shell", session=plain["session"],
                              command="head -c 300000 /dev/zero | tr '\\0' '\\1'")
            assert loud["exit_code"] == 0 and loud["truncated"]
            fill = await call(client, "run_shell", session=plain["session"], timeout=120,
                              command="head -c 1100M /dev/zero > fill; echo $?; rm -f fill")
            assert fill["stdout"].strip() != "0" and "space" in fill["stderr"], fill

    run(main)


# --- configuration --------------------------------------------------------------------------


def test_config_refuses_unsafe_http() -> None:
    with pytest.raises(ValueError, match="needs a bearer token"):
        MCPServerConfig(transport="http")
    with pytest.raises(ValueError, match="only when bound to a loopback"):
        MCPServerConfig(transport="http", host="0.0.0.0", require_token=False)
    assert not MCPServerConfig(transport="http", host="::1", require_token=False).require_token
    assert MCPServerConfig().clamp_timeout(10**6) == MCPServerConfig().max_timeout


def test_cli_rejects_bad_settings() -> None:
    runner = CliRunner()
    for args in (["--transport", "http", "--host", "0.0.0.0", "--no-auth"],
                 ["--transport", "http"], ["--egress", "{not json"],
                 ["--network", "none", "--egress", '{"default": "deny"}']):
        result = runner.invoke(mcp_cli, ["serve", *args], env={"RAY_SANDBOX_MCP_TOKEN": ""})
        assert result.exit_code == 2, (args, result.output)
    for args, message in (
        (["--opt", "nope=1"], "unknown sandbox option 'nope'"),
        (["--opt", "pids_limit=12"], "pids_limit: "),
        (["--image", "ray-sandbox/busybox", "--opt", "image=x"],
         "image set both by a flag and by --opt"),
    ):
        result = runner.invoke(mcp_cli, ["serve", *args])
        assert result.exit_code == 2, (args, result.output)
        assert message in " ".join(result.stderr.split()), result.stderr
