"""Volume commands: create, ls, inspect, fill, rm (mounted as ``ray-sandbox volume``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..runtime import paths
from ..runtime.errors import SandboxError
from ..runtime.volumes import VolumeInfo, VolumeStore
from .images import _errors, _size

app = typer.Typer(help="Create, list, inspect and remove this node's named volumes.",
                  no_args_is_help=True)
err = Console(stderr=True)

AsJson = Annotated[bool, typer.Option("--json", help="machine-readable output")]


def _store() -> VolumeStore:
    return VolumeStore(paths.home())


def _show(volumes: list[VolumeInfo], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps([v.model_dump(mode="json") for v in volumes], indent=2))
        return
    table = Table("NAME", "SIZE", "USED", "NODE", "CREATED", "MOUNTED BY")
    for v in volumes:
        users = ", ".join(f"{u.sandbox_id[:12]}{' (ro)' if u.readonly else ''}"
                          for u in v.mounts)
        table.add_row(v.name, _size(v.size), _size(v.used), v.node,
                      time.strftime("%Y-%m-%d %H:%M", time.localtime(v.created_at)), users)
    Console().print(table)


@app.command()
def create(
    name: Annotated[str, typer.Argument(help="1-63 of a-z 0-9 _ . -")],
    size: Annotated[str, typer.Option(help="the cap: '1Gi', '512Mi' or bytes")],
    as_json: AsJson = False,
) -> None:
    """Create an empty volume of SIZE on this node."""
    with _errors():
        _show([_store().create(name, size)], as_json)


@app.command("list")
def list_volumes(as_json: AsJson = False) -> None:
    """List this node's volumes and who has them mounted."""
    with _errors():
        _show(_store().list(), as_json)


app.command("ls", hidden=True)(list_volumes)  # as `ray-sandbox image ls`


@app.command()
def inspect(name: str) -> None:
    """One volume as JSON: size, used, node, created_at, mounts."""
    with _errors():
        typer.echo(json.dumps(_store().inspect(name).model_dump(mode="json"), indent=2))


@app.command()
def fill(
    name: str,
    source: Annotated[Path, typer.Argument(help="a directory, or a tar file", exists=True)],
    path: Annotated[str, typer.Option(help="where in the volume")] = "/",
) -> None:
    """Copy a directory or a tar's members into a volume, unpacked in a short-lived sandbox
    that mounts it (never on the host: a volume's contents may be sandbox-written)."""
    from ..runtime import SandboxRuntime, archive
    from ..runtime.volumes import fill as fill_volume

    with _errors(), SandboxRuntime(paths.home(), reap=False) as rt:
        fill_volume(rt, name, archive.tar_of(source), path=path)
    typer.echo(f"filled {name}")


@app.command()
def rm(names: list[str]) -> None:
    """Delete volumes and their data (refused for a volume a sandbox has mounted)."""
    store, code = _store(), 0
    for name in names:
        try:
            store.delete(name)
            typer.echo(f"deleted {name}")
        except SandboxError as exc:  # the others are still removed
            err.print(f"[red]error:[/red] {type(exc).__name__}: {escape(str(exc))}")
            code = 2
    raise typer.Exit(code)
