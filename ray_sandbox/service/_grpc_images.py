"""Modal's images, as its client sends them (``ImageGetOrCreate``, ``ImageJoinStreaming``,
``ImageFromId``, handled by :class:`Images`): each ``ImageGetOrCreate`` is one layer, a
Dockerfile whose ``FROM`` is either a registry reference (``Image.from_registry``, the first
line of ``from_dockerfile``) or ``base``, the parent layer (``base_images``), with the
layer's own Dockerfile commands (one DSL step each: ``.pip_install`` is ``RUN python -m pip
install ...``, ``.env`` is ``ENV ...``).

A chain is kept per tenant as its root reference and its Dockerfile lines. One with only
``ENV``/``WORKDIR``/``CMD``/``ENTRYPOINT``/``LABEL`` lines needs no build: a sandbox of it
runs the root image with that environment and working directory. One with ``RUN`` (or
another step that changes files) is built by the project's Dockerfile builder inside gVisor
(``runtime/docker.py``) on this replica's node, its log kept for the client's
``ImageJoinStreaming`` (``modal.enable_output()`` prints it), and its sandboxes are placed
on that node. Modal's ``debian_slim()`` (the default image of every ``Sandbox.create``) is
known by its recipe and maps to the node's offline ``ray-sandbox/python:<minor>``; the
operator's aliases (``modal_image_aliases``, ``--modal-image-alias``) map any other root, so
unmodified scripts run offline. A root is held to the tenant's policy (registries, paths of
the node) before anything is pulled or built.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import shlex
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import ray
from modal_proto import api_pb2

from ..runtime import SandboxRuntime, docker, paths
from ..runtime.config import PullNetwork
from ..runtime.errors import ImageBuildError, SandboxError
from ..runtime.images import ImageStore
from ._config import ServiceConfig
from ._grpc import Call, invalid, not_found, unimplemented
from ._kept import FS_IMAGE_SCHEME

BUILDER_VERSION = "2025.06"  # one the 1.6 client accepts, whose debian_slim is known here
R = api_pb2.GenericResult
JOIN_CAP = 50.0  # an image join answers within the client's 55 s
MAX_IMAGES = 1024  # kept per tenant (least recently used forgotten)
MAX_LOG_LINES = 2000  # of one build, for the client's join
MAX_LOG_LINE = 4096  # characters of one line
NO_BUILD = frozenset({"ENV", "WORKDIR", "CMD", "ENTRYPOINT", "LABEL", "EXPOSE", "SHELL",
                      "STOPSIGNAL", "HEALTHCHECK", "MAINTAINER", "VOLUME"})
# Modal's debian_slim() recipe (its RUN lines, builder 2025.06 and later): the image exists
# offline as ray-sandbox/python:<minor>
DEBIAN_SLIM_RUNS = frozenset({
    "RUN apt-get update",
    "RUN apt-get install -y gcc gfortran build-essential",
    "RUN pip install --upgrade pip wheel uv",
    "RUN echo 'debconf debconf/frontend select Noninteractive' | debconf-set-selections",
})
DEBIAN_SLIM_FROM = re.compile(r"^python:(3\.\d+)(\.\d+)?-slim(-[a-z]+)?$")
OFFLINE_PYTHONS = ("3.11", "3.13")  # ray-sandbox/python's tags (runtime/image_builders.py)
SNAPSHOT_PREFIX = "im-fs"  # a filesystem snapshot's image id: im-fs<32 hex>

_builder: SandboxRuntime | None = None
_builder_lock = threading.Lock()


def _build_runtime() -> SandboxRuntime:
    """This replica's runtime for Dockerfile builds: a home of its own beside the node's,
    the node's image store (where the Ray host finds the built image)."""
    global _builder
    with _builder_lock:
        if _builder is None:
            _builder = SandboxRuntime(paths.home() / "modal-builds", images=ImageStore())
        return _builder


