"""Block reservations: the Ray capacity one node's host holds for its sandboxes.

A placement group per sandbox costs the GCS 1.15–2.65 ms of CPU per lifecycle, one GCS for
the whole cluster (docs/scale.md). Instead each host reserves *blocks*: one placement group
with one bundle of N times a sandbox shape (CPU, memory, custom resources) pinned to its own
node; the GCS's work is per bundle, so a block costs it what one sandbox did.
A sandbox takes a free slot of its shape with no GCS call; a shape without a free slot grows
a new block, doubling that shape's capacity (at most ``MAX_BLOCK`` bundles, at most what the
node has free); a block nobody uses for ``RAY_SANDBOX_BLOCK_IDLE_S`` seconds (10) is given back.
Ray still accounts every reserved bundle (``ray status``), so other Ray work and the
autoscaler see what the node's sandboxes hold: at most the used slots plus the spare of the
last growth.

Failure semantics (docs/scale.md, "Blocks"):
- the host dies and restarts: the new incarnation's runtime reaps the old sandboxes, and the
  blocks listed in ``<home>/blocks/`` are removed before any new one is made;
- the node dies: its blocks are reserved on a dead node; the host of any live node removes
  blocks whose node is gone when it sweeps (``sweep_dead_nodes``);
- a block half used: spare slots stay reserved until the block's last sandbox ends, then
  the block is given back after the idle time. New sandboxes go to the fullest block first,
  so spare capacity drains.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, placement_group_table

from ..runtime.errors import CapacityError
from .placement import NODE_ID_LABEL, remove_pg

MAX_BLOCK = 64  # sandboxes per block: one GCS round trip and one bundle reserve them
MAX_GROWTH = 16 * MAX_BLOCK  # slots one growth reserves at most (its blocks in parallel)
_GROW_WAIT_S = 10.0  # a block that fits by the node's free resources is placed in well under
_NAME_PREFIX = "ray_sandbox:block:"

log = logging.getLogger(__name__)

Shape = tuple[tuple[str, float], ...]


def shape_of(bundle: Mapping[str, float]) -> Shape:
    return tuple(sorted((k, float(v)) for k, v in bundle.items()))


def fits(free: Mapping[str, float], bundle: Mapping[str, float]) -> int:
    """How many bundles ``free`` resources hold (pure)."""
    counts = [math.floor(free.get(k, 0.0) / v + 1e-9) for k, v in bundle.items() if v > 0]
    return max(0, min(counts)) if counts else MAX_BLOCK


def grow_sizes(capacity: int, want: int, room: int) -> list[int]:
    """The blocks to reserve for a shape that has ``capacity`` slots and needs ``want``
    more: double the capacity (at least ``want``), within ``room`` and MAX_GROWTH, in
    blocks of at most MAX_BLOCK (pure)."""
    total = max(0, min(MAX_GROWTH, room, max(want, capacity, 1)))
    return [min(MAX_BLOCK, total - i) for i in range(0, total, MAX_BLOCK)]


@dataclass
class Block:
    pg_hex: str
    node_id: str
    shape: Shape
    size: int
    used: int = 0
    idle_since: float = field(default_factory=time.monotonic)

    @property
    def free(self) -> int:
        return self.size - self.used


class Blocks:
    """The blocks of one node's host. Thread-safe; one growth at a time per host."""

    def __init__(self, node_id: str, state_dir: Path, *, idle_s: float) -> None:
        self.node_id = node_id
        self._dir = state_dir
        self._dir.mkdir(parents=True, exist_ok=True)
        self._idle_limit = idle_s
        self._lock = threading.Lock()
        self._grow_lock = threading.Lock()
        self._blocks: dict[str, Block] = {}
        self._release_previous()

    def _release_previous(self) -> None:
        """Blocks a previous incarnation of this host listed: their sandboxes are reaped
        with it, so every one of them is given back."""
        for f in self._dir.iterdir():
            remove_pg(f.name)
            f.unlink(missing_ok=True)

    # --- slots -------------------------------------------------------------------------------

    def take(self, bundle: Mapping[str, float], k: int = 1) -> list[str]:
        """Up to ``k`` slots of ``bundle``'s shape (growing blocks as needed); the block of
        each. Fewer than ``k`` when the node has no room for more; CapacityError when it
        has room for none."""
        shape = shape_of(bundle)
        got = self._take_free(shape, k)
        if len(got) < k:
            with self._grow_lock:  # one growth at a time; others may free slots meanwhile
                got += self._take_free(shape, k - len(got))
                if len(got) < k and self._grow(bundle, shape, k - len(got)):
                    got += self._take_free(shape, k - len(got))
        if not got:
            raise CapacityError(f"node {self.node_id} has no room for another {dict(bundle)}")
        return got

    def _take_free(self, shape: Shape, k: int) -> list[str]:
        out: list[str] = []
        with self._lock:
            # fullest first: spare capacity concentrates in the other blocks, which drain
            for b in sorted((b for b in self._blocks.values() if b.shape == shape and b.free),
                            key=lambda b: b.free):
                n = min(b.free, k - len(out))
                b.used += n
                out += [b.pg_hex] * n
                if len(out) == k:
                    break
        return out

    def give(self, pg_hex: str) -> None:
        """A slot of block ``pg_hex`` is free again."""
        with self._lock:
            b = self._blocks.get(pg_hex)
            if b is not None and b.used:
                b.used -= 1
                if not b.used:
                    b.idle_since = time.monotonic()

    def free_slots(self) -> dict[Shape, int]:
        """What this host advertises to callers: free slots per shape."""
        out: dict[Shape, int] = {}
        with self._lock:
            for b in self._blocks.values():
                out[b.shape] = out.get(b.shape, 0) + b.free
        return out

    def owns(self, pg_hex: str) -> bool:
        with self._lock:
            return pg_hex in self._blocks

    def shape(self, pg_hex: str) -> dict[str, float] | None:
        """One slot's resources in block ``pg_hex`` (None: not a block of this host)."""
        with self._lock:
            b = self._blocks.get(pg_hex)
        return dict(b.shape) if b else None

    def reserved(self) -> list[Block]:
        with self._lock:
            return [Block(**vars(b)) for b in self._blocks.values()]

    # --- growing and giving back -------------------------------------------------------------

    def _grow(self, bundle: Mapping[str, float], shape: Shape, want: int) -> bool:
        """Reserve new blocks for ``shape``, all at once (the GCS places them together);
        False if the node had room for none."""
        with self._lock:
            capacity = sum(b.size for b in self._blocks.values() if b.shape == shape)
        free = ray._private.state.state.available_resources_per_node().get(self.node_id, {})
        pgs = []
        for size in grow_sizes(capacity, want, fits(free, bundle)):
            pg = placement_group([{k: v * size for k, v in bundle.items()}],
                                 strategy="STRICT_PACK",
                                 name=f"{_NAME_PREFIX}{self.node_id}:{uuid.uuid4().hex[:8]}",
                                 bundle_label_selector=[{NODE_ID_LABEL: self.node_id}],
                                 lifetime="detached")
            (self._dir / pg.id.hex()).touch()  # listed before placed: never lost on a crash
            pgs.append((pg, size))
        placed = 0
        deadline = time.monotonic() + _GROW_WAIT_S
        for pg, size in pgs:
            if not pg.wait(timeout_seconds=max(0.0, deadline - time.monotonic())):
                self._remove(pg.id.hex())  # taken by other work meanwhile
                continue
            with self._lock:
                self._blocks[pg.id.hex()] = Block(pg.id.hex(), self.node_id, shape, size)
            placed += size
        if placed:
            log.info("reserved %d slots of %s on %s", placed, dict(bundle), self.node_id)
        return placed > 0

    def shrink(self, idle_s: float | None = None) -> int:
        """Give back blocks idle for ``idle_s`` (default: the idle limit; 0: every empty
        one); returns how many."""
        now = time.monotonic()
        limit = self._idle_limit if idle_s is None else idle_s
        with self._lock:
            idle = [b.pg_hex for b in self._blocks.values()
                    if not b.used and now - b.idle_since >= limit]
            for pg_hex in idle:
                del self._blocks[pg_hex]
        for pg_hex in idle:
            self._remove(pg_hex)
        return len(idle)

    def drop(self, pg_hex: str) -> None:
        """Forget a block that Ray no longer has (removed by hand) and its file."""
        with self._lock:
            self._blocks.pop(pg_hex, None)
        self._remove(pg_hex)

    def release_all(self) -> None:
        with self._lock:
            ids = list(self._blocks)
            self._blocks.clear()
        for pg_hex in ids:
            self._remove(pg_hex)

    def _remove(self, pg_hex: str) -> None:
        remove_pg(pg_hex)
        (self._dir / pg_hex).unlink(missing_ok=True)


def sweep_dead_nodes() -> int:
    """Remove the blocks of nodes that are dead (their hosts died with them); returns how
    many. One placement-group table read: there are few blocks (a handful per node)."""
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    removed = 0
    for pg_id, info in (placement_group_table() or {}).items():
        name = info.get("name", "")  # ray_sandbox:block:<node>:<random> (names are unique)
        node = name[len(_NAME_PREFIX):].rpartition(":")[0]
        if name.startswith(_NAME_PREFIX) and node not in alive and info.get("state") != "REMOVED":
            remove_pg(pg_id)
            removed += 1
    return removed
