"""``ray-sandbox doctor``."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape

from ..runtime import SandboxRuntime
from ..runtime.doctor import Check, diagnose
from ..runtime.errors import SandboxError


def doctor(as_json: bool = typer.Option(False, "--json")) -> None:
    """Report runsc version and features, platform, cgroups, tools, what is not enforced,
    the node's suspended sandboxes and their disk, and the node's sandbox ceiling: how many
    more idle sandboxes fit and which limit sets it."""
    report = diagnose()
    report.checks.append(suspended_check())
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


def suspended_check() -> Check:
    """How many of this home's sandboxes are suspended and the disk their checkpoints take
    (docs/snapshots.md, "Idle suspend"); informational."""
    try:
        n, size = SandboxRuntime(reap=False).suspensions.usage()
    except (SandboxError, OSError) as exc:
        return Check(name="suspended", ok=True, detail=f"not counted: {exc}")
    return Check(name="suspended", ok=True,
                 detail=f"{n} sandbox(es) suspended, {size / 2**20:.1f} MiB of checkpoints")
