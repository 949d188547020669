"""What the nodes hold of the service's: snapshots and filesystem images in each live node's
home, read by a zero-CPU task pinned to that node (as ``actor/volumes.py`` reaches volumes).
Used to mark what the books name but no node has as lost, and by ``ray-sandbox serve
--reconcile`` to find what the nodes hold that the books never named. Every read is bounded
(entries, bytes, the wait for each node)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..runtime import fs_image, paths
from ..runtime.snapshot import SnapshotStore

log = logging.getLogger(__name__)

MAX_ENTRIES = 100_000  # snapshots or images listed per node
MAX_JSON = 1 << 16  # bytes of one OCI index, manifest or config read to find an image's source
_ID_RE = re.compile(r"^[0-9a-f]{32}$")
_SOURCE_RE = re.compile(r"snapshot_filesystem of ([0-9A-Za-z_-]{1,128})$")
_DIGEST_RE = re.compile(r"^sha256:([0-9a-f]{64})$")


def _json(path: Path) -> Any:
    with open(path, "rb") as f:
        data = f.read(MAX_JSON + 1)
    if len(data) > MAX_JSON:
        raise ValueError(f"{path} is over {MAX_JSON} bytes")
    return json.loads(data)


def _blob(layout: Path, digest: Any) -> Any:
    m = _DIGEST_RE.match(str(digest))
    if m is None:
        raise ValueError(f"not a sha256 digest: {digest!r}")
    return _json(layout / "blobs" / "sha256" / m.group(1))


MAX_HISTORY = 256  # entries of an image's history looked at


def image_source(layout: Path) -> str | None:
    """The runtime id of the sandbox a filesystem image was taken of (the newest entry of its
    config's history that names one: a diff image's is after its base image's), or None if
    unreadable."""
    try:
        manifest = _blob(layout, _json(layout / "index.json")["manifests"][0]["digest"])
        config = _blob(layout, manifest["config"]["digest"])
        for item in reversed(config["history"][-MAX_HISTORY:]):
            m = _SOURCE_RE.search(str(item.get("created_by", "")))
            if m:
                return m.group(1)
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
    return None


@ray.remote(num_cpus=0)
def _on_node(tenant_label: str) -> dict[str, Any]:
    """This node's snapshots (with the tenant their sandbox's labels name, if any) and
    filesystem images (with the sandbox they were taken of)."""
    home = paths.home()
    snaps = []
    if (home / "snapshots").is_dir():
        for snap in SnapshotStore(home / "snapshots").list()[:MAX_ENTRIES]:
            labels = snap.config.get("labels") or {}
            snaps.append({"id": snap.snapshot_id, "created_at": snap.created_at,
                          "tenant": labels.get(tenant_label), "snapshot":
                          snap.model_dump(mode="json")})
    images: list[dict[str, Any]] = []
    root = fs_image.root(home)
    if root.is_dir():
        for scope in sorted(root.iterdir()):
            if not scope.is_dir() or scope.is_symlink():
                continue
            for d in sorted(scope.iterdir()):
                if len(images) >= MAX_ENTRIES:
                    break
                if _ID_RE.match(d.name) and d.is_dir() and not d.is_symlink():
                    images.append({"id": d.name, "scope": scope.name,
                                   "ref": fs_image.reference(d),
                                   "created_at": d.stat().st_mtime,
                                   "source": image_source(d)})
    return {"snapshots": snaps, "fs_images": images}


def collect(tenant_label: str, timeout: float = 60.0) -> dict[str, Any]:
    """``{"alive": [node ids], "nodes": {node id: what it holds}}``: every live node that
    answered within ``timeout`` (one that did not is alive but absent from ``nodes``: what it
    holds is unknown, not lost)."""
    alive = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
    refs = {node: _on_node.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node, soft=False)).remote(tenant_label) for node in alive}
    nodes = {}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
    done = set(ready)
    for node, ref in refs.items():
        if ref not in done:
            log.warning("node %s did not say what it holds within %g s", node, timeout)
            ray.cancel(ref, force=True)
            continue
        try:
            nodes[node] = ray.get(ref)
        except ray.exceptions.RayError as exc:
            log.warning("node %s could not say what it holds: %s", node, exc)
    return {"alive": alive, "nodes": nodes}


def presence(inv: dict[str, Any], kind: str, key: str, origin: str | None) -> bool | None:
    """Whether a node holds snapshot or image ``key`` (``kind``: "snapshots" or
    "fs_images"): True (found), False (lost: no node that answered has it, and its origin
    node is gone or answered), None (unknown: its origin did not answer)."""
    for held in inv["nodes"].values():
        if any(x["id"] == key for x in held[kind]):
            return True
    if origin is None or origin not in inv["alive"] or origin in inv["nodes"]:
        return False
    return None
