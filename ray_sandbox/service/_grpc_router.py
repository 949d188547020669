"""The sandbox side of Modal's API (``modal.task_command_router.TaskCommandRouter``), which
the client calls directly with the JWT the control plane handed out for one sandbox: a
command's start, output, stdin, poll and wait; the entrypoint's output and stdin; a
filesystem snapshot; network access changed at runtime; and Modal's filesystem calls, which
the client sends as a command (``/__modal/.bin/modal-sandbox-fs-tools`` with one JSON
argument) and which are answered here with the sandbox's own file calls, so no tool needs to
be in the tenant's image.
"""

from __future__ import annotations

import json
import stat as stat_mod
import time
from typing import Any

from grpclib import GRPCError, Status
from modal_proto import api_pb2
from modal_proto import task_command_router_pb2 as tcr

from ..runtime import errors as e
from ..runtime.results import FileInfo, FileType
from ..runtime.verbs import SpawnRequest
from ._config import ServiceConfig
from ._grpc import Call, invalid, not_found, unimplemented
from ._grpc_images import SNAPSHOT_PREFIX
from ._grpc_lifecycle import egress_of
from ._grpc_procs import Collecting, Finished, Proc, fs_error
from ._grpc_sandboxes import WireSandbox, WireSandboxes, api_id_of
from ._grpc_secrets import Secrets
from ._kept import FS_IMAGE_SCHEME
from ._sandboxes import Sandboxes

FS_TOOLS = "/__modal/.bin/modal-sandbox-fs-tools"
EXEC_WAIT = 50.0  # a TaskExecWait answers within the client's 60 s per attempt
NA = api_pb2.NetworkAccess
_MODE_BITS = {FileType.DIRECTORY: stat_mod.S_IFDIR, FileType.SYMLINK: stat_mod.S_IFLNK,
              FileType.FILE: stat_mod.S_IFREG, FileType.OTHER: 0}
# the runtime's file errors as the filesystem tools' error kinds (the client raises the
# matching modal.exception for each)
_FS_KINDS: tuple[tuple[type[e.SandboxError], str], ...] = (
    (e.SandboxFileNotFoundError, "NotFound"), (e.SandboxIsADirectoryError, "IsDirectory"),
    (e.SandboxNotADirectoryError, "NotDirectory"), (e.SandboxFileExistsError, "PathAlreadyExists"),
    (e.SandboxPermissionError, "PermissionDenied"), (e.FileTooLargeError, "FileTooLarge"),
)


