"""``ray-sandbox mcp serve``: the MCP server (mounted as ``ray-sandbox mcp``).

Settings come from, lowest first: the defaults of MCPServerConfig, a JSON ``--config`` file
(MCPServerConfig's fields), ``RAY_SANDBOX_MCP_*`` environment variables, and flags. Any option
of the sessions' sandbox is also an ``--opt KEY=VALUE``, as in ``ray-sandbox run``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

from ..runtime.errors import ConfigError
from ._options import Opts, sandbox_config

app = typer.Typer(help="Serve per-session gVisor sandboxes to MCP clients.",
                  no_args_is_help=True, add_completion=False)
err = Console(stderr=True)


@app.callback()
def _group() -> None:
    """Serve per-session gVisor sandboxes to MCP clients."""
    # A callback keeps `serve` a subcommand; typer would fold a lone command into the app.


def _opt(help: str, *names: str, env: str) -> Any:
    return typer.Option(*names, help=help, envvar=f"RAY_SANDBOX_MCP_{env}", show_default=False)


@app.command()
def serve(
    transport: Annotated[str | None, _opt("stdio (default) or http", env="TRANSPORT")] = None,
    host: Annotated[str | None, _opt("HTTP bind address (default 127.0.0.1)", env="HOST")] = None,
    port: Annotated[int | None, _opt("HTTP port (default 8765)", env="PORT")] = None,
    path: Annotated[str | None, _opt("HTTP endpoint path (default /mcp)", env="PATH")] = None,
    token: Annotated[str | None, _opt("bearer token HTTP clients must send", env="TOKEN")] = None,
    no_auth: Annotated[bool, _opt("serve HTTP without a token (loopback only)", "--no-auth",
                                  env="NO_AUTH")] = False,
    image: Annotated[str | None, _opt("sandbox image (default ray-sandbox/python)",
                                      env="IMAGE")] = None,
    cpu: Annotated[float | None, _opt("CPU cores per sandbox", env="CPU")] = None,
    memory: Annotated[str | None, _opt("memory per sandbox, e.g. 1Gi", env="MEMORY")] = None,
    disk: Annotated[str | None, _opt("disk each sandbox may write, e.g. 4Gi (default 1Gi)",
                                     env="DISK")] = None,
    network: Annotated[str | None, _opt("none | public | host | sandbox", env="NETWORK")] = None,
    egress: Annotated[str | None, _opt(
        'egress policy JSON, e.g. \'{"allow_domains": ["pypi.org"], "default": "deny"}\'',
        env="EGRESS")] = None,
    timeout: Annotated[float | None, _opt("default call timeout, s", env="TIMEOUT")] = None,
    max_timeout: Annotated[float | None, _opt("longest call timeout, s",
                                              env="MAX_TIMEOUT")] = None,
    max_output_bytes: Annotated[int | None, _opt("output kept per stream and call",
                                                 env="MAX_OUTPUT_BYTES")] = None,
    idle_timeout: Annotated[float | None, _opt("idle seconds before a session ends",
                                               env="IDLE_TIMEOUT")] = None,
    max_sessions: Annotated[int | None, _opt("sessions alive at once",
                                             env="MAX_SESSIONS")] = None,
    workspace_volume: Annotated[str | None, _opt(
        "a workspace volume of this size per client connection (e.g. 256Mi): files survive "
        "reset_sandbox", env="WORKSPACE_VOLUME")] = None,
    config: Annotated[Path | None, _opt("JSON file of server settings", env="CONFIG")] = None,
    opt: Opts = None,
) -> None:
    """Serve MCP clients over stdio (one client) or streamable HTTP (many, with a token)."""
    try:
        from ..mcp import MCPServerConfig, serve
        from ..mcp._config import default_sandbox
    except ImportError as exc:
        if (exc.name or "").split(".")[0] != "mcp":
            raise
        err.print("[red]error:[/red] the MCP server needs the MCP SDK: "
                  "pip install 'ray_sandbox[mcp]'")
        raise typer.Exit(2) from None
    data: dict[str, Any] = _json(config.read_text(), "--config") if config else {}
    base = {**default_sandbox().model_dump(exclude_unset=True), **data.get("sandbox", {})}
    data.update(_given(
        transport=transport, host=host, port=port, path=path, token=token,
        require_token=False if no_auth else None, default_timeout=timeout,
        max_timeout=max_timeout, max_output_bytes=max_output_bytes, idle_timeout=idle_timeout,
        max_sessions=max_sessions, workspace_volume=workspace_volume,
    ))
    try:
        data["sandbox"] = sandbox_config(opt, base, image=image, cpu=cpu, memory=memory,
                                         disk=disk, network=network,
                                         egress=_json(egress, "--egress"))
        settings = MCPServerConfig.model_validate(data)
    except ConfigError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}")
        raise typer.Exit(2) from None
    except ValidationError as exc:
        for e in exc.errors():
            err.print(f"[red]error:[/red] {'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}")
        raise typer.Exit(2) from None
    serve(settings)


def _given(**values: Any) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


def _json(text: str | None, flag: str) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise typer.BadParameter(f"{flag} is not JSON: {exc}") from None
