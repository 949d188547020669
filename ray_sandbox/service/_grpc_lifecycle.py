"""The sandboxes' lifecycle on Modal's control plane (``modal.client.ModalClient``): create,
the task id, wait, terminate, list, by name, tags, tunnels, the router's access, and the
entrypoint's V1 stdio; both the V2 calls the client makes by default and their V1 names.
The other concepts of the control plane have modules of their own (``_grpc_apps``,
``_grpc_images``, ``_grpc_secrets``, ``_grpc_volumes``); every RPC of the service's ~570
without a handler is UNIMPLEMENTED naming it (``_grpc.Ingress``).

Creates go through :meth:`Sandboxes.create` (the tenant's policy, quota and books); a
Modal option this service cannot honour is UNIMPLEMENTED naming it, never dropped.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from grpclib import GRPCError, Status
from modal_proto import api_pb2

from . import _grpc_sandboxes as ws
from ._config import ServiceConfig
from ._grpc import JWT_TTL, Call, invalid, make_jwt, not_found, spawn, unimplemented
from ._grpc_apps import Apps
from ._grpc_images import Images
from ._grpc_sandboxes import WireSandbox, WireSandboxes, modal_id, task_id
from ._grpc_secrets import Secrets
from ._models import CreateSandbox
from ._sandboxes import Sandboxes

WAIT_CAP = 10.0  # a long poll of the client (SandboxWait asks for 10 s; others less)
ONCE_S = 120.0  # a retried call (the same x-idempotency-key) gets the first one's answer
MAX_ONCE = 4096
NA = api_pb2.NetworkAccess
R = api_pb2.GenericResult


class Lifecycle:
    """The sandbox lifecycle handlers, over this replica's :class:`Sandboxes` and Modal's
    view of them (``wire``)."""

    def __init__(self, config: ServiceConfig, sandboxes: Sandboxes, wire: WireSandboxes,
                 apps: Apps, images: Images, secrets: Secrets) -> None:
        self._config = config
        self._sandboxes = sandboxes
        self._wire = wire
        self._apps = apps
        self._images = images
        self._secrets = secrets
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

    # --- sandboxes: create -------------------------------------------------------------------

    async def SandboxCreateV2(self, call: Call,
                              req: api_pb2.SandboxCreateV2Request) -> Any:
        return await self._idempotent(call, lambda: self._create_v2(call, req))

    async def _create_v2(self, call: Call, req: api_pb2.SandboxCreateV2Request) -> Any:
        env = self._secrets.env(call.tenant, req.secret_sources, req.definition.secret_ids)
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
                out.tunnels.extend(self._wire.tunnels(rec, entry, self._base()))
        return out

    async def SandboxCreate(self, call: Call, req: api_pb2.SandboxCreateRequest) -> Any:
        """The V1 create (``MODAL_SANDBOX_V2=0``): secrets by id; the client then polls
        ``SandboxGetTaskId``."""
        return await self._idempotent(call, lambda: self._create_v1(call, req))

    async def _create_v1(self, call: Call, req: api_pb2.SandboxCreateRequest) -> Any:
        env = self._secrets.env(call.tenant, (), req.definition.secret_ids)
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
        image = self._images.find(call.tenant, d.image_id) if d.image_id else None
        built = None
        if image is not None:
            options["image"] = image.root
            if image.needs_build:
                await self._images.wait(image, self._config.modal_build_timeout)
                if image.state != "ready" or image.built is None:
                    raise GRPCError(Status.FAILED_PRECONDITION,
                                    f"image {image.image_id} did not build: {image.error}")
                built = (*image.built, image.image_id)
            else:
                options["env"] = {**image.env(), **options["env"]}
                if image.workdir() and "workdir" not in options:
                    options["workdir"] = image.workdir()
        else:
            options["image"] = self._images.default_root()
        plain = [p.port for p in d.open_ports.ports if p.unencrypted]
        labels = {**tags, ws.APP_LABEL: app_id}
        if plain:
            labels[ws.PLAIN_LABEL] = ",".join(map(str, plain))
        name = d.name if d.HasField("name") and d.name else None
        if name is not None:
            labels[ws.NAME_LABEL] = name
            await self._wire.claim_name(call.tenant, name)
        options["labels"] = labels
        try:
            body = CreateSandbox.model_validate(options)
        except ValueError as exc:
            if name is not None:
                self._wire.release_name(call.tenant, name)
            raise invalid(f"invalid sandbox: {exc}") from None
        try:
            entry = await self._sandboxes.create(call.tenant, body, built)
        finally:
            if name is not None:
                self._wire.release_name(call.tenant, name)
        rec = self._wire.remember(WireSandbox(
            entry.api_id, call.tenant, app_id, name, tags, entry.created_at or time.time(),
            timeout=options.get("ttl_seconds"), plain_ports=tuple(plain)))
        running = await self._until_running(rec, self._config.modal_create_wait)
        if running is not None and d.entrypoint_args:
            await self._wire.start_entrypoint(rec, running, list(d.entrypoint_args),
                                             options.get("workdir"))
        elif d.entrypoint_args:
            spawn(self._tasks, self._entrypoint_later(rec, list(d.entrypoint_args),
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
                await self._wire.start_entrypoint(rec, entry, args, workdir)
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
        rec = await self._wire.record(call.tenant, req.sandbox_id)
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
        rec = await self._wire.record(call.tenant, req.sandbox_id or req.task_id)
        access = self._access(call, rec)
        return api_pb2.SandboxGetCommandRouterAccessResponse(jwt=access.jwt, url=access.url)

    async def TaskGetCommandRouterAccess(
            self, call: Call, req: api_pb2.TaskGetCommandRouterAccessRequest) -> Any:
        rec = await self._wire.record(call.tenant, req.task_id)
        access = self._access(call, rec)
        return api_pb2.TaskGetCommandRouterAccessResponse(jwt=access.jwt, url=access.url)

    async def SandboxWaitV2(self, call: Call, req: api_pb2.SandboxWaitRequest) -> Any:
        rec = await self._wire.record(call.tenant, req.sandbox_id)
        result = await self._wire.result(rec, min(req.timeout, WAIT_CAP))
        out = api_pb2.SandboxWaitResponse(
            metadata=api_pb2.SandboxHandleMetadata(app_id=rec.app_id))
        if result is not None:
            out.result.CopyFrom(result)
            out.metadata.result.CopyFrom(result)
        return out

    SandboxWait = SandboxWaitV2

    async def SandboxTerminateV2(self, call: Call, req: api_pb2.SandboxTerminateRequest) -> Any:
        rec = await self._wire.record(call.tenant, req.sandbox_id)
        if rec.result is None:
            await self._wire.terminate(rec)
        return api_pb2.SandboxTerminateResponse(existing_result=rec.result)

    SandboxTerminate = SandboxTerminateV2

    async def SandboxGetTunnelsV2(self, call: Call, req: api_pb2.SandboxGetTunnelsRequest) -> Any:
        rec = await self._wire.record(call.tenant, req.sandbox_id)
        entry = await self._wire.running(rec)
        return api_pb2.SandboxGetTunnelsResponse(
            result=R(status=R.GENERIC_STATUS_SUCCESS),
            tunnels=self._wire.tunnels(rec, entry, self._base()))

    SandboxGetTunnels = SandboxGetTunnelsV2

    async def SandboxListV2(self, call: Call, req: api_pb2.SandboxListRequest) -> Any:
        tags = {t.tag_name: t.tag_value for t in req.tags}
        return api_pb2.SandboxListResponse(sandboxes=await self._wire.listing(
            call.tenant, req.app_id, tags, req.before_timestamp, req.include_finished))

    SandboxList = SandboxListV2

    async def SandboxGetFromNameV2(self, call: Call,
                                   req: api_pb2.SandboxGetFromNameRequest) -> Any:
        app_id = self._apps.app_id(call.tenant, req.environment_name, req.app_name)
        for info in await self._wire.listing(call.tenant, app_id, {}, 0,
                                            req.include_terminated):
            if info.name == req.sandbox_name:
                return api_pb2.SandboxGetFromNameResponse(
                    sandbox_id=info.id, metadata=api_pb2.SandboxHandleMetadata(app_id=app_id))
        raise not_found(f"no running sandbox named {req.sandbox_name!r} in app "
                        f"{req.app_name!r}")

    SandboxGetFromName = SandboxGetFromNameV2

    async def SandboxTagsGetV2(self, call: Call, req: api_pb2.SandboxTagsGetRequest) -> Any:
        rec = await self._wire.record(call.tenant, req.sandbox_id)
        return api_pb2.SandboxTagsGetResponse(tags=[
            api_pb2.SandboxTag(tag_name=k, tag_value=v) for k, v in sorted(rec.tags.items())])

    SandboxTagsGet = SandboxTagsGetV2

    # --- V1 entrypoint stdio (control plane) -----------------------------------------------

    async def SandboxGetLogs(self, call: Call,
                             req: api_pb2.SandboxGetLogsRequest) -> AsyncIterator[Any]:
        rec = await self._wire.record(call.tenant, req.sandbox_id)
        if rec.entry is None:
            await self._wire.result(rec, min(req.timeout or WAIT_CAP, WAIT_CAP))
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
        rec = await self._wire.record(call.tenant, req.sandbox_id)
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

