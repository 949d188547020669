"""Modal's view of a tenant's sandboxes, over the service's :class:`Sandboxes`: each is one
of the tenant's sandboxes there (the same quota, policy, books and audit log as ``/api/v1``),
with what Modal's client also asks about kept beside it: its app, name and tags (as labels
on the sandbox, so another replica or a restart finds them), its entrypoint process, its
commands' processes (``_grpc_procs``), and how it ended.

Ids: the Modal id of the sandbox with API id ``X`` is ``sb-X``, its task id ``ta-X`` (both
longer than Modal's V1 shape, so the client uses its default V2 calls on any handle).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from grpclib import GRPCError, Status
from modal_proto import api_pb2

from ..runtime.errors import SandboxError
from ..runtime.verbs import SpawnRequest
from . import _ports
from ._config import ServiceConfig
from ._grpc import not_found
from ._grpc_procs import Proc
from ._sandboxes import Entry, Sandboxes

log = logging.getLogger(__name__)

APP_LABEL = "modal.app"  # the sandbox's app id (Sandbox.list(app_id=), from_name)
NAME_LABEL = "modal.name"  # its name, unique among the tenant's running sandboxes
PLAIN_LABEL = "modal.unencrypted"  # its unencrypted_ports (the others are encrypted)
MODAL_LABELS = (APP_LABEL, NAME_LABEL, PLAIN_LABEL)
ID_RE = re.compile(r"^(sb|ta)-([0-9a-f]{32})$")
WAIT_STEP = 1.0  # a wait asks the host whether the sandbox still runs this often
MAX_RECORDS = 4096  # sandboxes remembered per replica (ended ones are forgotten first)
MAX_EXECS = 256  # processes per sandbox (running ones included)
MAX_FINISHED = 16  # finished processes kept per sandbox, with their unread output
FINISHED_KEEP_S = 300.0  # ... and for this long after they ended
FINISHED = {"terminated", "error"}

R = api_pb2.GenericResult


def modal_id(api_id: str) -> str:
    return f"sb-{api_id}"


def task_id(api_id: str) -> str:
    return f"ta-{api_id}"


def api_id_of(some_id: str) -> str:
    """The API id in a Modal sandbox or task id; any other string is not found (as an id of
    another tenant's: the answer must not tell them apart)."""
    m = ID_RE.match(some_id or "")
    if m is None:
        raise not_found(f"no sandbox {some_id!r}")
    return m.group(2)


@dataclass(eq=False)
class WireSandbox:
    """What the Modal ingress knows of one sandbox beyond the service's entry."""

    api_id: str
    tenant: str
    app_id: str
    name: str | None
    tags: dict[str, str]
    created_at: float
    timeout: float | None = None
    plain_ports: tuple[int, ...] = ()
    entry: Proc | None = None  # the entrypoint, if one was given
    execs: OrderedDict[str, Proc] = field(default_factory=OrderedDict)
    result: api_pb2.GenericResult | None = None
    ending: bool = False  # a terminate was asked for
    ended: asyncio.Event = field(default_factory=asyncio.Event, init=False)

    def end(self, result: api_pb2.GenericResult) -> None:
        if self.result is None:
            self.result = result
            self.ended.set()


def _labels_of(entry: Entry) -> tuple[str, str | None, tuple[int, ...], dict[str, str]]:
    labels = entry.labels
    plain = tuple(int(p) for p in labels.get(PLAIN_LABEL, "").split(",") if p.isdigit())
    tags = {k: v for k, v in labels.items() if k not in MODAL_LABELS}
    return labels.get(APP_LABEL, ""), labels.get(NAME_LABEL), plain, tags


class WireSandboxes:
    """This replica's records of the tenants' sandboxes as Modal sees them."""

    def __init__(self, config: ServiceConfig, sandboxes: Sandboxes) -> None:
        self.config = config
        self.sandboxes = sandboxes
        self._records: OrderedDict[str, WireSandbox] = OrderedDict()
        self._naming: dict[str, set[str]] = {}  # tenant -> names being created here

    # --- records ---------------------------------------------------------------------------

    def remember(self, rec: WireSandbox) -> WireSandbox:
        self._records[rec.api_id] = rec
        while len(self._records) > MAX_RECORDS:
            ended = next((k for k, r in self._records.items() if r.result is not None), None)
            self._records.pop(ended if ended is not None else next(iter(self._records)))
        return rec

    async def record(self, tenant: str, some_id: str) -> WireSandbox:
        """The tenant's sandbox by Modal id (or task id); anyone else's is not found. One
        this replica did not make (another replica's, one made over HTTP) is found through
        the service and its labels."""
        api_id = api_id_of(some_id)
        rec = self._records.get(api_id)
        if rec is not None:
            if rec.tenant != tenant:
                raise not_found(f"no sandbox {some_id!r}")
            return rec
        entry = await self.sandboxes.find(tenant, api_id)
        app_id, name, plain, tags = _labels_of(entry)
        return self.remember(WireSandbox(api_id, tenant, app_id, name, tags,
                                         entry.created_at or time.time(), plain_ports=plain))

    async def running(self, rec: WireSandbox) -> Entry:
        """The service's entry of a running sandbox (with its handle); one that ended is
        FAILED_PRECONDITION, as Modal answers for a finished sandbox."""
        if rec.result is not None:
            raise GRPCError(Status.FAILED_PRECONDITION, f"sandbox {modal_id(rec.api_id)} "
                                                        "has finished")
        return await self.sandboxes.running(rec.tenant, rec.api_id)

    # --- names -------------------------------------------------------------------------------

    async def claim_name(self, tenant: str, name: str) -> None:
        """Hold ``name`` for a create of the tenant: ALREADY_EXISTS if one of its running
        sandboxes (on any replica: asked through the service) or a create here has it."""
        taking = self._naming.setdefault(tenant, set())
        if name in taking:
            raise GRPCError(Status.ALREADY_EXISTS, f"a sandbox named {name!r} is being "
                                                   "created")
        taking.add(name)
        try:
            found = await self.sandboxes.list(tenant, {NAME_LABEL: name})
        except BaseException:
            self.release_name(tenant, name)
            raise
        if any(info.status not in FINISHED for info in found):
            self.release_name(tenant, name)
            raise GRPCError(Status.ALREADY_EXISTS, f"a running sandbox is named {name!r} "
                                                   "already")

    def release_name(self, tenant: str, name: str) -> None:
        taking = self._naming.get(tenant)
        if taking is not None:
            taking.discard(name)
            if not taking:
                del self._naming[tenant]

    # --- state -------------------------------------------------------------------------------

    async def result(self, rec: WireSandbox, wait: float) -> api_pb2.GenericResult | None:
        """How it ended, waiting up to ``wait`` seconds (asking its host every
        ``WAIT_STEP``); None while it runs."""
        deadline = time.monotonic() + max(0.0, wait)
        while True:
            if rec.result is not None:
                return rec.result
            await self._check(rec)
            left = deadline - time.monotonic()
            if rec.result is not None or left <= 0:
                return rec.result
            try:
                await asyncio.wait_for(rec.ended.wait(), min(WAIT_STEP, left))
            except TimeoutError:
                pass

    async def _check(self, rec: WireSandbox) -> None:
        """Ask the service whether it still runs; one it ended by itself ended by its
        timeout (TTL, idle), one that failed to be created by its error."""
        try:
            entry = await self.sandboxes.find(rec.tenant, rec.api_id)
            info = await self.sandboxes.info(entry)
        except Exception as exc:  # gone (404: deleted elsewhere, ended by its TTL)
            if getattr(exc, "status_code", None) != 404:
                raise
            status, reason = "terminated", None
        else:
            status, reason = info.status, info.reason
        if status == "error":
            rec.end(R(status=R.GENERIC_STATUS_FAILURE, exitcode=1,
                      exception=f"the sandbox could not be created: {reason}"))
        elif status == "terminated":
            rec.end(R(status=R.GENERIC_STATUS_TERMINATED) if rec.ending
                    else R(status=R.GENERIC_STATUS_TIMEOUT, exitcode=124))

    async def terminate(self, rec: WireSandbox) -> None:
        rec.ending = True
        for proc in [*rec.execs.values(), *([rec.entry] if rec.entry else [])]:
            if proc.task is not None:
                proc.task.cancel()
        await self.sandboxes.delete(rec.tenant, rec.api_id)
        rec.end(R(status=R.GENERIC_STATUS_TERMINATED))

    # --- the entrypoint ----------------------------------------------------------------------

    async def start_entrypoint(self, rec: WireSandbox, entry: Entry, args: list[str],
                               workdir: str | None) -> None:
        """Run ``args`` as the sandbox's command: its output is the sandbox's stdout and
        stderr, and the sandbox ends when it exits, with its exit code."""
        proc = Proc(entry.handle, self.sandboxes.call, out_cap=self.config.modal_output_bytes,
                    stdin_cap=self.config.modal_stdin_bytes)
        try:
            await proc.start(SpawnRequest(command=args, cwd=workdir), None)
        except SandboxError as exc:  # it could not start (no such command): the sandbox ends
            rec.ending = True
            rec.end(R(status=R.GENERIC_STATUS_FAILURE, exitcode=127,
                      exception=f"the sandbox's command could not start: {exc.message}"))
            await self.sandboxes.delete(rec.tenant, rec.api_id)
            return
        rec.entry = proc

        async def ended() -> None:
            await proc.done.wait()
            if rec.result is None and not rec.ending:
                try:  # the command may have died with its sandbox (its TTL): that is its end
                    await self._check(rec)
                except Exception as exc:
                    log.info("checking %s after its command exited: %s", rec.api_id, exc)
            if rec.result is not None or rec.ending:
                return
            code = proc.exit_code if proc.exit_code is not None else 1
            result = R(status=R.GENERIC_STATUS_SUCCESS if code == 0 else
                       R.GENERIC_STATUS_FAILURE, exitcode=code)
            rec.ending = True
            rec.end(result)  # before the delete: a wait meanwhile sees the exit, not an end
            try:
                await self.sandboxes.delete(rec.tenant, rec.api_id)
            except Exception as exc:  # its TTL ends it
                log.warning("ending %s after its command exited: %s", rec.api_id, exc)

        proc.watcher = asyncio.ensure_future(ended())  # held: an unheld task may vanish

    # --- tunnels -----------------------------------------------------------------------------

    def tunnels(self, rec: WireSandbox, entry: Entry, base: str) -> list[api_pb2.TunnelData]:
        """One tunnel per published port: the service's signed port URL in its host form
        (``<label>.<port_host_suffix>``), the grant in the name; its life is the sandbox's
        timeout, at most ``max_port_url_seconds``."""
        if not entry.ports:
            return []
        if not self.config.port_host_suffix:
            raise GRPCError(Status.FAILED_PRECONDITION, "tunnels need the service's "
                                                        "port_host_suffix (--port-host-suffix"
                                                        "): Modal's tunnel is a host name")
        ttl = rec.timeout or self.config.max_port_url_seconds
        port = self.config.modal_tunnel_port
        out = []
        for p in entry.ports:
            grant = _ports.port_url(self.config, base, entry, p, ttl)
            host = urlsplit(grant["host_url"]).hostname or ""
            t = api_pb2.TunnelData(host=host, port=port, container_port=p)
            if p in rec.plain_ports:
                t.unencrypted_host = host
                t.unencrypted_port = self.config.modal_tunnel_plain_port or port
            out.append(t)
        return out

    def info(self, rec: WireSandbox) -> api_pb2.SandboxInfo:
        return api_pb2.SandboxInfo(
            id=modal_id(rec.api_id), created_at=rec.created_at, app_id=rec.app_id,
            name=rec.name or "", tags=[api_pb2.SandboxTag(tag_name=k, tag_value=v)
                                       for k, v in sorted(rec.tags.items())],
            task_info=api_pb2.TaskInfo(id=task_id(rec.api_id), result=rec.result,
                                       sandbox_id=modal_id(rec.api_id)),
            metadata=api_pb2.SandboxHandleMetadata(app_id=rec.app_id, result=rec.result))

    async def listing(self, tenant: str, app_id: str, tags: dict[str, str],
                      before: float, finished: bool) -> list[api_pb2.SandboxInfo]:
        """The tenant's sandboxes of ``app_id`` (any, when empty) carrying every tag,
        newest first and strictly older than ``before`` (0: any), as the client pages."""
        wanted = {**tags, **({APP_LABEL: app_id} if app_id else {})}
        out = []
        for info in await self.sandboxes.list(tenant, wanted):
            if info.status in FINISHED and not finished:
                continue
            created = info.created_at or 0.0
            if before and created >= before:
                continue
            rec = self._records.get(info.sandbox_id)
            if rec is None:
                app, name, plain, user_tags = info.labels.get(APP_LABEL, ""), \
                    info.labels.get(NAME_LABEL), (), \
                    {k: v for k, v in info.labels.items() if k not in MODAL_LABELS}
                rec = WireSandbox(info.sandbox_id, tenant, app, name, user_tags, created,
                                  plain_ports=plain)
            out.append(self.info(rec))
        out.sort(key=lambda i: -i.created_at)
        return out

    def execs(self, rec: WireSandbox) -> OrderedDict[str, Proc]:
        """The sandbox's processes, with room for one more: finished ones are forgotten
        (their output with them) past ``MAX_FINISHED`` or ``FINISHED_KEEP_S``, oldest
        first."""
        now = time.monotonic()
        ended = [k for k, p in rec.execs.items() if p.finished_at is not None]
        for k in ended[:max(0, len(ended) - MAX_FINISHED)]:
            del rec.execs[k]
        for k in ended[-MAX_FINISHED:]:
            at = rec.execs[k].finished_at
            if at is not None and now - at > FINISHED_KEEP_S:
                del rec.execs[k]
        while len(rec.execs) >= MAX_EXECS:
            done = next((k for k, p in rec.execs.items() if p.done.is_set()), None)
            if done is None:
                raise GRPCError(Status.RESOURCE_EXHAUSTED, f"{MAX_EXECS} commands are "
                                                           "running in this sandbox")
            del rec.execs[done]
        return rec.execs


def check_tags(tags: dict[str, str]) -> None:
    """Tags may not be Modal's own labels (nor the service's reserved ones)."""
    for key in tags:
        if key in MODAL_LABELS or key.startswith("ray-sandbox/"):
            raise GRPCError(Status.INVALID_ARGUMENT, f"tag {key!r} is reserved")
