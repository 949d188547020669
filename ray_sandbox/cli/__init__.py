"""The ``ray-sandbox`` command line: images, sandboxes, garbage collection, diagnostics."""

from __future__ import annotations

import typer
from rich.console import Console

from . import _remote
from .doctor import doctor
from .images import app as image_app
from .mcp import app as mcp_app
from .sandboxes import app as sandbox_app
from .serve import serve
from .volumes import app as volume_app

app = typer.Typer(help="Isolated gVisor sandboxes for Ray programs.", no_args_is_help=True)
err = Console(stderr=True)


@app.callback()
def _main(
    ctx: typer.Context,
    url: str | None = typer.Option(
        None, envvar="RAY_SANDBOX_URL",
        help="an HTTP service (ray-sandbox serve) to send run, create, exec, ps, rm and cp "
        "to, instead of this node's runtime"),
    token: str | None = typer.Option(None, envvar="RAY_SANDBOX_API_TOKEN",
                                     help="the service token (with --url)"),
) -> None:
    _remote.target(url, token)
    if url and ctx.invoked_subcommand not in _remote.COMMANDS:
        err.print(f"[red]error:[/red] '{ctx.invoked_subcommand}' works on this node only, "
                  f"not over --url (over a service: {', '.join(sorted(_remote.COMMANDS))})")
        raise typer.Exit(2)


app.add_typer(image_app, name="image", help="Pull, build, list and remove images.")
app.add_typer(mcp_app, name="mcp", help="Serve sandboxes to MCP clients.")
app.add_typer(volume_app, name="volume", help="Create, list, inspect and remove volumes.")
app.registered_commands += sandbox_app.registered_commands
app.command()(doctor)
app.command()(serve)

__all__ = ["app"]
