"""Image commands: pull, build, ls, inspect, rm, prune (mounted as ``ray-sandbox image``)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..runtime import SandboxRuntime, docker  # docker: also ray-sandbox/docker's builder
from ..runtime.errors import SandboxError
from ..runtime.images import LOCAL_NAMESPACE, Image, ImageStore, PullPolicy

app = typer.Typer(help="Pull, build, list and remove images in this node's image store.",
                  no_args_is_help=True)
out = Console()
err = Console(stderr=True)

AsJson = Annotated[bool, typer.Option("--json", help="machine-readable output")]


@app.callback()
def _store_options(
    ctx: typer.Context,
    root: Annotated[Path | None, typer.Option(help="store directory (default: node store)")] = None,
    platform: Annotated[str | None, typer.Option(help="os/arch or os/arch/variant")] = None,
    insecure_registry: Annotated[list[str] | None, typer.Option(
        "--insecure-registry", help="HOST or HOST:PORT reached without TLS (repeatable)")] = None,
    max_bytes: Annotated[int | None, typer.Option(help="evict LRU unpinned images above")] = None,
) -> None:
    insecure = tuple(insecure_registry or ())
    ctx.obj = lambda: ImageStore(root, platform=platform, insecure_registries=insecure,
                                 max_bytes=max_bytes)


def _store(ctx: typer.Context) -> ImageStore:
    factory: Callable[[], ImageStore] = ctx.obj
    return factory()


@contextmanager
def _errors() -> Iterator[None]:
    try:
        yield
    except SandboxError as exc:
        err.print(f"[red]error:[/red] {type(exc).__name__}: {exc}")
        raise typer.Exit(2) from None


@contextmanager
def _progress(title: str) -> Iterator[Callable[[str], None]]:
    """A spinner on stderr whose text follows the store's progress messages."""
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=err, transient=True) as bar:
        task = bar.add_task(title)
        yield lambda message: bar.update(task, description=message)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _print_removed(removed: list[str], as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps({"removed": removed}))
    else:
        typer.echo("\n".join(f"deleted {d}" for d in removed) or "nothing deleted")


def _as_dict(image: Image, store: ImageStore) -> dict:
    return {**image.model_dump(mode="json"), "pins": sorted(store.pins(image.digest))}


def _show(images: list[Image], store: ImageStore, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps([_as_dict(i, store) for i in images], indent=2))
        return
    table = Table()
    table.add_column("REFERENCE", overflow="fold")
    table.add_column("DIGEST", no_wrap=True)
    table.add_column("SIZE", justify="right", no_wrap=True)
    table.add_column("PINS", justify="right")
    table.add_column("LAST USED", no_wrap=True)
    for image in images:
        table.add_row(image.ref, image.digest[:19], _size(image.size_bytes),
                      str(len(store.pins(image.digest))),
                      time.strftime("%Y-%m-%d %H:%M", time.localtime(image.last_used)))
    out.print(table)


@app.command()
def pull(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="python:3.12-slim, oci:/path:tag, localhost:5000/x")],
    policy: Annotated[PullPolicy, typer.Option(help="always re-resolves the tag")] = (
        PullPolicy.ALWAYS),
    timeout: Annotated[float, typer.Option(help="seconds")] = 1800.0,
    as_json: AsJson = False,
) -> None:
    """Pull (and unpack) an image into the store."""
    with _errors():
        store = _store(ctx)
        with _progress(f"pulling {ref}") as progress:
            image = store.get(ref, policy=policy, timeout=timeout, progress=progress)
        _show([image], store, as_json)


@app.command()
def build(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(
        help="busybox | python | python:3.13 | docker | ray-sandbox/<name>:tag; with -t: "
             "the build CONTEXT directory")] = "python",
    tag: Annotated[str | None, typer.Option(
        "--tag", "-t", help="build a Dockerfile in a gVisor build sandbox; its image is "
                            "localhost/NAME on this node")] = None,
    file: Annotated[Path | None, typer.Option(
        "--file", "-f", help="the Dockerfile (default CONTEXT/Dockerfile); needs -t")] = None,
    network: Annotated[str, typer.Option(
        help="the build sandbox's network for RUN steps: none | public | sandbox")] = "none",
    memory: Annotated[str, typer.Option(
        help="the build sandbox's memory (holds the bases and layers)")] = "2Gi",
    force: Annotated[bool, typer.Option("--force", help="rebuild even if present")] = False,
    as_json: AsJson = False,
) -> None:
    """Build one of the offline images (ray-sandbox/busybox, ray-sandbox/python[:3.11|:3.13],
    ray-sandbox/docker), or with -t a Dockerfile: image build -f Dockerfile CONTEXT -t
    NAME runs every step under gVisor (docs/docker.md, "Dockerfile builds"), streams the
    output to stderr and prints the image, whose REFERENCE (localhost/NAME) is what sandboxes
    on this node use."""
    with _errors():
        store = _store(ctx)
        if tag is not None:
            if force:
                raise typer.BadParameter("--force does not apply to Dockerfile builds "
                                         "(they are cached by content)")
            with SandboxRuntime(images=store) as rt:
                image = docker.build_image(rt, Path(name), tag=tag, dockerfile=file,
                                           network=network, memory=memory,
                                           progress=lambda line: err.print(line, markup=False,
                                                                           highlight=False))
            _show([image], store, as_json)
            return
        if file is not None:
            raise typer.BadParameter("-f/--file needs -t/--tag (a Dockerfile build)")
        ref = name if "/" in name else f"{LOCAL_NAMESPACE}/{name}"  # the tag: latest
        with _progress(f"building {ref}") as progress:
            image = store.build(ref, force=force, progress=progress)
        _show([image], store, as_json)


@app.command("ls")
def list_images(ctx: typer.Context, as_json: AsJson = False) -> None:
    """List stored images (one row per reference)."""
    with _errors():
        store = _store(ctx)
        _show(store.list(), store, as_json)


@app.command()
def inspect(
    ctx: typer.Context, ref: Annotated[str, typer.Argument(help="reference or digest")]
) -> None:
    """Print a stored image as JSON."""
    with _errors():
        store = _store(ctx)
        typer.echo(json.dumps(_as_dict(store.inspect(ref), store), indent=2))


@app.command()
def rm(
    ctx: typer.Context,
    refs: Annotated[list[str], typer.Argument(help="references or digests")],
    as_json: AsJson = False,
) -> None:
    """Untag references (deleting images nothing else names) or delete images by digest."""
    with _errors():
        store = _store(ctx)
        _print_removed([digest for ref in refs for digest in store.remove(ref)], as_json)


@app.command()
def prune(
    ctx: typer.Context,
    all_images: Annotated[bool, typer.Option("--all", help="also images with a reference")] = False,
    as_json: AsJson = False,
) -> None:
    """Delete unpinned images no reference points to (all unpinned ones with --all)."""
    with _errors():
        _print_removed(_store(ctx).prune(all_images=all_images), as_json)
