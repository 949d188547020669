"""Each tenant's volumes. A volume belongs to a node (``ray_sandbox.actor.volumes``), so the
service gives every tenant its own namespace on it: a tenant's volume ``ws`` is the node's
``tv-<10 hex of the tenant>-ws``. A tenant names only its own volumes, in the API and in a
sandbox's ``volumes=``; listing shows only its own, without the prefix. Bounded per tenant in
count and size (``max_volumes``, ``max_volume_bytes``; the count holds across replicas: a
tenant's creates take turns through a lease in the shared books). The books also name each
tenant's volumes (those made before them are taken in when listed), so one whose node is
gone is listed as lost until the tenant deletes it. The blocking calls (one task per node)
run in the caller's threads (``blocking``)."""

from __future__ import annotations

import asyncio
import builtins
import hashlib
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from ..actor import volumes
from ..runtime.config import VOLUME_NAME_RE, parse_size
from ..runtime.errors import VolumeNotFoundError
from ..runtime.volumes import VolumeInfo
from . import _errors
from ._config import ServiceConfig
from ._state import Shared

Blocking = Callable[..., Awaitable[Any]]
_NAME_MAX = 48  # 63 (a volume name) less the tenant's prefix
LEASE_POLL = 0.1  # seconds between tries for the tenant's volume lease


def prefix(tenant: str) -> str:
    return f"tv-{hashlib.sha256(tenant.encode()).hexdigest()[:10]}-"


def _public(info: VolumeInfo, tenant: str) -> VolumeInfo:
    return info.model_copy(update={"name": info.name.removeprefix(prefix(tenant))})


def _checked(name: str) -> str:
    if not (VOLUME_NAME_RE.match(name) and len(name) <= _NAME_MAX):
        raise _errors.refusal(400, f"volume name {name!r}: 1-{_NAME_MAX} of a-z 0-9 _ . -, "
                                   "starting with a letter or digit")
    return name


class TenantVolumes:
    def __init__(self, config: ServiceConfig, blocking: Blocking, state: Shared) -> None:
        self._config = config
        self._blocking = blocking
        self._state = state

    async def list(self, tenant: str) -> list[VolumeInfo]:
        mine = prefix(tenant)
        found = await self._blocking(volumes.list_volumes)
        return [_public(v, tenant) for v in found if v.name.startswith(mine)]

    async def listing(self, tenant: str) -> tuple[builtins.list[VolumeInfo],
                                                   builtins.list[str]]:
        """The tenant's volumes on the live nodes, and the names of those the books hold
        that no live node has (lost: their node died)."""
        live = await self.list(tenant)
        lost = await self._state("volumes_seen", tenant,
                                 {v.name: [v.node, v.size] for v in live})
        return live, lost

    async def create(self, tenant: str, name: str, size: str | int) -> VolumeInfo:
        _checked(name)
        try:
            nbytes = parse_size(size)
        except ValueError as exc:
            raise _errors.refusal(400, f"volume size: {exc}") from None
        if nbytes > self._config.max_volume_bytes:
            raise _errors.refusal(400, f"a volume is at most {self._config.max_volume_bytes} "
                                       "bytes here")
        # one count-then-create per tenant at a time, whichever replica: else two creates
        # could both see room for one
        key, holder = f"volumes:{tenant}", secrets.token_hex(8)
        deadline = time.monotonic() + self._config.max_wait_seconds
        while not await self._state("lease", key, holder, self._config.call_timeout):
            if time.monotonic() > deadline:
                raise _errors.refusal(409, "another volume of this tenant is being created; "
                                           "retry")
            await asyncio.sleep(LEASE_POLL)
        try:
            if len(await self.list(tenant)) >= self._config.max_volumes:
                raise _errors.refusal(429, f"this tenant has {self._config.max_volumes} "
                                           "volumes, its limit; delete one first")
            info = await self._blocking(volumes.create_volume, prefix(tenant) + name, nbytes)
            await self._state("volume_made", tenant, name, info.node, info.size)
        finally:
            with anyio.CancelScope(shield=True):
                await self._state("unlease", key, holder)
        return _public(info, tenant)

    async def delete(self, tenant: str, name: str) -> None:
        """Idempotent; a volume a sandbox has mounted is a 409 (VolumeInUseError). A lost
        one is forgotten."""
        try:
            await self._blocking(volumes.delete_volume, prefix(tenant) + _checked(name))
        except VolumeNotFoundError:
            pass
        await self._state("volume_gone", tenant, name)

    async def mounts(self, tenant: str, wanted: dict[str, Any]) -> dict[str, Any]:
        """A create's ``volumes`` (path -> mount, as SandboxConfig dumps it) with the
        tenant's names turned into the node's; a name the tenant has no volume of is a 400,
        so no other tenant's (or the operator's) volume can be reached by name."""
        have = {v.name for v in await self.list(tenant)}
        out = {}
        for path, mount in wanted.items():
            if mount["name"] not in have:
                raise _errors.refusal(400, f"no volume {mount['name']!r} for this tenant "
                                           "(POST /volumes makes one)")
            out[path] = {**mount, "name": prefix(tenant) + mount["name"]}
        return out


__all__ = ["TenantVolumes", "prefix"]
