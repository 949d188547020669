"""veRL uni-agent's sandbox provider ``ray_sandbox``: commands, files, a port and a fork.

    # uni-agent is not on PyPI: put a checkout of github.com/verl-project/uni-agent on PYTHONPATH
    PYTHONPATH=/path/to/uni-agent python examples/uni_agent_provider.py

Importing ``ray_sandbox.integrations.uni_agent`` registers the provider; uni-agent builds it
from its own ``SandboxConfig`` and runs its lifecycle (``async with``).
"""

from __future__ import annotations

import asyncio
import socket
import time
import urllib.request

from uni_agent.sandbox import SandboxConfig, build_sandbox

import ray_sandbox.integrations.uni_agent  # noqa: F401 - registers provider "ray_sandbox"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def main() -> None:
    port = free_port()
    sandbox = build_sandbox(SandboxConfig(
        provider="ray_sandbox", image="ray-sandbox/python:latest", runtime_timeout=600,
        sandbox_kwargs={"network": "sandbox", "expose_ports": [port], "cpu": 0.5}))
    async with sandbox:
        r = await sandbox.exec_shell("python3 -V; pwd", workdir="/tmp")
        print("exec:", r.exit_code, r.stdout.split())
        await sandbox.write_file("/srv/hello.txt", "hello from the sandbox\n")
        (copy,) = await sandbox.fork(1)  # a running copy: same files, own sandbox
        try:
            print("fork reads:", (await copy.read_file("/srv/hello.txt")).decode().strip())
        finally:
            await copy.stop()
        await sandbox.exec_shell(f"cd /srv && (setsid python3 -m http.server {port} "
                                 ">/dev/null 2>&1 &)")
        url = await sandbox.expose_port(port)
        for attempt in range(40):  # the server starts in the background
            try:
                with urllib.request.urlopen(f"{url}/hello.txt", timeout=5) as resp:
                    print("port:", url, "->", resp.read().decode().strip())
                    break
            except OSError as exc:
                if attempt == 39:
                    raise SystemExit(f"{url} did not answer: {exc}") from None
                time.sleep(0.25)


if __name__ == "__main__":
    asyncio.run(main())
