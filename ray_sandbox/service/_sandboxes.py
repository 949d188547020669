"""The sandboxes of every tenant, as the service sees them: created through the Ray layer
(``ray_sandbox.actor``), found again by their labels, and their execs' results.

A sandbox's API id is its Ray-layer name (``create(name=...)``), made before the create
starts so ``POST`` can answer at once; its tenant and charge are labels on it, so a restarted
replica adopts what its predecessor made. Used from the replica's event loop only; calls that
block (create, listing) run in a bounded set of threads.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import anyio.to_thread

from .. import actor
from ..runtime.config import SandboxConfig
from ..runtime.errors import SandboxError, SandboxNotFoundError
from ..runtime.results import ExecResult, SandboxState
from . import _errors, _pty, _streams
from ._config import ServiceConfig
from ._models import ExecInfo, SandboxInfo
from ._quota import Charge, charge, over_quota
from ._volumes import TenantVolumes

log = logging.getLogger(__name__)

LABEL_PREFIX = "ray-sandbox/"  # the Ray layer's and this service's labels; callers' may not
TENANT_LABEL = "ray-sandbox/service-tenant"
CPU_LABEL = "ray-sandbox/service-cpu"
MEMORY_LABEL = "ray-sandbox/service-memory"
PORTS_LABEL = "ray-sandbox/service-ports"  # its published ports, for port URLs after adoption
ID_RE = re.compile(r"^[0-9a-f]{32}$")


@dataclass(eq=False)
class Exec:
    exec_id: str
    future: asyncio.Future[ExecResult]


@dataclass(eq=False)
class Entry:
    """One sandbox of one tenant: being created, running, or failed to create."""

    api_id: str
    tenant: str
    charge: Charge
    image: str
    labels: dict[str, str]
    created_at: float | None
    ports: tuple[int, ...] = ()
    handle: Any = None  # SandboxHandle once made
    creating: asyncio.Task[None] | None = None
    error: str | None = None
    deleted: bool = False
    execs: OrderedDict[str, Exec] = field(default_factory=OrderedDict)
    streams: dict[str, _streams.Stream] = field(default_factory=dict)


@dataclass(eq=False)
class Kept:
    """A snapshot the service took for a tenant, and the sandbox it was taken from."""

    tenant: str
    snapshot: Any  # ray_sandbox.actor.Snapshot
    source: Entry


def user_labels(labels: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in labels.items() if not k.startswith(LABEL_PREFIX)}


class Sandboxes:
    """Every tenant's sandboxes in one replica."""

    def __init__(self, config: ServiceConfig) -> None:
        self._config = config
        self._entries: dict[str, Entry] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._threads = anyio.CapacityLimiter(config.create_threads)
        self._direct = 0  # execs running in threads through handle.run
        self._direct_threads = anyio.CapacityLimiter(max(1, config.direct_exec_threads))
        self._adopted = False
        self._adopting = asyncio.Lock()
        self._streaming = 0
        self._snapshots: dict[str, Kept] = {}
        self.volumes = TenantVolumes(config, self._blocking)

    async def _blocking(self, fn: Any, *args: Any) -> Any:
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._threads)

    # --- finding ---------------------------------------------------------------------------

    async def _adopt(self) -> None:
        """Once per replica: take over the sandboxes an earlier replica made for the tenants
        it serves (found by their tenant label)."""
        if self._adopted:
            return
        async with self._adopting:  # the first requests arrive together
            if self._adopted:
                return
            for tenant in self._config.tokens:
                handles = await self._blocking(actor.list, {TENANT_LABEL: tenant})
                await asyncio.gather(*(self._adopt_one(h) for h in handles))
            self._adopted = True

    async def _adopt_one(self, handle: Any) -> Entry | None:
        # a copy (fork, restore) has no name: its runtime id is its API id
        api_id = handle.name or handle.sandbox_id
        if api_id in self._entries:
            return self._entries[api_id]
        try:
            status = await self.call(handle.status.remote())
        except SandboxNotFoundError:
            return None
        labels = status.labels
        if TENANT_LABEL not in labels:
            return None  # not the service's
        entry = Entry(api_id, labels[TENANT_LABEL],
                      Charge(float(labels.get(CPU_LABEL, 0)), int(labels.get(MEMORY_LABEL, 0))),
                      status.image or "", user_labels(labels),
                      status.created_at.timestamp() if status.created_at else None,
                      ports=tuple(int(p) for p in labels.get(PORTS_LABEL, "").split(",") if p),
                      handle=handle)
        self._entries[entry.api_id] = entry
        return entry

    async def find(self, tenant: str, api_id: str) -> Entry:
        """The tenant's sandbox; anyone else's, or none, is 404 (never 403: an id of another
        tenant must not be told apart from one that does not exist)."""
        await self._adopt()
        entry = self._entries.get(api_id) if ID_RE.match(api_id) else None
        if entry is None and ID_RE.match(api_id):
            # made by another replica since this one adopted: ask the hosts by its labels
            found = [h for h in await self._blocking(actor.list, {TENANT_LABEL: tenant})
                     if api_id in (h.name, h.sandbox_id)]
            entry = await self._adopt_one(found[0]) if found else None
        if entry is None or entry.tenant != tenant or entry.deleted:
            raise _errors.refusal(404, f"no sandbox {api_id!r}")
        return entry

    async def running(self, tenant: str, api_id: str) -> Entry:
        """The tenant's sandbox once its create finished; 409 while pending, the create's
        error once it failed."""
        entry = await self.find(tenant, api_id)
        if entry.creating is not None and not entry.creating.done():
            await asyncio.wait([entry.creating], timeout=self._config.max_wait_seconds)
        if entry.handle is None:
            message = entry.error or "the sandbox is still being created; wait for running"
            raise _errors.refusal(409, message)
        return entry

    # --- create, status, list, delete ------------------------------------------------------

    async def create(self, tenant: str, options: dict[str, Any]) -> Entry:
        """Start a create and return its entry (status pending) without waiting for it."""
        await self._adopt()
        labels = options.get("labels") or {}
        if any(k.startswith(LABEL_PREFIX) for k in labels):
            raise _errors.refusal(400, f"label keys starting with {LABEL_PREFIX!r} are "
                                       "reserved")
        if options.get("network") == "host" and not self._config.allow_host_network:
            raise _errors.refusal(400, "network='host' is not allowed by this service")
        if options.get("volumes"):  # the tenant's own, by the names it gave them
            options = {**options,
                       "volumes": await self.volumes.mounts(tenant, options["volumes"])}
        # the Ray layer's defaults (a writable root capped by a disk) apply, as for create()
        config = actor.make_template(**options).config
        cost = charge(config)
        async with self._locks.setdefault(tenant, asyncio.Lock()):
            await self._check_quota(tenant, cost)
            api_id = secrets.token_hex(16)
            entry = Entry(api_id, tenant, cost, config.image, dict(labels), time.time(),
                          ports=config.expose_ports)
            self._entries[api_id] = entry
        ray_labels = {**labels, TENANT_LABEL: tenant, CPU_LABEL: repr(cost.cpu),
                      MEMORY_LABEL: str(cost.memory),
                      PORTS_LABEL: ",".join(map(str, config.expose_ports))}
        entry.creating = asyncio.ensure_future(self._create(entry, {**options,
                                                                     "labels": ray_labels}))
        return entry

    async def _check_quota(self, tenant: str, cost: Charge, count: int = 1) -> None:
        """429 unless ``count`` more sandboxes of ``cost`` fit the tenant's quota."""
        quota = self._config.quota(tenant)

        def why() -> str | None:
            held = self._charges(tenant)
            for _ in range(count):
                reason = over_quota(quota, held, cost)
                if reason is not None:
                    return reason
                held.append(cost)
            return None

        if why() is None:
            return
        # What a host ended by itself (TTL, death) is still counted here: look again.
        await self._forget_gone(tenant)
        reason = why()
        if reason is not None:
            raise _errors.refusal(429, reason)

    def _charges(self, tenant: str) -> list[Charge]:
        # one deleted while still being made holds its resources until it is made and ended
        return [e.charge for e in self._entries.values() if e.tenant == tenant
                and e.error is None and (not e.deleted or e.handle is None)]

    async def _forget_gone(self, tenant: str) -> None:
        live = {h.name or h.sandbox_id
                for h in await self._blocking(actor.list, {TENANT_LABEL: tenant})}
        for e in list(self._entries.values()):
            if e.tenant == tenant and e.handle is not None and e.api_id not in live:
                del self._entries[e.api_id]

    async def _create(self, entry: Entry, options: dict[str, Any]) -> None:
        try:
            handle = await self._blocking(self._create_blocking, entry.api_id, options)
        except SandboxError as exc:
            entry.error = f"{_errors.code_of(exc)}: {exc.message}"
            self._trim_errors(entry.tenant)
            return
        except Exception as exc:  # a host or Ray failure: the entry must not stay pending
            log.warning("create of %s failed: %s", entry.api_id, exc)
            entry.error = f"unavailable: {exc}"[:2000]
            self._trim_errors(entry.tenant)
            return
        entry.handle = handle
        if entry.deleted:  # deleted while it was being made
            try:
                await self._terminate(entry)
            except Exception as exc:  # nobody awaits this task: say it, the TTL or gc ends it
                log.warning("ending %s, deleted while being made, failed: %s", entry.api_id, exc)

    def _create_blocking(self, api_id: str, options: dict[str, Any]) -> Any:
        # Detached: the service, not the job that happened to start its replica, owns it.
        return actor.create(name=api_id, lifetime="detached",
                            timeout=self._config.create_timeout, **options)

    def _trim_errors(self, tenant: str) -> None:
        failed = [e for e in self._entries.values() if e.tenant == tenant and e.error]
        for e in failed[:max(0, len(failed) - self._config.max_errored)]:
            del self._entries[e.api_id]

    async def info(self, entry: Entry, wait: float = 0.0) -> SandboxInfo:
        """Its status, waiting up to ``wait`` seconds for a pending create to finish."""
        if entry.creating is not None and not entry.creating.done() and wait > 0:
            await asyncio.wait([entry.creating], timeout=min(wait, self._config.max_wait_seconds))
        status, reason = "pending", None
        if entry.error is not None:
            status, reason = "error", entry.error
        elif entry.handle is not None:
            try:
                st = await self.call(entry.handle.status.remote())
                status, reason = _STATES[st.state], st.reason
            except SandboxNotFoundError:
                status, reason = "terminated", "gone"
        return SandboxInfo(sandbox_id=entry.api_id, status=status, reason=reason,
                           image=entry.image, cpu=entry.charge.cpu, memory=entry.charge.memory,
                           labels=entry.labels, created_at=entry.created_at)

    async def list(self, tenant: str, labels: Mapping[str, str]) -> list[SandboxInfo]:
        await self._adopt()
        await self._forget_gone(tenant)
        mine = [e for e in self._entries.values() if e.tenant == tenant and not e.deleted
                and all(e.labels.get(k) == v for k, v in labels.items())]
        return list(await asyncio.gather(*(self.info(e) for e in mine)))

    async def delete(self, tenant: str, api_id: str) -> None:
        """Idempotent: an unknown, already deleted or someone else's id is not an error."""
        try:
            entry = await self.find(tenant, api_id)
        except _errors.HTTPException:
            return
        entry.deleted = True
        for ex in entry.execs.values():
            ex.future.cancel()
        # streamed execs end with their sandbox: their next read fails and closes them
        if entry.creating is not None and not entry.creating.done():
            # _create terminates it once made; waiting (bounded) lets the caller see it gone
            await asyncio.wait([entry.creating], timeout=self._config.max_wait_seconds)
        elif entry.handle is not None:
            await self._terminate(entry)
        elif entry.error is not None:
            self._entries.pop(entry.api_id, None)

    async def _terminate(self, entry: Entry) -> None:
        try:
            await self.call(entry.handle.terminate.remote())
        except SandboxNotFoundError:
            pass
        self._entries.pop(entry.api_id, None)

    async def shutdown(self) -> None:
        """Wait for creates in flight (bounded), so none is left half made."""
        pending = [e.creating for e in self._entries.values()
                   if e.creating is not None and not e.creating.done()]
        if pending:
            await asyncio.wait(pending, timeout=self._config.call_timeout)

    # --- snapshots and copies -------------------------------------------------------------

    async def snapshot(self, entry: Entry) -> str:
        """Snapshot a running sandbox (it keeps running); the tenant's snapshots are bounded."""
        mine = [x for x in self._snapshots.values() if x.tenant == entry.tenant]
        if len(mine) >= self._config.max_snapshots:
            raise _errors.refusal(429, f"{len(mine)} snapshots kept, the limit; delete one")
        snap = await self.call(entry.handle.snapshot.remote())
        self._snapshots[snap.snapshot_id] = Kept(entry.tenant, snap, entry)
        return snap.snapshot_id

    def kept(self, tenant: str, snapshot_id: str) -> Kept:
        kept = self._snapshots.get(snapshot_id)
        if kept is None or kept.tenant != tenant:
            raise _errors.refusal(404, f"no snapshot {snapshot_id!r}")
        return kept

    def snapshots(self, tenant: str) -> list[str]:
        return [k for k, x in self._snapshots.items() if x.tenant == tenant]

    async def delete_snapshot(self, tenant: str, snapshot_id: str) -> None:
        try:
            kept = self.kept(tenant, snapshot_id)
        except _errors.HTTPException:
            return  # idempotent, like a sandbox's delete
        del self._snapshots[snapshot_id]
        await self._blocking(actor.delete_snapshot, kept.snapshot)

    async def restore(self, tenant: str, snapshot_id: str, count: int) -> list[str]:
        """``count`` running copies of a snapshot (all or none), charged like their source."""
        kept = self.kept(tenant, snapshot_id)
        return await self._copies(kept.source, count, partial(
            actor.restore, kept.snapshot, count, timeout=self._config.create_timeout,
            lifetime="detached"))

    async def fork(self, entry: Entry, count: int) -> list[str]:
        """``count`` running copies of a running sandbox."""
        return await self._copies(entry, count, partial(
            actor.fork, entry.handle, count, timeout=self._config.create_timeout,
            lifetime="detached"))

    async def _copies(self, source: Entry, count: int, make: Any) -> list[str]:
        async with self._locks.setdefault(source.tenant, asyncio.Lock()):
            await self._check_quota(source.tenant, source.charge, count)
            # held while the copies are made, so no create slips past the quota meanwhile
            handles = await self._blocking(make)
        ids = []
        for h in handles:
            entry = Entry(h.sandbox_id, source.tenant, source.charge, source.image,
                          dict(source.labels), time.time(), handle=h)
            self._entries[entry.api_id] = entry
            ids.append(entry.api_id)
        return ids

    # --- execs -----------------------------------------------------------------------------

    async def start_exec(self, entry: Entry, command: list[str] | str, **kw: Any) -> Exec:
        """Start a command; its result is kept among the sandbox's last
        ``max_execs_per_sandbox`` (the oldest finished one is evicted, never a running one)."""
        if len(entry.execs) >= self._config.max_execs_per_sandbox:
            done = next((k for k, x in entry.execs.items() if x.future.done()), None)
            if done is None:
                raise _errors.refusal(429, f"{len(entry.execs)} execs are running in this "
                                           "sandbox, its limit; wait for one to finish")
            del entry.execs[done]
        timeout = min(kw.pop("timeout", None) or self._config.max_exec_timeout,
                      self._config.max_exec_timeout)
        kw.update(timeout=timeout, max_output_bytes=self._config.max_output_bytes)
        if self._direct < self._config.direct_exec_threads:
            self._direct += 1  # here, not in the task: a task cancelled unstarted never runs
            future: asyncio.Future[ExecResult] = asyncio.ensure_future(
                self._run_direct(entry.handle, command, kw))
            future.add_done_callback(self._direct_done)
        else:  # every thread busy: no waiting for one, the actor call costs ~2 ms more
            future = asyncio.wrap_future(entry.handle.exec.remote(command, **kw).future())
        ex = Exec(secrets.token_hex(8), future)
        ex.future.add_done_callback(_consume)
        entry.execs[ex.exec_id] = ex
        return ex

    async def _run_direct(self, handle: Any, command: list[str] | str,
                          kw: dict[str, Any]) -> ExecResult:
        """``handle.run`` in a thread: the node-local channel when the sandbox is on this
        replica's node (``actor/channel.py``), else the actor call, blocking. Not abandoned
        when cancelled (a DELETE cancels and does not wait): the thread and its count are
        given back only when the command ends (its timeout, or the sandbox's deletion), so
        their number stays bounded."""
        return await anyio.to_thread.run_sync(partial(handle.run, command, **kw),
                                              limiter=self._direct_threads)

    def _direct_done(self, _: asyncio.Future[ExecResult]) -> None:
        self._direct -= 1

    async def exec_info(self, entry: Entry, exec_id: str, wait: float = 0.0) -> ExecInfo:
        ex = entry.execs.get(exec_id)
        if ex is None:
            raise _errors.refusal(404, f"no exec {exec_id!r} in this sandbox (results are "
                                       f"kept for its last {self._config.max_execs_per_sandbox})")
        if not ex.future.done() and wait > 0:
            await asyncio.wait([ex.future], timeout=min(wait, self._config.max_wait_seconds))
        return exec_info(ex)

    def _take_stream(self) -> None:
        """One of the ``max_streams`` streamed execs and terminals; 429 when none is left."""
        if self._streaming >= self._config.max_streams:
            raise _errors.refusal(429, f"{self._streaming} streamed execs and terminals are "
                                       "running, the service's limit; try again later")
        self._streaming += 1

    async def terminal(self, ws: Any, entry: Entry, command: str, rows: int,
                       cols: int) -> None:
        """An interactive terminal on the WebSocket ``ws`` (``_pty``), counted as a stream."""
        self._take_stream()
        try:
            await _pty.session(ws, entry.handle, self.call, command, rows, cols,
                               self._config.max_exec_timeout)
        finally:
            self._streaming -= 1

    async def stream_exec(self, entry: Entry, command: list[str] | str, *,
                          timeout: float | None, **kw: Any) -> AsyncIterator[bytes]:
        """Start a streamed exec; returns its NDJSON lines (``_streams``)."""
        self._take_stream()
        try:
            stream = await _streams.start(entry.handle, self.call, command, **kw)
        except BaseException:
            self._streaming -= 1
            raise
        entry.streams[stream.exec_id] = stream
        limit = min(timeout or self._config.max_exec_timeout, self._config.max_exec_timeout)
        return self._stream_lines(entry, stream, limit)

    async def _stream_lines(self, entry: Entry, stream: _streams.Stream,
                            limit: float) -> AsyncIterator[bytes]:
        try:
            async for line in _streams.lines(stream, self.call, limit,
                                             self._config.stream_keepalive_seconds):
                yield line
        finally:
            entry.streams.pop(stream.exec_id, None)
            self._streaming -= 1

    async def signal_exec(self, entry: Entry, exec_id: str, signal: int | None) -> None:
        """Send ``signal`` to a streamed exec, or cancel it (None: SIGTERM, then SIGKILL)."""
        stream = entry.streams.get(exec_id)
        if stream is None:
            if exec_id in entry.execs:
                raise _errors.refusal(409, "only a streamed exec (POST .../execs/stream) can "
                                           "be signalled or cancelled")
            raise _errors.refusal(404, f"no running streamed exec {exec_id!r}")
        if signal is None:
            await _streams.cancel(stream, self.call)
        else:
            await self.call(entry.handle.process.remote(stream.key, "kill", signal))

    async def call(self, ref: Any) -> Any:
        """A host call's result, bounded: no request waits forever on a stuck host."""
        return await asyncio.wait_for(asyncio.wrap_future(ref.future()),
                                      self._config.call_timeout)


