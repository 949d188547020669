"""Fixtures of the Modal compatibility tests (tests/compat/): Modal's examples and the
snippets of its sandbox guide, run with only ``import modal`` changed, on a real local Ray
cluster (tests/fx_ray.py) and real gVisor sandboxes.

Images built from Modal's DSL land in the node's image store and the builder's cache; each
module removes what it built (the builds, their ``localhost/modal-dsl/…`` names and the
filesystem images that carried them), so the machine is left as found and the next run
builds again."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator

import pytest

from ray_sandbox.runtime import ImageStore, fs_image
from tests.fx_runtime import NODE_IMAGES

BUILDS = NODE_IMAGES.parent / "builds"


@pytest.fixture(scope="module", autouse=True)
def build_ca() -> Iterator[None]:
    """This workplace's network intercepts TLS with its own CA (the host trusts it, through
    PIP_CERT/SSL_CERT_FILE): image builds trust it too (RAY_SANDBOX_BUILD_CA, docs/compat.md);
    set before the module's Ray cluster starts, so its workers see it."""
    ca = next((os.environ[v] for v in ("PIP_CERT", "SSL_CERT_FILE") if v in os.environ), None)
    old = os.environ.get("RAY_SANDBOX_BUILD_CA")
    if ca and old is None:
        os.environ["RAY_SANDBOX_BUILD_CA"] = ca
    yield
    if ca and old is None:
        os.environ.pop("RAY_SANDBOX_BUILD_CA", None)


@pytest.fixture(scope="module")
def app(ray_cluster):
    import ray_sandbox.modal as modal

    return modal.App.lookup("compat", create_if_missing=True)


@pytest.fixture(scope="module")
def built_images(ray_cluster, ray_home) -> Iterator[None]:
    """Removes, after the module, every image its DSL builds made, and only those (other
    runs on this machine build into the same cache): the filesystem images that carried
    them, from every node (their ids are the builds' digests), then the builds and their
    ``localhost/modal-dsl/`` names in the node's store."""
    import ray_sandbox

    yield
    ids = set()
    for layout in sorted((ray_home / fs_image.DIR).glob("*/*")):
        ids.add(layout.name)
        with contextlib.suppress(ray_sandbox.SandboxError):
            ray_sandbox.delete_filesystem_image(fs_image.reference(layout))
    store = ImageStore(NODE_IMAGES)
    for record in BUILDS.glob("*/built.json") if BUILDS.is_dir() else ():
        built = json.loads(record.read_text())
        if not (built["ref"].startswith("localhost/modal-dsl/")
                and built["digest"].removeprefix("sha256:")[:32] in ids):
            continue
        with contextlib.suppress(ray_sandbox.SandboxError):
            store.remove(built["digest"])
        shutil.rmtree(record.parent, ignore_errors=True)
        record.parent.with_suffix(".lock").unlink(missing_ok=True)
