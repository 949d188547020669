"""The sandboxes of every tenant, as the service sees them: created through the Ray layer
(``ray_sandbox.actor``), found again by their labels, copied, linked and deleted.

A sandbox's API id is its Ray-layer name (``create(name=...)``), made before the create
starts so ``POST`` can answer at once; its tenant and charge are labels on it, so a restarted
replica adopts what its predecessor made. What every replica must agree on lives in the
shared books (``_state``). Used from the replica's event loop only; calls that block
(create, listing) run in a bounded set of threads.

(Finding and adopting, create and delete under the quota, links and copies all act on the
same entries and their creates, so they stay together; what stands apart is apart: an entry
and its labels (``_entry``), the execs, streams and terminals run in them (``_execs``),
whether a port's sandbox runs now and whose it is (``_liveness``), the books (``_state``),
volumes (``_volumes``), snapshots and filesystem images (``_kept``).)
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import secrets
import time
from collections.abc import Mapping
from functools import partial
from typing import Any

import anyio
import anyio.to_thread
from fastapi import HTTPException

from .. import actor
from ..actor.hosts import host_for_node
from ..runtime.config import EgressPolicy, PullNetwork, SandboxConfig
from ..runtime.errors import CapacityError, SandboxError, SandboxNotFoundError
from ..runtime.results import SandboxState
from . import _errors, _policy
from ._config import ServiceConfig
from ._entry import (
    CPU_LABEL,
    IMAGE_LABEL,
    MEMORY_LABEL,
    PORTS_LABEL,
    TENANT_LABEL,
    Entry,
    user_labels,
)
from ._execs import SandboxExecs
from ._kept import FS_IMAGE_PATH_RE, FS_IMAGE_SCHEME, TenantKept
from ._liveness import Liveness
from ._models import REQUEST_FIELDS, CreateSandbox, LinkInfo, SandboxInfo
from ._policy import Nodes, ray_node_addresses
from ._quota import Charge, charge
from ._state import Shared
from ._volumes import TenantVolumes

log = logging.getLogger(__name__)

ID_RE = re.compile(r"^[0-9a-f]{32}$")


def _from_record(rec: dict[str, Any], tenant: str) -> Entry:
    """A create the books know (pending or failed), perhaps another replica's."""
    return Entry(rec["sandbox_id"], tenant, Charge(rec.get("cpu", 0.0), rec.get("memory", 0)),
                 rec.get("image", ""), dict(rec.get("labels") or {}), rec.get("created_at"),
                 error=rec["error"], lost=bool(rec.get("lost")))


class Sandboxes:
    """Every tenant's sandboxes as one replica sees them. What every replica must agree on
    (creates in flight, the quota, exec results, snapshots) is in the shared books
    (``_state``); a replica keeps its own handles, the execs it runs and its streams
    (``execs``), and what it learned of ports' sandboxes (``liveness``)."""

    def __init__(self, config: ServiceConfig, state: Shared) -> None:
        self._config = config
        self._state = state
        self.replica = secrets.token_hex(6)
        self._entries: dict[str, Entry] = {}
        # Lookups (listings, adoption, policy checks) are short; creates may wait long for
        # room or an image: each has its own threads, so waiting creates never starve GETs.
        self._threads = anyio.CapacityLimiter(config.create_threads)
        self._create_threads = anyio.CapacityLimiter(config.create_threads)
        self._adopted = False
        self._adopting = asyncio.Lock()
        # reports to the books nobody waits for (an exec's result, a stream's end): one per
        # exec or stream at most, so bounded by them
        self._reports: set[asyncio.Task[Any]] = set()
        self.volumes = TenantVolumes(config, self._blocking, state)
        self.kept = TenantKept(config, state, self._blocking, self._track)
        self._nodes = Nodes(ray_node_addresses)  # what tenants' sandboxes never reach
        self._pending: dict[str, int] = {}  # tenant -> creates and copies being made here
        self.execs = SandboxExecs(config, state, self._report, self.call)
        self.liveness = Liveness(self._entries, self._blocking, self.call)

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
            state = await self.liveness.state_on(h.node_id, h.sandbox_id)
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
            node = await self.liveness.wake_on(h.node_id, h.sandbox_id)
            if node != h.node_id:  # resumed on another node: its port is there now
                host = await self._blocking(partial(host_for_node, node))
                entry.handle = actor.SandboxHandle(h.sandbox_id, host, name=h.name,
                                                   node_id=node)
        return entry

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

    async def call(self, ref: Any) -> Any:
        """A host call's result, bounded: no request waits forever on a stuck host."""
        return await asyncio.wait_for(asyncio.wrap_future(ref.future()),
                                      self._config.call_timeout)


_STATES = {SandboxState.PENDING: "pending", SandboxState.RUNNING: "running",
           SandboxState.PAUSED: "paused", SandboxState.SUSPENDED: "suspended",
           SandboxState.TERMINATED: "terminated", SandboxState.ERROR: "error"}
