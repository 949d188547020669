"""Modal's apps and environments on the control plane (``modal.client.ModalClient``): the
client's hello and token, ``App.lookup`` (named apps, kept per tenant), ``app.run()``'s
ephemeral app (its sandboxes end with it) and the environment the client asks for. An app
is only a label on its sandboxes (``_grpc_sandboxes.APP_LABEL``): a named app's id is a
hash of its tenant, environment and name, so a new replica finds the same sandboxes.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from google.protobuf import empty_pb2
from modal_proto import api_pb2

from ._config import ServiceConfig
from ._grpc import (
    JWT_TTL,
    MAX_PER_TENANT,
    Call,
    bounded_put,
    hash_id,
    invalid,
    make_jwt,
    not_found,
    spawn,
)
from ._grpc_images import BUILDER_VERSION
from ._grpc_sandboxes import WireSandboxes

log = logging.getLogger(__name__)

C = api_pb2.ObjectCreationType


class Apps:
    """The client, app and environment handlers, over Modal's view of the sandboxes."""

    def __init__(self, config: ServiceConfig, wire: WireSandboxes) -> None:
        self._config = config
        self._wire = wire
        self._apps: dict[str, OrderedDict[str, str]] = {}  # tenant -> name -> app id
        self._ephemeral_apps: dict[str, str] = {}  # app id -> tenant (app.run())
        self._tasks: set[asyncio.Task[Any]] = set()

    def app_id(self, tenant: str, env: str, name: str) -> str:
        """The id of the tenant's app ``name`` (in environment ``env``)."""
        known = self._apps.get(tenant, OrderedDict()).get(name)
        return known or hash_id("ap", tenant, env, name)

    async def ClientHello(self, call: Call, req: Any) -> api_pb2.ClientHelloResponse:
        return api_pb2.ClientHelloResponse(image_builder_version=BUILDER_VERSION)

    async def AuthTokenGet(self, call: Call, req: Any) -> api_pb2.AuthTokenGetResponse:
        # the client only reads its expiry; every control call carries the token anyway
        return api_pb2.AuthTokenGetResponse(
            token=make_jwt(self._config, {"sub": call.tenant, "use": "auth"}, JWT_TTL))

    async def AppGetOrCreate(self, call: Call,
                             req: api_pb2.AppGetOrCreateRequest) -> api_pb2.AppGetOrCreateResponse:
        if not req.app_name:
            raise invalid("an app needs a name")
        apps = self._apps.setdefault(call.tenant, OrderedDict())
        if req.app_name.startswith("ap-") and (req.app_name in apps.values()
                                              or req.app_name in self._ephemeral_apps):
            app_id = req.app_name
        elif req.app_name in apps:
            app_id = apps[req.app_name]
        elif req.object_creation_type in (C.OBJECT_CREATION_TYPE_CREATE_IF_MISSING,
                                          C.OBJECT_CREATION_TYPE_CREATE_FAIL_IF_EXISTS):
            app_id = hash_id("ap", call.tenant, req.environment_name, req.app_name)
        else:
            app_id = hash_id("ap", call.tenant, req.environment_name, req.app_name)
            if not await self._wire.listing(call.tenant, app_id, {}, 0, False):
                raise not_found(f"app {req.app_name!r} not found")
        bounded_put(apps, req.app_name, app_id)
        return api_pb2.AppGetOrCreateResponse(
            app_id=app_id, handle_metadata=api_pb2.AppHandleMetadata(
                app_id=app_id, description=req.app_name,
                environment_name=req.environment_name))

    async def AppCreate(self, call: Call, req: api_pb2.AppCreateRequest) -> Any:
        app_id = "ap-" + secrets.token_hex(11)
        self._ephemeral_apps[app_id] = call.tenant
        while len(self._ephemeral_apps) > MAX_PER_TENANT * 16:
            self._ephemeral_apps.pop(next(iter(self._ephemeral_apps)))
        return api_pb2.AppCreateResponse(app_id=app_id)

    async def AppPublish(self, call: Call, req: Any) -> api_pb2.AppPublishResponse:
        return api_pb2.AppPublishResponse(deployed_at=time.time())

    async def AppHeartbeat(self, call: Call, req: Any) -> empty_pb2.Empty:
        return empty_pb2.Empty()

    async def AppClientDisconnect(self, call: Call,
                                  req: api_pb2.AppClientDisconnectRequest) -> empty_pb2.Empty:
        """``app.run()`` ending: its ephemeral app's sandboxes end with it, as in Modal."""
        if self._ephemeral_apps.pop(req.app_id, None) == call.tenant:
            spawn(self._tasks, self._end_app(call.tenant, req.app_id))
        return empty_pb2.Empty()

    async def _end_app(self, tenant: str, app_id: str) -> None:
        for info in await self._wire.listing(tenant, app_id, {}, 0, False):
            try:
                await self._wire.terminate(await self._wire.record(tenant, info.id))
            except Exception as exc:  # gone already, or its TTL ends it
                log.info("ending %s of app %s: %s", info.id, app_id, exc)

    async def AppGetLogs(self, call: Call,
                         req: api_pb2.AppGetLogsRequest) -> AsyncIterator[Any]:
        # no app logs here: the client's log loop (enable_output) waits, then asks again
        await asyncio.sleep(min(req.timeout or 1.0, 5.0))
        return
        yield

    async def EnvironmentGetOrCreate(self, call: Call, req: Any) -> Any:
        name = req.deployment_name or "main"
        return api_pb2.EnvironmentGetOrCreateResponse(
            environment_id=hash_id("en", call.tenant, name),
            metadata=api_pb2.EnvironmentMetadata(name=name, settings=api_pb2.EnvironmentSettings(
                image_builder_version=BUILDER_VERSION)))
