"""Volumes through Ray: every node keeps its own (``runtime/volumes.py``, in the node's
home), so each verb runs as a zero-CPU task pinned to the node it concerns; a sandbox that
mounts volumes is placed on the node that holds them (:func:`volume_node`, used by
``make_template``); an idle volume is copied or moved between nodes through the object
store. Through Ray a volume's ``node`` is the Ray node id holding it now."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..runtime import SandboxRuntime, archive, paths
from ..runtime.errors import ConfigError, VolumeExistsError, VolumeNotFoundError
from ..runtime.volumes import VolumeInfo, VolumeStore, fill
from .transfer import fetch, put_chunks

_TIMEOUT_S = 120.0  # a create runs mkfs; everything else is a directory listing
_COPY_TIMEOUT_S = 3600.0  # a copy moves up to the volume's size between nodes
_where_lock = threading.Lock()
_where: dict[str, str] = {}  # volume name -> node id, as last seen by this process


@ray.remote(num_cpus=0)
def _on_node(op: str, *args: Any) -> Any:
    """``VolumeStore.<op>(*args)`` in the home of the node this task runs on (its
    RAY_SANDBOX_HOME, as the node's host uses)."""
    return getattr(VolumeStore(paths.home()), op)(*args)


def _pinned(node_id: str, op: str, *args: Any) -> ray.ObjectRef:
    strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return _on_node.options(scheduling_strategy=strategy).remote(op, *args)


def _call(node_id: str, op: str, *args: Any) -> Any:
    return ray.get(_pinned(node_id, op, *args), timeout=_TIMEOUT_S)


def _alive_nodes() -> list[str]:
    return sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])


def _relabel(info: VolumeInfo, node_id: str) -> VolumeInfo:
    return info.model_copy(update={"node": node_id})


def list_volumes() -> list[VolumeInfo]:
    """Every volume of every live node (one task per node, concurrently)."""
    nodes = _alive_nodes()
    lists = ray.get([_pinned(n, "list") for n in nodes], timeout=_TIMEOUT_S)
    out = [_relabel(i, node) for node, infos in zip(nodes, lists, strict=True) for i in infos]
    with _where_lock:
        _where.clear()
        _where.update({v.name: v.node for v in out})
    return out


def create_volume(name: str, size: int | str, *, node_id: str | None = None) -> VolumeInfo:
    """A new volume on ``node_id`` (default: the caller's node). A name is unique in the
    cluster, so that a sandbox naming it has one node to go to."""
    node = node_id or ray.get_runtime_context().get_node_id()
    holders = [v.node for v in list_volumes() if v.name == name]
    if holders:
        raise VolumeExistsError(f"volume {name!r} already exists on node {holders[0]}")
    info = _relabel(_call(node, "create", name, size), node)
    with _where_lock:
        _where[name] = node
    return info


def inspect_volume(name: str) -> VolumeInfo:
    node = volume_node([name])
    return _relabel(_call(node, "inspect", name), node)


def delete_volume(name: str) -> None:
    """Delete the volume and its data on its node (refused while a sandbox has it mounted)."""
    node = volume_node([name])
    _call(node, "delete", name)
    with _where_lock:
        _where.pop(name, None)


@ray.remote(num_cpus=0)
def _export(name: str) -> Iterator[bytes]:
    yield from VolumeStore(paths.home()).export_stream(name)


@ray.remote(num_cpus=0)
def _import_from(source: str, name: str, new_name: str) -> VolumeInfo:
    """On the destination node: stream the volume from ``source`` into a new volume."""
    strategy = NodeAffinitySchedulingStrategy(source, soft=False)
    gen = _export.options(scheduling_strategy=strategy, num_returns="streaming").remote(name)
    return VolumeStore(paths.home()).import_stream(new_name, fetch(gen))


def copy_volume(name: str, node_id: str, new_name: str) -> VolumeInfo:
    """A copy of the idle volume ``name`` on ``node_id`` as ``new_name``, through the object
    store in ~4 MiB objects (only the image's data extents travel)."""
    if any(v.name == new_name for v in list_volumes()):
        raise VolumeExistsError(f"volume {new_name!r} already exists")
    return _copy(name, node_id, new_name)


def move_volume(name: str, node_id: str) -> VolumeInfo:
    """Move the idle volume ``name`` to ``node_id`` (a copy there, then the source deleted);
    its sandboxes go there from now on."""
    source = volume_node([name])
    if source == node_id:
        return inspect_volume(name)
    info = _copy(name, node_id, name)
    _call(source, "delete", name)
    with _where_lock:
        _where[name] = node_id
    return info


def _copy(name: str, node_id: str, new_name: str) -> VolumeInfo:
    source = volume_node([name])
    task = _import_from.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
    info = ray.get(task.remote(source, name, new_name), timeout=_COPY_TIMEOUT_S)
    with _where_lock:
        _where.setdefault(new_name, node_id)
    return _relabel(info, node_id)


def volume_node(names: Iterable[str]) -> str:
    """The live node that holds every one of ``names``: where a sandbox mounting them must
    run. Remembered per process; looked up across the cluster again when a name is unknown
    or its node died."""
    names = sorted(set(names))
    alive = set(_alive_nodes())
    with _where_lock:
        where = {n: _where.get(n) for n in names}
    if not all(node in alive for node in where.values()):
        listed = {v.name: v.node for v in list_volumes()}
        where = {n: listed.get(n) for n in names}
    missing = [n for n, node in where.items() if node is None]
    if missing:
        raise VolumeNotFoundError(f"no live node has volume(s) {', '.join(missing)}")
    nodes = {node for node in where.values() if node is not None}
    if len(nodes) != 1:
        raise ConfigError(f"volumes {', '.join(names)} are on different nodes; a sandbox "
                          "mounts volumes of one node")
    return nodes.pop()


@ray.remote(num_cpus=0)
def _fill_on_node(name: str, refs: list[ray.ObjectRef], path: str) -> None:
    with SandboxRuntime(paths.home(), reap=False) as rt:
        fill(rt, name, fetch(refs), path=path)


def fill_volume(name: str, source: str | Path, *, path: str = "/") -> None:
    """Copy a local directory, or the members of a local tar file, into volume ``name``
    under ``path``, on whichever node holds it: the bytes go through the object store and
    are unpacked in a short-lived sandbox there (``runtime.volumes.fill``)."""
    node = volume_node([name])  # first: an unknown name fails before anything is sent
    refs = put_chunks(archive.tar_of(Path(source)))
    ray.get(_fill_on_node.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node, soft=False)).remote(name, refs, path), timeout=_COPY_TIMEOUT_S)
