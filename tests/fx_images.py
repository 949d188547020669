"""Fixtures for the images tests, and the node's default images for every test module.

Everything here is real: a ``docker-registry`` process on a free loopback port, OCI layouts and
archives written by the offline builders, skopeo and umoci. Scratch directories are removed and
the registry is killed by PID at teardown; only the default store's images stay (node cache).
"""

from __future__ import annotations

import base64
import json
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ray_sandbox.runtime import docker
from ray_sandbox.runtime.image_builders import export_layout, serve_registry, write_busybox_layout
from ray_sandbox.runtime.images import Image, ImageStore


@contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A temporary directory that is always removed (pytest's tmp_path keeps old runs)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def assert_store_clean(store: ImageStore) -> None:
    """No image, reference, blob or work directory is left (lock files are permanent)."""
    leftovers = {sub: sorted(p.name for p in (store.root / sub).iterdir())
                 for sub in ("sha256", "refs", "blobs/sha256", "tmp")}
    assert leftovers == dict.fromkeys(leftovers, []), leftovers


def busybox_variant(layout: Path, tag: str, marker: str | None = None, **kwargs) -> None:
    """Add a busybox image as ``layout:tag``; a marker file makes its digest unique."""
    extra = {"/etc/variant": marker.encode()} if marker else None
    write_busybox_layout(layout, tag, extra_files=extra, **kwargs)


@pytest.fixture(scope="session")
def registry() -> Iterator[str]:
    """``127.0.0.1:PORT`` of a real, empty docker-registry (plain HTTP)."""
    with scratch_dir("rsb-registry-") as root, serve_registry(root) as addr:
        yield addr


@pytest.fixture(scope="session")
def auth_registry() -> Iterator[tuple[str, str, str]]:
    """(address, user, password) of a registry that requires basic auth."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt  # bcrypt via libxcrypt: what docker-registry's htpasswd accepts
    with scratch_dir("rsb-auth-registry-") as root:
        htpasswd = root / "htpasswd"
        htpasswd.write_text(f"alice:{crypt.crypt('s3cret', crypt.mksalt(crypt.METHOD_BLOWFISH))}\n")
        with serve_registry(root / "registry", htpasswd=htpasswd) as addr:
            yield addr, "alice", "s3cret"


def write_authfile(path: Path, registry: str, user: str, password: str) -> Path:
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    path.write_text(json.dumps({"auths": {registry: {"auth": token}}}))
    return path


@pytest.fixture(scope="session")
def busybox_layout() -> Iterator[Path]:
    """An OCI layout with the busybox image tagged ``latest``."""
    with scratch_dir("rsb-layout-") as root:
        layout = root / "oci"
        write_busybox_layout(layout, "latest")
        yield layout


@pytest.fixture(scope="session")
def busybox_sources(busybox_layout: Path) -> Iterator[dict[str, str]]:
    """The busybox image in every file transport: name -> skopeo/ImageStore reference."""
    with scratch_dir("rsb-archives-") as root:
        refs = {
            "oci": f"oci:{busybox_layout}:latest",
            "oci-archive": f"oci-archive:{root / 'bb.oci.tar'}",
            "docker-archive": f"docker-archive:{root / 'bb.docker.tar'}",
            "dir": f"dir:{root / 'bb.dir'}",
        }
        for name, ref in refs.items():
            dest = f"{ref}:lab/busybox:latest" if name == "docker-archive" else ref
            if name != "oci":
                export_layout(busybox_layout, "latest", dest)
        yield refs


@pytest.fixture(scope="session")
def pushed_busybox(registry: str, busybox_layout: Path) -> str:
    """``registry/lab/busybox:latest``, pushed once per session."""
    ref = f"{registry}/lab/busybox:latest"
    export_layout(busybox_layout, "latest", f"docker://{ref}", tls_verify=False)
    return ref


@pytest.fixture
def temp_store() -> Iterator[ImageStore]:
    """An empty ImageStore in a scratch directory."""
    with scratch_dir("rsb-store-") as root:
        yield ImageStore(root / "images")


@pytest.fixture(scope="session")
def default_image() -> Image:
    """``ray-sandbox/python:latest`` in the node's default store (built once, ~30-60 s)."""
    return ImageStore().get("ray-sandbox/python:latest")


@pytest.fixture(scope="session")
def busybox_image() -> Image:
    """``ray-sandbox/busybox:latest`` in the node's default store."""
    return ImageStore().get("ray-sandbox/busybox:latest")


@pytest.fixture(scope="session")
def docker_image() -> Image:
    """``ray-sandbox/docker:latest`` in the node's default store: built once per node
    (~1.5-3 min: mmdebstrap, umoci, unpack), then a cache hit like the python image."""
    return ImageStore().get(docker.DOCKER_IMAGE)


@pytest.fixture(scope="session")
def busybox_docker_archive(busybox_layout: Path) -> Iterator[Path]:
    """The busybox image as a ``docker load``-able archive tagged ``lab/busybox:latest``."""
    with scratch_dir("rsb-docker-archive-") as root:
        path = root / "busybox.docker.tar"
        export_layout(busybox_layout, "latest", f"docker-archive:{path}:lab/busybox:latest")
        yield path
