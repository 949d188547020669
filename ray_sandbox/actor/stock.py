"""A node host's stock: sandboxes booted ahead of time and never used, handed to creates whose
config boots the same way, so that ``create()`` does not wait for a gVisor boot (~165 ms).

A shelf holds the stock of one boot (``runtime.config.boot_key``: image, limits, network
mode, …) and one Ray shape. It holds what its demand needs over a refill's latency: the
average interval between its takes and the average time a refill takes (boot, ping, the
quiet gap below) give ``1.5 × latency / interval + 1``; each miss also raises a floor by one.
Both are capped by ``RAY_SANDBOX_STOCK_PER_SHAPE`` (8). A shelf nobody took from for
``RAY_SANDBOX_STOCK_IDLE_S`` seconds (30) forgets its demand, holds one fewer and deletes
what is over. All shelves together hold at most ``RAY_SANDBOX_STOCK_MAX`` sandboxes (32; 0
switches the stock off) and at most ``RAY_SANDBOX_STOCK_SHARE`` (0.25) of each resource the
node gives Ray (CPU, memory, …): the stock must not keep other Ray work off the node.

- Each stocked sandbox holds a slot of the host's blocks, so Ray accounts it like any
  sandbox (``ray status``) and the stock can never take what the node does not have. A
  create that finds no free slot evicts stocked sandboxes of its shape (:meth:`evict`); a
  create that came with its own reservation takes a stocked sandbox of its boot, whose slot
  goes back (:meth:`take_any`).
- Refills boot two sandboxes at a time, more (at most four) while the shelves' demand over a
  refill's latency needs it. They start while no caller's create (boot or hand-out) is in
  flight on the host and none ended in the last 0.1 s, so the stock does not compete with
  the creates callers wait for, nor with their first commands; except for a shelf whose stock
  and refills would run out before a refill started later is ready (a miss costs a boot).
- The node keeps ``RAY_SANDBOX_STOCK_MEM_FREE`` bytes (1 GiB) or a tenth of its memory
  available, whichever is more: below that no refill starts and stocked sandboxes are given
  back, one per tick.
- Every miss is counted with its cause (:data:`MISS_CAUSES`; ``stats()``, the metric
  ``ray_sandbox_stock_misses{cause}``).
- A taken sandbox leaves the stock for good: a sandbox anybody used is never handed out.
- Stocked sandboxes die with their host, at once and however it dies: a keeper process
  (``runtime.keeper``) waits for the host's process to exit and deletes them. The host's
  other sandboxes are reaped by its next incarnation or the node's next gc; the stock must
  not wait for that, since nobody else knows of it (a local Ray cluster shut down with its
  hosts would otherwise leave it running although the caller deleted everything it made).

What a taken sandbox shows that a fresh one would not: a longer uptime (``/proc/uptime``)
and the agent's connection handler already running (a fresh sandbox has it after its first
call). Hostname, environment, ``/tmp``, processes, network identity and seed file are its
own (docs/ray.md, "Stock").
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import ray

from ..runtime import SandboxRuntime, keeper
from ..runtime.config import PERSONAL_FIELDS, SandboxConfig, boot_key
from ..runtime.errors import CapacityError, SandboxError
from . import metrics
from .blocks import Blocks, Shape, shape_of
from .placement import PG_LABEL
from .residents import REFILL_QUIET_S

STOCK_LABEL = "ray-sandbox/stock"  # on stocked sandboxes' records, for `ray-sandbox list`
_TICK_S = 1.0  # how often idle shelves are looked at without a miss to wake the refill
_SHORT_TICK_S = 0.02  # ... and how often while a shelf is short and callers' boots hold it back
_RETRY_S = 5.0  # how long a shelf whose refill failed waits before the next try
_REFILLS = 2  # refill boots at once, usually: keeps up with a caller that creates every 0.2 s
_REFILLS_MAX = 4  # ... and at most, while demand over a refill's latency needs more
_CLOSE_WAIT_S = 60.0  # how long close() waits for refills in flight (a boot takes < 1 s)

log = logging.getLogger(__name__)


# Why a create found no stocked sandbox (``ray_sandbox_stock_misses{cause}``, stats()):
MISS_CAUSES = (
    "new",  # its boot had no shelf yet: the first create of a config (or after it idled out)
    "refilling",  # the shelf was empty with refills booting: demand outran the refill
    "late",  # the shelf was short, no refill started yet: creates kept the host busy
    "low",  # the shelf was empty and wanted nothing: its demand had been forgotten (idle)
    "held",  # the shelf was short, its refill held back: no slot, no share, memory pressure
    "failed",  # the shelf's last refill failed (it retries after _RETRY_S)
    "handout",  # a stocked sandbox was taken but could not be made the caller's: it booted
    "reserved",  # the create came with its own reservation (no block had room): it booted
)
_RATE_MEMORY = 0.3  # weight of the newest interval in a shelf's take-interval average
_LEAD = 1.5  # stock for this many refill latencies of demand
_REFILL_GUESS_S = 0.4  # a refill's latency before one is measured (boot, ping, the quiet gap)
# memory the node keeps free whatever the stock (RAY_SANDBOX_STOCK_MEM_FREE bytes, default
# 1 GiB, or this share of its memory if more): below it no refill starts and stocked
# sandboxes are given back, one per tick
_MEM_FLOOR_SHARE = 0.1


@dataclass
class _Shelf:
    config: SandboxConfig  # the boot: the caller's config without its personal fields
    bundle: dict[str, float]
    target: int = 0  # raised by misses, lowered when idle
    ready: list[tuple[str, str]] = field(default_factory=list)  # (sandbox id, block)
    booting: int = 0
    last_take: float = field(default_factory=time.monotonic)
    retry_at: float = 0.0
    interval: float | None = None  # average seconds between takes (None: one take so far)
    held: bool = False  # the last refill it wanted was held back (slots, share, memory)

    def urgent(self, latency: float) -> bool:
        """Whether what it holds and boots runs out before a refill started now is ready."""
        if self.interval is None:
            return not self.ready and not self.booting
        return len(self.ready) + self.booting < math.ceil(latency / max(self.interval, 1e-3))

    def wanted(self, latency: float, cap: int) -> int:
        """How many to hold: the demand over a refill's latency (with a margin), or the
        target misses set, whichever is more; at most ``cap``."""
        ahead = 0
        if self.interval is not None:
            ahead = math.ceil(_LEAD * latency / max(self.interval, 1e-3)) + 1
        return min(cap, max(self.target, ahead))


class Stock:
    """The stock of one host. Thread-safe; one refill thread."""

    def __init__(self, rt: SandboxRuntime, blocks: Blocks, node_id: str, *,
                 busy: Callable[[], bool], per_shape: int, total: int, idle_s: float,
                 share: float) -> None:
        """``per_shape``, ``total``, ``idle_s`` and ``share`` are the module docstring's
        ``RAY_SANDBOX_STOCK_*`` settings (the host reads them); ``total`` 0 is off."""
        self._rt = rt
        self._blocks = blocks
        self._node_id = node_id
        self._busy = busy
        self._per_shape = max(0, per_shape)
        self._max = max(0, total)
        self._idle_s = max(0.0, idle_s)
        share = min(1.0, max(0.0, share))
        self._budget = ({k: v * share for k, v in _node_resources(node_id).items()}
                        if self._max else {})  # off: no GCS read
        self._lock = threading.Condition()
        self._shelves: dict[tuple[str, Shape], _Shelf] = {}
        self._hits = self._misses = self._booting = 0
        self._causes = dict.fromkeys(MISS_CAUSES, 0)
        self._latency = _REFILL_GUESS_S  # average seconds from a refill's start to ready
        self._pressure = False
        self._mem_free = int(_env_number("RAY_SANDBOX_STOCK_MEM_FREE", 1 << 30))
        self._closed = False
        if self._max:
            keeper.start(rt.home, {STOCK_LABEL: "1"})
            threading.Thread(target=self._loop, name="ray-sandbox-stock", daemon=True).start()

    # --- callers -----------------------------------------------------------------------------

    def take(self, config: SandboxConfig, bundle: Mapping[str, float]) -> tuple[str, str] | None:
        """A stocked sandbox booted like ``config`` and its block slot, or None (a miss,
        which asks for one more on that shelf)."""
        key = boot_key(config)
        if key is None or not self._max:
            return None
        with self._lock:
            if self._closed:
                return None
            now = time.monotonic()
            shelf = self._shelves.get((key, shape_of(bundle)))
            cause = None
            if shelf is None:
                boot = config.model_copy(update={f: SandboxConfig.model_fields[f].get_default(
                    call_default_factory=True) for f in PERSONAL_FIELDS})
                shelf = self._shelves[(key, shape_of(bundle))] = _Shelf(boot, dict(bundle))
                cause = "new"
            else:
                gap = now - shelf.last_take
                shelf.interval = gap if shelf.interval is None else (
                    _RATE_MEMORY * gap + (1 - _RATE_MEMORY) * shelf.interval)
            shelf.last_take = now
            hit = bool(shelf.ready)
            if hit:
                self._hits += 1
                got = shelf.ready.pop(0)  # the oldest: every one is equally unused
            else:
                self._misses += 1
                shelf.target = min(shelf.target + 1, self._per_shape)
                cause = cause or (
                    "refilling" if shelf.booting else "held" if shelf.held
                    else "failed" if shelf.retry_at > now
                    else "late" if shelf.wanted(self._latency, self._per_shape) else "low")
                self._causes[cause] += 1
            self._lock.notify_all()  # a shelf is short now: refill
        metrics.count_stock_take(hit)
        if cause is not None:
            metrics.count_stock_miss(cause)
        self._publish()
        return got if hit else None

    def take_any(self, config: SandboxConfig) -> tuple[str, str] | None:
        """A stocked sandbox booted like ``config``, of any shape, for a create that came
        with its own reservation (the sandbox then runs under that one; the caller gives
        the block slot back); None is a miss of cause ``reserved``."""
        key = boot_key(config)
        if key is None or not self._max:
            return None
        with self._lock:
            if self._closed:
                return None
            shelf = max((s for (k, _), s in self._shelves.items() if k == key and s.ready),
                        key=lambda s: len(s.ready), default=None)
            got = shelf.ready.pop(0) if shelf is not None else None
            if got is not None:
                self._hits += 1
                self._lock.notify_all()
        metrics.count_stock_take(got is not None)
        if got is None:
            self.missed("reserved")
        self._publish()
        return got

    def missed(self, cause: str) -> None:
        """A create the stock did not serve for a reason the host saw (``handout``,
        ``reserved``: MISS_CAUSES)."""
        with self._lock:
            if not self._max:
                return
            self._misses += 1
            self._causes[cause] += 1
        metrics.count_stock_miss(cause)

    def evict(self, bundle: Mapping[str, float], k: int) -> int:
        """Delete up to ``k`` stocked sandboxes of ``bundle``'s shape to free their slots
        for a create that found none; how many were freed."""
        shape = shape_of(bundle)
        gone: list[tuple[str, str]] = []
        with self._lock:
            for (_, s), shelf in self._shelves.items():
                while s == shape and shelf.ready and len(gone) < k:
                    gone.append(shelf.ready.pop())
        self._discard(gone)
        return len(gone)

    def forget_image(self, image: str) -> None:
        """Delete every stocked sandbox booted from ``image`` and stop stocking it, waiting
        (bounded) for those still booting: nobody asked for them, so they must not keep the
        image in use (a filesystem image being deleted was "in use" for ~30 s)."""
        with self._lock:
            shelves = [(k, sh) for k, sh in self._shelves.items() if sh.config.image == image]
            gone = [g for _, sh in shelves for g in sh.ready]
            for key, shelf in shelves:
                shelf.ready.clear()
                del self._shelves[key]
        self._discard(gone)
        with self._lock:  # a refill in flight finds its shelf gone and deletes its sandbox
            if not self._lock.wait_for(lambda: not any(sh.booting for _, sh in shelves),
                                       _CLOSE_WAIT_S):
                log.warning("stocked sandboxes of %s still booting after %gs", image,
                            _CLOSE_WAIT_S)

    def ids(self) -> set[str]:
        with self._lock:
            return {sid for shelf in self._shelves.values() for sid, _ in shelf.ready}

    def shapes(self) -> dict[Shape, int]:
        """Stocked sandboxes per shape."""
        out: dict[Shape, int] = {}
        with self._lock:
            for (_, shape), shelf in self._shelves.items():
                out[shape] = out.get(shape, 0) + len(shelf.ready)
        return out

    def stats(self) -> dict[str, Any]:
        """Hits, misses and their causes (MISS_CAUSES), stocked sandboxes, the shelves'
        targets (what each wants to hold now) and the average refill latency."""
        with self._lock:
            return {"hits": self._hits, "misses": self._misses,
                    "stocked": sum(len(s.ready) for s in self._shelves.values()),
                    "target": sum(s.wanted(self._latency, self._per_shape)
                                  for s in self._shelves.values()),
                    "causes": {k: v for k, v in self._causes.items() if v},
                    "refill_s": round(self._latency, 3), "memory_short": self._pressure}

    def close(self) -> None:
        """Stop refilling and delete every stocked sandbox, those still booting included once
        they are up (the host retires or shuts down)."""
        with self._lock:
            self._closed = True
            gone = [g for shelf in self._shelves.values() for g in shelf.ready]
            self._shelves.clear()
            self._lock.notify_all()
        self._discard(gone)
        with self._lock:
            if not self._lock.wait_for(lambda: not self._booting, _CLOSE_WAIT_S):
                log.warning("%d stock refills still booting after %gs; the next host reaps "
                            "them", self._booting, _CLOSE_WAIT_S)

    # --- refill ------------------------------------------------------------------------------

    def _loop(self) -> None:
        with ThreadPoolExecutor(_REFILLS_MAX, thread_name_prefix="ray-sandbox-refill") as pool:
            while True:
                with self._lock:
                    short = any(len(s.ready) + s.booting < s.wanted(self._latency,
                                                                    self._per_shape)
                                for s in self._shelves.values())
                    self._lock.wait(_SHORT_TICK_S if short else _TICK_S)
                    if self._closed:
                        return
                self._shrink()
                self._pressure = _memory_short(self._mem_free)
                if self._pressure:
                    self._give_back()
                    continue
                # creates in flight get the CPU: refills start between them, but for a
                # shelf that would run dry before a refill started later could be ready
                while (shelf := self._wanting(urgent_only=self._busy())) is not None:
                    pool.submit(self._refill, shelf)

    def _wanting(self, *, urgent_only: bool = False) -> _Shelf | None:
        """The emptiest shelf below its target, counted as booting one more, if the refills
        in flight, the total and the node share allow one more; with ``urgent_only``, only
        one whose stock and refills cover less than a refill's latency of its demand."""
        now = time.monotonic()
        with self._lock:
            shelves = self._shelves.values()
            held = [(s.bundle, len(s.ready) + s.booting) for s in shelves]
            if self._closed or sum(s.booting for s in shelves) >= self._parallel():
                return None
            want = {id(s): s.wanted(self._latency, self._per_shape) for s in shelves}
            short = [s for s in shelves if len(s.ready) + s.booting < want[id(s)]
                     and s.retry_at <= now]
            full = sum(n for _, n in held) >= self._max
            for s in short:
                s.held = full or not self._affordable(held, s.bundle)
            short = [s for s in short if not s.held
                     and not (urgent_only and not s.urgent(self._latency))]
            shelf = min(short, key=lambda s: len(s.ready) + s.booting - want[id(s)],
                        default=None)
            if shelf is not None:
                shelf.booting += 1
                self._booting += 1
            return shelf

    def _parallel(self) -> int:
        """Refills at once: enough for the demand of every shelf over a refill's latency
        (Little's law), between _REFILLS and _REFILLS_MAX. The caller holds the lock."""
        demand = sum(self._latency / max(s.interval, 1e-3) for s in self._shelves.values()
                     if s.interval is not None)
        return max(_REFILLS, min(_REFILLS_MAX, math.ceil(demand)))

    def _affordable(self, held: list[tuple[dict[str, float], int]],
                    bundle: Mapping[str, float]) -> bool:
        """Whether one more ``bundle`` keeps the stock within its share of the node."""
        for res, amount in bundle.items():
            total = amount + sum(b.get(res, 0.0) * n for b, n in held)
            if amount > 0 and total > self._budget.get(res, 0.0) + 1e-9:
                return False
        return True

    def _refill(self, shelf: _Shelf) -> None:
        try:
            self._boot_one(shelf)
        finally:
            with self._lock:
                shelf.booting -= 1
                self._booting -= 1
                self._lock.notify_all()

    def _boot_one(self, shelf: _Shelf) -> None:
        t0 = time.monotonic()
        try:
            pg_hex = self._blocks.take(shelf.bundle, 1)[0]
        except CapacityError:
            shelf.retry_at = time.monotonic() + _RETRY_S  # the node is full: real demand first
            shelf.held = True
            return
        try:
            sid = self._rt.create(shelf.config.model_copy(
                update={"labels": {PG_LABEL: pg_hex, STOCK_LABEL: "1"}}))
        except SandboxError as exc:
            self._blocks.give(pg_hex)
            shelf.retry_at = time.monotonic() + _RETRY_S
            log.warning("stock refill failed; next try in %gs: %s", _RETRY_S, exc)
            return
        try:
            self._rt.ping(sid)  # the first call's connection, made now instead of then
        except SandboxError:
            self._discard([(sid, pg_hex)])
            return
        with self._lock:
            keep = not self._closed and any(s is shelf for s in self._shelves.values())
            if keep:
                shelf.ready.append((sid, pg_hex))
                shelf.held = False
            # the quiet gap creates leave before a refill starts is part of its latency
            took = time.monotonic() - t0 + REFILL_QUIET_S
            self._latency = _RATE_MEMORY * took + (1 - _RATE_MEMORY) * self._latency
        if not keep:
            self._discard([(sid, pg_hex)])
        self._publish()

    def _shrink(self) -> None:
        """Shelves idle for the idle time hold one less and forget their demand; empty idle
        ones go."""
        now = time.monotonic()
        gone: list[tuple[str, str]] = []
        with self._lock:
            for key, shelf in list(self._shelves.items()):
                if now - shelf.last_take < self._idle_s:
                    continue
                shelf.last_take = now
                shelf.interval = None
                shelf.target = max(0, max(shelf.target, len(shelf.ready)) - 1)
                while len(shelf.ready) > shelf.target:
                    gone.append(shelf.ready.pop())
                if not shelf.target:
                    del self._shelves[key]
        self._discard(gone)

    def _give_back(self) -> None:
        """Under memory pressure: delete one stocked sandbox (the fullest shelf's newest),
        a tick at a time, until the node has its floor of memory free again."""
        with self._lock:
            shelves = [s for s in self._shelves.values() if s.ready]
            for s in self._shelves.values():
                s.held = True
            gone = [max(shelves, key=lambda s: len(s.ready)).ready.pop()] if shelves else []
        self._discard(gone)

    def _discard(self, items: list[tuple[str, str]]) -> None:
        for sid, pg_hex in items:
            try:
                self._rt.delete(sid)
            except SandboxError as exc:
                log.warning("deleting stocked sandbox %s failed: %s", sid, exc)
            self._blocks.give(pg_hex)
        if items:
            self._publish()

    def _publish(self) -> None:
        metrics.set_stock(self._node_id, self.stats()["stocked"])


def _memory_short(floor: int) -> bool:
    """Whether the node has less memory available than the stock leaves free: the larger of
    ``floor`` and _MEM_FLOOR_SHARE of its memory (``/proc/meminfo``)."""
    info: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("MemTotal", "MemAvailable"):
                    info[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return False
    if len(info) < 2:
        return False
    return info["MemAvailable"] < max(floor, _MEM_FLOOR_SHARE * info["MemTotal"])


def _env_number(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def _node_resources(node_id: str) -> dict[str, float]:
    """What the node gives Ray, by resource (one GCS read when the host starts)."""
    for n in ray.nodes():
        if n.get("NodeID") == node_id:
            return {k: float(v) for k, v in n.get("Resources", {}).items()}
    return {}
