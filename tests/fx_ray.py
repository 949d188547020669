"""Fixtures for the Ray layer: a real local Ray cluster whose sandboxes live in a private home
and use the node's image cache; everything is deleted and checked at teardown."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from ray_sandbox.runtime.paths import images
from tests.fx_runtime import NODE_IMAGES, leftovers

# Tests of the Ray layer run with the hosts' stock off, so that what they count (sandboxes,
# slots, reservations) is what they made; tests/test_stock.py turns it on.
STOCK_OFF = "0"


@pytest.fixture(scope="module")
def ray_home(tmp_path_factory, default_image, busybox_image):
    home = tmp_path_factory.mktemp("rsb-ray")
    old = {k: os.environ.get(k) for k in ("RAY_SANDBOX_HOME", "RAY_SANDBOX_IMAGES",
                                          "RAY_SANDBOX_BLOCK_IDLE_S", "RAY_SANDBOX_STOCK_MAX")}
    os.environ["RAY_SANDBOX_IMAGES"] = str(images())
    os.environ["RAY_SANDBOX_HOME"] = str(home)
    os.environ["RAY_SANDBOX_STOCK_MAX"] = STOCK_OFF
    # idle blocks are given back within seconds (default 10), so tests that check a freed
    # reservation need not wait that long; tests/test_blocks.py checks the blocks themselves
    os.environ["RAY_SANDBOX_BLOCK_IDLE_S"] = "2"
    yield home
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def ray_metrics_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster(ray_home, ray_metrics_port):
    import ray

    import ray_sandbox

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             object_store_memory=300 * 2**20, _metrics_export_port=ray_metrics_port)
    yield ray
    ray_sandbox.shutdown()
    ray.shutdown()
    assert_reaped_clean(ray_home)


def assert_reaped_clean(home: Path) -> None:
    """Reap what a killed host left in ``home``, then check nothing of ours is left. The
    reaper uses the node's image store, as the hosts did: a teardown it finishes unpins there
    (after homes_cluster the environment no longer names that store)."""
    from ray_sandbox.runtime import ImageStore, SandboxRuntime

    SandboxRuntime(home, reap=True, images=ImageStore(NODE_IMAGES))
    assert leftovers(home) == {}, leftovers(home)
    stored = remove_stored_images_of(home)
    assert stored == [], f"filesystem images of {home} left in the node's store: {stored}"


def remove_stored_images_of(home: Path) -> list[str]:
    """Remove, and name, the node store's images made from layouts under ``home`` (a
    filesystem image that nobody deleted): the store is shared and outlives the home."""
    import json

    from ray_sandbox.runtime import ImageStore

    store, found = ImageStore(NODE_IMAGES), []
    for ref_file in sorted((Path(NODE_IMAGES) / "refs").glob("*.json")):
        try:
            ref = json.loads(ref_file.read_text())["ref"]
        except (OSError, ValueError, KeyError):
            continue
        if ref.startswith(f"oci:{home}/"):
            found.append(ref)
            store.remove(ref)
    return found


def host_pid(ray, host) -> int:
    """The PID of a sandbox host actor's process (e.g. ``sb._host``)."""
    return ray.get(host.__ray_call__.remote(lambda self: os.getpid()), timeout=30)


@contextmanager
def homes_cluster(homes: list[Path], env: dict[str, str] | None = None,
                  node_args: list[dict[str, Any]] | None = None) -> Iterator[Any]:
    """A local multi-node ``ray.cluster_utils.Cluster``, one node per home (the node's
    processes inherit ``RAY_SANDBOX_HOME``), connected; at the end Ray is shut down, the
    environment restored, what a killed host left in each home reaped and checked."""
    import ray
    from ray.cluster_utils import Cluster

    import ray_sandbox

    env = {"RAY_SANDBOX_IMAGES": str(images()), "RAY_SANDBOX_STOCK_MAX": STOCK_OFF, **(env or {})}
    old = {k: os.environ.get(k) for k in [*env, "RAY_SANDBOX_HOME"]}
    os.environ.update(env)
    c = Cluster()
    try:
        for home, args in zip(homes, node_args or [{}] * len(homes), strict=True):
            os.environ["RAY_SANDBOX_HOME"] = str(home)
            c.add_node(**{"num_cpus": 2, "include_dashboard": False, **args})
        ray.init(address=c.address, log_to_driver=False)
        yield c
        ray_sandbox.shutdown()
        ray.shutdown()
    finally:
        c.shutdown()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    for home in homes:
        assert_reaped_clean(home)
