"""An MCP server that gives every client session its own gVisor sandbox: run Python and shell
commands, read, write and list files. ``ray-sandbox mcp serve`` runs it over stdio or
streamable HTTP; see docs/mcp.md. Needs the ``mcp`` extra (the official MCP Python SDK 2.x)."""

from ._config import MCPServerConfig, Transport
from ._server import SandboxMCPServer
from ._transports import serve

__all__ = ["MCPServerConfig", "SandboxMCPServer", "Transport", "serve"]
