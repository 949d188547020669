"""``ray-sandbox doctor``."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape

from ..runtime.doctor import diagnose


def doctor(as_json: bool = typer.Option(False, "--json")) -> None:
    """Report runsc version and features, platform, cgroups, tools, what is not enforced, and
    the node's sandbox ceiling: how many more idle sandboxes fit and which limit sets it."""
    report = diagnose()
    if as_json:
        typer.echo(report.model_dump_json(indent=1))
    else:
        con = Console()
        for c in report.checks:
            con.print(f"{'[green]ok[/green]' if c.ok else '[red]!![/red]'}  {c.name:12} "
                      f"{escape(c.detail)}")
        for item in report.not_enforced:
            con.print(f"[yellow]not enforced:[/yellow] {escape(item)}")
        if report.ceiling is not None:
            con.print("ceiling, every limit (tightest first; per idle sandbox as measured, "
                      "ray_sandbox/runtime/doctor.py IDLE_SANDBOX):")
            for lim in report.ceiling.limits:
                con.print(f"    {escape(lim.describe())}")
    raise typer.Exit(0 if report.ok else 1)
