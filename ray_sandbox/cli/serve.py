"""``ray-sandbox serve``: the HTTP service (docs/service.md) on a Ray cluster, until
interrupted. Tokens come from the environment or ``--tokens-file``; the service's sandboxes
outlive it and are adopted by its next start, and its books (``--state-db``) are reloaded.
``--reconcile`` compares the books with the nodes once, prints the report (JSON) and exits."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

from ..runtime.errors import ConfigError

err = Console(stderr=True)
TOKEN_VARIABLES = ("RAY_SANDBOX_API_TOKEN", "RAY_SANDBOX_API_TOKENS",
                   "RAY_SANDBOX_API_TOKENS_FILE")


def _refuse(message: str) -> NoReturn:
    err.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True)
    raise typer.Exit(2)


def _one_line(exc: ConfigError) -> str:
    """The service's config errors in one line: what pydantic said of each field, without
    its report around it (the input, the error type, a link)."""
    cause = exc.__context__
    if not isinstance(cause, ValidationError):
        return str(exc)
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: "
                     f"{e['msg'].removeprefix('Value error, ')}" for e in cause.errors())


def serve(
    host: Annotated[str, typer.Option(help="bind address of Serve's HTTP proxy")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTP port")] = 8000,
    address: Annotated[str | None, typer.Option(
        help="Ray cluster to join (default: RAY_ADDRESS, a running local one, or a new one)")
    ] = None,
    tokens_file: Annotated[Path | None, typer.Option(
        help="one tenant=token a line")] = None,
    quota: Annotated[list[str], typer.Option(
        help="what a tenant may hold, e.g. alice:sandboxes=4,cpu=2 or (every tenant) "
             "sandboxes=8,memory=16Gi; keys sandboxes, cpu, memory; repeatable")
    ] = [],  # noqa: B006 - typer reads the default
    max_file_bytes: Annotated[int | None, typer.Option(help="one file up or down")] = None,
    audit_log: Annotated[Path | None, typer.Option(help="also append audit lines here")] = None,
    replicas: Annotated[int, typer.Option(
        min=1, help="Serve replicas; more than one share their books through a state actor")
    ] = 1,
    tenant_policy: Annotated[Path | None, typer.Option(
        help="JSON file: what tenants' sandboxes may be, by default and per tenant "
             "(docs/security.md, 'Tenants')")] = None,
    port_host_suffix: Annotated[str | None, typer.Option(
        help="also give port URLs as <label>.SUFFIX (a wildcard DNS name for *.SUFFIX "
             "pointing here): apps that redirect to absolute paths work")] = None,
    public_url: Annotated[str | None, typer.Option(
        help="where clients reach the service, for port URLs (default: the base each "
             "request came to)")] = None,
    state_db: Annotated[str | None, typer.Option(
        help="where the books are kept: a postgresql:// URL or a SQLite file (absolute "
             "path); default a SQLite file in the head node's home")] = None,
    reconcile: Annotated[bool, typer.Option(
        "--reconcile", help="do not serve: compare the books with the nodes once (what they "
        "name that no node has is marked lost; what the nodes hold that they never named is "
        "reported), print the report as JSON and exit")] = False,
    delete_after: Annotated[float | None, typer.Option(
        min=0, help="with --reconcile: delete the orphans found that are older than this "
        "many seconds")] = None,
    modal_port: Annotated[int | None, typer.Option(
        help="also serve Modal's gRPC API on this port: unmodified `modal` scripts run with "
             "MODAL_SERVER_URL pointing here and a tenant's name and token as "
             "MODAL_TOKEN_ID and MODAL_TOKEN_SECRET (docs/modal.md; needs "
             "ray_sandbox[modal])")
    ] = None,
    modal_image_alias: Annotated[list[str], typer.Option(
        help="IMAGE=OTHER: a Modal script's image IMAGE booted as OTHER (offline), e.g. "
             "IMAGE python:3.12-slim, OTHER ray-sandbox/python:3.13; repeatable")
    ] = [],  # noqa: B006 - typer reads the default
    modal_url: Annotated[str | None, typer.Option(
        help="where Modal's clients reach --modal-port (scheme://host:port), handed out as "
             "the sandboxes' command router (default: the host each client named)")] = None,
    modal_tunnel_port: Annotated[int | None, typer.Option(
        help="port of the TLS ingress serving <label>.SUFFIX, for Modal's tunnels "
             "(default 443)")] = None,
) -> None:
    """Serve sandboxes over HTTP (/api/v1) on Ray Serve. Tokens: RAY_SANDBOX_API_TOKEN (one
    tenant), RAY_SANDBOX_API_TOKENS=tenant=token,... or --tokens-file. --tokens-file,
    --tenant-policy, --public-url and --state-db may also come from the environment, as
    RAY_SANDBOX_API_TOKENS_FILE, RAY_SANDBOX_API_TENANT_POLICY, RAY_SANDBOX_API_PUBLIC_URL
    and RAY_SANDBOX_API_STATE_DB."""
    try:
        import ray

        from ..service import from_env, start, stop
    except ImportError as exc:
        err.print(f"[red]error:[/red] the service needs Ray Serve ({escape(str(exc))}): "
                  "pip install 'ray_sandbox[service]'")
        raise typer.Exit(2) from None
    if tokens_file is None and not any(os.environ.get(k) for k in TOKEN_VARIABLES):
        _refuse("no API token: give one with RAY_SANDBOX_API_TOKEN=TOKEN (one tenant), "
                "RAY_SANDBOX_API_TOKENS=TENANT=TOKEN,... or --tokens-file FILE (one "
                "TENANT=TOKEN a line; also RAY_SANDBOX_API_TOKENS_FILE)")
    aliases = {}
    for item in modal_image_alias:
        image, eq, other = item.partition("=")
        if not eq or not image.strip() or not other.strip():
            _refuse(f"--modal-image-alias takes IMAGE=OTHER, got {item!r}")
        aliases[image.strip()] = other.strip()
    if delete_after is not None and not reconcile:
        _refuse("--delete-after is for --reconcile")
    given: dict[str, Any] = {"max_file_bytes": max_file_bytes, "audit_log": audit_log,
                             "num_replicas": replicas, "public_url": public_url,
                             "port_host_suffix": port_host_suffix, "state_db": state_db,
                             "modal_port": modal_port, "modal_url": modal_url,
                             "modal_tunnel_port": modal_tunnel_port,
                             "modal_image_aliases": aliases or None}
    settings = {k: v for k, v in given.items() if v is not None}
    if modal_port is not None:
        try:
            import modal_proto.api_grpc  # noqa: F401 - the [modal] extra is there
        except ImportError:
            _refuse("--modal-port needs Modal's protocol definitions: pip install "
                    "'ray_sandbox[modal]'")
    try:
        config = from_env(tokens_file=tokens_file, quotas=tuple(quota),
                          policy_file=tenant_policy, **settings)
    except ConfigError as exc:
        _refuse(_one_line(exc))
    if reconcile:
        _reconcile(config, address, delete_after)
        return
    ray.init(address=address, log_to_driver=False)
    url = start(config, host, port)
    err.print(f"serving {url} for tenants {', '.join(sorted(config.tokens))}", soft_wrap=True)
    if config.modal_port is not None:
        err.print(f"Modal's API: MODAL_SERVER_URL=http://{host}:{config.modal_port} "
                  "MODAL_TOKEN_ID=<tenant> MODAL_TOKEN_SECRET=<its token>", soft_wrap=True,
                  markup=False, highlight=False)
    join = ray.get_runtime_context().gcs_address
    err.print(f'Ray scripts (ray_sandbox, its Modal facade) join this cluster with '
              f'ray.init(address="{join}")', soft_wrap=True, markup=False, highlight=False)
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    stopped.wait()
    stop()
    ray.shutdown()


def _reconcile(config: Any, address: str | None, delete_after: float | None) -> None:
    import ray

    from ..service import APP_NAME
    from ..service import reconcile as run_pass

    joined = not ray.is_initialized()
    if joined:
        ray.init(address=address, log_to_driver=False)
    try:
        report = run_pass(config, APP_NAME, delete_after)
    finally:
        if joined:
            ray.shutdown()
    print(json.dumps(report, indent=2, sort_keys=True))
    counts = {f"{what} {kind}": len(found) for what in ("lost", "orphans", "taken_in", "foreign")
              for kind, found in report[what].items() if found}
    deleted = sum(1 for found in report["orphans"].values() for x in found
                  if x.get("action") == "deleted")
    err.print(f"books at {report['books']}: "
              + (", ".join(f"{n} {k}" for k, n in counts.items()) or "nothing to report")
              + (f"; {deleted} orphans deleted" if deleted else ""), soft_wrap=True,
              markup=False, highlight=False)
