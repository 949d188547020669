"""Where a caller sends creates, with no GCS operation per sandbox.

Each host's reply advertises its free block slots per sandbox shape; the caller keeps the
last advertisement of every node and, refreshed at most every ``_NODES_TTL_S``, the nodes'
free Ray resources (one GCS read for all nodes). A plan gives each node as many sandboxes as
its free slots plus the bundles its free resources hold; a node that answered "no room" is
skipped for ``_FULL_S``. When no node has room the caller falls back to a placement group per
sandbox, which waits as pending demand the autoscaler sees (``api``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import ray

from .blocks import Block, Shape, fits, shape_of
from .placement import NODE_ID_LABEL
from .template import SandboxTemplate

_NODES_TTL_S = 1.0
_FULL_S = 2.0


def selector_matches(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    """Ray's label selector on one node's labels: ``v`` (equal), ``!v`` (not equal),
    ``in(a,b)`` and ``!in(a,b)`` (pure)."""
    for key, want in selector.items():
        have = labels.get(key)
        negate = want.startswith("!")
        want = want[1:] if negate else want
        if want.startswith("in(") and want.endswith(")"):
            ok = have in {v.strip() for v in want[3:-1].split(",")}
        else:
            ok = have == want
        if ok == negate:
            return False
    return True


def plan(room: Mapping[str, int], k: int) -> list[tuple[str, int]]:
    """Spread ``k`` sandboxes over nodes by their room, most room first (pure)."""
    out = []
    for node, n in sorted(room.items(), key=lambda kv: -kv[1]):
        if k <= 0:
            break
        take = min(n, k)
        if take > 0:
            out.append((node, take))
            k -= take
    return out


class Router:
    """One per process (:data:`router`). Thread-safe; estimates are decremented as plans are
    made, so concurrent creates do not all pick the same free slot."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: dict[str, dict[Shape, int]] = {}
        self._full: dict[tuple[str, Shape], float] = {}
        self._nodes: list[tuple[str, dict[str, str]]] = []
        self._free: dict[str, dict[str, float]] = {}
        self._read_at = 0.0

    def place(self, t: SandboxTemplate, k: int) -> list[tuple[str, int]]:
        """Nodes for up to ``k`` sandboxes of ``t`` and how many each; may cover fewer than
        ``k`` (or none) when the cluster has no more room now."""
        bundle = t.bundle
        shape = shape_of(bundle)
        self._refresh()
        now = time.monotonic()
        with self._lock:
            room = {}
            for node, labels in self._nodes:
                if t.node_id and node != t.node_id:
                    continue
                if t.label_selector and not selector_matches(labels, t.label_selector):
                    continue
                if self._full.get((node, shape), 0.0) > now:
                    continue
                room[node] = (self._slots.get(node, {}).get(shape, 0)
                              + fits(self._free.get(node, {}), bundle))
            chosen = plan(room, k)
            for node, n in chosen:  # spend the estimate: slots first, then free resources
                slots = self._slots.setdefault(node, {})
                from_slots = min(n, slots.get(shape, 0))
                slots[shape] = slots.get(shape, 0) - from_slots
                free = self._free.setdefault(node, {})
                for key, v in bundle.items():
                    free[key] = free.get(key, 0.0) - v * (n - from_slots)
        return chosen

    def advertised(self, node: str, slots: Mapping[Shape, int]) -> None:
        with self._lock:
            self._slots[node] = dict(slots)

    def learn(self, blocks: Iterable[Block]) -> None:
        """Free slots from the hosts' own lists of their blocks (slots freed since their last
        reply to this process: deletes do not report back)."""
        slots: dict[str, dict[Shape, int]] = {}
        for b in blocks:
            per = slots.setdefault(b.node_id, {})
            per[b.shape] = per.get(b.shape, 0) + b.free
        with self._lock:
            self._slots.update(slots)
            self._full.clear()

    def no_room(self, node: str, t: SandboxTemplate) -> None:
        with self._lock:
            self._full[(node, shape_of(t.bundle))] = time.monotonic() + _FULL_S
            self._read_at = 0.0  # its free resources were wrong: read them again

    def forget(self) -> None:
        with self._lock:
            self._slots.clear()
            self._full.clear()
            self._read_at = 0.0

    def _refresh(self) -> None:
        with self._lock:
            if time.monotonic() - self._read_at < _NODES_TTL_S:
                return
        nodes = [(n["NodeID"], {**n.get("Labels", {}), NODE_ID_LABEL: n["NodeID"]})
                 for n in ray.nodes() if n.get("Alive")]
        free: dict[str, Any] = ray._private.state.state.available_resources_per_node()
        with self._lock:
            self._nodes = nodes
            self._free = {k: dict(v) for k, v in free.items()}
            self._read_at = time.monotonic()


router = Router()
