"""SandboxPool: warm sandboxes per template, served to rollouts without create latency.

A small public proxy over a private pool actor (the ``ray.util.queue`` shape): ``acquire``
hands out a warm sandbox (or creates one on a miss), ``release`` recycles it (deleted and
replaced by a fresh one, so no state leaks between users) and a background thread keeps
``size`` sandboxes warm. ``map`` runs a function over items, one sandbox per item. Warm
sandboxes that are lost (their node or host died, their TTL ran out) are dropped from stock
within a second or two and replaced.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import ray

from ..runtime.errors import SandboxError
from . import metrics
from .admission import admit
from .api import create_from_template
from .handle import SandboxHandle
from .template import SandboxTemplate, make_template

_BATCH_MAX = 64  # sandboxes asked for in one replenishment round
_ROOM_WAIT_S = 10.0  # a full cluster: wait this long (pending demand), then ask again
_PRUNE_INTERVAL = 1.0

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class _PoolActor:
    def __init__(self, template: SandboxTemplate, size: int, max_size: int | None) -> None:
        self.template = template
        self.size = size
        self.max_size = max_size
        self._warm: list[SandboxHandle] = []
        self._out: set[SandboxHandle] = set()
        self._lock = threading.Condition()
        self._closed = False
        self._creating = 0
        self.hits = 0
        self.misses = 0
        self._workers = [
            threading.Thread(target=self._replenish, name="pool-replenish", daemon=True),
            threading.Thread(target=self._prune_loop, name="pool-prune", daemon=True),
        ]
        for t in self._workers:
            t.start()

    def _replenish(self) -> None:
        """Keeps ``size`` sandboxes warm. Each shortfall is created as one batch, all in
        flight at once (one call per node, into the hosts' blocks): one create at a time
        warmed ~2 sandboxes/s per pool."""
        while True:
            with self._lock:
                while not self._closed and len(self._warm) + self._creating >= self.size:
                    self._lock.wait(timeout=1.0)
                if self._closed:
                    return
                want = min(self.size - len(self._warm) - self._creating, _BATCH_MAX)
                self._creating += want
            try:
                results = admit(self.template, want, timeout=_ROOM_WAIT_S)
            except Exception as exc:  # noqa: BLE001 - e.g. a node died mid-call: retry
                log.warning("pool replenishment failed: %s", exc)
                results = []
            made = [r for r in results if isinstance(r, SandboxHandle)]
            with self._lock:
                self._creating -= want
                closed = self._closed
                if not closed:
                    self._warm.extend(made)
                self._lock.notify_all()
            if closed:  # close() ran while these were being created
                ray.get([sb.terminate.remote() for sb in made])
                return
            if len(made) < want:
                errors = [r for r in results if not isinstance(r, SandboxHandle)]
                log.warning("pool: %d of %d sandboxes not created (%s); retrying",
                            want - len(made), want, errors[0] if errors else "no result")
                time.sleep(1.0)  # e.g. cluster full: try again later

    def _prune_loop(self) -> None:
        while True:
            with self._lock:
                if self._lock.wait_for(lambda: self._closed, timeout=_PRUNE_INTERVAL):
                    return
            self._prune()

    def _prune(self) -> None:
        """Drop warm sandboxes their host no longer runs (one ``list`` call per host)."""
        with self._lock:
            warm = list(self._warm)
        by_host: dict[Any, list[SandboxHandle]] = {}
        for sb in warm:
            by_host.setdefault(sb._host, []).append(sb)
        lost: set[SandboxHandle] = set()
        for host, sbs in by_host.items():
            try:
                live = {sid for sid, _ in ray.get(host.list.remote(None), timeout=30)}
            except ray.exceptions.RayActorError:
                live = set()  # the host or its node died: so did its sandboxes
            except ray.exceptions.GetTimeoutError:
                continue  # busy, not dead
            lost.update(sb for sb in sbs if sb.sandbox_id not in live)
        if not lost:
            return
        log.warning("pool: %d warm sandboxes were lost; replacing them", len(lost))
        with self._lock:
            self._warm = [sb for sb in self._warm if sb not in lost]
            self._lock.notify_all()
        for sb in lost:  # best effort: most are gone already
            sb.terminate.remote()

    def acquire(self) -> SandboxHandle:
        with self._lock:
            if self.max_size is not None and len(self._out) >= self.max_size:
                raise SandboxError(f"pool exhausted: {len(self._out)} sandboxes out")
            sb = self._warm.pop() if self._warm else None
            self._lock.notify_all()
        hit = sb is not None
        metrics.count_acquire(hit)
        if sb is None:
            sb = create_from_template(self.template)
        with self._lock:
            self._out.add(sb)
            if hit:
                self.hits += 1
            else:
                self.misses += 1
        return sb

    def release(self, sb: SandboxHandle) -> None:
        with self._lock:
            self._out.discard(sb)
        try:
            ray.get(sb.terminate.remote())
        except Exception:  # noqa: BLE001 - already gone (node died): replenishment replaces it
            pass

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"warm": len(self._warm), "out": len(self._out), "hits": self.hits,
                    "misses": self.misses}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            victims = self._warm + list(self._out)
            self._warm, self._out = [], set()
            self._lock.notify_all()
        refs = [sb.terminate.remote() for sb in victims]
        if refs:
            ray.get(refs)
        for t in self._workers:  # in-flight creates delete their sandbox themselves
            t.join()


class SandboxPool:
    """Warm sandboxes from one template.

    >>> pool = SandboxPool(image="ray-sandbox/python", size=8, cpu=0.5, memory="256Mi")
    >>> sb = pool.acquire()
    >>> ray.get(sb.exec.remote("python3 -c 'print(1)'")).stdout
    >>> pool.release(sb)
    """

    def __init__(self, template: SandboxTemplate | None = None, *, size: int = 4,
                 max_size: int | None = None, actor_options: dict | None = None,
                 **kwargs: Any) -> None:
        t = make_template(template, **kwargs)
        opts = {"num_cpus": 0, "max_concurrency": 256, **(actor_options or {})}
        self._size = size
        self._actor = ray.remote(_PoolActor).options(**opts).remote(t, size, max_size)

    def acquire(self) -> SandboxHandle:
        return ray.get(self._actor.acquire.remote())

    def release(self, sb: SandboxHandle) -> None:
        ray.get(self._actor.release.remote(sb))

    def stats(self) -> dict[str, int]:
        return ray.get(self._actor.stats.remote())

    def wait_warm(self, n: int | None = None, timeout: float = 120.0) -> None:
        """Block until ``n`` (default: size) sandboxes are warm."""
        deadline = time.monotonic() + timeout
        want = self._size if n is None else n
        while self.stats()["warm"] < want:
            if time.monotonic() > deadline:
                raise TimeoutError(f"pool did not warm {want} sandboxes in {timeout}s")
            time.sleep(0.1)

    def map(self, fn: Callable[[SandboxHandle, T], R], items: Iterable[T], *,
            concurrency: int = 8) -> Iterator[R]:
        """``fn(sandbox, item)`` for each item (in order), each in its own pooled sandbox,
        ``concurrency`` at a time (threads on the caller)."""
        def one(item: T) -> R:
            sb = self.acquire()
            try:
                return fn(sb, item)
            finally:
                self.release(sb)

        with ThreadPoolExecutor(max_workers=concurrency) as ex:
            yield from ex.map(one, items)

    def close(self) -> None:
        """Delete every sandbox of the pool and stop it."""
        try:
            ray.get(self._actor.close.remote())
        finally:
            ray.kill(self._actor)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
