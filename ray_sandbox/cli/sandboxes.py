"""Sandbox commands: run, create, exec, ps, rm, gc, cp, logs. Given a service URL (``--url`` or
``RAY_SANDBOX_URL``), run, create, exec, ps, rm and cp go to the service (``_remote``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from ..runtime import SandboxConfig, SandboxRuntime, reaper
from ..runtime.errors import ConfigError, SandboxError
from . import _remote
from ._options import Opts, sandbox_config

app = typer.Typer()
err = Console(stderr=True)


def _fail(exc: SandboxError) -> typer.Exit:
    err.print(f"[red]error:[/red] {escape(str(exc))}")
    return typer.Exit(2)


def _config(opts: list[str] | None, env: list[str], **flags: Any) -> SandboxConfig:
    """The sandbox the flags and ``--opt`` items describe; unset flags keep SandboxConfig's
    defaults."""
    env_map = {}
    for item in env:
        k, sep, v = item.partition("=")
        if not sep:
            raise ConfigError(f"--env needs KEY=VALUE, got {item!r}")
        env_map[k] = v
    return sandbox_config(opts, env=env_map or None, **flags)


# Shortcuts for the common options; each is the same as --opt with its field's name, and
# None (not given) leaves SandboxConfig's default.
_IMAGE = typer.Option(None, "--image", "-i", help="image reference",
                      show_default="ray-sandbox/python")
_CPU = typer.Option(None, help="CPU quota in cores; 0 = unlimited", show_default="1")
_MEM = typer.Option(None, help="memory limit, e.g. 1Gi", show_default="512Mi")
_NET = typer.Option(None, help="none | public | host | sandbox", show_default="none")
_RO = typer.Option(None, "--readonly/--writable", help="read-only root or private CoW",
                   show_default="readonly")
_WORKDIR = typer.Option(None, help="writable working directory")
_ENV = typer.Option([], "--env", "-e", help="KEY=VALUE (repeatable)")
_OPTIONS_HELP = ("Sandbox options: the common ones have their own flags; every other one is an "
                 "--opt KEY=VALUE, e.g. --opt pids_limit=256 --opt directfs=false.")


def _print_result(res, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps({
            "exit_code": res.exit_code, "stdout": res.stdout, "stderr": res.stderr,
            "timed_out": res.timed_out, "truncated": res.truncated,
            "duration_seconds": res.duration_seconds,
        }))
        return
    sys.stdout.buffer.write(res.stdout_bytes)
    sys.stdout.flush()
    sys.stderr.buffer.write(res.stderr_bytes)
    sys.stderr.flush()
    if res.timed_out:
        err.print("[yellow]timed out[/yellow]")


@app.command(epilog=_OPTIONS_HELP)
def run(
    command: list[str] = typer.Argument(..., help="command (after --)"),
    image: str | None = _IMAGE, cpu: float | None = _CPU, memory: str | None = _MEM,
    network: str | None = _NET, readonly: bool | None = _RO, workdir: str | None = _WORKDIR,
    env: list[str] = _ENV, opt: Opts = None,
    timeout: float | None = typer.Option(None, help="seconds"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Run one command in a fresh sandbox, then delete it. Exits with the command's code."""
    try:
        config = _config(opt, env, image=image, cpu=cpu, memory=memory, network=network,
                         readonly=readonly, workdir=workdir)
        cmd = command[0] if len(command) == 1 else command
        if (service := _remote.client()) is not None:
            res = _remote.run(service, config, cmd, timeout)
        else:
            with SandboxRuntime() as rt:
                res = rt.exec(rt.create(config), cmd, timeout=timeout)
    except SandboxError as exc:
        raise _fail(exc) from None
    _print_result(res, as_json)
    raise typer.Exit(res.exit_code)


