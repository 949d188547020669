"""The control plane of Modal's API (``modal.client.ModalClient``): one method per RPC the
client uses for sandboxes (apps, environments, images, secrets, volumes, the sandboxes'
lifecycle, both the V2 calls the client makes by default and their V1 names). Every other
RPC of the service's ~570 is UNIMPLEMENTED naming it (``_grpc.Ingress``).

Creates go through :meth:`Sandboxes.create` (the tenant's policy, quota and books); a
Modal option this service cannot honour is UNIMPLEMENTED naming it, never dropped.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from google.protobuf import empty_pb2
from grpclib import GRPCError, Status
from modal_proto import api_pb2

from ..runtime.errors import VolumeInUseError
from . import _grpc_sandboxes as ws
from ._config import ServiceConfig
from ._grpc import Call, invalid, make_jwt, not_found, unimplemented
from ._grpc_images import Images, WireImage
from ._grpc_sandboxes import WireSandbox, WireSandboxes, modal_id, task_id
from ._models import CreateSandbox
from ._sandboxes import Sandboxes

log = logging.getLogger(__name__)

BUILDER_VERSION = "2025.06"  # one the 1.6 client accepts, whose debian_slim _grpc_images knows
JWT_TTL = 3600.0
MAX_PER_TENANT = 1024  # apps, secrets, ephemeral volumes kept per tenant (LRU)
EPHEMERAL_TTL = 900.0  # an ephemeral volume without a heartbeat this long is deleted
SWEEP_S = 60.0
WAIT_CAP = 10.0  # a long poll of the client (SandboxWait asks for 10 s; others less)
ONCE_S = 120.0  # a retried call (the same x-idempotency-key) gets the first one's answer
MAX_ONCE = 4096
JOIN_CAP = 50.0  # an image join answers within the client's 55 s
C = api_pb2.ObjectCreationType
NA = api_pb2.NetworkAccess
R = api_pb2.GenericResult


def _bounded_put(table: OrderedDict[str, Any], key: str, value: Any) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > MAX_PER_TENANT:
        table.popitem(last=False)


def _hash_id(prefix: str, *parts: str) -> str:
    return f"{prefix}-" + hashlib.sha256("\0".join(parts).encode()).hexdigest()[:22]


class Control:
    """The control-plane handlers, over this replica's :class:`Sandboxes`."""

    def __init__(self, config: ServiceConfig, sandboxes: Sandboxes) -> None:
        self._config = config
        self._sandboxes = sandboxes
        self.wire = WireSandboxes(config, sandboxes)
        self.images = Images(config, sandboxes.check_image)
        self._apps: dict[str, OrderedDict[str, str]] = {}  # tenant -> name -> app id
        self._ephemeral_apps: dict[str, str] = {}  # app id -> tenant (app.run())
        self._secrets: dict[str, OrderedDict[str, dict[str, str]]] = {}
        self._ephemeral_volumes: dict[tuple[str, str], float] = {}  # (tenant, name) -> beat
        self._sweeper: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        # (tenant, RPC, idempotency key) -> (when, the first call's answer): the client retries
        # a create on UNAVAILABLE or a lost answer with the same key
        self._once: OrderedDict[tuple[str, str, str], tuple[float, asyncio.Future[Any]]] = \
            OrderedDict()

    async def _idempotent(self, call: Call, make: Any) -> Any:
        """``make()``'s answer, once per idempotency key: a retry waits for the first
        attempt and gets its answer (or its error) instead of creating again."""
        key = call.meta("x-idempotency-key")
        if not key:
            return await make()
        now = time.monotonic()
        while self._once and next(iter(self._once.values()))[0] < now - ONCE_S:
            self._once.popitem(last=False)
        found = self._once.get((call.tenant, call.name, key))
        if found is not None:
            return await asyncio.shield(found[1])
        fut: asyncio.Future[Any] = asyncio.ensure_future(make())
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "unretrieved"
        self._once[(call.tenant, call.name, key)] = (now, fut)
        while len(self._once) > MAX_ONCE:
            self._once.popitem(last=False)
        return await asyncio.shield(fut)

    def _background(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- client, apps, environments --------------------------------------------------------

    async def ClientHello(self, call: Call, req: Any) -> api_pb2.ClientHelloResponse:
        return api_pb2.ClientHelloResponse(image_builder_version=BUILDER_VERSION)

    async def AuthTokenGet(self, call: Call, req: Any) -> api_pb2.AuthTokenGetResponse:
        # the client only reads its expiry; every control call carries the token anyway
        return api_pb2.AuthTokenGetResponse(
            token=make_jwt(self._config, {"sub": call.tenant, "use": "auth"}, JWT_TTL))

    def _app_id(self, tenant: str, env: str, name: str) -> str:
        return _hash_id("ap", tenant, env, name)

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
            app_id = self._app_id(call.tenant, req.environment_name, req.app_name)
        else:
            app_id = self._app_id(call.tenant, req.environment_name, req.app_name)
            if not await self.wire.listing(call.tenant, app_id, {}, 0, False):
                raise not_found(f"app {req.app_name!r} not found")
        _bounded_put(apps, req.app_name, app_id)
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
            self._background(self._end_app(call.tenant, req.app_id))
        return empty_pb2.Empty()

    async def _end_app(self, tenant: str, app_id: str) -> None:
        for info in await self.wire.listing(tenant, app_id, {}, 0, False):
            try:
                await self.wire.terminate(await self.wire.record(tenant, info.id))
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
            environment_id=_hash_id("en", call.tenant, name),
            metadata=api_pb2.EnvironmentMetadata(name=name, settings=api_pb2.EnvironmentSettings(
                image_builder_version=BUILDER_VERSION)))

    # --- images ------------------------------------------------------------------------------

    async def ImageGetOrCreate(self, call: Call, req: api_pb2.ImageGetOrCreateRequest) -> Any:
        img = req.image
        refused = [what for what, on in (
            ("Image.add_local_* and from_dockerfile context files (context mounts)",
             bool(img.context_mount_id or img.context_files)),
            ("image build functions (Image.run_function)",
             bool(img.build_function_def or img.HasField("build_function"))),
            ("secrets in image builds", bool(img.secret_ids)),
            ("GPUs in image builds", bool(img.gpu_config.type or img.gpu_config.count)),
            ("registry credentials (Image.from_aws_ecr, from_gcp_artifact_registry, "
             "registry_secret)", bool(img.image_registry_config.secret_id)),
            ("build_args", bool(img.build_args)),
            ("volumes in image builds", bool(img.volume_mounts)),
        ) if on]
        bases = {b.docker_tag: b.image_id for b in img.base_images}
        image = await self.images.get_or_create(call.tenant, list(img.dockerfile_commands),
                                                bases, refused)
        out = api_pb2.ImageGetOrCreateResponse(image_id=image.image_id)
        if image.state != "building":
            out.result.CopyFrom(_image_result(image))
            out.metadata.CopyFrom(_image_metadata(image))
        return out

    async def ImageJoinStreaming(self, call: Call,
                                 req: api_pb2.ImageJoinStreamingRequest) -> AsyncIterator[Any]:
        image = self.images.find(call.tenant, req.image_id)
        sent = int(req.last_entry_id) if req.last_entry_id.isdigit() else 0
        deadline = time.monotonic() + min(req.timeout or JOIN_CAP, JOIN_CAP)
        while True:
            if sent < len(image.logs):
                lines = image.logs[sent:]
                sent += len(lines)
                yield api_pb2.ImageJoinStreamingResponse(
                    task_logs=[api_pb2.TaskLogs(data=line + "\n",
                                                file_descriptor=api_pb2.FILE_DESCRIPTOR_STDOUT)
                               for line in lines], entry_id=str(sent))
                continue
            if image.state != "building":
                yield api_pb2.ImageJoinStreamingResponse(
                    result=_image_result(image), metadata=_image_metadata(image),
                    entry_id=str(sent), eof=True)
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return  # the client joins again from its last entry
            await self.images.wait(image, left)

    async def ImageFromId(self, call: Call, req: api_pb2.ImageFromIdRequest) -> Any:
        image = self.images.find(call.tenant, req.image_id)
        return api_pb2.ImageFromIdResponse(image_id=image.image_id,
                                           metadata=_image_metadata(image))

    # --- secrets -----------------------------------------------------------------------------

    async def SecretGetOrCreate(self, call: Call,
                                req: api_pb2.SecretGetOrCreateRequest) -> Any:
        inline = req.object_creation_type in (C.OBJECT_CREATION_TYPE_ANONYMOUS_OWNED_BY_APP,
                                              C.OBJECT_CREATION_TYPE_EPHEMERAL)
        if not inline:
            if req.deployment_name and not req.env_dict:
                raise not_found(f"secret {req.deployment_name!r} not found: this service keeps "
                                "no named secrets; use Secret.from_dict")
            raise unimplemented("named secrets (Secret.from_name, modal secret create)")
        env = dict(req.env_dict)
        sid = _hash_id("st", call.tenant, repr(sorted(env.items())))
        _bounded_put(self._secrets.setdefault(call.tenant, OrderedDict()), sid, env)
        return api_pb2.SecretGetOrCreateResponse(secret_id=sid)

    def _env(self, tenant: str, sources: Any, secret_ids: Any) -> dict[str, str]:
        env: dict[str, str] = {}
        mine = self._secrets.get(tenant, OrderedDict())
        for sid in secret_ids:
            if sid not in mine:
                raise not_found(f"secret {sid!r} not found")
            env.update(mine[sid])
        for source in sources:
            if source.WhichOneof("source") == "env":
                env.update(dict(source.env.contents))
            elif source.secret_id in mine:
                env.update(mine[source.secret_id])
            else:
                raise not_found(f"secret {source.secret_id!r} not found: this service keeps "
                                "no named secrets; use Secret.from_dict")
        return env

    # --- volumes -----------------------------------------------------------------------------

    async def VolumeGetOrCreate(self, call: Call,
                                req: api_pb2.VolumeGetOrCreateRequest) -> Any:
        kind = req.object_creation_type
        if kind == C.OBJECT_CREATION_TYPE_EPHEMERAL:
            name = "eph-" + secrets.token_hex(8)
            await self._sandboxes.volumes.create(call.tenant, name,
                                                 self._config.modal_volume_size)
            self._ephemeral_volumes[(call.tenant, name)] = time.monotonic()
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
        if key in self._ephemeral_volumes:
            self._ephemeral_volumes[key] = time.monotonic()
        return empty_pb2.Empty()

    async def VolumeDelete(self, call: Call, req: api_pb2.VolumeDeleteRequest) -> Any:
        name = req.volume_id.removeprefix("vo-")
        await self._sandboxes.volumes.delete(call.tenant, name)
        self._ephemeral_volumes.pop((call.tenant, name), None)
        return empty_pb2.Empty()

    def _sweep_later(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.ensure_future(self._sweep())

    async def _sweep(self) -> None:
        """Ephemeral volumes whose client stopped its heartbeats are deleted (one still
        mounted is tried again at the next sweep)."""
        while self._ephemeral_volumes:
            await asyncio.sleep(SWEEP_S)
            now = time.monotonic()
            for (tenant, name), beat in list(self._ephemeral_volumes.items()):
                if now - beat < EPHEMERAL_TTL:
                    continue
                try:
                    await self._sandboxes.volumes.delete(tenant, name)
                    self._ephemeral_volumes.pop((tenant, name), None)
                except VolumeInUseError:
                    pass
                except Exception as exc:
                    log.warning("deleting ephemeral volume %s: %s", name, exc)

    # --- sandboxes: create -------------------------------------------------------------------

    async def SandboxCreateV2(self, call: Call,
                              req: api_pb2.SandboxCreateV2Request) -> Any:
        return await self._idempotent(call, lambda: self._create_v2(call, req))

    async def _create_v2(self, call: Call, req: api_pb2.SandboxCreateV2Request) -> Any:
        env = self._env(call.tenant, req.secret_sources, req.definition.secret_ids)
        if req.ephemeral_secrets.contents:
            env.update(dict(req.ephemeral_secrets.contents))
        rec, entry = await self._create(call, req.app_id, req.definition, env,
                                        {t.tag_name: t.tag_value for t in req.tags})
        out = api_pb2.SandboxCreateV2Response(
            sandbox_id=modal_id(rec.api_id),
            metadata=api_pb2.SandboxHandleMetadata(app_id=rec.app_id))
        if entry is not None:
            out.task_id = task_id(rec.api_id)
            out.command_router_access.CopyFrom(self._access(call, rec))
            if self._config.port_host_suffix:
                out.tunnels.extend(self.wire.tunnels(rec, entry, self._base()))
        return out

    async def SandboxCreate(self, call: Call, req: api_pb2.SandboxCreateRequest) -> Any:
        """The V1 create (``MODAL_SANDBOX_V2=0``): secrets by id; the client then polls
        ``SandboxGetTaskId``."""
        return await self._idempotent(call, lambda: self._create_v1(call, req))

    async def _create_v1(self, call: Call, req: api_pb2.SandboxCreateRequest) -> Any:
        env = self._env(call.tenant, (), req.definition.secret_ids)
        rec, _ = await self._create(call, req.app_id, req.definition, env,
                                    {t.tag_name: t.tag_value for t in req.tags})
        return api_pb2.SandboxCreateResponse(
            sandbox_id=modal_id(rec.api_id),
            metadata=api_pb2.SandboxHandleMetadata(app_id=rec.app_id))

    async def _create(self, call: Call, app_id: str, d: api_pb2.Sandbox, env: dict[str, str],
                      tags: dict[str, str]) -> tuple[WireSandbox, Any]:
        if not app_id:
            raise invalid("a sandbox needs an app (App.lookup(name, create_if_missing=True))")
        ws.check_tags(tags)
        options = self._options(d, env)
        image = self.images.find(call.tenant, d.image_id) if d.image_id else None
        built = None
        if image is not None:
            options["image"] = image.root
            if image.needs_build:
                await self.images.wait(image, self._config.modal_build_timeout)
                if image.state != "ready" or image.built is None:
                    raise GRPCError(Status.FAILED_PRECONDITION,
                                    f"image {image.image_id} did not build: {image.error}")
                built = (*image.built, image.image_id)
            else:
                options["env"] = {**image.env(), **options["env"]}
                if image.workdir() and "workdir" not in options:
                    options["workdir"] = image.workdir()
        else:
            options["image"] = self.images.default_root()
        plain = [p.port for p in d.open_ports.ports if p.unencrypted]
        labels = {**tags, ws.APP_LABEL: app_id}
        if plain:
            labels[ws.PLAIN_LABEL] = ",".join(map(str, plain))
        name = d.name if d.HasField("name") and d.name else None
        if name is not None:
            labels[ws.NAME_LABEL] = name
            await self.wire.claim_name(call.tenant, name)
        options["labels"] = labels
        try:
            body = CreateSandbox.model_validate(options)
        except ValueError as exc:
            if name is not None:
                self.wire.release_name(call.tenant, name)
            raise invalid(f"invalid sandbox: {exc}") from None
        try:
            entry = await self._sandboxes.create(call.tenant, body, built)
        finally:
            if name is not None:
                self.wire.release_name(call.tenant, name)
        rec = self.wire.remember(WireSandbox(
            entry.api_id, call.tenant, app_id, name, tags, entry.created_at or time.time(),
            timeout=options.get("ttl_seconds"), plain_ports=tuple(plain)))
        running = await self._until_running(rec, self._config.modal_create_wait)
        if running is not None and d.entrypoint_args:
            await self.wire.start_entrypoint(rec, running, list(d.entrypoint_args),
                                             options.get("workdir"))
        elif d.entrypoint_args:
            self._background(self._entrypoint_later(rec, list(d.entrypoint_args),
                                                    options.get("workdir")))
        return rec, running

    async def _until_running(self, rec: WireSandbox, wait: float) -> Any:
        """The service's entry once the sandbox runs (within ``wait`` s), else None; a
        create that failed is its error, as Modal's client shows it."""
        entry = await self._sandboxes.find(rec.tenant, rec.api_id)
        info = await self._sandboxes.info(entry, wait)
        if info.status == "error":
            rec.end(R(status=R.GENERIC_STATUS_FAILURE, exitcode=1, exception=info.reason or ""))
            code = info.reason.split(":", 1)[0] if info.reason else ""
            status = {"capacity": Status.RESOURCE_EXHAUSTED, "image_not_found": Status.NOT_FOUND,
                      "config": Status.INVALID_ARGUMENT}.get(code, Status.FAILED_PRECONDITION)
            raise GRPCError(status, f"the sandbox could not be created: {info.reason}")
        if info.status != "running":
            return None
        return await self._sandboxes.running(rec.tenant, rec.api_id)

    async def _entrypoint_later(self, rec: WireSandbox, args: list[str],
                                workdir: str | None) -> None:
        deadline = time.monotonic() + self._config.create_timeout
        while time.monotonic() < deadline and rec.result is None:
            try:
                entry = await self._until_running(rec, WAIT_CAP)
            except GRPCError:
                return  # its error is its result
            if entry is not None:
                await self.wire.start_entrypoint(rec, entry, args, workdir)
                return

    def _options(self, d: api_pb2.Sandbox, env: dict[str, str]) -> dict[str, Any]:
        """A Modal sandbox definition as the service's create options (or UNIMPLEMENTED
        naming the first option it cannot honour)."""
        exp = dict(d.experimental_options) or dict(d.experimental_options_v2)
        for what, given in (
            ("gpu", bool(d.resources.gpu_config.type or d.resources.gpu_config.count)),
            ("pty on create", d.pty_info.enabled),
            ("network_file_systems", bool(d.nfs_mounts)),
            ("cloud bucket mounts", bool(d.cloud_bucket_mounts or d.s3_mounts)),
            ("local mounts (mount_ids)", bool(d.mount_ids)),
            ("custom_domain", bool(d.custom_domain)),
            ("readiness_probe", d.HasField("readiness_probe")),
            ("inbound_cidr_allowlist", bool(d.inbound_cidr_allowlist)),
            ("proxy", d.HasField("proxy_id")),
            ("region/cloud placement", d.HasField("scheduler_placement")
             or bool(d.cloud_provider_str)),
            ("runtime='vm'", d.HasField("runtime") and d.runtime not in ("", "gvisor")),
            (f"experimental_options {sorted(exp)}", bool(exp)),
            ("_experimental_enable_snapshot", d.enable_snapshot),
            ("include_oidc_identity_token", d.include_oidc_identity_token),
            ("include_x509_svid", d.include_x509_svid),
            ("i6pn networking", d.i6pn_enabled),
            ("outbound policies (OutboundPolicy)", d.HasField("outbound_policy")
             or d.HasField("experimental_outbound_policy")),
            ("HTTP/2 tunnels (h2_ports)", any(p.HasField("tunnel_type") and p.tunnel_type
                                              for p in d.open_ports.ports)),
            ("rdma", d.resources.rdma),
        ):
            if given:
                raise unimplemented(f"Sandbox.create({what})")
        env = {**env, **dict(d.environment_variables.contents)}
        out: dict[str, Any] = {"env": env}
        access = d.network_access.network_access_type
        blocked = d.block_network or access == NA.BLOCKED
        out["network"] = "none" if blocked else "public"
        if access == NA.ALLOWLIST:
            out["egress"] = egress_of(d.network_access)
        ports = [p.port for p in d.open_ports.ports]
        if ports:
            if blocked:
                raise invalid("a sandbox with block_network=True publishes no ports")
            out["expose_ports"] = ports
        if d.timeout_secs:
            out["ttl_seconds"] = float(d.timeout_secs)
        if d.HasField("idle_timeout_secs") and d.idle_timeout_secs:
            out["idle_timeout_seconds"] = float(d.idle_timeout_secs)
        if d.HasField("workdir") and d.workdir:
            out["workdir"] = d.workdir
        r = d.resources
        if r.milli_cpu or r.milli_cpu_max:
            out["cpu"] = max(r.milli_cpu, r.milli_cpu_max) / 1000  # reserves what it may use
        if r.memory_mb or r.memory_mb_max:
            out["memory"] = f"{max(r.memory_mb, r.memory_mb_max)}Mi"
        if r.ephemeral_disk_mb:
            out["disk"] = f"{r.ephemeral_disk_mb}Mi"
        if d.volume_mounts:
            vols = {}
            for m in d.volume_mounts:
                if m.HasField("sub_path"):
                    raise unimplemented("a volume's sub_path")
                vols[m.mount_path] = {"name": m.volume_id.removeprefix("vo-"),
                                      "readonly": m.read_only}
            out["volumes"] = vols
        return out

    # --- sandboxes: state --------------------------------------------------------------------

    def _base(self) -> str:
        return self._config.public_url or self._config.served_at or "http://127.0.0.1"

    def _router_url(self, call: Call) -> str:
        if self._config.modal_url:
            return self._config.modal_url
        host = call.meta("x-modal-host") or "127.0.0.1"
        if not re.fullmatch(r"[A-Za-z0-9.\-]+|\[[0-9a-fA-F:.]+\]", host):
            host = "127.0.0.1"
        return f"http://{host}:{self._config.modal_port}"

    def _access(self, call: Call, rec: WireSandbox) -> api_pb2.CommandRouterAccess:
        jwt = make_jwt(self._config, {"sub": call.tenant, "sid": rec.api_id}, JWT_TTL)
        return api_pb2.CommandRouterAccess(url=self._router_url(call), jwt=jwt)

    async def SandboxGetTaskIdV2(self, call: Call, req: api_pb2.SandboxGetTaskIdRequest) -> Any:
        rec = await self.wire.record(call.tenant, req.sandbox_id)
        if rec.result is None:
            wait = min(req.timeout, WAIT_CAP) if req.HasField("timeout") else WAIT_CAP / 2
            try:
                running = await self._until_running(rec, wait)
            except GRPCError:
                running = None  # its error is its result
            if running is not None and rec.result is None:
                return api_pb2.SandboxGetTaskIdResponse(task_id=task_id(rec.api_id))
        if rec.result is not None:
            return api_pb2.SandboxGetTaskIdResponse(task_result=rec.result)
        return api_pb2.SandboxGetTaskIdResponse()

    SandboxGetTaskId = SandboxGetTaskIdV2

    async def SandboxGetCommandRouterAccess(
            self, call: Call, req: api_pb2.SandboxGetCommandRouterAccessRequest) -> Any:
        rec = await self.wire.record(call.tenant, req.sandbox_id or req.task_id)
        access = self._access(call, rec)
        return api_pb2.SandboxGetCommandRouterAccessResponse(jwt=access.jwt, url=access.url)

    async def TaskGetCommandRouterAccess(
            self, call: Call, req: api_pb2.TaskGetCommandRouterAccessRequest) -> Any:
        rec = await self.wire.record(call.tenant, req.task_id)
        access = self._access(call, rec)
        return api_pb2.TaskGetCommandRouterAccessResponse(jwt=access.jwt, url=access.url)

    async def SandboxWaitV2(self, call: Call, req: api_pb2.SandboxWaitRequest) -> Any:
        rec = await self.wire.record(call.tenant, req.sandbox_id)
        result = await self.wire.result(rec, min(req.timeout, WAIT_CAP))
        out = api_pb2.SandboxWaitResponse(
            metadata=api_pb2.SandboxHandleMetadata(app_id=rec.app_id))
        if result is not None:
            out.result.CopyFrom(result)
            out.metadata.result.CopyFrom(result)
        return out

    SandboxWait = SandboxWaitV2

    async def SandboxTerminateV2(self, call: Call, req: api_pb2.SandboxTerminateRequest) -> Any:
        rec = await self.wire.record(call.tenant, req.sandbox_id)
        if rec.result is None:
            await self.wire.terminate(rec)
        return api_pb2.SandboxTerminateResponse(existing_result=rec.result)

    SandboxTerminate = SandboxTerminateV2

    async def SandboxGetTunnelsV2(self, call: Call, req: api_pb2.SandboxGetTunnelsRequest) -> Any:
        rec = await self.wire.record(call.tenant, req.sandbox_id)
        entry = await self.wire.running(rec)
        return api_pb2.SandboxGetTunnelsResponse(
            result=R(status=R.GENERIC_STATUS_SUCCESS),
            tunnels=self.wire.tunnels(rec, entry, self._base()))

    SandboxGetTunnels = SandboxGetTunnelsV2

    async def SandboxListV2(self, call: Call, req: api_pb2.SandboxListRequest) -> Any:
        tags = {t.tag_name: t.tag_value for t in req.tags}
        return api_pb2.SandboxListResponse(sandboxes=await self.wire.listing(
            call.tenant, req.app_id, tags, req.before_timestamp, req.include_finished))

    SandboxList = SandboxListV2

    async def SandboxGetFromNameV2(self, call: Call,
                                   req: api_pb2.SandboxGetFromNameRequest) -> Any:
        apps: OrderedDict[str, str] = self._apps.get(call.tenant, OrderedDict())
        app_id = apps.get(req.app_name) or \
            self._app_id(call.tenant, req.environment_name, req.app_name)
        for info in await self.wire.listing(call.tenant, app_id, {}, 0,
                                            req.include_terminated):
            if info.name == req.sandbox_name:
                return api_pb2.SandboxGetFromNameResponse(
                    sandbox_id=info.id, metadata=api_pb2.SandboxHandleMetadata(app_id=app_id))
        raise not_found(f"no running sandbox named {req.sandbox_name!r} in app "
                        f"{req.app_name!r}")

    SandboxGetFromName = SandboxGetFromNameV2

    async def SandboxTagsGetV2(self, call: Call, req: api_pb2.SandboxTagsGetRequest) -> Any:
        rec = await self.wire.record(call.tenant, req.sandbox_id)
        return api_pb2.SandboxTagsGetResponse(tags=[
            api_pb2.SandboxTag(tag_name=k, tag_value=v) for k, v in sorted(rec.tags.items())])

    SandboxTagsGet = SandboxTagsGetV2

    # --- V1 entrypoint stdio (control plane) -----------------------------------------------

    async def SandboxGetLogs(self, call: Call,
                             req: api_pb2.SandboxGetLogsRequest) -> AsyncIterator[Any]:
        rec = await self.wire.record(call.tenant, req.sandbox_id)
        if rec.entry is None:
            await self.wire.result(rec, min(req.timeout or WAIT_CAP, WAIT_CAP))
        proc = rec.entry
        if proc is None:  # no command: no output
            if rec.result is not None:
                yield api_pb2.TaskLogsBatch(eof=True, entry_id=req.last_entry_id or "0")
            return
        out = proc.stdout if req.file_descriptor == api_pb2.FILE_DESCRIPTOR_STDOUT \
            else proc.stderr
        start = int(req.last_entry_id) if req.last_entry_id.isdigit() else 0
        async for off, chunk in out.read(start, self._config.modal_stream_idle_seconds):
            yield api_pb2.TaskLogsBatch(
                items=[api_pb2.TaskLogs(data=chunk.decode(errors="replace"),
                                        file_descriptor=req.file_descriptor)],
                entry_id=str(off + len(chunk)))
        yield api_pb2.TaskLogsBatch(eof=True, entry_id=str(out.end))

    async def SandboxStdinWrite(self, call: Call, req: api_pb2.SandboxStdinWriteRequest) -> Any:
        rec = await self.wire.record(call.tenant, req.sandbox_id)
        if rec.entry is None:
            raise GRPCError(Status.FAILED_PRECONDITION, "the sandbox has no command to write "
                                                        "to")
        await rec.entry.write_stdin(rec.entry.stdin_offset, req.input, req.eof)
        return api_pb2.SandboxStdinWriteResponse()


def egress_of(access: api_pb2.NetworkAccess) -> dict[str, Any]:
    """Modal's allow-lists as an egress policy that denies the rest. ``"*"`` among the
    domains or ``0.0.0.0/0`` among the CIDRs (Harbor's "public" phase) opens the public
    internet as a plain networked sandbox does (private ranges stay denied)."""
    cidrs = list(access.allowed_cidrs)
    domains = list(access.allowed_domains)
    if "*" in domains or "0.0.0.0/0" in cidrs:
        return {"default": "allow"}
    for d in domains:
        if d.startswith("*."):
            raise unimplemented(f"wildcard domains in an allow-list ({d!r})")
    return {"default": "deny", "allow_cidrs": cidrs, "allow_domains": domains}


def _image_result(image: WireImage) -> api_pb2.GenericResult:
    if image.state == "failed":
        return R(status=R.GENERIC_STATUS_FAILURE, exception=image.error or "build failed")
    return R(status=R.GENERIC_STATUS_SUCCESS)


def _image_metadata(image: WireImage) -> api_pb2.ImageMetadata:
    out = api_pb2.ImageMetadata(image_builder_version=BUILDER_VERSION)
    workdir = image.workdir()
    if workdir:
        out.workdir = workdir
    return out
