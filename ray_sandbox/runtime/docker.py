"""Docker inside a sandbox (``docker=True``, docs/docker.md): what the spec adds for it and
the start of the daemon, once the agent answers.

What Docker needs under runsc 0.0~20240729, as measured here (docs/docker.md, "How it
works") and as gVisor's "Docker in gVisor" tutorial and its ``images/basic/docker/
start-dockerd.sh`` say:

- capabilities: ``config.DOCKER_IN_SANDBOX_CAPABILITIES`` (the config's default with docker);
- cgroups: gVisor's own cgroupfs mounted at ``/sys/fs/cgroup`` (a spec mount of type
  ``cgroup``: the sentry emulates it, the host's cgroups are not reachable through it);
- storage: ``overlay2`` on a tmpfs at ``/var/lib/docker``. gVisor accepts only a tmpfs as the
  upper layer of an overlay mount; on the sandbox's root overlay dockerd falls back to
  ``vfs``, which copies the whole image for every container (12-16 s per ``docker run`` of
  a 173 MB image against 1.1 s on the tmpfs). The tmpfs lives in the sandbox's memory;
  ``disk=`` (else ``memory=``) caps its size;
- network: ``dockerd --iptables=false --ip6tables=false`` (gVisor has no netfilter tables
  for it: ``iptables-legacy`` says "Table does not exist", ``iptables-nft`` "Protocol not
  supported"); in network ``public`` (runsc ``--network=host``, the host's stack) no bridge
  can be made nor ``ip_forward`` set, so ``--bridge=none --ip-forward=false``, and nested
  containers need ``--network=host``;
- no ``runsc --net-raw``: gVisor's tutorial asks for it (Docker 28+ sends ARP through packet
  sockets), but Docker 20.10 runs, builds, bridges and composes here without it, and it
  would give every process in the sandbox raw sockets (tests/test_docker.py passes either way).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shlex
import stat
import tempfile
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import image_builders
from .agent.client import AgentClient
from .config import SandboxConfig
from .errors import (
    ImageBuildError,
    ImageNotFoundError,
    ImageReferenceError,
    SandboxCreationError,
    SandboxError,
)
from .images import LOCAL_NAMESPACE, Image, ImageStore, built_name
from .spec import Mount

DOCKER_IMAGE = f"{LOCAL_NAMESPACE}/docker:latest"  # built offline (images/store.py)
DOCKER_ROOT = "/var/lib/docker"
CGROUP_ROOT = "/sys/fs/cgroup"
DOCKERD_LOG = "/var/log/rsb-dockerd.log"
DOCKER_SOCKET = "/var/run/docker.sock"
START_TIMEOUT = 60.0  # measured ~1 s (docs/docker.md, "Costs"); room for a loaded node
_LOG_TAIL_LINES = 40


def mounts(config: SandboxConfig) -> list[Mount]:
    """The spec mounts a Docker sandbox adds: gVisor's cgroupfs and the storage tmpfs."""
    size = config.disk if isinstance(config.disk, int) else config.memory
    options = ["nosuid", "nodev", "mode=0711"] + ([f"size={size}"] if size else [])
    return [
        Mount(destination=CGROUP_ROOT, type="cgroup", source="cgroup",
              options=["nosuid", "noexec", "nodev"]),
        Mount(destination=DOCKER_ROOT, type="tmpfs", source="tmpfs", options=options),
    ]  # fmt: skip


def dockerd_argv(network: str) -> list[str]:
    """dockerd's command line for a sandbox in network mode ``network``."""
    argv = ["dockerd", "--iptables=false", "--ip6tables=false", "--storage-driver=overlay2",
            f"--data-root={DOCKER_ROOT}"]
    if network == "public":
        # runsc --network=host: the sentry uses the host's stack in the sandbox's netns,
        # where no bridge can be made and /proc/sys/net/ipv4/ip_forward is read-only
        # ("Enabling IP forwarding failed: ... permission denied" ends dockerd otherwise).
        argv += ["--bridge=none", "--ip-forward=false"]
    return argv


