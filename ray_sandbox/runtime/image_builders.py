"""Offline image builders and a node-local registry.

These images are built without any image registry: ``ray-sandbox/busybox`` from the host's
busybox-static (reproducible: the same digest on every node with the same busybox), and with
mmdebstrap from Debian's package mirror ``ray-sandbox/python`` (:data:`PYTHON_IMAGES`: Python
3.11 from bookworm, 3.13 from trixie, with ``python``, ``pip`` and ``venv``) and
``ray-sandbox/docker`` (bookworm + docker.io + docker-compose, for ``docker=True``).
Each builder writes a single-layer image into an OCI layout; :class:`~.images.ImageStore` imports
that layout like any other source, and keeps each image's :func:`recipe` beside it, so that a
changed builder rebuilds the image on nodes that hold an older one. :func:`export_layout` and
:func:`serve_registry` put such layouts into other transports and a throwaway
``docker-registry`` (tests, benchmarks, seeding).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import socket
import subprocess
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from . import _proc
from .errors import ImageError, RegistryUnreachableError, StoreFullError, ToolMissingError
from .skopeo import Skopeo, host_architecture
from .umoci import Umoci

BUSYBOX = Path("/bin/busybox")
# Fixed timestamp so the busybox image is bit-for-bit reproducible.
REPRODUCIBLE_EPOCH = 1704067200  # 2024-01-01T00:00:00Z
DEBIAN_SUITE = "bookworm"  # the host's, and ray-sandbox/python:latest's
DEBIAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# What Modal's and Ray's examples call: python (python-is-python3), pip, venv; setuptools so
# that pip builds pure-Python sdists offline (--no-build-isolation). No compiler and no
# headers: build-essential + python3-dev would add ~290 MB to a ~210 MB image (docs/images.md).
PYTHON_PACKAGES = ("python3", "python-is-python3", "python3-pip", "python3-venv",
                   "python3-setuptools", "bash", "ca-certificates")
# PEP 668: Debian's pip refuses `pip install` outside a venv while this marker exists. The
# image behaves like python:3.x-slim instead (which has no marker): dpkg never installs the
# file (the exclusion stays in the image's dpkg config, so an upgrade inside does not bring it
# back), and Debian's pip installs into /usr/local, apart from what dpkg owns.
NO_PEP668_MARKER = "--dpkgopt=path-exclude=/usr/lib/python3*/EXTERNALLY-MANAGED"
# runsc adds no /etc/hosts; without it "localhost" does not resolve inside the sandbox.
ETC_HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
BUSYBOX_BUILD_TIMEOUT = 120.0
PYTHON_BUILD_TIMEOUT = 1800.0
# Debian's Docker 20.10 and Compose 1.29 (bookworm has no compose plugin for `docker
# compose`); iproute2 for `ip` when debugging the nested network.
DOCKER_PACKAGES = ("python3", "bash", "ca-certificates", "docker.io", "docker-compose",
                   "iproute2", "procps")

_BUSYBOX_ETC = {
    "etc/passwd": "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n",
    "etc/group": "root:x:0:\nnogroup:x:65534:\n",
    "etc/hosts": ETC_HOSTS,
}
_DEBIAN_SLIM = (
    "--variant=minbase",
    "--dpkgopt=path-exclude=/usr/share/man/*",
    "--dpkgopt=path-exclude=/usr/share/info/*",
    "--dpkgopt=path-exclude=/usr/share/locale/*",
    "--dpkgopt=path-exclude=/usr/share/doc/*",
    "--dpkgopt=path-include=/usr/share/doc/*/copyright",
    "--dpkgopt=path-exclude=/usr/share/lintian/*",
    f"--customize-hook=printf '{ETC_HOSTS.encode('unicode_escape').decode()}' > \"$1/etc/hosts\"",
    # mmdebstrap copies the build host's name and resolver; the runtime mounts its own.
    "--customize-hook=echo sandbox > \"$1/etc/hostname\" && : > \"$1/etc/resolv.conf\""
    " && chmod 644 \"$1/etc/hostname\" \"$1/etc/resolv.conf\"",
)
_MMDEBSTRAP_RULES: tuple[tuple[re.Pattern[str], type[ImageError]], ...] = (
    (re.compile(r"no space left on device", re.I), StoreFullError),
    (re.compile(r"failed to fetch|could not resolve|temporary failure resolving|"
                r"connection failed|unable to connect", re.I), RegistryUnreachableError),
)


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _classify_mmdebstrap(returncode: int, stderr: str) -> type[ImageError]:
    return next((cls for pattern, cls in _MMDEBSTRAP_RULES if pattern.search(stderr)), ImageError)


def _tar_entry(name: str, kind: bytes, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.mtime = kind, mode, REPRODUCIBLE_EPOCH
    info.uname = info.gname = "root"
    return info


def write_busybox_layer(tar_path: Path, extra_files: Mapping[str, bytes] | None = None) -> None:
    """Write the busybox root filesystem as an uncompressed, reproducible layer tar.

    ``extra_files`` maps absolute paths to contents (tests use it to make distinct images).
    """
    if not BUSYBOX.is_file():
        raise ToolMissingError(f"{BUSYBOX} is missing (apt-get install busybox-static)")
    applets = _proc.run([str(BUSYBOX), "--list-full"], timeout=30).stdout.decode().split()
    links = sorted(a for a in applets if "/" in a and a != "bin/busybox")
    dirs = {"bin", "dev", "etc", "proc", "root", "sys", "tmp", "usr", "var"}
    dirs |= {str(Path(p).parent) for p in links}
    files = {**{k: v.encode() for k, v in _BUSYBOX_ETC.items()},
             **{k.lstrip("/"): v for k, v in (extra_files or {}).items()}}
    dirs |= {str(p) for f in files for p in Path(f).parents if str(p) != "."}
    special = {"tmp": 0o1777, "root": 0o700}
    with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
        for d in sorted(dirs):
            tar.addfile(_tar_entry(d, tarfile.DIRTYPE, special.get(d, 0o755)))
        binary = _tar_entry("bin/busybox", tarfile.REGTYPE, 0o755)
        binary.size = BUSYBOX.stat().st_size
        with BUSYBOX.open("rb") as f:
            tar.addfile(binary, f)
        for link in links:
            entry = _tar_entry(link, tarfile.SYMTYPE, 0o777)
            entry.linkname = "/bin/busybox"
            tar.addfile(entry)
        for name, data in sorted(files.items()):
            entry = _tar_entry(name, tarfile.REGTYPE, 0o644)
            entry.size = len(data)
            tar.addfile(entry, io.BytesIO(data))


def write_debian_layer(tar_path: Path, *, timeout: float = PYTHON_BUILD_TIMEOUT,
                       packages: tuple[str, ...] = PYTHON_PACKAGES, suite: str = DEBIAN_SUITE,
                       options: tuple[str, ...] = (NO_PEP668_MARKER,)) -> None:
    """Write a slim Debian ``suite`` root filesystem with ``packages`` (default: the Python
    image's) as an uncompressed tar; ``options`` go to mmdebstrap after the slimming ones."""
    # mmdebstrap stages the whole tree in $TMPDIR: keep it on the disk that receives the tar.
    env = {**os.environ, "TMPDIR": str(tar_path.parent), "LC_ALL": "C.UTF-8"}
    _proc.run(["mmdebstrap", "--quiet", *_DEBIAN_SLIM, *options,
               f"--include={','.join(packages)}", suite, str(tar_path)],
              timeout=timeout, env=env, classify=_classify_mmdebstrap, what="mmdebstrap")


# Bump when a builder's code changes what it makes in a way its inputs do not show.
_RECIPE_VERSION = 1


def recipe(*parts: object) -> str:
    """A digest of what a builder makes an image from (``sha256:…``): the store rebuilds a
    local image whose stored recipe differs, so a changed builder reaches every node."""
    text = json.dumps([_RECIPE_VERSION, *parts], sort_keys=True, default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class DebianImage:
    """An image mmdebstrap builds from Debian's ``suite``: its packages, options and config."""

    suite: str
    packages: tuple[str, ...]
    cmd: tuple[str, ...]
    options: tuple[str, ...] = ()
    env: tuple[str, ...] = field(default=(f"PATH={DEBIAN_PATH}", "LANG=C.UTF-8"))

    @property
    def recipe(self) -> str:
        return recipe("debian", self.suite, self.packages, self.options, self.env, self.cmd,
                      _DEBIAN_SLIM)

    def write_layout(self, layout: Path, tag: str = "latest", *,
                     timeout: float = PYTHON_BUILD_TIMEOUT) -> None:
        """Add the image as ``layout:tag`` (the layout is created if needed)."""
        deadline = time.monotonic() + timeout
        layout.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=layout.parent, prefix=".debian-") as work:
            layer = Path(work) / "rootfs.tar"
            write_debian_layer(layer, timeout=timeout, packages=self.packages,
                               suite=self.suite, options=self.options)
            _layout_from_layer(layout, tag, layer, created=_iso(time.time()),
                               architecture=host_architecture(), env=list(self.env),
                               cmd=list(self.cmd),
                               timeout=max(1.0, deadline - time.monotonic()))


# ray-sandbox/python:<version>: Debian's own python3 of each suite (the host's debian-archive-
# keyring verifies both; mmdebstrap builds trixie on a bookworm host).
PYTHON_IMAGES = {
    version: DebianImage(suite, PYTHON_PACKAGES, ("/usr/bin/python3",), (NO_PEP668_MARKER,))
    for version, suite in (("3.11", "bookworm"), ("3.13", "trixie"))
}
PYTHON_LATEST = "3.11"  # the host's Python, and what sandboxes had before 3.13 was offered
DOCKER_IMAGE = DebianImage(DEBIAN_SUITE, DOCKER_PACKAGES, ("/bin/bash",))
BUSYBOX_RECIPE = recipe("busybox", _BUSYBOX_ETC)


def _layout_from_layer(
    layout: Path, tag: str, layer: Path, *, created: str, architecture: str,
    env: list[str], cmd: list[str], timeout: float,
) -> None:
    umoci = Umoci()
    image = f"{layout}:{tag}"
    if not (layout / "index.json").exists():
        umoci.init(layout, timeout=timeout)
    umoci.new(image, timeout=timeout)
    umoci.raw_add_layer(image, layer, created=created, timeout=timeout)
    umoci.config(image, created=created, architecture=architecture, env=env, cmd=cmd,
                 timeout=timeout)
    umoci.gc(layout, timeout=timeout)


def write_busybox_layout(
    layout: Path,
    tag: str = "latest",
    *,
    extra_files: Mapping[str, bytes] | None = None,
    architecture: str | None = None,
    timeout: float = BUSYBOX_BUILD_TIMEOUT,
) -> None:
    """Add the busybox image as ``layout:tag`` (the layout is created if needed).

    ``architecture`` (default: the host's, like the busybox binary) only labels the config;
    tests use it to fake a foreign image.
    """
    layout.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=layout.parent, prefix=".busybox-") as work:
        layer = Path(work) / "layer.tar"
        write_busybox_layer(layer, extra_files)
        _layout_from_layer(layout, tag, layer, created=_iso(REPRODUCIBLE_EPOCH),
                           architecture=architecture or host_architecture(),
                           env=["PATH=/bin:/sbin:/usr/bin:/usr/sbin"],
                           cmd=["/bin/sh"], timeout=timeout)


