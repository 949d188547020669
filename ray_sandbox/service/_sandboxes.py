"""The sandboxes of every tenant, as the service sees them: created through the Ray layer
(``ray_sandbox.actor``), found again by their labels, and their execs' results.

A sandbox's API id is its Ray-layer name (``create(name=...)``), made before the create
starts so ``POST`` can answer at once; its tenant and charge are labels on it, so a restarted
replica adopts what its predecessor made. What every replica must agree on lives in the
shared books (``_state``). Used from the replica's event loop only; calls that block
(create, listing) run in a bounded set of threads.

(~700 lines: finding and adopting, create and delete under the quota, links, copies and
execs all act on the same entries, handles and replica-local tasks, so they stay together;
what stands apart is apart: the books (``_state``), volumes (``_volumes``), snapshots and
filesystem images (``_kept``), streamed output (``_streams``) and the terminal (``_pty``).)
"""

from __future__ import annotations

import asyncio
import hashlib
import json
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
from fastapi import HTTPException
from ray.exceptions import RayActorError

from .. import actor
from ..actor.hosts import host_for_node
from ..actor.placement import node_alive
from ..runtime.config import EgressPolicy, PullNetwork, SandboxConfig
from ..runtime.errors import CapacityError, SandboxError, SandboxNotFoundError
from ..runtime.results import ExecResult, SandboxState
from ..runtime.verbs import ExecRequest, NoRequest
from . import _errors, _policy, _pty, _streams
from ._config import ServiceConfig
from ._kept import FS_IMAGE_PATH_RE, FS_IMAGE_SCHEME, TenantKept
from ._models import REQUEST_FIELDS, CreateSandbox, ExecInfo, LinkInfo, SandboxInfo
from ._policy import Nodes, ray_node_addresses
from ._quota import Charge, charge
from ._state import Shared
from ._volumes import TenantVolumes

log = logging.getLogger(__name__)

LABEL_PREFIX = "ray-sandbox/"  # the Ray layer's and this service's labels; callers' may not
TENANT_LABEL = "ray-sandbox/service-tenant"
CPU_LABEL = "ray-sandbox/service-cpu"
MEMORY_LABEL = "ray-sandbox/service-memory"
PORTS_LABEL = "ray-sandbox/service-ports"  # its published ports, for port URLs after adoption
IMAGE_LABEL = "ray-sandbox/service-image"  # the image as the tenant named it (not a host path)
ID_RE = re.compile(r"^[0-9a-f]{32}$")
NODE_SEEN_S = 10.0  # how long a node seen alive is believed alive (port traffic)
MAX_NODES_SEEN = 4096


@dataclass(eq=False)
class Exec:
    exec_id: str
    future: asyncio.Future[ExecResult]
    reported: asyncio.Task[Any] | None = None  # its result on its way to the books


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
    creating: asyncio.Task[None] | None = None  # this replica's create of it
    error: str | None = None
    deleted: bool = False
    lost: bool = False  # the books made it, no node has it any more
    token_answer: bool = False  # returned for a create's client token, not made by it
    execs: OrderedDict[str, Exec] = field(default_factory=OrderedDict)  # run by this replica
    streams: dict[str, _streams.Stream] = field(default_factory=dict)  # read by this replica

    def source(self) -> dict[str, Any]:
        """What copies of it get: its charge, image and labels (a snapshot keeps these)."""
        return {"cpu": self.charge.cpu, "memory": self.charge.memory, "image": self.image,
                "labels": self.labels}

    def row(self) -> list[Any]:
        """What the books' ``reconcile`` takes of a sandbox the hosts list."""
        return [self.charge.cpu, self.charge.memory,
                {**self.source(), "created_at": self.created_at}]


def user_labels(labels: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in labels.items() if not k.startswith(LABEL_PREFIX)}


def _from_record(rec: dict[str, Any], tenant: str) -> Entry:
    """A create the books know (pending or failed), perhaps another replica's."""
    return Entry(rec["sandbox_id"], tenant, Charge(rec.get("cpu", 0.0), rec.get("memory", 0)),
                 rec.get("image", ""), dict(rec.get("labels") or {}), rec.get("created_at"),
                 error=rec["error"], lost=bool(rec.get("lost")))


