"""The Modal ingress's bounds, each a clear gRPC status (docs/modal.md, "Bounds"), seen on
the wire by a client in the Modal client's venv (its own ``modal_proto`` and grpclib, as the
SDK sends them) against a service whose bounds are small enough to reach."""

from __future__ import annotations

import pytest

from tests import fx_modal_wire
from tests.fx_modal_wire import ModalService
from tests.fx_service import free_port

SERVICE_SETTINGS = {"modal_port": free_port(), "modal_max_message_bytes": 64 * 1024,
                    "modal_max_streams_per_tenant": 3, "modal_stream_idle_seconds": 2.0,
                    "modal_stdin_bytes": 16 * 1024}
SERVICE_QUOTAS = ()
pytestmark = pytest.mark.timeout(600)
modal_python = fx_modal_wire.modal_python
modal_service = fx_modal_wire.modal_service

WIRE = """
import asyncio, os, uuid
from urllib.parse import urlsplit
import modal
from grpclib import GRPCError
from grpclib.client import Channel
from modal_proto import api_grpc, api_pb2, task_command_router_grpc
from modal_proto import task_command_router_pb2 as tcr

app = modal.App.lookup("wire-bounds", create_if_missing=True)
sb = modal.Sandbox.create(app=app, timeout=120)


async def status(coro):
    try:
        await coro
        return "OK"
    except GRPCError as exc:
        return f"{exc.status.name}: {exc.message}"


async def main():
    server = urlsplit(os.environ["MODAL_SERVER_URL"])
    ch = Channel(server.hostname, server.port)
    md = {"x-modal-token-id": os.environ["MODAL_TOKEN_ID"],
          "x-modal-token-secret": os.environ["MODAL_TOKEN_SECRET"]}
    control = api_grpc.ModalClientStub(ch)
    access = await control.SandboxGetCommandRouterAccess(
        api_pb2.SandboxGetCommandRouterAccessRequest(sandbox_id=sb.object_id), metadata=md)
    router = task_command_router_grpc.TaskCommandRouterStub(ch)
    auth = {"authorization": "Bearer " + access.jwt}
    task = "ta-" + sb.object_id[3:]

    async def start(*argv):
        exec_id = str(uuid.uuid4())
        await router.TaskExecStart(tcr.TaskExecStartRequest(
            task_id=task, exec_id=exec_id, command_args=list(argv),
            stdout_config=tcr.TASK_EXEC_STDOUT_CONFIG_PIPE,
            stderr_config=tcr.TASK_EXEC_STDERR_CONFIG_PIPE), metadata=auth)
        return exec_id

    async def read(exec_id):
        async with router.TaskExecStdioRead.open(metadata=auth) as s:
            await s.send_message(tcr.TaskExecStdioReadRequest(
                task_id=task, exec_id=exec_id, offset=0,
                file_descriptor=tcr.TASK_EXEC_STDIO_FILE_DESCRIPTOR_STDOUT), end=True)
            return [m.data async for m in s]

    cat = await start("cat")
    print("MESSAGE", await status(router.TaskExecStdinWrite(tcr.TaskExecStdinWriteRequest(
        task_id=task, exec_id=cat, offset=0, data=b"x" * 100_000), metadata=auth)))
    print("STDIN", await status(router.TaskExecStdinWrite(tcr.TaskExecStdinWriteRequest(
        task_id=task, exec_id=cat, offset=0, data=b"x" * 20_000), metadata=auth)))
    print("FITS", await status(router.TaskExecStdinWrite(tcr.TaskExecStdinWriteRequest(
        task_id=task, exec_id=cat, offset=0, data=b"hello", eof=True), metadata=auth)))
    print("CAT", await read(cat))
    silent = await start("sleep", "20")
    print("IDLE", await status(read(silent)))
    held = [asyncio.ensure_future(read(silent)) for _ in range(3)]
    await asyncio.sleep(0.5)
    print("STREAMS", await status(read(silent)))
    for h in held:
        h.cancel()
    await asyncio.gather(*held, return_exceptions=True)
    print("UNKNOWN", await status(control.QueueGetOrCreate(
        api_pb2.QueueGetOrCreateRequest(deployment_name="q"), metadata=md)))
    print("NOAUTH", await status(control.AppGetOrCreate(
        api_pb2.AppGetOrCreateRequest(app_name="x"), metadata={})))
    ch.close()


asyncio.run(main())
sb.terminate()
"""


def test_bounds_are_clear_statuses(modal_service: ModalService, tmp_path):
    out = modal_service.ok(WIRE, tmp_path)
    lines = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    assert lines["MESSAGE"].startswith("RESOURCE_EXHAUSTED") and \
        "modal_max_message_bytes" in lines["MESSAGE"], out
    assert lines["STDIN"].startswith("RESOURCE_EXHAUSTED") and \
        "modal_stdin_bytes" in lines["STDIN"], out
    assert lines["FITS"] == "OK", out
    assert lines["CAT"] == "[b'hello']", out
    assert lines["IDLE"].startswith("DEADLINE_EXCEEDED"), out
    assert lines["STREAMS"].startswith("RESOURCE_EXHAUSTED") and \
        "modal_max_streams_per_tenant" in lines["STREAMS"], out
    assert lines["UNKNOWN"].startswith("UNIMPLEMENTED") and "QueueGetOrCreate" in out, out
    assert lines["NOAUTH"].startswith("UNAUTHENTICATED"), out