def write_python_layout(
    layout: Path, tag: str = "latest", *, version: str = PYTHON_LATEST,
    timeout: float = PYTHON_BUILD_TIMEOUT,
) -> None:
    """Add ``ray-sandbox/python:<version>`` as ``layout:tag`` (~30-60 s here)."""
    PYTHON_IMAGES[version].write_layout(layout, tag, timeout=timeout)


def write_docker_layout(
    layout: Path, tag: str = "latest", *, timeout: float = PYTHON_BUILD_TIMEOUT
) -> None:
    """Add ``ray-sandbox/docker`` as ``layout:tag``: Debian bookworm + Docker 20.10 +
    docker-compose 1.29 (~60-90 s here, ~450 MB unpacked). Its CMD is a shell; the runtime
    starts dockerd itself with ``docker=True`` (runtime/docker.py)."""
    DOCKER_IMAGE.write_layout(layout, tag, timeout=timeout)


def export_layout(
    layout: Path, tag: str, dest: str, *, tls_verify: bool = True, all_images: bool = False,
    timeout: float = 600.0,
) -> None:
    """Copy ``layout:tag`` to any skopeo destination (``oci-archive:``, ``docker://``, …)."""
    Skopeo().copy(f"oci:{layout}:{tag}", dest, timeout=timeout, dest_tls_verify=tls_verify,
                  all_images=all_images)


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            opener.open(url, timeout=1).close()
            return True
        except urllib.error.HTTPError:  # 401 from an auth-enabled registry still means "up"
            return True
        except OSError:
            time.sleep(0.02)
    return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def serve_registry(
    root: Path, *, htpasswd: Path | None = None, timeout: float = 15.0
) -> Iterator[str]:
    """Run Debian's ``docker-registry`` on a free 127.0.0.1 port; yield ``"127.0.0.1:PORT"``.

    Data, config and log live under ``root``; the process is killed by PID on exit.
    """
    root.mkdir(parents=True, exist_ok=True)
    config = root / "config.yml"
    settings: dict[str, Any] = {
        "version": 0.1,
        "log": {"level": "warn"},
        "storage": {"filesystem": {"rootdirectory": str(root / "data")},
                    "delete": {"enabled": True}},
    }
    if htpasswd is not None:
        settings["auth"] = {"htpasswd": {"realm": "ray-sandbox", "path": str(htpasswd)}}
    for _ in range(3):  # the free port can be taken between probing and binding
        addr = f"127.0.0.1:{_free_port()}"
        config.write_text(json.dumps({**settings, "http": {"addr": addr}}))  # JSON is YAML
        with (root / "registry.log").open("ab") as log:
            proc = _proc.spawn(["docker-registry", "serve", str(config)], stdout=log, stderr=log)
        try:
            if _wait_ready(f"http://{addr}/v2/", proc, timeout):
                yield addr
                return
        finally:
            _proc.kill_group(proc)
            proc.wait()
            _proc.forget(proc)
    raise ImageError(f"docker-registry did not start; see {root / 'registry.log'}")
