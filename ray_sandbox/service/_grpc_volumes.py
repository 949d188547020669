"""Modal's volumes on the control plane: ``Volume.from_name`` (the tenant's volumes of the
service, ``_volumes.py``, id ``vo-<name>``), ``Volume.ephemeral()`` (a volume deleted once
its client stops its heartbeats) and ``Volume.delete``. Their files are reached by the
sandboxes that mount them.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any

from google.protobuf import empty_pb2
from grpclib import GRPCError, Status
from modal_proto import api_pb2

from ..runtime.errors import VolumeInUseError
from ._config import ServiceConfig
from ._grpc import Call, not_found
from ._sandboxes import Sandboxes

log = logging.getLogger(__name__)

EPHEMERAL_TTL = 900.0  # an ephemeral volume without a heartbeat this long is deleted
SWEEP_S = 60.0
C = api_pb2.ObjectCreationType


class Volumes:
    """The volume handlers, over the service's volumes, and the sweep of ephemeral ones."""

    def __init__(self, config: ServiceConfig, sandboxes: Sandboxes) -> None:
        self._config = config
        self._sandboxes = sandboxes
        self._ephemeral: dict[tuple[str, str], float] = {}  # (tenant, name) -> last beat
        self._sweeper: asyncio.Task[None] | None = None

    async def VolumeGetOrCreate(self, call: Call,
                                req: api_pb2.VolumeGetOrCreateRequest) -> Any:
        kind = req.object_creation_type
        if kind == C.OBJECT_CREATION_TYPE_EPHEMERAL:
            name = "eph-" + secrets.token_hex(8)
            await self._sandboxes.volumes.create(call.tenant, name,
                                                 self._config.modal_volume_size)
            self._ephemeral[(call.tenant, name)] = time.monotonic()
            self._sweep_later()
        else:
            name = req.deployment_name
            have = {v.name for v in await self._sandboxes.volumes.list(call.tenant)}
            if name in have and kind == C.OBJECT_CREATION_TYPE_CREATE_FAIL_IF_EXISTS:
                raise GRPCError(Status.ALREADY_EXISTS, f"volume {name!r} exists")
            if name not in have:
                if kind not in (C.OBJECT_CREATION_TYPE_CREATE_IF_MISSING,
                                C.OBJECT_CREATION_TYPE_CREATE_FAIL_IF_EXISTS):
                    raise not_found(f"volume {name!r} not found")
                await self._sandboxes.volumes.create(call.tenant, name,
                                                     self._config.modal_volume_size)
        return api_pb2.VolumeGetOrCreateResponse(
            volume_id=f"vo-{name}", version=api_pb2.VOLUME_FS_VERSION_V2,
            metadata=api_pb2.VolumeMetadata(name=name, version=api_pb2.VOLUME_FS_VERSION_V2))

    async def VolumeHeartbeat(self, call: Call, req: api_pb2.VolumeHeartbeatRequest) -> Any:
        key = (call.tenant, req.volume_id.removeprefix("vo-"))
        if key in self._ephemeral:
            self._ephemeral[key] = time.monotonic()
        return empty_pb2.Empty()

    async def VolumeDelete(self, call: Call, req: api_pb2.VolumeDeleteRequest) -> Any:
        name = req.volume_id.removeprefix("vo-")
        await self._sandboxes.volumes.delete(call.tenant, name)
        self._ephemeral.pop((call.tenant, name), None)
        return empty_pb2.Empty()

    def _sweep_later(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.ensure_future(self._sweep())

    async def _sweep(self) -> None:
        """Ephemeral volumes whose client stopped its heartbeats are deleted (one still
        mounted is tried again at the next sweep)."""
        while self._ephemeral:
            await asyncio.sleep(SWEEP_S)
            now = time.monotonic()
            for (tenant, name), beat in list(self._ephemeral.items()):
                if now - beat < EPHEMERAL_TTL:
                    continue
                try:
                    await self._sandboxes.volumes.delete(tenant, name)
                    self._ephemeral.pop((tenant, name), None)
                except VolumeInUseError:
                    pass
                except Exception as exc:
                    log.warning("deleting ephemeral volume %s: %s", name, exc)