def start_script(network: str) -> str:
    """A shell script that starts dockerd in its own session, its output in DOCKERD_LOG,
    and returns once the daemon answers (non-zero, with the log's tail, if it dies or
    START_TIMEOUT passes). A daemon that already answers is left alone."""
    dockerd = shlex.join(dockerd_argv(network))
    tries = int(START_TIMEOUT / 0.05)
    return f"""
if [ -S {DOCKER_SOCKET} ] && docker version >/dev/null 2>&1; then exit 0; fi
command -v dockerd >/dev/null || {{ echo "no dockerd in this image's PATH" >&2; exit 127; }}
mkdir -p "$(dirname {DOCKERD_LOG})"
setsid {dockerd} >>{DOCKERD_LOG} 2>&1 </dev/null &
pid=$!
i=0
until [ -S {DOCKER_SOCKET} ] && docker version >/dev/null 2>&1; do
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "dockerd exited" >&2; tail -n {_LOG_TAIL_LINES} {DOCKERD_LOG} >&2; exit 1
  fi
  i=$((i + 1))
  if [ "$i" -gt {tries} ]; then
    echo "dockerd did not answer within {START_TIMEOUT:g}s" >&2
    tail -n {_LOG_TAIL_LINES} {DOCKERD_LOG} >&2; exit 1
  fi
  sleep 0.05
done
"""


def start(client: AgentClient, sandbox_id: str, network: str) -> None:
    """Start dockerd in a booted sandbox and wait until it answers; a SandboxCreationError
    with dockerd's log tail if it does not."""
    try:
        res = client.exec(["/bin/sh", "-c", start_script(network)],
                          timeout=START_TIMEOUT + 10)
    except SandboxError as exc:
        raise SandboxCreationError(f"starting dockerd failed: {exc.message}",
                                   sandbox_id=sandbox_id) from exc
    if res.exit_code != 0:
        raise SandboxCreationError(
            f"dockerd did not start (exit {res.exit_code}); is the image ray-sandbox/docker "
            "or one with docker.io?", sandbox_id=sandbox_id, stderr=res.stderr[-4000:],
        )


# --- Dockerfile builds in a build sandbox -----------------------------------------------------

BUILD_TIMEOUT = 1800.0
BUILD_MEMORY = "2Gi"
_BUILD_CACHE_VERSION = "1"  # part of every cache key: bump when the build itself changes
_LOG_TAIL_KEEP = 60
_FROM_RE = re.compile(r"^\s*FROM\s+(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?\s*$",
                      re.IGNORECASE)
_STEP_RE = re.compile(r"^Step \d+/\d+ : (.*)$")
_DOCKER_REF_RE = re.compile(r"^[a-z0-9][a-z0-9._/-]*(:[A-Za-z0-9_.-]{1,128})?$")  # a FROM


def base_images(dockerfile: str) -> list[str]:
    """The images a Dockerfile's stages start ``FROM`` (not earlier stages, not scratch).
    Build arguments in a ``FROM`` are refused: the base must be known before the build."""
    stages: set[str] = set()
    bases: list[str] = []
    for line in dockerfile.splitlines():
        m = _FROM_RE.match(line)
        if not m:
            continue
        ref, alias = m.group(1), m.group(2)
        if "$" in ref:
            raise ImageBuildError(f"FROM {ref}: build arguments in FROM are not supported",
                                  step=line.strip())
        if ref.lower() not in stages and ref != "scratch" and ref not in bases:
            if not _DOCKER_REF_RE.match(ref):
                raise ImageBuildError(f"FROM {ref}: not a Docker image name this node's "
                                      "image store can provide", step=line.strip())
            bases.append(ref)
        if alias:
            stages.add(alias.lower())
    if not bases and not stages and "scratch" not in dockerfile:
        raise ImageBuildError("the Dockerfile has no FROM")
    return bases


