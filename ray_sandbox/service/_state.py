"""The books every replica of one service shares: creates in flight and failed, the quota
ledger, exec results, which streamed exec runs where, kept snapshots and filesystem images,
and recent deletes.

With one replica they are a plain object in it; with more, one named, detached Ray actor
per service app holds them (``ray_sandbox_service_state:<app>:v<version>``, zero CPUs,
restarted by Ray), and every replica calls it with a bound (``state_timeout``): an actor
that does not answer is a 503, never a hang. :class:`Books` is plain data and asyncio only
(its waits are events), so the same code runs in both places. Every table is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import ray
from pydantic import BaseModel, ConfigDict
from ray.exceptions import RayError

from . import _errors
from ._config import Quota, ServiceConfig
from ._quota import Charge, over_quota

log = logging.getLogger(__name__)

NAMESPACE = "ray_sandbox_service"
UNSEEDED = "unseeded"  # admit's answer when the books do not know the tenant's sandboxes yet
STATE_CONCURRENCY = 4096  # long polls wait inside the actor, one slot each
MAX_SANDBOXES = 1024  # a tenant's sandboxes whose exec results are kept (LRU evicted)
MAX_TOMBSTONES = 4096  # recent deletes, so every replica answers 404 for them
MAX_STREAMS = 4096  # streamed execs findable by another replica (a replica caps its own)
GRACE = 60.0  # a create or exec past its own bound by this much lost its replica
BOOKS_VERSION = 3  # raise it with every change to Books' methods or their meaning
SNAPSHOT, FS_IMAGE = "snapshot", "filesystem image"  # the kinds of things a tenant keeps


class Bounds(BaseModel):
    """What the books are held to (from ServiceConfig; no tokens cross to the actor)."""

    model_config = ConfigDict(frozen=True)

    max_execs_per_sandbox: int
    max_errored: int
    max_snapshots: int
    max_fs_images: int
    create_timeout: float
    max_running_execs_per_tenant: int
    max_result_bytes_per_tenant: int

    @classmethod
    def of(cls, config: ServiceConfig) -> Bounds:
        return cls(**{k: getattr(config, k) for k in cls.model_fields})

    def limit(self, kind: str) -> int:
        """How many of ``kind`` (SNAPSHOT, FS_IMAGE) one tenant keeps."""
        return self.max_snapshots if kind == SNAPSHOT else self.max_fs_images


@dataclass(eq=False)
class Create:
    """A create accepted by some replica and not finished, or failed."""

    tenant: str
    info: dict[str, Any]  # image, labels, cpu, memory, created_at: what GET shows
    deadline: float
    error: str | None = None
    deleted: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(eq=False)
class Held:
    """One sandbox's charge in the ledger; ``settled`` is the epoch its create finished in
    (None while it is being made: never dropped by a reconcile)."""

    charge: Charge
    settled: int | None


@dataclass(eq=False)
class ExecRecord:
    tenant: str
    deadline: float
    info: dict[str, Any] | None = None  # ExecInfo's fields once finished
    size: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)


class Books:
    """The shared state; every method is one atomic step (no await between a check and its
    change), so two replicas cannot both pass a check that only one may."""

    def __init__(self, bounds: Bounds) -> None:
        self._b = bounds
        self._creates: OrderedDict[str, Create] = OrderedDict()
        self._ledger: dict[str, dict[str, Held]] = {}  # tenant -> key -> held
        self._epoch = 0
        # Exec results, all per tenant: what one tenant runs or keeps never evicts another's
        self._execs: OrderedDict[str, OrderedDict[str, ExecRecord]] = OrderedDict()
        self._sandboxes: dict[str, OrderedDict[str, None]] = {}  # tenant -> its, LRU
        self._finished: dict[str, OrderedDict[tuple[str, str], int]] = {}  # for the byte cap
        self._bytes: dict[str, int] = {}
        self._running: dict[str, int] = {}  # tenant -> execs running, streamed ones included
        self._streams: OrderedDict[tuple[str, str], tuple[str, str]] = OrderedDict()
        self._kept: dict[tuple[str, str], OrderedDict[str, dict[str, Any]]] = {}
        self._tombstones: OrderedDict[str, None] = OrderedDict()
        self._leases: dict[str, tuple[str, float]] = {}  # key -> holder, until

    # --- creates and the quota ---------------------------------------------------------------

    async def admit(self, tenant: str, quota: dict[str, Any], keys: list[str], cpu: float,
                    memory: int, pending: dict[str, Any] | None = None) -> str | None:
        """Charge ``keys`` (one sandbox each) if they fit the tenant's quota: None, or why
        not (``UNSEEDED``: look the tenant's sandboxes up and ``reconcile`` first).
        ``pending`` makes the one key a create others see as pending."""
        held = self._ledger.get(tenant)
        if held is None:
            return UNSEEDED
        charges = [h.charge for h in held.values()]
        cost = Charge(cpu, memory)
        for _ in keys:
            reason = over_quota(Quota.model_validate(quota), charges, cost)
            if reason is not None:
                return reason
            charges.append(cost)
        for key in keys:
            held[key] = Held(cost, None)
        if pending is not None:
            self._creates[keys[0]] = Create(tenant, pending,
                                            time.time() + self._b.create_timeout + GRACE)
        return None

    async def epoch(self) -> int:
        return self._epoch

    async def reconcile(self, tenant: str, live: dict[str, tuple[float, int]],
                        epoch: int) -> None:
        """The tenant's sandboxes the hosts list (``live``, looked up after ``epoch``) are
        charged; a charge of one not listed is dropped if its create finished before the
        look began (a host ended it: TTL, death), kept if still being made or made since."""
        self._expire_creates()
        held = self._ledger.setdefault(tenant, {})
        for key, h in list(held.items()):
            if key not in live and h.settled is not None and h.settled <= epoch:
                del held[key]
        for key, (cpu, memory) in live.items():
            held.setdefault(key, Held(Charge(cpu, memory), self._epoch))

    async def settle(self, tenant: str, keys: list[str], ids: list[str]) -> None:
        """Copies were made: their placeholder charges become their ids'."""
        held = self._ledger.get(tenant, {})
        self._epoch += 1
        for key, sid in zip(keys, ids, strict=False):
            h = held.pop(key, None)
            if h is not None:
                held[sid] = Held(h.charge, self._epoch)

    async def release(self, tenant: str, keys: list[str]) -> None:
        held = self._ledger.get(tenant, {})
        for key in keys:
            held.pop(key, None)

    async def created(self, api_id: str, error: str | None) -> bool:
        """A create finished (or failed, with ``error``); True if a delete came meanwhile,
        so the replica that made it ends it."""
        rec = self._creates.get(api_id)
        self._epoch += 1
        if rec is None:  # expired, or the books restarted: a reconcile counts it again
            return api_id in self._tombstones
        held = self._ledger.get(rec.tenant, {})
        deleted = rec.deleted
        if error is None or deleted:
            del self._creates[api_id]
        if error is not None:
            held.pop(api_id, None)
            rec.error = error
            self._trim_errors(rec.tenant)
        elif api_id in held:
            held[api_id].settled = self._epoch
        rec.done.set()
        return deleted

    def _trim_errors(self, tenant: str) -> None:
        failed = [k for k, c in self._creates.items() if c.tenant == tenant and c.error]
        for k in failed[:max(0, len(failed) - self._b.max_errored)]:
            del self._creates[k]

    def _expire_creates(self) -> None:
        """A create whose replica went away never reports: past its bound it failed."""
        now = time.time()
        for key, rec in list(self._creates.items()):
            if rec.error is None and rec.deadline < now:
                rec.error = "unavailable: the replica making it went away"
                self._ledger.get(rec.tenant, {}).pop(key, None)
                rec.done.set()
                self._trim_errors(rec.tenant)

    async def create_record(self, tenant: str, api_id: str,
                            wait: float = 0.0) -> dict[str, Any] | None:
        """The tenant's create of ``api_id`` if pending or failed (None: finished, deleted,
        unknown or another tenant's), waiting up to ``wait`` s for a pending one to end."""
        rec = self._creates.get(api_id)
        if rec is None or rec.tenant != tenant or rec.deleted:
            return None
        if rec.error is None and wait > 0:
            try:
                await asyncio.wait_for(rec.done.wait(), min(wait, rec.deadline - time.time()))
            except TimeoutError:
                pass
        self._expire_creates()
        if rec.deleted or (rec.error is None and rec.done.is_set()):
            return None
        return {**rec.info, "sandbox_id": api_id, "error": rec.error}

    async def creates(self, tenant: str) -> list[dict[str, Any]]:
        """The tenant's creates pending or failed, for a listing."""
        self._expire_creates()
        return [{**c.info, "sandbox_id": k, "error": c.error}
                for k, c in self._creates.items() if c.tenant == tenant and not c.deleted]

    async def delete_create(self, tenant: str, api_id: str, wait: float = 0.0) -> str | None:
        """Delete a create that is pending (its replica ends it once made: ``"pending"``,
        after waiting up to ``wait`` s for that) or failed (forgotten: ``"error"``); None if
        the books have no such create."""
        rec = self._creates.get(api_id)
        if rec is None or rec.tenant != tenant:
            return None
        self._tomb(api_id)
        if rec.error is not None:
            del self._creates[api_id]
            return "error"
        rec.deleted = True
        if wait > 0:
            try:
                await asyncio.wait_for(rec.done.wait(), wait)
            except TimeoutError:
                pass
        return "pending"

    async def gone(self, tenant: str, api_id: str) -> None:
        """A sandbox was deleted: its charge, exec results and streams go, and every replica
        answers 404 for it from now on."""
        self._ledger.get(tenant, {}).pop(api_id, None)
        self._tomb(api_id)
        self._forget_sandbox(api_id)
        for key in [k for k in self._streams if k[0] == api_id]:
            self._end_stream(key)

    async def was_deleted(self, api_id: str) -> bool:
        return api_id in self._tombstones

    def _tomb(self, api_id: str) -> None:
        self._tombstones[api_id] = None
        self._tombstones.move_to_end(api_id)
        while len(self._tombstones) > MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)

    # --- execs -----------------------------------------------------------------------------

    async def exec_started(self, tenant: str, api_id: str, exec_id: str,
                           timeout: float) -> str | None:
        """Record a running exec (None), or why there is no room: the tenant runs
        ``max_running_execs_per_tenant`` already, or the sandbox's last
        ``max_execs_per_sandbox`` are all running (else the oldest finished one is
        evicted)."""
        reason = self._over_running(tenant)
        if reason is not None:
            return reason
        execs = self._execs.setdefault(api_id, OrderedDict())
        self._execs.move_to_end(api_id)
        if len(execs) >= self._b.max_execs_per_sandbox:
            done = next((k for k, x in execs.items() if x.info is not None), None)
            if done is None:
                return (f"{len(execs)} execs are running in this sandbox, its limit; wait for "
                        "one to finish")
            self._evict(api_id, done)
        execs[exec_id] = ExecRecord(tenant, time.time() + timeout + GRACE)
        self._running[tenant] = self._running.get(tenant, 0) + 1
        mine = self._sandboxes.setdefault(tenant, OrderedDict())
        mine[api_id] = None
        mine.move_to_end(api_id)
        while len(mine) > MAX_SANDBOXES:
            self._forget_sandbox(next(iter(mine)))
        return None

    def _over_running(self, tenant: str) -> str | None:
        limit = self._b.max_running_execs_per_tenant
        if self._running.get(tenant, 0) >= limit:
            self._expire_execs(tenant)  # those whose replica went away count no more
        if self._running.get(tenant, 0) >= limit:
            return (f"{self._running[tenant]} execs of this tenant are running, its limit "
                    "(max_running_execs_per_tenant); wait for one to finish")
        return None

    def _expire_execs(self, tenant: str) -> None:
        now = time.time()
        for api_id in list(self._sandboxes.get(tenant, ())):
            for ex_id, rec in list(self._execs.get(api_id, {}).items()):
                if rec.info is None and rec.deadline < now:
                    self._evict(api_id, ex_id)

    def _forget_sandbox(self, api_id: str) -> None:
        for ex_id in list(self._execs.get(api_id, ())):
            self._evict(api_id, ex_id)
        self._execs.pop(api_id, None)
        for mine in self._sandboxes.values():
            mine.pop(api_id, None)

    async def exec_finished(self, api_id: str, exec_id: str, info: dict[str, Any]) -> None:
        rec = self._execs.get(api_id, {}).get(exec_id)
        if rec is None or rec.info is not None:  # evicted or deleted meanwhile
            return
        self._running[rec.tenant] -= 1
        rec.info = info
        rec.size = sum(len(info.get(k) or "") for k in ("stdout", "stderr"))
        rec.done.set()
        finished = self._finished.setdefault(rec.tenant, OrderedDict())
        finished[(api_id, exec_id)] = rec.size
        self._bytes[rec.tenant] = self._bytes.get(rec.tenant, 0) + rec.size
        while self._bytes[rec.tenant] > self._b.max_result_bytes_per_tenant and finished:
            (sid, ex_id), _ = next(iter(finished.items()))
            self._evict(sid, ex_id)

    def _evict(self, api_id: str, exec_id: str) -> None:
        rec = self._execs.get(api_id, {}).pop(exec_id, None)
        if rec is None:
            return
        if rec.info is None:
            self._running[rec.tenant] -= 1
            rec.done.set()  # a waiter reads it gone
        else:
            size = self._finished.get(rec.tenant, {}).pop((api_id, exec_id), 0)
            self._bytes[rec.tenant] = self._bytes.get(rec.tenant, 0) - size

    async def exec_record(self, tenant: str, api_id: str, exec_id: str,
                          wait: float = 0.0) -> dict[str, Any] | None:
        """The tenant's exec as ExecInfo's fields (None: unknown, evicted or another
        tenant's), waiting up to ``wait`` s while it runs."""
        rec = self._execs.get(api_id, {}).get(exec_id)
        if rec is None or rec.tenant != tenant:
            return None
        if rec.info is None and wait > 0:
            try:
                await asyncio.wait_for(rec.done.wait(), wait)
            except TimeoutError:
                pass
        if rec.info is not None:
            return rec.info
        if time.time() > rec.deadline:  # its replica went away before it could report
            return {"exec_id": exec_id, "status": "failed", "error": {
                "code": "unavailable", "message": "the replica running it went away"}}
        return {"exec_id": exec_id, "status": "running"}

    async def stream_started(self, tenant: str, api_id: str, exec_id: str,
                             key: str) -> str | None:
        """Record a running streamed exec (None), or why not (the tenant's running execs)."""
        reason = self._over_running(tenant)
        if reason is not None:
            return reason
        self._streams[(api_id, exec_id)] = (tenant, key)
        self._running[tenant] = self._running.get(tenant, 0) + 1
        while len(self._streams) > MAX_STREAMS:
            self._end_stream(next(iter(self._streams)))
        return None

    async def stream_ended(self, api_id: str, exec_id: str) -> None:
        self._end_stream((api_id, exec_id))

    def _end_stream(self, key: tuple[str, str]) -> None:
        found = self._streams.pop(key, None)
        if found is not None:
            self._running[found[0]] -= 1

    async def stream_key(self, tenant: str, api_id: str, exec_id: str) -> str | None:
        """The host's process key of a running streamed exec of the tenant, so any replica
        can signal or cancel it through the sandbox's handle."""
        found = self._streams.get((api_id, exec_id))
        return found[1] if found is not None and found[0] == tenant else None

    # --- leases ----------------------------------------------------------------------------

    async def lease(self, key: str, holder: str, ttl: float) -> bool:
        """Hold ``key`` for ``holder`` for ``ttl`` s (True) unless someone else holds it: a
        check-then-act on the hosts (a tenant's volume count) done by one replica at a time.
        Keys are per tenant and expire, so the table stays bounded."""
        now = time.time()
        for k in [k for k, (_, until) in self._leases.items() if until < now]:
            del self._leases[k]
        held = self._leases.get(key)
        if held is not None and held[0] != holder:
            return False
        self._leases[key] = (holder, now + ttl)
        return True

    async def unlease(self, key: str, holder: str) -> None:
        if self._leases.get(key, ("", 0.0))[0] == holder:
            del self._leases[key]

    # --- what tenants keep: snapshots and filesystem images --------------------------------

    async def keep(self, kind: str, tenant: str, key: str, kept: dict[str, Any]) -> str | None:
        """Keep a snapshot or a filesystem image (``kind``) for the tenant (None), or why
        not: the tenant's limit of that kind is reached."""
        mine = self._kept.setdefault((kind, tenant), OrderedDict())
        if len(mine) >= self._b.limit(kind):
            return f"{len(mine)} {kind}s kept, the limit; delete one"
        mine[key] = kept
        return None

    async def kept_keys(self, kind: str, tenant: str) -> list[str]:
        return list(self._kept.get((kind, tenant), {}))

    async def kept(self, kind: str, tenant: str, key: str) -> dict[str, Any] | None:
        return self._kept.get((kind, tenant), {}).get(key)

    async def drop(self, kind: str, tenant: str, key: str) -> dict[str, Any] | None:
        return self._kept.get((kind, tenant), {}).pop(key, None)


