"""An image built with ``image build -t NAME`` is ``localhost/NAME`` in the node's store
(docs/docker.md, "Dockerfile builds"; docs/images.md, "Built images"), and that name works
everywhere on the node: ``SandboxRuntime.create``, ``ray-sandbox run --image`` and the Ray
layer. Real Dockerfile builds in a gVisor build sandbox, real Ray."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from ray_sandbox.runtime import SandboxRuntime
from ray_sandbox.runtime.docker import build_image
from ray_sandbox.runtime.errors import ImageBuildError
from ray_sandbox.runtime.images import Image, ImageStore
from tests.fx_runtime import leftovers

CLI = str(Path(sys.executable).parent / "ray-sandbox")
NAME = "localhost/lab/named:v1"


class Built(NamedTuple):
    image: Image
    marker: str
    context: Path
    cache: Path


@pytest.fixture(scope="module")
def built(runtime: SandboxRuntime, docker_image, image_store: ImageStore,
          tmp_path_factory) -> Iterator[Built]:
    """``lab/named:v1`` built once for the module, in a private build cache; its image
    leaves the node's store afterwards."""
    ctx = tmp_path_factory.mktemp("ctx")
    marker = secrets.token_hex(6)
    (ctx / "Dockerfile").write_text(f"FROM ray-sandbox/busybox:latest\nRUN echo {marker} > /m\n")
    cache = tmp_path_factory.mktemp("builds")
    image = build_image(runtime, ctx, tag="lab/named:v1", cache_dir=cache)
    yield Built(image, marker, ctx, cache)
    image_store.remove(NAME)


def test_a_build_is_named_localhost_name(runtime: SandboxRuntime, image_store: ImageStore,
                                         built: Built):
    assert built.image.ref == NAME
    # one row in the store: the name, not the archive's path
    assert [i.ref for i in image_store.list() if i.digest == built.image.digest] == [NAME]
    sid = runtime.create(image=NAME, memory="64Mi")
    try:
        assert runtime.exec(sid, "cat /m").stdout.split() == [built.marker]
    finally:
        runtime.delete(sid, wait=True)  # unpinned now: the image is removed below
    lines: list[str] = []  # the same build again, named either way: the cache answers
    again = build_image(runtime, built.context, tag=NAME, cache_dir=built.cache,
                        progress=lines.append)
    assert (again.ref, again.digest) == (NAME, built.image.digest)
    assert [line.split()[0] for line in lines] == ["cached"]
    image_store.remove(NAME)  # a name removed meanwhile comes back from the cache
    assert build_image(runtime, built.context, tag="lab/named:v1",
                       cache_dir=built.cache).digest == built.image.digest
    assert image_store.get(NAME).digest == built.image.digest


def test_a_later_dockerfile_builds_from_a_built_name(runtime: SandboxRuntime,
                                                     image_store: ImageStore, built: Built,
                                                     tmp_path: Path):
    (tmp_path / "Dockerfile").write_text(f"FROM {NAME}\nRUN cat /m > /m2\n")
    image = build_image(runtime, tmp_path, tag="lab/on-top", cache_dir=tmp_path / "builds")
    try:
        assert image.ref == "localhost/lab/on-top:latest"
        sid = runtime.create(image=image.ref, memory="64Mi")
        try:
            assert runtime.exec(sid, "cat /m2").stdout.split() == [built.marker]
        finally:
            runtime.delete(sid, wait=True)
    finally:
        image_store.remove(image.digest)


@pytest.mark.parametrize("tag", ["ghcr.io/org/app:v1", "localhost:5000/app", "ray-sandbox/x",
                                 "Upper/Case", "docker://localhost/x"])
def test_a_build_is_named_on_this_node_only(runtime: SandboxRuntime, tmp_path: Path, tag: str):
    (tmp_path / "Dockerfile").write_text("FROM ray-sandbox/busybox:latest\n")
    with pytest.raises(ImageBuildError, match="localhost/"):
        build_image(runtime, tmp_path, tag=tag, cache_dir=tmp_path / "builds")


def test_cli_runs_a_built_name(tmp_path: Path, image_store: ImageStore, built: Built):
    env = {**os.environ, "RAY_SANDBOX_HOME": str(tmp_path),
           "RAY_SANDBOX_IMAGES": str(image_store.root)}
    proc = subprocess.run([CLI, "run", "--image", NAME, "--memory", "64Mi", "--", "cat", "/m"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert (proc.returncode, proc.stdout.split()) == (0, [built.marker]), proc.stderr
    assert leftovers(tmp_path) == {}


def test_the_ray_layer_on_the_node_runs_a_built_name(ray_cluster, built: Built):
    import ray

    import ray_sandbox

    sb = ray_sandbox.create(image=NAME, memory="64Mi")
    try:
        assert sb.run("cat /m").stdout.split() == [built.marker]
    finally:
        ray.get(sb.terminate.remote())
