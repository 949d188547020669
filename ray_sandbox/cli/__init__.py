"""The ``ray-sandbox`` command line: images, sandboxes, garbage collection, diagnostics."""

from __future__ import annotations

import typer

from . import _remote
from .doctor import doctor
from .images import app as image_app
from .mcp import app as mcp_app
from .sandboxes import app as sandbox_app
from .serve import serve
from .volumes import app as volume_app

app = typer.Typer(help="Isolated gVisor sandboxes for Ray programs.", no_args_is_help=True)


@app.callback()
def _main(
    url: str | None = typer.Option(
        None, envvar="RAY_SANDBOX_URL",
        help="an HTTP service (ray-sandbox serve) to send run, create, exec, ps, rm and cp "
        "to, instead of this node's runtime"),
    token: str | None = typer.Option(None, envvar="RAY_SANDBOX_API_TOKEN",
                                     help="the service token (with --url)"),
) -> None:
    _remote.target(url, token)


app.add_typer(image_app, name="image", help="Pull, build, list and remove images.")
app.add_typer(mcp_app, name="mcp", help="Serve sandboxes to MCP clients.")
app.add_typer(volume_app, name="volume", help="Create, list, inspect and remove volumes.")
app.registered_commands += sandbox_app.registered_commands
app.command()(doctor)
app.command()(serve)

__all__ = ["app"]
