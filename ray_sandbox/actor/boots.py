"""How one host brings sandboxes up in its node's blocks: a stocked sandbox handed out
(made the caller's), or a fresh boot in a slot, at most ``BOOT_PARALLEL`` at once; and the
free slots the host advertises to callers that route creates (``routing.py``)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..runtime import SandboxRuntime
from ..runtime.config import SandboxConfig
from ..runtime.errors import CapacityError, SandboxError
from . import metrics
from .blocks import Blocks, Shape
from .labels import NAME_LABEL
from .placement import PG_LABEL
from .stock import Stock
from .transfer import ImageImports

BOOT_PARALLEL = 16  # sandboxes booting at once on one host; more only queue in the kernel

log = logging.getLogger(__name__)


def labels_of(config: SandboxConfig, pg_hex: str, name: str | None) -> dict[str, str]:
    """A sandbox's labels: its caller's, its reservation and its name."""
    labels = {**config.labels, PG_LABEL: pg_hex}
    if name:
        labels[NAME_LABEL] = name
    return labels


class Boots:
    """The create side of one host: stock hand-outs, boots in slots, advertised room."""

    def __init__(self, rt: SandboxRuntime, blocks: Blocks, stock: Stock,
                 images: ImageImports, start_host: Callable[..., Any]) -> None:
        self._rt = rt
        self._blocks = blocks
        self._stock = stock
        self._images = images
        self._start_host = start_host
        self._parallel = threading.BoundedSemaphore(BOOT_PARALLEL)

    def slots(self, bundle: Mapping[str, float], k: int) -> list[str]:
        """Up to ``k`` block slots; stocked sandboxes of the shape give theirs up to real
        demand when the node has no other room."""
        slots: list[str] = []
        for _ in range(2):
            if len(slots) == k:
                break
            try:
                slots += self._blocks.take(bundle, k - len(slots))
            except CapacityError:
                pass
            if len(slots) < k and not self._stock.evict(bundle, k - len(slots)):
                break
        return slots

    def advertised(self) -> dict[Shape, int]:
        """Free slots per shape, a stocked sandbox counted as one (it yields its slot)."""
        free = self._blocks.free_slots()
        for shape, n in self._stock.shapes().items():
            free[shape] = free.get(shape, 0) + n
        return free

    def hand_out(self, sid: str, config: SandboxConfig, pg_hex: str, name: str | None) -> str:
        """A stocked sandbox becomes the caller's; one that cannot be is deleted and the
        caller gets a fresh boot in its slot."""
        try:
            self._rt.personalize(sid, config.model_copy(
                update={"labels": labels_of(config, pg_hex, name)}))
            return sid
        except SandboxError as exc:
            log.warning("stocked sandbox %s could not be handed out (%s); booting anew",
                        sid, exc)
            self._stock.missed("handout")
            try:
                self._rt.delete(sid)
            except SandboxError:
                pass
            return self._boot(config, pg_hex, name)

    def boot(self, config: SandboxConfig, pg_hex: str, name: str | None) -> str:
        """A sandbox in ``pg_hex``: a block slot the stock had none for, or the caller's own
        reservation (no block had room), which a stocked sandbox of the same boot serves
        too (its slot goes back to the blocks)."""
        if not self._blocks.owns(pg_hex) and (got := self._stock.take_any(config)):
            sid, slot = got
            self._blocks.give(slot)
            return self.hand_out(sid, config, pg_hex, name)
        return self._boot(config, pg_hex, name)

    def _boot(self, config: SandboxConfig, pg_hex: str, name: str | None) -> str:
        labels = labels_of(config, pg_hex, name)
        t0 = time.perf_counter()
        if config.image:  # a filesystem image from another node is fetched first
            image = self._images.local_ref(config.image, self._start_host)
            config = config.model_copy(update={"image": image})
        with self._parallel:
            sid = self._rt.create(config.model_copy(update={"labels": labels}), detach=False)
        metrics.observe_create(time.perf_counter() - t0)
        return sid