_STATES = {SandboxState.PENDING: "pending", SandboxState.RUNNING: "running",
           SandboxState.PAUSED: "paused", SandboxState.SUSPENDED: "suspended",
           SandboxState.TERMINATED: "terminated", SandboxState.ERROR: "error"}


def _consume(fut: asyncio.Future[Any]) -> None:
    # a result nobody polled must not log "exception was never retrieved"
    if not fut.cancelled():
        fut.exception()


def exec_info(ex: Exec) -> ExecInfo:
    """An exec's state as the API shows it."""
    fut = ex.future
    if not fut.done():
        return ExecInfo(exec_id=ex.exec_id, status="running")
    if fut.cancelled():
        return ExecInfo(exec_id=ex.exec_id, status="failed",
                        error={"code": "cancelled", "message": "the sandbox was deleted"})
    exc = fut.exception()
    if exc is not None:
        code = _errors.code_of(exc) if isinstance(exc, SandboxError) else "unavailable"
        message = exc.message if isinstance(exc, SandboxError) else str(exc)
        return ExecInfo(exec_id=ex.exec_id, status="failed",
                        error={"code": code, "message": message[:2000]})
    res: ExecResult = fut.result()
    return ExecInfo(exec_id=ex.exec_id, status="timed_out" if res.timed_out else "completed",
                    exit_code=res.exit_code, stdout=res.stdout, stderr=res.stderr,
                    truncated=res.truncated, duration_seconds=res.duration_seconds)


def make_options(body: SandboxConfig) -> dict[str, Any]:
    """The options a caller set (only those: the Ray layer's defaults fill the rest)."""
    return body.model_dump(exclude_unset=True, exclude={"spec_transform"})