class Shared:
    """The replica's way to the books: in-process, or the state actor with a bound on each
    call (unreachable or too slow: 503 ``unavailable``)."""

    def __init__(self, books: Books | None = None, actor: Any = None,
                 timeout: float = 10.0) -> None:
        self._books = books
        self._actor = actor
        self._timeout = timeout

    async def __call__(self, method: str, *args: Any, wait: float = 0.0) -> Any:
        if self._books is not None:
            return await getattr(self._books, method)(*args)
        ref = getattr(self._actor, method).remote(*args)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()),
                                          self._timeout + wait)
        except (RayError, TimeoutError) as exc:
            log.warning("the service's state actor failed on %s: %s", method, exc)
            raise _errors.refusal(503, "the service's shared state did not answer; retry "
                                       "shortly") from None


def actor_name(app: str) -> str:
    # versioned: replicas of a new release must not call an older release's books (an in-place
    # RayService upgrade keeps the detached actor), whose methods may differ
    return f"{_actor_prefix(app)}{BOOKS_VERSION}"


def _actor_prefix(app: str) -> str:
    return f"ray_sandbox_service_state:{app}:v"


def connect(config: ServiceConfig, app: str | None) -> Shared:
    """The books of the service app ``app``: in-process for one replica, else its state
    actor, made by whichever replica comes first (the others get the same one)."""
    if config.num_replicas == 1 or app is None:
        return Shared(books=Books(Bounds.of(config)))
    actor = ray.remote(Books).options(
        name=actor_name(app), namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
        num_cpus=0, max_restarts=-1, max_concurrency=STATE_CONCURRENCY,
    ).remote(Bounds.of(config))
    return Shared(actor=actor, timeout=config.state_timeout)


def disconnect(app: str) -> None:
    """End the state actor of ``app`` (it is detached: nothing else ends it)."""
    for info in ray.util.list_named_actors(all_namespaces=True):  # older releases' too
        name = info.get("name", "")
        if info.get("namespace") == NAMESPACE and name.startswith(_actor_prefix(app)):
            with contextlib.suppress(ValueError):  # gone meanwhile
                ray.kill(ray.get_actor(name, namespace=NAMESPACE))