@app.command(epilog=_OPTIONS_HELP)
def create(
    image: str | None = _IMAGE, cpu: float | None = _CPU, memory: str | None = _MEM,
    network: str | None = _NET, readonly: bool | None = _RO, workdir: str | None = _WORKDIR,
    env: list[str] = _ENV, opt: Opts = None,
    ttl: float | None = typer.Option(None, help="delete after this many seconds"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Create a sandbox that outlives this command; prints its id."""
    try:
        config = _config(opt, env, image=image, cpu=cpu, memory=memory, network=network,
                         readonly=readonly, workdir=workdir, ttl_seconds=ttl)
        if (service := _remote.client()) is not None:
            sid = _remote.create(service, config)
        else:
            sid = SandboxRuntime().create(config, detach=True)
    except SandboxError as exc:
        raise _fail(exc) from None
    typer.echo(json.dumps({"sandbox_id": sid}) if as_json else sid)


@app.command("exec")
def exec_(
    sandbox_id: str,
    command: list[str] = typer.Argument(..., help="command (after --)"),
    timeout: float | None = typer.Option(None, help="seconds"),
    cwd: str | None = typer.Option(None),
    user: str | None = typer.Option(None),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Run a command in an existing sandbox. Exits with the command's code."""
    try:
        cmd = command[0] if len(command) == 1 else command
        if (service := _remote.client()) is not None:
            res = _remote.exec_(service, sandbox_id, cmd, timeout=timeout, cwd=cwd,
                                user=user)
        else:
            res = SandboxRuntime(reap=False).exec(sandbox_id, cmd, timeout=timeout, cwd=cwd,
                                                  user=user)
    except SandboxError as exc:
        raise _fail(exc) from None
    _print_result(res, as_json)
    raise typer.Exit(res.exit_code)


@app.command("port-url")
def port_url(
    sandbox_id: str,
    port: int,
    ttl: float | None = typer.Option(None, help="seconds the URL stays valid (capped)"),
) -> None:
    """Print a signed URL to a published port of a sandbox of the service (--url): no
    bearer token needed to open it, until it expires."""
    try:
        if (service := _remote.client()) is None:
            raise ConfigError("port-url needs the service: give --url and --token (a local "
                              "sandbox's published port is on this node, 127.0.0.1:PORT)")
        typer.echo(_remote.port_url(service, sandbox_id, port, ttl))
    except SandboxError as exc:
        raise _fail(exc) from None


@app.command()
def ps(
    as_json: bool = typer.Option(False, "--json"),
    show_all: bool = typer.Option(False, "--all", "-a", help="also the Ray hosts' stock of "
                                  "booted, never-used sandboxes (owner 'stock')"),
) -> None:
    """List the sandboxes on this node with their real state (a service's: this tenant's)."""
    try:
        service = _remote.client()
        rows = _remote.ps(service) if service is not None else _local_ps(show_all)
    except SandboxError as exc:
        raise _fail(exc) from None
    if as_json:
        typer.echo(json.dumps(rows))
        return
    table = Table("ID", "STATE", "IMAGE", "NETWORK", "CREATED", "OWNER")
    for r in rows:
        state = r["state"] + (f" ({r['reason']})" if r["reason"] else "")
        owner = "stock" if r.get("stock") else r.get("owner_pid") or "detached"
        cells = (r["sandbox_id"][:12], state, r["image"], r["network"], r["created_at"], owner)
        table.add_row(*(Text("" if v is None else str(v)) for v in cells))  # never markup
    Console().print(table)
    asleep = [r for r in rows if r["state"] == "SUSPENDED"]
    if asleep:
        size = sum(r.get("suspended_bytes") or 0 for r in asleep)
        Console().print(Text(f"{len(asleep)} suspended, {size / 2**20:.1f} MiB of checkpoints "
                             "on disk"))


# The label the Ray hosts' stock puts on the sandboxes it holds (actor/stock.py STOCK_LABEL;
# the CLI imports no Ray, and tests/test_cli_stock.py checks the two agree). A sandbox handed
# out from the stock gets its caller's labels instead.
STOCK_LABEL = "ray-sandbox/stock"


def _local_ps(show_all: bool) -> list[dict[str, Any]]:
    rt = SandboxRuntime(reap=False)
    rows = []
    for sid in rt.list(all=True):
        try:
            rec = rt.record(sid)
            stock = STOCK_LABEL in rec.config.get("labels", {})
            if stock and not show_all:
                continue
            st = rt.get_status(sid)
        except SandboxError:
            continue
        sus = rt.suspensions.state(sid) if st.state.value == "SUSPENDED" else None
        rows.append({
            "sandbox_id": sid, "state": st.state.value, "reason": st.reason,
            "image": rec.image, "network": rec.config.get("network"),
            "created_at": st.created_at.isoformat() if st.created_at else None,
            "owner_pid": rec.owner_pid, "stock": stock,
            "suspended_at": st.suspended_at.isoformat() if st.suspended_at else None,
            "suspended_bytes": sus.size_bytes if sus else None,
        })
    return rows


@app.command()
def rm(sandbox_ids: list[str]) -> None:
    """Delete sandboxes (idempotent)."""
    code = 0
    for sid in sandbox_ids:
        try:
            if (service := _remote.client()) is not None:
                _remote.rm(service, sid)
            else:
                SandboxRuntime(reap=False).delete(sid)
            typer.echo(sid)
        except SandboxError as exc:
            err.print(f"[red]error:[/red] {exc}")
            code = 2
    raise typer.Exit(code)


@app.command()
def gc(
    as_json: bool = typer.Option(False, "--json"),
    unknown_pins: bool = typer.Option(
        False, "--unknown-pins",
        help="also remove sandbox pins that name no home (written by a version before pins "
        "named their home) and are older than a minute: only once no runtime of such a "
        "version uses the image store"),
) -> None:
    """Remove sandboxes whose owner died, expired ones, orphaned runsc state, and image pins of
    sandboxes that no home on the image store has any more."""
    rt = SandboxRuntime(reap=False)
    unpinned = reaper.unpin_stale(rt.images, rt.home, unknown=unknown_pins)
    removed = rt.gc()
    if as_json:
        typer.echo(json.dumps({"removed": removed, "unpinned": [
            {"image": p.digest, "owner": p.owner, "home": p.home and str(p.home)}
            for p in unpinned]}))
    else:
        for sid in removed:
            typer.echo(sid)
        for p in unpinned:
            typer.echo(f"unpinned {p.digest} {p.owner} (home {p.home or 'unknown'})")
        err.print(f"removed {len(removed)} sandbox(es), {len(unpinned)} stale image pin(s)")


@app.command()
def cp(src: str, dst: str) -> None:
    """Copy files or directories between host and sandbox: ID:/path names a path in sandbox
    ID (one side only), e.g. ray-sandbox cp ./src ID:/work."""

    def split(s: str) -> tuple[str | None, str]:
        head, sep, tail = s.partition(":")
        if sep and len(head) == 32 and tail.startswith("/"):
            return head, tail
        return None, s

    (s_id, s_path), (d_id, d_path) = split(src), split(dst)
    if bool(s_id) == bool(d_id):
        raise typer.BadParameter("exactly one side must be SANDBOX_ID:/path")
    try:
        if (service := _remote.client()) is not None:
            if s_id:
                _remote.cp(service, s_id, s_path, Path(d_path), upload=False)
            else:
                _remote.cp(service, d_id, d_path, Path(s_path), upload=True)
            return
        rt = SandboxRuntime(reap=False)
        if s_id:
            if rt.stat(s_id, s_path).type.value == "directory":
                rt.download_dir(s_id, s_path, Path(d_path))
            else:
                rt.download_file(s_id, s_path, Path(d_path))
        elif Path(s_path).is_dir():
            rt.upload_dir(d_id, Path(s_path), d_path)
        else:
            rt.upload_file(d_id, Path(s_path), d_path)
    except SandboxError as exc:
        raise _fail(exc) from None


@app.command()
def logs(sandbox_id: str) -> None:
    """Print runsc's log for a sandbox (boot errors, panics)."""
    rt = SandboxRuntime(reap=False)
    rt.record(sandbox_id)
    path = rt.sandboxes_dir / sandbox_id / "runsc.err"
    typer.echo(path.read_text(errors="replace") if path.exists() else "")


@app.command()
def demo(
    solutions: int = typer.Option(48, help="model-style solutions to run"),
    concurrency: int = typer.Option(8, help="sandboxes in flight"),
) -> None:
    """Run the rollout demo: model-written solutions tested in sandboxes on local Ray."""
    import runpy
    import sys

    script = Path(__file__).resolve().parents[2] / "examples" / "rollout_demo.py"
    if not script.is_file():
        raise typer.BadParameter(f"{script} not found (the demo ships with the repository)")
    sys.argv = [str(script), "--solutions", str(solutions), "--concurrency", str(concurrency)]
    runpy.run_path(str(script), run_name="__main__")
