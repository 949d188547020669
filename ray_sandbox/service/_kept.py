"""What each tenant keeps: snapshots (memory, processes and files, for restore) and filesystem
images (files only, ``fs-image://<id>``, for later creates). Both live in the shared books by
kind (``_state``), bounded per tenant (``max_snapshots``, ``max_fs_images``), and are the
tenant's alone: another tenant's id is not found, as one that does not exist. Taking one runs
in a task of its own, so a request that gives up leaves what is made kept and listed, never on
a disk with nothing naming it; the books hold each take from before it starts until it is
kept (a crash between leaves a record ``ray-sandbox serve --reconcile`` finds). What the books
name but no node holds any more (its node died) is marked lost: listed apart, refused with a
message saying so, forgotten by a delete (``recover``). Blocking calls run in the caller's
threads (``blocking``)."""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from .. import actor
from ..runtime import fs_image
from ..runtime.errors import ImageInUseError
from ..runtime.snapshot import Snapshot
from . import _errors, _inventory
from ._bounds import FS_IMAGE, SNAPSHOT, Bounds
from ._config import ServiceConfig
from ._state import LOST, Shared

log = logging.getLogger(__name__)

FS_IMAGE_SCHEME = "fs-image://"  # a tenant's filesystem image, by the id the service gave it
# where a filesystem image lives on some node, as an error message may name it
FS_IMAGE_PATH_RE = re.compile(r"(?:oci:)?[^\s'\"]*/fs-images/[^/\s'\"]+/[0-9a-f]{32}(?::image)?")

Blocking = Callable[..., Awaitable[Any]]