def context_key(context: Path, dockerfile: bytes, base_digests: list[str], tag: str,
                network: str) -> str:
    """The cache key of a build: the Dockerfile, every path, mode, link target and file
    content of the context, the bases' digests, the tag and the network mode."""
    h = hashlib.sha256()

    def add(*parts: str | bytes) -> None:
        for part in parts:
            data = part.encode() if isinstance(part, str) else part
            h.update(len(data).to_bytes(8, "big") + data)

    add(_BUILD_CACHE_VERSION, dockerfile, tag, network, *base_digests)
    for dirpath, dirnames, filenames in os.walk(context):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            st = path.lstat()
            rel = str(path.relative_to(context))
            add(rel, oct(st.st_mode))
            if stat.S_ISLNK(st.st_mode):
                add(os.readlink(path))
            elif stat.S_ISREG(st.st_mode):
                fh = hashlib.sha256()
                with path.open("rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        fh.update(chunk)
                add(fh.digest())
    return h.hexdigest()


def _failed_step(lines: deque[str]) -> str | None:
    steps = [m.group(1) for line in lines if (m := _STEP_RE.match(line))]
    return steps[-1] if steps else None


def build_image(
    runtime: Any, context: Path | str, *, tag: str, dockerfile: Path | str | None = None,
    network: str = "none", memory: str | int = BUILD_MEMORY, cpu: float | None = 1.0,
    timeout: float = BUILD_TIMEOUT, progress: Callable[[str], None] | None = None,
    cache_dir: Path | str | None = None,
) -> Image:
    """Build ``dockerfile`` (default ``context/Dockerfile``) with Docker inside a build
    sandbox of ``runtime`` (a :class:`SandboxRuntime`) and import the result into its image
    store as ``localhost/<tag>`` (``tag`` may say ``localhost/`` itself; any other registry
    is refused); returns the stored :class:`Image`, whose ``ref`` is that name.

    Nothing of the build runs on the host: the context is copied in, the ``FROM`` images
    come from the node's image store (``docker load``), every ``RUN`` runs under gVisor with
    the build sandbox's ``network`` (``none`` by default), and the image comes out as a
    ``docker save`` archive. Cached by :func:`context_key`: the same Dockerfile, context,
    bases and name give the stored image at once; the archives are kept in ``cache_dir``
    (default ``builds/`` beside the store), each with ``built.json`` (its name and digest).
    ``progress`` gets each line of output. A failing build raises :class:`ImageBuildError`
    with the failing ``step`` and the ``log_tail``.
    """
    context = Path(context).resolve()
    if not context.is_dir():
        raise ImageBuildError(f"build context {context} is not a directory")
    df_path = Path(dockerfile) if dockerfile is not None else context / "Dockerfile"
    try:
        df_bytes = df_path.read_bytes()
    except OSError as exc:
        raise ImageBuildError(f"cannot read the Dockerfile {df_path}: {exc}") from None
    try:
        name = str(built_name(tag))
    except ImageReferenceError as exc:
        raise ImageBuildError(exc.message) from None
    say = progress or (lambda _line: None)
    store = runtime.images
    bases = {ref: store.get(ref, progress=say) for ref in base_images(df_bytes.decode())}
    key = context_key(context, df_bytes, [i.digest for i in bases.values()], name, network)
    cache = Path(cache_dir or Path(store.root).parent / "builds") / key
    archive = cache / "image.docker.tar"
    if archive.is_file():
        say(f"cached {key[:12]}")
        return _named(store, cache, name, say)
    cache.parent.mkdir(parents=True, exist_ok=True)
    # One build per key on the node at a time (concurrent trials of one task, several
    # processes): the others wait here and then find it cached.
    with open(cache.parent / f"{key}.lock", "wb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if archive.is_file():
            say(f"cached {key[:12]}")
            return _named(store, cache, name, say)
        _build(runtime, context, df_bytes, bases, name, network, memory, cpu, timeout, say,
               cache, archive)
    return _named(store, cache, name, say)


def _named(store: ImageStore, cache: Path, name: str, say: Callable[[str], None]) -> Image:
    """The build kept in ``cache`` as ``name`` in the store: its recorded digest named again
    if the store still holds it, else imported from its archive. The archive's own
    reference is dropped, so the store lists the build once, by its name."""
    record = cache / "built.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, ImageNotFoundError):
        return store.tag(json.loads(record.read_text())["digest"], name)
    source = f"docker-archive:{cache / 'image.docker.tar'}"
    image = store.tag(store.get(source, progress=say).digest, name)
    with contextlib.suppress(ImageNotFoundError):  # a concurrent import dropped it already
        store.remove(source)  # only untags: the name keeps the image
    staged = cache / f".built.json.{os.getpid()}"
    staged.write_text(json.dumps({"ref": image.ref, "digest": image.digest}))
    os.replace(staged, record)
    return image


def _build(runtime: Any, context: Path, df_bytes: bytes, bases: dict[str, Image], tag: str,
           network: str, memory: str | int, cpu: float | None, timeout: float,
           say: Callable[[str], None], cache: Path, archive: Path) -> None:
    """The build itself, in a build sandbox that is deleted whatever happens."""
    sid = runtime.create(image=DOCKER_IMAGE, docker=True, readonly=False, memory=memory,
                         cpu=cpu, network=network, labels={"ray-sandbox/role": "build"})
    try:
        with tempfile.TemporaryDirectory(prefix=".build-", dir=cache.parent) as tmp:
            for i, (ref, image) in enumerate(bases.items()):
                say(f"loading {ref}")
                base_tar = Path(tmp) / f"base{i}.tar"
                image_builders.export_layout(Path(image.rootfs).parent / "oci", "image",
                                             f"docker-archive:{base_tar}:{ref}")
                runtime.upload_file(sid, base_tar, f"/root/base{i}.tar")
                base_tar.unlink()
                _check(runtime.exec(sid, f"docker load -q -i /root/base{i}.tar && "
                                         f"rm /root/base{i}.tar", timeout=timeout),
                       f"docker load of {ref}")
            runtime.upload_dir(sid, context, "/root/ctx")
            runtime.write_file(sid, "/root/Dockerfile.rsb", df_bytes)
            _run_build(runtime, sid, tag, timeout, say)
            say(f"saving {tag}")
            _check(runtime.exec(sid, f"docker save -o /root/image.tar {shlex.quote(tag)}",
                                timeout=timeout), "docker save")
            staged = Path(tmp) / "image.docker.tar"
            runtime.download_file(sid, "/root/image.tar", staged, max_bytes=None)
            cache.mkdir(parents=True, exist_ok=True)
            os.replace(staged, archive)
    finally:
        runtime.delete(sid)


def _run_build(runtime: Any, sid: str, tag: str, timeout: float,
               say: Callable[[str], None]) -> None:
    """``docker build`` (the classic builder: its ``Step N/M`` lines name a failing step),
    RUN steps on the sandbox's own network; each output line goes to ``say``."""
    argv = ["env", "DOCKER_BUILDKIT=0", "docker", "build", "--network=host", "--force-rm",
            "-f", "/root/Dockerfile.rsb", "-t", tag, "/root/ctx"]
    tail: deque[str] = deque(maxlen=_LOG_TAIL_KEEP)
    pending = {"stdout": "", "stderr": ""}  # a line may arrive in pieces, per stream
    result = None
    for item in runtime.exec_stream(sid, argv, timeout=timeout):
        if not hasattr(item, "data"):
            result = item
            continue
        text = pending[item.stream] + item.data.decode("utf-8", errors="replace")
        *lines, pending[item.stream] = text.split("\n")
        for line in lines:
            tail.append(line)
            say(line)
    for rest in pending.values():
        if rest:
            tail.append(rest)
            say(rest)
    if result is None or result.exit_code != 0 or result.timed_out:
        step = _failed_step(tail)
        why = "timed out" if result is not None and result.timed_out else (
            f"exit {result.exit_code}" if result is not None else "no result")
        raise ImageBuildError(f"docker build of {tag} failed ({why})"
                              + (f" at: {step}" if step else ""),
                              step=step, log_tail="\n".join(tail), sandbox_id=sid)


def _check(res: Any, what: str) -> None:
    if res.exit_code != 0:
        raise ImageBuildError(f"{what} failed (exit {res.exit_code})",
                              log_tail=(res.stdout + res.stderr)[-4000:])
