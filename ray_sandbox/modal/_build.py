"""Building an image of Modal's DSL: its Dockerfile and build context are built by the
node's Dockerfile builder (``runtime/docker.build_image``: Docker inside a build sandbox,
every step under gVisor, docs/docker.md, "Dockerfile builds"), with network ``public``
during the build only, in a Ray task.

Where: the task prefers the caller's node (soft affinity) and holds one CPU there, as the
build sandbox uses one; on a node without a free CPU (a head node started with
``--num-cpus=0``) Ray runs it elsewhere. The context travels as a tar through the object
store, so the build needs nothing of the caller's disk.

What it leaves: the build is kept by the builder (``builds/<key>/`` beside the node's image
store, keyed by the Dockerfile, the context's files and the bases' digests: the same chain
is not built twice) and named ``localhost/modal-dsl/<hash>`` in the node's store, so later
creates on that node start from it at once. It is also published as a filesystem image of
that node (``runtime/fs_image.publish``): its reference, which is what the facade creates
sandboxes from, works on every node, and another node fetches it once from the building
node's host, as it fetches a ``snapshot_filesystem`` image (``actor/transfer.ImageImports``).
It stays until ``ray_sandbox.delete_filesystem_image(ref)`` (the builder's cache and the
``localhost/`` name stay until ``ray-sandbox image rm``).

A network that intercepts TLS (a proxy with its own CA) breaks ``pip``/``uv``/``curl`` in
the build, whose images trust only their own CAs. ``RAY_SANDBOX_BUILD_CA``, set on the nodes
to a PEM bundle (e.g. the host's ``/etc/ssl/certs/ca-certificates.crt`` holding that CA),
is trusted by every ``RUN`` step of a build (as ``SSL_CERT_FILE``, ``PIP_CERT``,
``REQUESTS_CA_BUNDLE``, ``CURL_CA_BUNDLE``, ``NODE_EXTRA_CA_CERTS``, ``GIT_SSL_CAINFO``:
build arguments, not the image's environment); the file is removed from the image at the
end, and the image's own trust is unchanged.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..actor.transfer import fetch, put_chunks
from ..runtime import SandboxRuntime, archive, docker, fs_image, paths
from ..runtime.errors import ImageBuildError, ModalImageBuildError, ModalInvalidError

BUILD_CPU = 1.0  # what the build sandbox may use (docker.build_image's cpu=1.0)
BUILD_CA_ENV = "RAY_SANDBOX_BUILD_CA"
_CA_IN_CONTEXT = ".rsb-build-ca.pem"
_CA_IN_IMAGE = "/tmp/.rsb-build-ca.pem"
_CA_VARS = ("SSL_CERT_FILE", "PIP_CERT", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
            "NODE_EXTRA_CA_CERTS", "GIT_SSL_CAINFO")
_FROM = re.compile(r"^\s*FROM\s", re.IGNORECASE)
MAX_CONTEXT_BYTES = 8 << 30  # a build context larger than this is refused before it travels
_QUEUE_MAX = 10_000  # output lines not yet sent to the caller; past it lines are dropped
_ITEM_WAIT_S = docker.BUILD_TIMEOUT + 600.0  # longest silence of a build (incl. waiting for a CPU)
_DONE = object()


def with_build_ca(dockerfile: str) -> str:
    """``dockerfile`` whose every stage trusts the build CA in its RUN steps (build
    arguments: not the image's environment) and whose image leaves the file out."""
    out: list[str] = []
    trusted = False  # whether the last stage got the file (a FROM scratch one cannot RUN)
    for line in dockerfile.splitlines():
        out.append(line)
        if _FROM.match(line):
            trusted = line.split()[1].lower() != "scratch"
            if trusted:
                out += [f"COPY {_CA_IN_CONTEXT} {_CA_IN_IMAGE}",
                        *(f"ARG {v}={_CA_IN_IMAGE}" for v in _CA_VARS)]
    if trusted:
        out.append(f"RUN rm -f {_CA_IN_IMAGE}")
    return "\n".join(out) + "\n"


def _bounded(chunks: Iterator[bytes], limit: int) -> Iterator[bytes]:
    total = 0
    for chunk in chunks:
        total += len(chunk)
        if total > limit:
            raise ModalInvalidError(f"the image's local files are over {limit} bytes: too "
                                    "large a build context")
        yield chunk


@ray.remote(num_cpus=BUILD_CPU, max_retries=0, num_returns="streaming")
def _build_task(dockerfile: str, context: list[ray.ObjectRef], tag: str) -> Iterator[Any]:
    """Yields ``("line", text)`` as the build prints, then ``("built", ref)``."""
    node = ray.get_runtime_context().get_node_id()
    home = paths.home()
    rt = SandboxRuntime(home, reap=False)
    lines: queue.Queue[Any] = queue.Queue(maxsize=_QUEUE_MAX)
    outcome: dict[str, Any] = {}

    def say(line: str) -> None:
        try:
            lines.put_nowait(line)
        except queue.Full:
            outcome["dropped"] = outcome.get("dropped", 0) + 1

    def build(ctx: Path, df: Path) -> None:
        try:
            image = docker.build_image(rt, ctx, tag=tag, dockerfile=df, network="public",
                                       cpu=BUILD_CPU, progress=say)
            image_id = image.digest.split(":", 1)[1][:32]
            ref = fs_image.publish(Path(image.rootfs).parent / "oci", node, image_id, home)
            rt.images.get(ref)  # this node's creates find it stored
            outcome["ref"] = ref
        except BaseException as exc:  # noqa: BLE001 - raised below, in the task
            outcome["error"] = exc
        finally:
            lines.put(_DONE)  # the loop below keeps taking lines: never full for long

    home.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".modal-build-", dir=home) as tmp:
        ctx, df = Path(tmp) / "ctx", Path(tmp) / "Dockerfile"
        ctx.mkdir()
        archive.extract_local(fetch(context), ctx)
        if ca := os.environ.get(BUILD_CA_ENV):
            shutil.copyfile(ca, ctx / _CA_IN_CONTEXT)
            dockerfile = with_build_ca(dockerfile)
        df.write_text(dockerfile)
        worker = threading.Thread(target=build, args=(ctx, df), daemon=True,
                                  name="modal-image-build")
        worker.start()
        while (item := lines.get()) is not _DONE:
            yield ("line", item)
        worker.join()
    if outcome.get("dropped"):
        yield ("line", f"({outcome['dropped']} lines of output were not shown)")
    if "error" in outcome:
        raise outcome["error"]
    yield ("built", outcome["ref"])