class Sandboxes:
    """Every tenant's sandboxes as one replica sees them. What every replica must agree on
    (creates in flight, the quota, exec results, snapshots) is in the shared books
    (``_state``); a replica keeps its own handles, the execs it runs and its streams."""

    def __init__(self, config: ServiceConfig, state: Shared) -> None:
        self._config = config
        self._state = state
        self.replica = secrets.token_hex(6)
        self._entries: dict[str, Entry] = {}
        # Lookups (listings, adoption, policy checks) are short; creates may wait long for
        # room or an image: each has its own threads, so waiting creates never starve GETs.
        self._threads = anyio.CapacityLimiter(config.create_threads)
        self._create_threads = anyio.CapacityLimiter(config.create_threads)
        self._direct = 0  # execs running in threads through handle.run
        self._direct_threads = anyio.CapacityLimiter(max(1, config.direct_exec_threads))
        self._adopted = False
        self._adopting = asyncio.Lock()
        self._streaming = 0
        # reports to the books nobody waits for (an exec's result, a stream's end): one per
        # exec or stream at most, so bounded by them
        self._reports: set[asyncio.Task[Any]] = set()
        self.volumes = TenantVolumes(config, self._blocking, state)
        self.kept = TenantKept(config, state, self._blocking, self._track)
        self._nodes_seen: dict[str, float] = {}  # node id -> when last seen alive
        self._nodes = Nodes(ray_node_addresses)  # what tenants' sandboxes never reach
        self._pending: dict[str, int] = {}  # tenant -> creates and copies being made here
        # sandbox id -> (tenant, node, when seen): whose a port's host form is
        self._owners: dict[str, tuple[str | None, str | None, float]] = {}

    async def _blocking(self, fn: Any, *args: Any) -> Any:
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._threads)

    def _report(self, method: str, *args: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(self._state(method, *args))
        self._track(task)
        return task

    def _track(self, task: asyncio.Task[Any]) -> None:
        """A task nobody awaits to its end (a report, a take): shutdown waits for it."""
        self._reports.add(task)
        task.add_done_callback(self._tracked)

    def _tracked(self, task: asyncio.Task[Any]) -> None:
        self._reports.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("a background task of the service failed: %s", task.exception())

    # --- finding ---------------------------------------------------------------------------

    async def _adopt(self) -> None:
        """Once per replica: take over the sandboxes an earlier replica made for the tenants
        it serves (found by their tenant label), tell the books what runs (those they hold
        as made that no node has are marked lost), then, in the background, check what the
        books keep (snapshots, images) against the nodes."""
        if self._adopted:
            return
        async with self._adopting:  # the first requests arrive together
            if self._adopted:
                return
            epoch = await self._state("epoch")
            for tenant in self._config.tokens:
                handles = await self._blocking(actor.list, {TENANT_LABEL: tenant})
                found = await asyncio.gather(*(self._adopt_one(h) for h in handles))
                lost = await self._state("reconcile", tenant, {
                    e.api_id: e.row() for e in found if e is not None and e.tenant == tenant},
                    epoch)
                if lost:
                    log.warning("%d sandboxes of tenant %s are on no node any more: marked "
                                "lost", len(lost), tenant)
            self._adopted = True
            self._track(asyncio.ensure_future(self.kept.recover(TENANT_LABEL)))

    async def _adopt_one(self, handle: Any) -> Entry | None:
        # a copy (fork, restore) has no name: its runtime id is its API id
        api_id = handle.name or handle.sandbox_id
        known = self._entries.get(api_id)
        if known is not None and known.handle is not None:
            return known
        try:
            status = await self.call(handle.status.remote())
        except SandboxNotFoundError:
            return None
        labels = status.labels
        if TENANT_LABEL not in labels:
            return None  # not the service's
        entry = Entry(api_id, labels[TENANT_LABEL],
                      Charge(float(labels.get(CPU_LABEL, 0)), int(labels.get(MEMORY_LABEL, 0))),
                      labels.get(IMAGE_LABEL, status.image or ""), user_labels(labels),
                      status.created_at.timestamp() if status.created_at else None,
                      ports=tuple(int(p) for p in labels.get(PORTS_LABEL, "").split(",") if p),
                      handle=handle)
        if known is None:  # one this replica is making keeps its entry (and its task)
            self._entries[entry.api_id] = entry
        return entry

    async def _live(self, tenant: str) -> dict[str, Entry]:
        """The tenant's sandboxes the hosts list now, adopted; the ones a host ended by
        itself (TTL, death) are forgotten."""
        found = {}
        for h in await self._blocking(actor.list, {TENANT_LABEL: tenant}):
            entry = await self._adopt_one(h)
            if entry is not None and entry.tenant == tenant:
                found[entry.api_id] = entry
        for e in list(self._entries.values()):
            if e.tenant == tenant and e.handle is not None and e.api_id not in found:
                del self._entries[e.api_id]
        return found

    async def find(self, tenant: str, api_id: str) -> Entry:
        """The tenant's sandbox; anyone else's, or none, is 404 (never 403: an id of another
        tenant must not be told apart from one that does not exist)."""
        await self._adopt()
        if not ID_RE.match(api_id):
            raise _errors.refusal(404, f"no sandbox {api_id!r}")
        entry = self._entries.get(api_id)
        if entry is None or entry.handle is None:
            # being created or failed, here or on another replica: the books know
            rec = await self._state("create_record", tenant, api_id)
            entry = self._entries.get(api_id)
            if rec is not None:
                return entry if entry is not None and entry.tenant == tenant \
                    else _from_record(rec, tenant)
        if entry is None or entry.handle is None:
            # made by another replica (or finished just now): ask the hosts by its labels
            epoch = await self._state("epoch")
            found = [h for h in await self._blocking(actor.list, {TENANT_LABEL: tenant})
                     if api_id in (h.name, h.sandbox_id)]
            entry = await self._adopt_one(found[0]) if found else None
            if entry is None:  # made before and no node has it: lost, if the books say so
                rec = await self._state("vanished", tenant, api_id, epoch)
                if rec is not None:
                    return _from_record(rec, tenant)
        if entry is None or entry.tenant != tenant or entry.deleted or entry.handle is None:
            raise _errors.refusal(404, f"no sandbox {api_id!r}")
        return entry

    async def _settle(self, entry: Entry, wait: float) -> Entry:
        """``entry`` once its create ended, waiting up to ``wait`` seconds (capped); still
        pending after that, it is returned as it is."""
        if entry.handle is not None or entry.error is not None or wait <= 0:
            return entry
        wait = min(wait, self._config.max_wait_seconds)
        if entry.creating is not None:  # this replica's: its task
            await asyncio.wait([entry.creating], timeout=wait)
            if not entry.creating.done() or entry.error is not None:
                return entry
        else:  # another replica's: the books wake us when it ends
            rec = await self._state("create_record", entry.tenant, entry.api_id, wait,
                                    wait=wait)
            if rec is not None:
                return _from_record(rec, entry.tenant)
        return await self.find(entry.tenant, entry.api_id)

    async def running(self, tenant: str, api_id: str) -> Entry:
        """The tenant's sandbox once its create finished; 409 while pending, the create's
        error once it failed."""
        entry = await self._settle(await self.find(tenant, api_id),
                                   self._config.max_wait_seconds)
        if entry.handle is None:
            message = entry.error or "the sandbox is still being created; wait for running"
            raise _errors.refusal(409, message)
        return entry

    async def alive(self, tenant: str, api_id: str) -> Entry:
        """``running``, and asked of its host now: a port of a sandbox that ended (deleted
        through another replica, whose handle this one still holds, or by its TTL) may be
        published by another sandbox meanwhile, and must not be reached through its URL."""
        entry = await self.running(tenant, api_id)
        h = entry.handle
        if h.node_id is not None:
            state = await self._state_on(h.node_id, h.sandbox_id)
        else:
            try:
                state = (await self.call(h.status.remote())).state
            except SandboxNotFoundError:
                state = SandboxState.TERMINATED
        if state == SandboxState.TERMINATED:
            self._entries.pop(api_id, None)
            raise _errors.refusal(404, f"no sandbox {api_id!r}")
        if state == SandboxState.SUSPENDED and h.node_id is not None:
            # a request to one of its ports wakes it, and is forwarded once it is back
            node = await self._wake_on(h.node_id, h.sandbox_id)
            if node != h.node_id:  # resumed on another node: its port is there now
                host = await self._blocking(partial(host_for_node, node))
                entry.handle = actor.SandboxHandle(h.sandbox_id, host, name=h.name,
                                                   node_id=node)
        return entry

    async def _wake_on(self, node_id: str, sandbox_id: str) -> str:
        """Resume a suspended sandbox through its node's host; the node it runs on now."""
        host = await self._blocking(partial(host_for_node, node_id))
        node, _ = await self.call(host.wake.options(concurrency_group="create").remote(
            sandbox_id))
        return str(node)

    async def _state_on(self, node_id: str, sandbox_id: str) -> SandboxState:
        """The sandbox's state, asked of its node's host now. A host this replica holds a
        handle of may have retired (idle) and been replaced: the handle is looked up again
        once, so a port URL keeps working across host retirement (it answered 503)."""
        for fresh in (False, True):
            host = await self._blocking(partial(host_for_node, node_id, fresh=fresh))
            try:
                return (await self.call(host.call.options(concurrency_group="control").remote(
                    "status", sandbox_id, NoRequest()))).state
            except SandboxNotFoundError:
                return SandboxState.TERMINATED
            except RayActorError:
                if fresh:
                    raise
        raise AssertionError("unreachable")

    async def ray_alive(self, sandbox_id: str, node_id: str) -> str:
        """``node_id`` if the sandbox made through Ray (no tenant's) still runs there, asked
        of its host now for the reason ``alive`` gives; else 404."""
        gone = _errors.refusal(404, f"no sandbox {sandbox_id!r}")
        # a port's traffic asks often: a node seen alive lately is not asked Ray's GCS again
        # (a node that died since fails the host call below: 503)
        if self._nodes_seen.get(node_id, 0.0) < time.monotonic() - NODE_SEEN_S:
            if not await self._blocking(node_alive, node_id):
                raise gone
            if len(self._nodes_seen) >= MAX_NODES_SEEN:
                self._nodes_seen.clear()
            self._nodes_seen[node_id] = time.monotonic()
        state = await self._state_on(node_id, sandbox_id)
        if state == SandboxState.TERMINATED:
            raise gone
        if state == SandboxState.SUSPENDED:  # its port's request wakes it
            return await self._wake_on(node_id, sandbox_id)
        return node_id

    async def port_owner(self, sandbox_id: str) -> tuple[str | None, str | None]:
        """Whose sandbox this is, for a port's host form (its label names no tenant):
        ``(tenant, None)`` for a tenant's, ``(None, node)`` for one made through Ray; looked
        up on the hosts once and kept for ``NODE_SEEN_S``; unknown: 404."""
        known = self._owners.get(sandbox_id)
        if known is not None and known[2] > time.monotonic() - NODE_SEEN_S:
            return known[0], known[1]
        entry = self._entries.get(sandbox_id)
        found: tuple[str | None, str | None] | None = (entry.tenant, None) if entry else None
        if found is None:
            for h in await self._blocking(actor.list, None):
                if sandbox_id == h.name:  # a tenant's: its API id is its name
                    status = await self.call(h.status.remote())
                    found = (status.labels.get(TENANT_LABEL), None)
                elif sandbox_id == h.sandbox_id:
                    found = (None, h.node_id)
                if found is not None:
                    break
        if found is None or found == (None, None):
            raise _errors.refusal(404, f"no sandbox {sandbox_id!r}")
        if len(self._owners) >= MAX_NODES_SEEN:
            self._owners.clear()
        self._owners[sandbox_id] = (*found, time.monotonic())
        return found

    def port_payer(self, sandbox_id: str) -> str | None:
        """The tenant whose share a request to this sandbox's port counts against, if
        this replica knows it already (the guard cannot wait for a lookup)."""
        known = self._owners.get(sandbox_id)
        return known[0] if known is not None else None

    # --- create, status, list, delete ------------------------------------------------------

    async def create(self, tenant: str, body: SandboxConfig,
                     built: tuple[str, str, str] | None = None) -> Entry:
        """Start a create of what the tenant asked (held to its policy) and return its
        entry (status pending) without waiting for it. With a ``client_token`` (a
        CreateSandbox's), the tenant's create with the same token within
        ``client_token_seconds`` is returned instead (409 if its body differed).
        ``built`` is an image an ingress built for this tenant from ``body.image``
        (``(reference on the node, node id, name shown)``: Modal's image steps,
        ``_grpc_images``): the policy holds the create to ``body.image``, then it boots the
        build, on its node."""
        self._hold_pending(tenant)  # before any await: concurrent creates count at once
        try:
            entry = await self._start_create(tenant, body, built)
        except BaseException:
            self._drop_pending(tenant)
            raise
        if entry.creating is None or entry.token_answer:  # an earlier create's (its token)
            self._drop_pending(tenant)
        else:
            entry.creating.add_done_callback(lambda _: self._drop_pending(tenant))
        return entry

    async def _start_create(self, tenant: str, body: SandboxConfig,
                            built: tuple[str, str, str] | None = None) -> Entry:
        await self._adopt()
        token = None
        if isinstance(body, CreateSandbox) and body.client_token is not None:
            asked = body.model_dump(mode="json", exclude_unset=True,
                                    exclude={"spec_transform", *REQUEST_FIELDS})
            digest = hashlib.sha256(json.dumps(asked, sort_keys=True).encode()).hexdigest()
            token = [body.client_token, digest]
            earlier = await self._state("client_token", tenant, token)
            if earlier is not None:
                return self._same(tenant, earlier)
        # only what the tenant set: the Ray layer's defaults and its policy fill the rest
        given = body.model_dump(exclude_unset=True, exclude={"spec_transform", *REQUEST_FIELDS})
        if given.get("volumes"):  # the tenant's own, by the names it gave them
            given["volumes"] = await self.volumes.mounts(tenant, given["volumes"])
        template = await self._blocking(self._under_policy, tenant, given)
        config, shown = template.config, None
        if built is not None:  # held to the policy as its base image, then the build
            ref, node, shown = built
            config = config.model_copy(update={"image": ref})
            template = template.model_copy(update={"node_id": node})
        elif config.image.startswith(FS_IMAGE_SCHEME):
            shown = config.image
            config = config.model_copy(
                update={"image": await self.kept.fs_image_ref(tenant, config.image)})
        cost = charge(config)
        api_id = secrets.token_hex(16)
        entry = Entry(api_id, tenant, cost, shown or config.image, dict(config.labels),
                      time.time(), ports=config.expose_ports)
        # its absence after its TTL (or at any time, with an idle timeout) is its own end
        ttl = 0.0 if config.idle_timeout_seconds else config.ttl_seconds
        earlier = await self._admit(tenant, [api_id], cost, {
            "image": entry.image, "labels": entry.labels, "cpu": cost.cpu,
            "memory": cost.memory, "created_at": entry.created_at, "ttl": ttl}, token)
        if earlier is not None:  # the same client token came in meanwhile
            return self._same(tenant, earlier)
        self._entries[api_id] = entry
        labels = {**config.labels, TENANT_LABEL: tenant, CPU_LABEL: repr(cost.cpu),
                  MEMORY_LABEL: str(cost.memory),
                  PORTS_LABEL: ",".join(map(str, config.expose_ports)),
                  **({IMAGE_LABEL: shown} if shown else {})}
        config = config.model_copy(update={"labels": labels})  # ours: valid by making
        entry.creating = asyncio.ensure_future(
            self._create(entry, template.model_copy(update={"config": config})))
        return entry

    def _same(self, tenant: str, earlier: dict[str, str]) -> Entry:
        """The entry of the tenant's earlier create with the same client token (whatever
        became of it since), or 409 when that create's body differed."""
        if "conflict" in earlier:
            raise _errors.refusal(409, earlier["conflict"])
        api_id = earlier["same"]
        known = self._entries.get(api_id)
        charge = known.charge if known is not None and known.tenant == tenant else Charge(0, 0)
        return Entry(api_id, tenant, charge, "", {}, None, token_answer=True)

    async def check_image(self, tenant: str, image: str) -> PullNetwork:
        """400 unless the tenant's policy lets it boot ``image`` (before an ingress pulls
        or builds on it); the network its pull must use (``pull_network``)."""
        template = await self._blocking(self._under_policy, tenant, {"image": image})
        return template.config.pull_network

    async def held_egress(self, tenant: str, network: str,
                          egress: dict[str, Any]) -> EgressPolicy:
        """``egress`` for a running sandbox on ``network``, held to the tenant's policy as
        at create (the cluster's nodes denied): an ingress changing it at runtime."""
        template = await self._blocking(self._under_policy, tenant,
                                        {"network": network, "egress": egress})
        assert template.config.egress is not None
        return template.config.egress

    async def count_exec(self, tenant: str, api_id: str, key: str) -> None:
        """Count a command an ingress runs among the tenant's running execs (the books,
        across replicas: ``max_running_execs_per_tenant``); 429 past it."""
        reason = await self._state("stream_started", tenant, api_id, key, key)
        if reason is not None:
            raise _errors.refusal(429, reason)

    def uncount_exec(self, api_id: str, key: str) -> None:
        self._report("stream_ended", api_id, key)

    def _under_policy(self, tenant: str, given: dict[str, Any]) -> actor.SandboxTemplate:
        """What the tenant asked, held to its policy and made once, with the Ray layer's
        defaults (``_policy``); blocking (names resolved, the cluster's nodes asked of Ray
        at most every 30 s)."""
        return _policy.admit(self._config.policy(tenant), given,
                             lambda options: actor.make_template(**options),
                             self._nodes.known())

    def _hold_pending(self, tenant: str) -> None:
        """A tenant's creates and copies still waiting for room (or an image) each hold a
        thread; past ``max_pending_creates`` it is told to wait, and cannot hold them all.
        Taken before the first await, so concurrent requests cannot all pass the check."""
        pending = self._pending.get(tenant, 0)
        if pending >= self._config.max_pending_creates:
            raise _errors.refusal(429, f"{pending} creates of this tenant are still being "
                                       f"made, the limit (max_pending_creates); wait for them")
        self._pending[tenant] = pending + 1

    def _drop_pending(self, tenant: str) -> None:
        self._pending[tenant] -= 1
        if not self._pending[tenant]:
            del self._pending[tenant]

    async def _admit(self, tenant: str, keys: list[str], cost: Charge,
                     pending: dict[str, Any] | None = None,
                     token: list[str] | None = None) -> dict[str, str] | None:
        """Charge ``keys`` (one sandbox each) to the tenant in one step of the books, so no
        two replicas both admit past the quota; 429 if they do not fit. With a client
        ``token`` already used, the books' answer about it (``Books.admit``)."""
        quota = self._config.quota(tenant).model_dump()
        args = (tenant, quota, keys, cost.cpu, cost.memory, pending, token)
        reason = await self._state("admit", *args)
        if isinstance(reason, str):
            # The books may not know the tenant's sandboxes yet (new books: a first start)
            # or still count ones a host ended by itself: look.
            epoch = await self._state("epoch")
            live = await self._live(tenant)
            await self._state("reconcile", tenant, {k: e.row() for k, e in live.items()},
                              epoch)
            reason = await self._state("admit", *args)
        if isinstance(reason, dict):
            return reason
        if reason is not None:
            raise _errors.refusal(429, reason)
        return None

    async def _create(self, entry: Entry, template: actor.SandboxTemplate) -> None:
        error, handle = None, None
        try:
            handle = await anyio.to_thread.run_sync(
                self._create_blocking, entry.api_id, template, limiter=self._create_threads)
        except CapacityError:  # its message lists the cluster's free resources: not theirs
            error = ("capacity: no room for this sandbox in the cluster within the create "
                     "timeout; retry later or ask for less")
        except SandboxError as exc:
            error = f"{_errors.code_of(exc)}: {exc.message}"
        except Exception as exc:  # a host or Ray failure: the entry must not stay pending
            log.warning("create of %s failed: %s", entry.api_id, exc)
            error = f"unavailable: {exc}"[:2000]
        if error is not None and entry.image.startswith(FS_IMAGE_SCHEME):
            error = FS_IMAGE_PATH_RE.sub(entry.image, error)  # the tenant's name, no host path
        if error is not None:
            entry.error = error  # the books keep it for GET; this replica forgets it
            self._entries.pop(entry.api_id, None)
        deleted = await self._report_created(entry.api_id, error)
        # running here only once the books say so too: no replica answers running before
        # another stops answering pending
        entry.handle = handle
        if entry.handle is not None and (entry.deleted or deleted):
            entry.deleted = True  # deleted while it was being made
            try:
                await self._terminate(entry)
            except Exception as exc:  # nobody awaits this task: say it, the TTL or gc ends it
                log.warning("ending %s, deleted while being made, failed: %s", entry.api_id, exc)

    async def _report_created(self, api_id: str, error: str | None) -> bool:
        """``created`` until the books answer (a restarting state actor comes back; they
        are durable, so the report is all they miss), for as long as a create may take;
        past that its record expires and a reconcile counts the sandbox."""
        loop = asyncio.get_running_loop()
        deadline, delay = loop.time() + self._config.create_timeout, 0.2
        while True:
            try:
                deleted: bool = await self._state("created", api_id, error)
                return deleted
            except _errors.HTTPException:
                if loop.time() + delay > deadline:
                    log.warning("the books did not hear that %s was made", api_id)
                    return False
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _create_blocking(self, api_id: str, template: actor.SandboxTemplate) -> Any:
        # Detached: the service, not the job that happened to start its replica, owns it.
        return actor.create(name=api_id, lifetime="detached", template=template,
                            timeout=self._config.create_timeout)

    async def info(self, entry: Entry, wait: float = 0.0) -> SandboxInfo:
        """Its status, waiting up to ``wait`` seconds for a pending create to finish."""
        entry = await self._settle(entry, wait)
        status, reason = "pending", None
        if entry.lost:
            status, reason = "terminated", entry.error
        elif entry.error is not None:
            status, reason = "error", entry.error
        elif entry.handle is not None:
            try:
                st = await self.call(entry.handle.status.remote())
                status, reason = _STATES[st.state], st.reason
            except SandboxNotFoundError:
                status, reason = "terminated", "gone"
            if status == "terminated" and await self._state("was_deleted", entry.api_id):
                # deleted through another replica: 404, as the replica that deleted it says
                self._entries.pop(entry.api_id, None)
                raise _errors.refusal(404, f"no sandbox {entry.api_id!r}")
        return SandboxInfo(sandbox_id=entry.api_id, status=status, reason=reason,
                           image=entry.image, cpu=entry.charge.cpu, memory=entry.charge.memory,
                           labels=entry.labels, created_at=entry.created_at)

    async def list(self, tenant: str, labels: Mapping[str, str]) -> list[SandboxInfo]:
        await self._adopt()
        live = await self._live(tenant)
        made = [e for e in live.values() if not e.deleted]
        # creates pending or failed, whichever replica took them
        more = [_from_record(r, tenant) for r in await self._state("creates", tenant)
                if r["sandbox_id"] not in live]
        mine = [e for e in made + more if all(e.labels.get(k) == v for k, v in labels.items())]
        return list(await asyncio.gather(*(self.info(e) for e in mine)))

    async def delete(self, tenant: str, api_id: str) -> None:
        """Idempotent: an unknown, already deleted or someone else's id is not an error."""
        try:
            entry = await self.find(tenant, api_id)
        except _errors.HTTPException as exc:
            if exc.status_code == 404:
                return
            raise
        entry.deleted = True
        for ex in entry.execs.values():
            ex.future.cancel()
        # streamed execs end with their sandbox: their next read fails and closes them
        if entry.handle is not None:
            await self._terminate(entry)
            return
        wait = self._config.max_wait_seconds
        # the replica making it ends it once made; waiting (bounded) lets the caller see it
        # gone and its charge given back
        if await self._state("delete_create", tenant, api_id, wait, wait=wait) != "pending":
            return
        if entry.creating is not None:
            await asyncio.wait([entry.creating], timeout=wait)
            return
        # another replica's, made meanwhile: ended here too (terminate is idempotent), so
        # the quota is free when this answers
        found = [h for h in await self._blocking(actor.list, {TENANT_LABEL: tenant})
                 if api_id in (h.name, h.sandbox_id)]
        made = await self._adopt_one(found[0]) if found else None
        if made is not None and made.tenant == tenant:
            await self._terminate(made)

    async def _terminate(self, entry: Entry) -> None:
        try:
            await self.call(entry.handle.terminate.remote())
        except SandboxNotFoundError:
            pass
        self._entries.pop(entry.api_id, None)
        try:
            await self._state("gone", entry.tenant, entry.api_id)
        except _errors.HTTPException:  # the charge heals at the next reconcile
            log.warning("the books did not hear of %s's deletion", entry.api_id)

    async def shutdown(self) -> None:
        """Wait for creates in flight and reports to the books (bounded), so none is left
        half made."""
        pending = [e.creating for e in self._entries.values()
                   if e.creating is not None and not e.creating.done()]
        if pending or self._reports:
            await asyncio.wait([*pending, *self._reports], timeout=self._config.call_timeout)

    # --- snapshots and copies -------------------------------------------------------------

    async def link(self, entry: Entry, to_api_id: str, port: int) -> LinkInfo:
        """Let ``entry`` open TCP connections to ``port`` of the same tenant's ``to``; any
        other tenant's sandbox is 404, as everywhere."""
        to = await self.running(entry.tenant, to_api_id)
        try:  # a handle found by its labels may not know its node: the host tells
            got = await self.call(entry.handle.link.remote(to.handle.sandbox_id, port))
        except SandboxNotFoundError as exc:
            if exc.sandbox_id != to.handle.sandbox_id:
                raise
            raise _errors.refusal(409, f"{to_api_id} runs on another node; links join "
                                       "sandboxes of one node") from None
        return LinkInfo(to=to_api_id, host=got.host, port=got.port)

    async def unlink(self, entry: Entry, to_api_id: str, port: int) -> None:
        """Close a link (idempotent). A peer that is gone needs none: the link names its
        veth, which no later sandbox gets, and is dropped when room is needed."""
        try:
            to = await self.running(entry.tenant, to_api_id)
        except HTTPException as exc:
            if exc.status_code == 404:
                return
            raise
        await self.call(entry.handle.unlink.remote(to.handle, port))

    async def restore(self, tenant: str, snapshot_id: str, count: int) -> list[str]:
        """``count`` running copies of a snapshot (all or none), charged like their source."""
        kept = await self.kept.snapshot_record(tenant, snapshot_id)
        return await self._copies(
            tenant, Charge(kept["cpu"], kept["memory"]), kept["image"], kept["labels"], count,
            partial(actor.restore, kept["snapshot"], count,
                    timeout=self._config.create_timeout, lifetime="detached"))

    async def fork(self, entry: Entry, count: int) -> list[str]:
        """``count`` running copies of a running sandbox."""
        return await self._copies(entry.tenant, entry.charge, entry.image, entry.labels, count,
                                  partial(actor.fork, entry.handle, count,
                                          timeout=self._config.create_timeout,
                                          lifetime="detached"))

    async def _copies(self, tenant: str, cost: Charge, image: str, labels: dict[str, str],
                      count: int, make: Any) -> list[str]:
        # charged before they are made (placeholders), so no create slips past the quota
        keys = [f"copy-{secrets.token_hex(8)}" for _ in range(count)]
        self._hold_pending(tenant)  # copies wait for room like creates
        try:
            await self._admit(tenant, keys, cost)
            try:
                handles = await anyio.to_thread.run_sync(make, limiter=self._create_threads)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await self._state("release", tenant, keys)
                raise
        finally:
            self._drop_pending(tenant)
        ids = []
        for h in handles:
            entry = Entry(h.sandbox_id, tenant, cost, image, dict(labels), time.time(),
                          handle=h)
            self._entries[entry.api_id] = entry
            ids.append(entry.api_id)
        await self._state("settle", tenant, keys, ids,
                          {"image": image, "labels": labels, "cpu": cost.cpu,
                           "memory": cost.memory})
        return ids

    # --- execs -----------------------------------------------------------------------------

    async def start_exec(self, entry: Entry, request: ExecRequest) -> Exec:
        """Start a command; its result is kept among the sandbox's last
        ``max_execs_per_sandbox`` in the books (the oldest finished one is evicted, never a
        running one), where every replica finds it; this replica keeps it until then."""
        if len(entry.execs) >= self._config.max_execs_per_sandbox:
            done = next((k for k, x in entry.execs.items() if x.future.done()), None)
            if done is None:
                raise _errors.refusal(429, f"{len(entry.execs)} execs are running in this "
                                           "sandbox, its limit; wait for one to finish")
            del entry.execs[done]
        request = capped(request, self._config)
        exec_id = secrets.token_hex(8)
        reason = await self._state("exec_started", entry.tenant, entry.api_id, exec_id,
                                   request.timeout)
        if reason is not None:
            raise _errors.refusal(429, reason)
        if self._direct < self._config.direct_exec_threads:
            self._direct += 1  # here, not in the task: a task cancelled unstarted never runs
            future: asyncio.Future[ExecResult] = asyncio.ensure_future(
                self._run_direct(entry.handle, request))
            future.add_done_callback(self._direct_done)
        else:  # every thread busy: no waiting for one, the actor call costs ~2 ms more
            future = asyncio.wrap_future(entry.handle.exec.remote(request).future())
        ex = Exec(exec_id, future)
        ex.future.add_done_callback(_consume)
        ex.future.add_done_callback(partial(self._finished, entry, ex))
        entry.execs[ex.exec_id] = ex
        return ex

    def _finished(self, entry: Entry, ex: Exec, _: asyncio.Future[ExecResult]) -> None:
        """Its result goes to the books; once there, they answer for it (this replica
        forgets it), so an eviction there holds for every replica."""
        ex.reported = self._report("exec_finished", entry.api_id, ex.exec_id,
                                   exec_info(ex).model_dump(mode="json"))

        def forget(task: asyncio.Task[Any]) -> None:
            if not task.cancelled() and task.exception() is None:
                entry.execs.pop(ex.exec_id, None)

        ex.reported.add_done_callback(forget)

    async def _run_direct(self, handle: Any, request: ExecRequest) -> ExecResult:
        """``handle.run`` in a thread: the node-local channel when the sandbox is on this
        replica's node (``actor/channel.py``), else the actor call, blocking. Not abandoned
        when cancelled (a DELETE cancels and does not wait): the thread and its count are
        given back only when the command ends (its timeout, or the sandbox's deletion), so
        their number stays bounded."""
        return await anyio.to_thread.run_sync(partial(handle.run, request),
                                              limiter=self._direct_threads)

    def _direct_done(self, _: asyncio.Future[ExecResult]) -> None:
        self._direct -= 1

    async def exec_info(self, entry: Entry, exec_id: str, wait: float = 0.0) -> ExecInfo:
        """From this replica's own future while it runs the exec (and until the books have
        its result), else from the books."""
        wait = min(wait, self._config.max_wait_seconds)
        ex = entry.execs.get(exec_id)
        if ex is not None:
            if not ex.future.done() and wait > 0:
                await asyncio.wait([ex.future], timeout=wait)
            if ex.reported is not None and not ex.reported.done():
                # finished here only once the books say so too, as with a create
                await asyncio.wait([ex.reported], timeout=self._config.state_timeout)
            return exec_info(ex)
        found = await self._state("exec_record", entry.tenant, entry.api_id, exec_id, wait,
                                  wait=wait)
        if found is None:
            raise _errors.refusal(404, f"no exec {exec_id!r} in this sandbox (results are "
                                       f"kept for its last {self._config.max_execs_per_sandbox})")
        return ExecInfo.model_validate(found)

    def _take_stream(self) -> None:
        """One of the ``max_streams`` streamed execs and terminals; 429 when none is left."""
        if self._streaming >= self._config.max_streams:
            raise _errors.refusal(429, f"{self._streaming} streamed execs and terminals are "
                                       "running, the service's limit; try again later")
        self._streaming += 1

    async def terminal(self, ws: Any, entry: Entry, command: str, rows: int,
                       cols: int) -> None:
        """An interactive terminal on the WebSocket ``ws`` (``_pty``), counted as a stream
        here and, in the books, as one of its tenant's running execs."""
        key = f"pty-{secrets.token_hex(8)}"
        reason = await self._state("stream_started", entry.tenant, entry.api_id, key, key)
        if reason is not None:
            await ws.accept()
            await ws.close(code=4429, reason=reason[:120])
            return
        try:
            self._take_stream()
        except BaseException:
            self._report("stream_ended", entry.api_id, key)
            raise
        try:
            await _pty.session(ws, entry.handle, self.call, command, rows, cols,
                               self._config.max_exec_timeout)
        finally:
            self._streaming -= 1
            self._report("stream_ended", entry.api_id, key)

    async def stream_exec(self, entry: Entry,
                          request: ExecRequest) -> AsyncIterator[bytes]:
        """Start a streamed exec; returns its NDJSON lines (``_streams``). Its process key
        goes to the books, so a signal or cancel landing on another replica reaches it."""
        self._take_stream()
        request = capped(request, self._config)
        try:
            stream = await _streams.start(entry.handle, self.call, request)
        except BaseException:
            self._streaming -= 1
            raise
        try:
            reason = await self._state("stream_started", entry.tenant, entry.api_id,
                                       stream.exec_id, stream.key)
            if reason is not None:
                raise _errors.refusal(429, reason)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await _streams.close(stream, self.call)
            self._streaming -= 1
            raise
        entry.streams[stream.exec_id] = stream
        return self._stream_lines(entry, stream, request.timeout)

    async def _stream_lines(self, entry: Entry, stream: _streams.Stream,
                            limit: float) -> AsyncIterator[bytes]:
        try:
            async for line in _streams.lines(stream, self.call, limit,
                                             self._config.stream_keepalive_seconds):
                yield line
        finally:
            entry.streams.pop(stream.exec_id, None)
            self._streaming -= 1
            self._report("stream_ended", entry.api_id, stream.exec_id)

    async def signal_exec(self, entry: Entry, exec_id: str, signal: int | None) -> None:
        """Send ``signal`` to a streamed exec, or cancel it (None: SIGTERM, then SIGKILL);
        one another replica reads is reached through the sandbox's handle by its key."""
        stream = entry.streams.get(exec_id)
        if stream is None:
            key = None if exec_id in entry.execs else await self._state(
                "stream_key", entry.tenant, entry.api_id, exec_id)
            if key is None:
                if exec_id in entry.execs or await self._state(
                        "exec_record", entry.tenant, entry.api_id, exec_id) is not None:
                    raise _errors.refusal(409, "only a streamed exec (POST .../execs/stream) "
                                               "can be signalled or cancelled")
                raise _errors.refusal(404, f"no running streamed exec {exec_id!r}")
            stream = _streams.Stream(exec_id, key, entry.handle)
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


def capped(request: ExecRequest, config: ServiceConfig) -> ExecRequest:
    """The request within the service's bounds (its exec timeout, its output kept)."""
    cap = config.max_exec_timeout
    return request.model_copy(update={
        "timeout": min(request.timeout or cap, cap),
        "max_output_bytes": min(request.max_output_bytes or config.max_output_bytes,
                                config.max_output_bytes)})


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
