"""``ray-sandbox doctor``."""

from __future__ import annotations

import typer
from rich.console import Console

from ..runtime.doctor import diagnose


def doctor(as_json: bool = typer.Option(False, "--json")) -> None:
    """Report runsc version and features, platform, cgroups, tools, and what is not enforced."""
    report = diagnose()
    if as_json:
        typer.echo(report.model_dump_json(indent=1))
    else:
        con = Console()
        for c in report.checks:
            con.print(f"{'[green]ok[/green]' if c.ok else '[red]!![/red]'}  {c.name:12} {c.detail}")
        for item in report.not_enforced:
            con.print(f"[yellow]not enforced:[/yellow] {item}")
    raise typer.Exit(0 if report.ok else 1)