def build(dockerfile: str, context: Path, say: Callable[[str], None]) -> str:
    """Build ``dockerfile`` with the files of the directory ``context``; returns the
    reference sandboxes start from (a filesystem image of the node that built it). A failing
    step raises Modal's ``ImageBuildError`` (``step``, ``log_tail``)."""
    tag = "modal-dsl/" + docker.context_key(context, dockerfile.encode(), [], "", "public")[:24]
    refs = put_chunks(_bounded(archive.pack_local(context), MAX_CONTEXT_BYTES))
    here = ray.get_runtime_context().get_node_id()
    gen: Any = _build_task.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True),
    ).remote(dockerfile, refs, tag)
    started = time.monotonic()
    say(f"Building image {tag} (a Dockerfile build under gVisor, network public)")
    try:
        while True:
            ready, _ = ray.wait([gen], timeout=_ITEM_WAIT_S)
            if not ready:
                raise ModalImageBuildError(f"the build of {tag} said nothing for "
                                           f"{_ITEM_WAIT_S:.0f} s; gave up")
            try:
                kind, value = ray.get(next(gen))
            except StopIteration:
                raise ModalImageBuildError(f"the build of {tag} ended without an image"
                                           ) from None
            if kind == "line":
                say(f"  {value}")
                continue
            say(f"Built image {tag} in {time.monotonic() - started:.1f} s")
            return value
    except ImageBuildError as exc:
        if isinstance(exc, ModalImageBuildError):
            raise
        raise ModalImageBuildError(getattr(exc, "message", str(exc)),
                                   step=getattr(exc, "step", None),
                                   log_tail=getattr(exc, "log_tail", ""),
                                   sandbox_id=getattr(exc, "sandbox_id", None)) from None