@dataclass(eq=False)
class WireImage:
    """One layer as the tenant made it: its chain's root and every Dockerfile line since."""

    image_id: str
    root: str  # what the sandbox boots (alias applied), or a fs-image:// name
    lines: tuple[str, ...]
    pull_network: PullNetwork = "public"  # how the root is fetched (the tenant policy's)
    state: str = "ready"  # ready | building | failed
    logs: list[str] = field(default_factory=list)
    error: str | None = None
    built: tuple[str, str] | None = None  # (reference on the node, node id)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def needs_build(self) -> bool:
        return any(_verb(line) not in NO_BUILD for line in self.lines)

    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for line in self.lines:
            if _verb(line) == "ENV":
                out.update(_env_line(line[4:].strip()))
        return out

    def workdir(self) -> str | None:
        found = None
        for line in self.lines:
            if _verb(line) == "WORKDIR":
                found = line[8:].strip() or found
        return found

    def say(self, line: str) -> None:
        if len(self.logs) < MAX_LOG_LINES:
            self.logs.append(line[:MAX_LOG_LINE])
        self.changed.set()
        self.changed = asyncio.Event()


def _verb(line: str) -> str:
    return line.strip().split(" ", 1)[0].upper()


def _env_line(text: str) -> dict[str, str]:
    """``ENV A=1 B="two words"`` (or the old ``ENV A value``) as a dict."""
    try:
        parts = shlex.split(text)
    except ValueError:
        raise invalid(f"cannot parse ENV {text!r}") from None
    if parts and "=" not in parts[0]:
        return {parts[0]: " ".join(parts[1:])}
    return dict(p.split("=", 1) for p in parts if "=" in p)