class Router:
    """The router handlers, over Modal's view of the sandboxes (``wire``, the control
    plane's) and the tenants' inline secrets."""

    def __init__(self, config: ServiceConfig, sandboxes: Sandboxes, wire: WireSandboxes,
                 secrets: Secrets) -> None:
        self._config = config
        self._sandboxes = sandboxes
        self._wire = wire
        self._secrets = secrets

    async def _rec(self, call: Call, some_id: str) -> WireSandbox:
        """The sandbox the call's JWT names, which must be the one it asks about."""
        api_id = api_id_of(some_id)
        if call.sandbox != api_id:
            raise not_found(f"no task {some_id!r}")
        return await self._wire.record(call.tenant, some_id)

    def _proc(self, rec: WireSandbox, exec_id: str) -> Proc:
        proc = rec.execs.get(exec_id)
        if proc is None:
            raise not_found(f"no command {exec_id!r} in this sandbox")
        return proc

    # --- commands ----------------------------------------------------------------------------

    async def TaskExecStart(self, call: Call, req: tcr.TaskExecStartRequest) -> Any:
        rec = await self._rec(call, req.task_id)
        if req.exec_id in rec.execs:  # the client's retry of the same start
            return tcr.TaskExecStartResponse()
        if req.container_id:
            raise unimplemented("sidecar containers (exec in container_id)")
        if req.HasField("pty_info") and req.pty_info.enabled:
            raise unimplemented("exec(pty=True)")
        argv = list(req.command_args)
        if not argv or not req.exec_id:
            raise invalid("a command needs arguments and an exec id")
        entry = await self._wire.running(rec)
        execs = self._wire.execs(rec)
        caps = {"out_cap": self._config.modal_output_bytes,
                "stdin_cap": self._config.modal_stdin_bytes}
        if argv[0] == FS_TOOLS:
            execs[req.exec_id] = await self._fs_tools(entry.handle, argv, caps)
            return tcr.TaskExecStartResponse()
        env = self._secrets.env(call.tenant, req.secret_sources, req.secret_ids)
        env.update(dict(req.env))
        cap = self._config.max_exec_timeout
        timeout = min(float(req.timeout_secs), cap) if req.HasField("timeout_secs") and \
            req.timeout_secs else cap
        proc = Proc(entry.handle, self._sandboxes.call,
                    pipe_out=req.stdout_config == tcr.TASK_EXEC_STDOUT_CONFIG_PIPE,
                    pipe_err=req.stderr_config != tcr.TASK_EXEC_STDERR_CONFIG_DEVNULL, **caps)
        key = f"modal-{req.exec_id}"[:64]
        await self._sandboxes.count_exec(call.tenant, rec.api_id, key)
        try:
            await proc.start(SpawnRequest(
                command=argv, env=env or None, timeout=timeout,
                cwd=req.workdir if req.HasField("workdir") and req.workdir else None),
                time.monotonic() + timeout)
        except BaseException:
            self._sandboxes.uncount_exec(rec.api_id, key)
            raise
        assert proc.task is not None
        proc.task.add_done_callback(lambda _: self._sandboxes.uncount_exec(rec.api_id, key))
        execs[req.exec_id] = proc
        return tcr.TaskExecStartResponse()

    async def TaskExecStdioRead(self, call: Call, req: tcr.TaskExecStdioReadRequest) -> Any:
        proc = self._proc(await self._rec(call, req.task_id), req.exec_id)
        out = proc.stdout if req.file_descriptor == \
            tcr.TASK_EXEC_STDIO_FILE_DESCRIPTOR_STDOUT else proc.stderr
        try:
            async for _, data in out.read(req.offset, self._config.modal_stream_idle_seconds):
                yield tcr.TaskExecStdioReadResponse(data=data)
        except TimeoutError:  # no output for the idle bound
            raise _idle() from None

    async def TaskExecStdinWrite(self, call: Call, req: tcr.TaskExecStdinWriteRequest) -> Any:
        proc = self._proc(await self._rec(call, req.task_id), req.exec_id)
        await _stdin(proc, req.offset, req.data, req.eof)
        return tcr.TaskExecStdinWriteResponse()

    async def TaskExecStdinWriteStream(self, call: Call, first: Any, rest: Any) -> Any:
        if first.WhichOneof("payload") != "start":
            raise invalid("a stdin stream starts with its start message")
        proc = self._proc(await self._rec(call, first.start.task_id), first.start.exec_id)
        offset = first.start.offset
        async for msg in rest:
            which = msg.WhichOneof("payload")
            if which == "data":
                await _stdin(proc, offset, msg.data, False)
                offset += len(msg.data)
            elif which == "end":
                await _stdin(proc, offset, b"", True)
                break
        return tcr.TaskExecStdinWriteStreamResponse()

    async def TaskExecStdinStatus(self, call: Call, req: Any) -> Any:
        proc = self._proc(await self._rec(call, req.task_id), req.exec_id)
        return tcr.TaskExecStdinStatusResponse(num_bytes_written=proc.stdin_offset,
                                               closed=proc.stdin_closed)

    async def TaskExecPoll(self, call: Call, req: tcr.TaskExecPollRequest) -> Any:
        proc = self._proc(await self._rec(call, req.task_id), req.exec_id)
        if not proc.done.is_set():
            return tcr.TaskExecPollResponse()
        return tcr.TaskExecPollResponse(code=_code(proc))

    async def TaskExecWait(self, call: Call, req: tcr.TaskExecWaitRequest) -> Any:
        proc = self._proc(await self._rec(call, req.task_id), req.exec_id)
        if not await proc.wait(EXEC_WAIT):
            raise GRPCError(Status.DEADLINE_EXCEEDED, "the command is still running")
        return tcr.TaskExecWaitResponse(code=_code(proc))

    # --- the entrypoint ----------------------------------------------------------------------

    async def SandboxStdioReadV2(self, call: Call, req: tcr.SandboxStdioReadV2Request) -> Any:
        rec = await self._rec(call, req.task_id)
        idle = self._config.modal_stream_idle_seconds
        if rec.entry is None:  # no command: nothing to read until the sandbox ends
            if await self._wire.result(rec, min(idle, 10.0)) is None:
                raise _idle()
            return
        out = rec.entry.stdout if req.file_descriptor == \
            tcr.SANDBOX_STDIO_FILE_DESCRIPTOR_STDOUT else rec.entry.stderr
        try:
            async for start, data in out.read(req.offset, idle):
                yield tcr.SandboxStdioReadV2Response(data=data, starting_offset=start)
        except TimeoutError:  # no output for the idle bound
            raise _idle() from None

    async def SandboxStdinWriteV2(self, call: Call, req: tcr.SandboxStdinWriteV2Request) -> Any:
        rec = await self._rec(call, req.task_id)
        if rec.entry is None:
            raise GRPCError(Status.FAILED_PRECONDITION, "the sandbox has no command to write "
                                                        "to")
        await _stdin(rec.entry, req.offset, req.data, req.eof)
        return tcr.SandboxStdinWriteV2Response()

    async def SandboxWaitUntilReady(self, call: Call, req: Any) -> Any:
        rec = await self._rec(call, req.task_id)
        await self._wire.running(rec)
        return tcr.SandboxWaitUntilReadyTcrResponse(ready_at=time.time())

    async def TaskReloadVolumes(self, call: Call, req: Any) -> Any:
        await self._rec(call, req.task_id)  # writes are on the volume's node at once
        return tcr.TaskReloadVolumesResponse()

    # --- snapshots, network ------------------------------------------------------------------

    async def TaskSnapshotFilesystem(self, call: Call,
                                     req: tcr.TaskSnapshotFilesystemRequest) -> Any:
        if req.container_id:
            raise unimplemented("snapshots of sidecar containers")
        rec = await self._rec(call, req.task_id)
        entry = await self._wire.running(rec)
        name = await self._sandboxes.kept.fs_image(call.tenant, entry.handle)
        return tcr.TaskSnapshotFilesystemResponse(
            image_id=SNAPSHOT_PREFIX + name.removeprefix(FS_IMAGE_SCHEME))

    async def TaskSetNetworkAccess(self, call: Call,
                                   req: tcr.TaskSetNetworkAccessRequest) -> Any:
        """The sandbox's egress replaced, held to the tenant's policy as at create."""
        rec = await self._rec(call, req.task_id)
        entry = await self._wire.running(rec)
        kind = req.network_access.network_access_type
        if kind == NA.OPEN:
            wanted: dict[str, Any] = {"default": "allow"}
        elif kind == NA.BLOCKED:
            wanted = {"default": "deny"}
        elif kind == NA.ALLOWLIST:
            wanted = egress_of(req.network_access)
        else:
            raise invalid("network_access_type must be OPEN, BLOCKED or ALLOWLIST")
        config = await self._sandboxes.call(entry.handle.get_config.remote())
        if config.network not in ("public", "sandbox"):
            if kind == NA.BLOCKED:
                return tcr.TaskSetNetworkAccessResponse()
            raise GRPCError(Status.FAILED_PRECONDITION, "this sandbox was created with "
                                                        "block_network=True: it has no "
                                                        "network to open")
        egress = await self._sandboxes.held_egress(call.tenant, config.network, wanted)
        await self._sandboxes.call(entry.handle.set_egress.remote(egress))
        return tcr.TaskSetNetworkAccessResponse()

    # --- Modal's filesystem calls ------------------------------------------------------------

    async def _fs_tools(self, handle: Any, argv: list[str], caps: dict[str, int]) -> Proc:
        """The answer of one filesystem tools call, as the tool would give it: a finished
        process (or, for WriteFile, one that finishes at its stdin's end)."""
        proc = Finished(**caps)
        try:
            op, args = _fs_command(argv)
            path = args.get("path")
            if not isinstance(path, str) or not path.startswith("/"):
                raise ValueError("an absolute path is needed")
        except ValueError as exc:
            proc.finish(2, err=fs_error("InvalidArgument", str(exc)))
            return proc
        call = self._sandboxes.call
        limit = self._config.max_file_bytes
        if op == "WriteFile":
            async def write(data: bytes) -> tuple[int, bytes]:
                try:
                    await call(handle.write_file.remote(path, data))
                except e.SandboxError as exc:
                    return 1, _fs_failure(exc)
                return 0, b""

            return Collecting(limit, write, **caps)
        try:
            if op == "ReadFile":
                proc.finish(0, out=await call(handle.read_file.remote(path, max_bytes=limit)))
            elif op == "ListFiles":
                found = await call(handle.list_dir.remote(path))
                proc.finish(0, out=json.dumps([_entry(f) for f in found]).encode())
            elif op == "Stat":
                proc.finish(0, out=json.dumps(_entry(await call(handle.stat.remote(path))))
                            .encode())
            elif op == "MakeDirectory":
                parents = bool(args.get("parents"))
                if not parents and await call(handle.exists.remote(path)):
                    raise e.SandboxFileExistsError(f"{path} exists")
                await call(handle.mkdir.remote(path, parents=parents))
                proc.finish(0)
            elif op == "Remove":
                await call(handle.remove.remote(path, recursive=bool(args.get("recursive"))))
                proc.finish(0)
            else:
                proc.finish(1, err=fs_error("NotSupported", f"{op} is not supported by "
                                                             "ray-sandbox's Modal API"))
        except e.SandboxError as exc:
            proc.finish(1, err=_fs_failure(exc))
        return proc


