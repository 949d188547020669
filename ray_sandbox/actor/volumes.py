"""Volumes through Ray: every node keeps its own (``runtime/volumes.py``, in the node's
home), so each verb runs as a zero-CPU task pinned to the node it concerns; a sandbox that
mounts volumes is placed on the node that holds them (:func:`volume_node`, used by
``make_template``). Through Ray a volume's ``node`` is the Ray node id holding it now."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..runtime import paths
from ..runtime.errors import ConfigError, SandboxNotFoundError
from ..runtime.volumes import VolumeInfo, VolumeStore

_TIMEOUT_S = 120.0  # a create runs mkfs; everything else is a directory listing
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
        raise ConfigError(f"volume {name!r} already exists on node {holders[0]}")
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
        raise SandboxNotFoundError(f"no live node has volume(s) {', '.join(missing)}")
    nodes = {node for node in where.values() if node is not None}
    if len(nodes) != 1:
        raise ConfigError(f"volumes {', '.join(names)} are on different nodes; a sandbox "
                          "mounts volumes of one node")
    return nodes.pop()