class Images:
    """The tenants' image chains on this replica, and the builds of those that need one."""

    def __init__(self, config: ServiceConfig, check_root: Any) -> None:
        self._config = config
        self._check_root = check_root  # async (tenant, ref): the tenant policy's image rule
        self._by_tenant: dict[str, OrderedDict[str, WireImage]] = {}
        self._builds = anyio.CapacityLimiter(config.modal_build_threads)
        self._tasks: set[asyncio.Task[None]] = set()

    def default_root(self) -> str:
        """What a sandbox without an image boots (Modal's client always names one)."""
        return self._config.modal_image_aliases.get("debian_slim", "ray-sandbox/python")

    def find(self, tenant: str, image_id: str) -> WireImage:
        if image_id.startswith(SNAPSHOT_PREFIX) and re.fullmatch(r"[0-9a-f]{32}",
                                                               image_id[len(SNAPSHOT_PREFIX):]):
            return WireImage(image_id, FS_IMAGE_SCHEME + image_id[len(SNAPSHOT_PREFIX):], ())
        mine = self._by_tenant.get(tenant, OrderedDict())
        image = mine.get(image_id)
        if image is None:
            raise not_found(f"no image {image_id!r} (images are kept by the replica serving "
                            "Modal's API; define it again)")
        mine.move_to_end(image_id)
        return image

    async def get_or_create(self, tenant: str, commands: list[str],
                            bases: dict[str, str], refused: list[str]) -> WireImage:
        """The layer these Dockerfile commands make (``bases``: tag -> parent image id);
        its build starts in the background when it needs one."""
        if refused:
            raise unimplemented(", ".join(refused))
        lines = [c for c in (c.strip() for c in commands) if c and not c.startswith("#")]
        if not lines or _verb(lines[0]) != "FROM":
            raise invalid("an image's Dockerfile commands must start with FROM")
        source = lines[0][5:].strip()
        if " AS " in source.upper() or any(_verb(line) == "FROM" for line in lines[1:]):
            raise unimplemented("multi-stage Dockerfiles (FROM ... AS, a second FROM)")
        rest = tuple(lines[1:])
        for line in rest:
            if _verb(line) in ("COPY", "ADD") and "--from" not in line:
                raise unimplemented(f"{line.split()[0]} of local files (Image.add_local_*, "
                                    "a Dockerfile COPY/ADD)")
            if _verb(line) == "ARG":
                raise unimplemented("Dockerfile ARG (build_args)")
        if source in bases:
            parent = self.find(tenant, bases[source])
            if parent.root.startswith(FS_IMAGE_SCHEME) and rest:
                raise unimplemented("image steps over a snapshot_filesystem() image")
            root, lines_all, pulls = parent.root, parent.lines + rest, parent.pull_network
        else:
            root, lines_all = self._root(source, rest)
            pulls = await self._check_root(tenant, root)
        key = hashlib.sha256("\0".join((tenant, root, *lines_all)).encode()).hexdigest()
        image_id = f"im-{key[:24]}"
        mine = self._by_tenant.setdefault(tenant, OrderedDict())
        known = mine.get(image_id)
        if known is not None and known.state != "failed":
            mine.move_to_end(image_id)
            return known
        image = WireImage(image_id, root, lines_all, pull_network=pulls)
        mine[image_id] = image
        while len(mine) > MAX_IMAGES:
            mine.popitem(last=False)
        if image.needs_build:
            image.state = "building"
            task = asyncio.ensure_future(self._build(tenant, image))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return image

    def _root(self, source: str, rest: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
        """The root a FROM names, the operator's aliases applied; Modal's debian_slim
        recipe becomes the offline Python image (its RUN lines dropped)."""
        ref = source.removeprefix("docker.io/library/")
        aliases = self._config.modal_image_aliases
        slim = DEBIAN_SLIM_FROM.match(ref)
        if slim and all(_verb(line) != "RUN" or line in DEBIAN_SLIM_RUNS for line in rest):
            minor = slim.group(1)
            kept = tuple(line for line in rest if line not in DEBIAN_SLIM_RUNS)
            alias = aliases.get(f"python:{minor}-slim")
            if alias:
                return alias, kept
            if minor in OFFLINE_PYTHONS:
                return f"ray-sandbox/python:{minor}", kept
            raise invalid(f"debian_slim(python_version={minor!r}): this service has Python "
                          f"{' and '.join(OFFLINE_PYTHONS)} offline; use one, or ask the "
                          f"operator for --modal-image-alias python:{minor}-slim=IMAGE")
        return aliases.get(ref, aliases.get(source, source)), rest

    async def _build(self, tenant: str, image: WireImage) -> None:
        """Build the chain's Dockerfile in a gVisor build sandbox on this node; the log
        goes to the image (and so to the client's join)."""
        loop = asyncio.get_running_loop()
        say = image.say

        def progress(line: str) -> None:
            loop.call_soon_threadsafe(say, line)

        tenant_key = hashlib.sha256(tenant.encode()).hexdigest()[:10]
        tag = f"modal/{tenant_key}-{image.image_id.removeprefix('im-')}:latest"
        network = "public" if "public" in self._config.policy(tenant).network_modes else "none"
        dockerfile = "\n".join([f"FROM {image.root}", *image.lines]) + "\n"

        def build() -> tuple[str, str]:
            runtime = _build_runtime()
            # the root first, from the network the tenant's policy names (a tenant's registry
            # reaches only public addresses); the build then finds it stored
            runtime.images.get(image.root, network=image.pull_network, progress=progress)
            with tempfile.TemporaryDirectory(prefix="modal-build-") as ctx:
                (Path(ctx) / "Dockerfile").write_text(dockerfile)
                built = docker.build_image(
                    runtime, ctx, tag=tag, network=network,
                    timeout=self._config.modal_build_timeout, progress=progress)
            return built.ref, ray.get_runtime_context().get_node_id()

        say(f"building {image.image_id} on this service's node (gVisor, network {network})")
        t0 = time.monotonic()
        try:
            image.built = await anyio.to_thread.run_sync(build, limiter=self._builds)
            image.state = "ready"
            say(f"built {image.image_id} in {time.monotonic() - t0:.1f} s")
        except ImageBuildError as exc:
            image.state, image.error = "failed", _build_error(exc)
            say(image.error)
        except SandboxError as exc:
            image.state, image.error = "failed", exc.message
            say(image.error)
        except Exception as exc:  # a build that could not run at all
            image.state, image.error = "failed", f"{type(exc).__name__}: {exc}"
            say(image.error)

    async def wait(self, image: WireImage, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while image.state == "building" and time.monotonic() < deadline:
            try:
                await asyncio.wait_for(image.changed.wait(), deadline - time.monotonic())
            except TimeoutError:
                return

    # --- the image handlers ------------------------------------------------------------------

    async def ImageGetOrCreate(self, call: Call, req: api_pb2.ImageGetOrCreateRequest) -> Any:
        img = req.image
        refused = [what for what, on in (
            ("Image.add_local_* and from_dockerfile context files (context mounts)",
             bool(img.context_mount_id or img.context_files)),
            ("image build functions (Image.run_function)",
             bool(img.build_function_def or img.HasField("build_function"))),
            ("secrets in image builds", bool(img.secret_ids)),
            ("GPUs in image builds", bool(img.gpu_config.type or img.gpu_config.count)),
            ("registry credentials (Image.from_aws_ecr, from_gcp_artifact_registry, "
             "registry_secret)", bool(img.image_registry_config.secret_id)),
            ("build_args", bool(img.build_args)),
            ("volumes in image builds", bool(img.volume_mounts)),
        ) if on]
        bases = {b.docker_tag: b.image_id for b in img.base_images}
        image = await self.get_or_create(call.tenant, list(img.dockerfile_commands),
                                         bases, refused)
        out = api_pb2.ImageGetOrCreateResponse(image_id=image.image_id)
        if image.state != "building":
            out.result.CopyFrom(image_result(image))
            out.metadata.CopyFrom(image_metadata(image))
        return out

    async def ImageJoinStreaming(self, call: Call,
                                 req: api_pb2.ImageJoinStreamingRequest) -> AsyncIterator[Any]:
        image = self.find(call.tenant, req.image_id)
        sent = int(req.last_entry_id) if req.last_entry_id.isdigit() else 0
        deadline = time.monotonic() + min(req.timeout or JOIN_CAP, JOIN_CAP)
        while True:
            if sent < len(image.logs):
                lines = image.logs[sent:]
                sent += len(lines)
                yield api_pb2.ImageJoinStreamingResponse(
                    task_logs=[api_pb2.TaskLogs(data=line + "\n",
                                                file_descriptor=api_pb2.FILE_DESCRIPTOR_STDOUT)
                               for line in lines], entry_id=str(sent))
                continue
            if image.state != "building":
                yield api_pb2.ImageJoinStreamingResponse(
                    result=image_result(image), metadata=image_metadata(image),
                    entry_id=str(sent), eof=True)
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return  # the client joins again from its last entry
            await self.wait(image, left)

    async def ImageFromId(self, call: Call, req: api_pb2.ImageFromIdRequest) -> Any:
        image = self.find(call.tenant, req.image_id)
        return api_pb2.ImageFromIdResponse(image_id=image.image_id,
                                           metadata=image_metadata(image))


def image_result(image: WireImage) -> api_pb2.GenericResult:
    if image.state == "failed":
        return R(status=R.GENERIC_STATUS_FAILURE, exception=image.error or "build failed")
    return R(status=R.GENERIC_STATUS_SUCCESS)


def image_metadata(image: WireImage) -> api_pb2.ImageMetadata:
    out = api_pb2.ImageMetadata(image_builder_version=BUILDER_VERSION)
    workdir = image.workdir()
    if workdir:
        out.workdir = workdir
    return out


def _build_error(exc: ImageBuildError) -> str:
    step = getattr(exc, "step", None)
    tail = getattr(exc, "log_tail", None) or ""
    head = f"the image build failed at {step!r}" if step else "the image build failed"
    return f"{head}: {exc.message}\n{tail}"[-8000:]
