"""``python -m ray_sandbox.mcp serve ...``: the same as ``ray-sandbox mcp serve``, for MCP
client configurations that name an interpreter rather than a script."""

from ..cli.mcp import app

app(prog_name="python -m ray_sandbox.mcp")