def _fs_command(argv: list[str]) -> tuple[str, dict[str, Any]]:
    if len(argv) != 2:
        raise ValueError("the filesystem tools take one JSON argument")
    try:
        cmd = json.loads(argv[1])
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(cmd, dict) or len(cmd) != 1:
        raise ValueError("one command, as {name: arguments}")
    ((op, args),) = cmd.items()
    if not isinstance(args, dict):
        raise ValueError("the command's arguments must be an object")
    return op, args


def _fs_failure(exc: e.SandboxError) -> bytes:
    kind = next((k for cls, k in _FS_KINDS if isinstance(exc, cls)), None)
    if kind is None and "not empty" in exc.message.lower():
        kind = "DirectoryNotEmpty"
    return fs_error(kind or "Other", exc.message)


def _entry(f: FileInfo) -> dict[str, Any]:
    mode = _MODE_BITS[f.type] | f.mode
    out: dict[str, Any] = {
        "name": f.name, "path": f.path,
        "type": f.type.value if f.type != FileType.OTHER else "file",
        "size": f.size, "mode": mode, "permissions": stat_mod.filemode(mode),
        "owner": str(f.uid), "group": str(f.gid), "modified_time": int(f.mtime)}
    if f.link_target is not None:
        out["symlink_target"] = f.link_target
    return out


def _code(proc: Proc) -> int:
    code = proc.exit_code
    return code if code is not None else 137


def _idle() -> GRPCError:
    # retried by the client, which reads again from where it was
    return GRPCError(Status.DEADLINE_EXCEEDED, "no output for modal_stream_idle_seconds; "
                                               "read again")


async def _stdin(proc: Proc, offset: int, data: bytes, eof: bool) -> None:
    await proc.write_stdin(offset, data, eof)  # its refusals map to their statuses (_grpc)
