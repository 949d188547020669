"""``serve``: run the server over stdio or streamable HTTP until the client (stdio) or a
signal ends it. The server's lifespan deletes every sandbox on the way out."""

from __future__ import annotations

import signal
import sys
from collections.abc import Awaitable, Callable

import anyio

from ..runtime import SandboxRuntime
from ._config import MCPServerConfig
from ._server import SandboxMCPServer


async def _until_signalled(main: Callable[[], Awaitable[None]]) -> None:
    """Run ``main``; SIGTERM/SIGINT cancel it, so the lifespan cleanup still runs."""
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    tg.cancel_scope.cancel()

        tg.start_soon(watch)
        await main()
        tg.cancel_scope.cancel()


async def _serve_http(server: SandboxMCPServer) -> None:
    import uvicorn

    from ._http import http_app

    cfg = server.config
    # uvicorn handles SIGTERM/SIGINT itself: it stops accepting, runs the lifespan exit, then
    # re-raises the signal, so the process ends as signalled.
    await uvicorn.Server(uvicorn.Config(http_app(server), host=cfg.host, port=cfg.port,
                                        log_level="warning")).serve()


def serve(config: MCPServerConfig) -> None:
    """Serve MCP clients with sandboxes of this node's runtime until stopped."""
    with SandboxRuntime() as runtime:  # closing it deletes any sandbox still left
        server = SandboxMCPServer(config, runtime)
        if config.transport == "stdio":
            anyio.run(_until_signalled, server.mcp.run_stdio_async)
        else:
            print(f"ray-sandbox MCP server on http://{config.host}:{config.port}{config.path}",
                  file=sys.stderr, flush=True)
            anyio.run(_serve_http, server)