class TenantKept:
    """The tenants' snapshots and filesystem images, through the shared books."""

    def __init__(self, config: ServiceConfig, state: Shared, blocking: Blocking,
                 track: Callable[[asyncio.Task[Any]], None]) -> None:
        self._config = config
        self._state = state
        self._blocking = blocking
        self._track = track  # the replica's set of background tasks (bounded by requests)

    # --- taking ------------------------------------------------------------------------------

    async def snapshot(self, tenant: str, handle: Any, source: dict[str, Any]) -> str:
        """Snapshot a running sandbox (it keeps running); ``source`` is what its copies get
        (charge, image, labels)."""
        return await self._keep(
            SNAPSHOT, tenant, handle, handle.snapshot.remote,
            lambda snap: (snap.snapshot_id, {"snapshot": snap.model_dump(mode="json"),
                                             **source}),
            actor.delete_snapshot)

    async def fs_image(self, tenant: str, handle: Any) -> str:
        """The running sandbox's files as an image only this tenant creates sandboxes from
        (``fs-image://<id>``, on any node)."""
        image_id = await self._keep(FS_IMAGE, tenant, handle, handle.snapshot_filesystem.remote,
                                    lambda ref: (fs_image.parse(ref)[1], {"ref": ref}),
                                    actor.delete_filesystem_image)
        return FS_IMAGE_SCHEME + image_id

    async def _keep(self, kind: str, tenant: str, handle: Any, take: Any, record: Any,
                    discard: Any) -> str:
        """Keep what ``take()`` (an ObjectRef) makes in the tenant's books as ``record``
        says (key, value), or 429 when the tenant's limit of ``kind`` is reached."""
        limit = Bounds.of(self._config).limit(kind)
        if await self._state("kept_count", kind, tenant) >= limit:
            raise _errors.refusal(429, f"{limit} {kind}s kept, the limit; delete one")
        take_id = secrets.token_hex(8)
        await self._state("take_started", take_id, kind, tenant, handle.sandbox_id)
        task = asyncio.ensure_future(self._take_and_keep(kind, tenant, take, record, discard,
                                                         take_id))
        self._track(task)
        key, refused = await asyncio.wait_for(asyncio.shield(task), self._config.create_timeout)
        if refused is not None:
            raise _errors.refusal(429, refused)
        return key

    async def _take_and_keep(self, kind: str, tenant: str, take: Any, record: Any,
                             discard: Any, take_id: str) -> tuple[str, str | None]:
        # bounded by the host's own bounds on the take (bytes, the agent's timeouts), and
        # here by twice the request's, so that no task waits forever on a lost host
        try:
            made = await asyncio.wait_for(asyncio.wrap_future(take().future()),
                                          2 * self._config.create_timeout)
        except BaseException:
            with anyio.CancelScope(shield=True):  # nothing made (or nothing to know of)
                await self._state("take_ended", take_id)
            raise
        key, value = record(made)
        with anyio.CancelScope(shield=True):  # made: it is kept or discarded, whatever comes
            refused = await self._keep_retried(kind, tenant, key, value, take_id)
            if refused is not None:  # another replica kept one meanwhile
                await self._blocking(discard, made)
                await self._state("take_ended", take_id)
        return key, refused

    async def _keep_retried(self, kind: str, tenant: str, key: str, value: dict[str, Any],
                            take_id: str) -> str | None:
        """``keep`` until the books answer (they may be restarting: a state actor Ray
        brings back), for as long as a create may take; past that the take's record stays
        for reconcile."""
        deadline = asyncio.get_running_loop().time() + self._config.create_timeout
        delay = 0.2
        while True:
            try:
                refused: str | None = await self._state("keep", kind, tenant, key, value,
                                                        take_id)
                return refused
            except _errors.HTTPException:
                if asyncio.get_running_loop().time() + delay > deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    # --- finding and deleting --------------------------------------------------------------

    async def snapshot_record(self, tenant: str, snapshot_id: str) -> dict[str, Any]:
        """The tenant's snapshot (``snapshot``: a Snapshot) and what its copies get; 404 if
        it has none of that id, or it is lost (saying so)."""
        kept = await self._state("kept", SNAPSHOT, tenant, snapshot_id)
        if kept is None:
            raise _errors.refusal(404, f"no snapshot {snapshot_id!r}")
        if kept.get("lost"):
            raise _errors.refusal(404, f"snapshot {snapshot_id!r} is {kept['lost']}")
        return {**kept, "snapshot": Snapshot.model_validate(kept["snapshot"])}

    async def fs_image_ref(self, tenant: str, name: str) -> str:
        """The host's reference of the tenant's filesystem image ``name``; anyone else's is
        not found either."""
        kept = await self._state("kept", FS_IMAGE, tenant, name.removeprefix(FS_IMAGE_SCHEME))
        if kept is None:
            raise _errors.refusal(400, f"no filesystem image {name!r}")
        if kept.get("lost"):
            raise _errors.refusal(400, f"filesystem image {name!r} is {kept['lost']}")
        ref: str = kept["ref"]
        return ref

    async def snapshots(self, tenant: str) -> list[str]:
        return await self._state("kept_keys", SNAPSHOT, tenant)

    async def fs_images(self, tenant: str) -> list[str]:
        return [FS_IMAGE_SCHEME + k for k in await self._state("kept_keys", FS_IMAGE, tenant)]

    async def listing(self, kind: str, tenant: str) -> dict[str, list[str]]:
        """``{"keys": [...], "lost": [...]}`` of the tenant's ``kind`` (images by name)."""
        found: dict[str, list[str]] = await self._state("kept_list", kind, tenant)
        if kind == FS_IMAGE:
            return {k: [FS_IMAGE_SCHEME + x for x in v] for k, v in found.items()}
        return found

    async def delete_snapshot(self, tenant: str, snapshot_id: str) -> None:
        kept = await self._state("drop", SNAPSHOT, tenant, snapshot_id)
        if kept is not None:  # else idempotent, like a sandbox's delete
            await self._blocking(actor.delete_snapshot,
                                 Snapshot.model_validate(kept["snapshot"]))

    async def delete_fs_image(self, tenant: str, image_id: str) -> None:
        """Idempotent; 409 while a sandbox on any node runs from it (and then it is kept).
        A lost one is forgotten."""
        kept = await self._state("kept", FS_IMAGE, tenant, image_id)
        if kept is not None and kept.get("lost"):
            await self._state("drop", FS_IMAGE, tenant, image_id)
        elif kept is not None:
            try:
                await self._blocking(actor.delete_filesystem_image, kept["ref"])
            except ImageInUseError:  # in the tenant's words: no node, no path of one
                raise ImageInUseError(f"{FS_IMAGE_SCHEME}{image_id} is in use by a sandbox; "
                                      "delete the sandboxes made from it first") from None
            await self._state("drop", FS_IMAGE, tenant, image_id)

    # --- recovery ----------------------------------------------------------------------------

    async def recover(self, tenant_label: str) -> dict[str, int]:
        """Mark what the books keep and no node holds any more lost (and what a node holds
        again found): a snapshot whose node died (or lacks it), an image no node has. A node
        that does not answer proves nothing either way. Returns counts, for the log."""
        inv = await self._blocking(_inventory.collect, tenant_label,
                                   self._config.call_timeout)
        counts = {"lost": 0, "found": 0}
        for kind, tenant, key, value, lost in await self._state("kept_all"):
            if kind == SNAPSHOT:
                origin = (value.get("snapshot") or {}).get("node_id")
                here = _inventory.presence(inv, "snapshots", key, origin)
            else:
                parsed = fs_image.parse(str(value.get("ref", "")))
                here = _inventory.presence(inv, "fs_images", key,
                                           parsed[0] if parsed else None)
            if here is False and not lost:
                await self._state("mark_lost", kind, tenant, key, LOST)
                counts["lost"] += 1
            elif here is True and lost:
                await self._state("mark_lost", kind, tenant, key, None)
                counts["found"] += 1
        if counts["lost"] or counts["found"]:
            log.warning("the service's kept snapshots and images: %d now lost, %d found again",
                        counts["lost"], counts["found"])
        return counts
