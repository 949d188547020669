"""An interactive terminal over a WebSocket: a process spawned with a pty through the
handle's ``spawn``/``process`` calls.

Client → service: binary frames are keystrokes (stdin); text frames are JSON controls,
``{"resize": [rows, cols]}``, ``{"signal": N}``, ``{"eof": true}``. Service → client: binary
frames of output as it arrives, then one text frame ``{"type": "exit", "exit_code",
"signal"}`` (or ``{"type": "error", "code", "message"}``) and the close. The process is
closed (its tree killed) however the socket ends, and at the latest after the longest exec
timeout.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import anyio
from fastapi import WebSocket, WebSocketDisconnect

from ..runtime.errors import SandboxError
from . import _errors
from ._streams import Call

READ_WAIT = 0.5
MAX_FRAME = 64 * 1024  # keystrokes or a paste; more in one frame is refused


async def session(ws: WebSocket, handle: Any, call: Call, command: str, rows: int,
                  cols: int, lifetime: float) -> None:
    """Run one terminal; after ``lifetime`` seconds it is killed like a timed-out exec."""
    key, _pid = await call(handle.spawn.remote(command, pty=(rows, cols)))
    proc = handle.process
    await ws.accept()
    inbound = asyncio.ensure_future(_inbound(ws, proc, call, key))
    deadline = time.monotonic() + lifetime
    try:
        while time.monotonic() < deadline:
            data = await call(proc.remote(key, "read", READ_WAIT))
            if data:
                await ws.send_bytes(data)
                continue
            result = await call(proc.remote(key, "wait", 0))
            if result is not None:
                if result.stdout_bytes:
                    await ws.send_bytes(result.stdout_bytes)
                await ws.send_text(json.dumps({"type": "exit", "exit_code": result.exit_code,
                                               "signal": result.signal}))
                break
            if inbound.done():  # the client went away or broke the protocol
                break
    except SandboxError as exc:
        await ws.send_text(json.dumps({"type": "error", "code": _errors.code_of(exc),
                                       "message": exc.message}))
    except WebSocketDisconnect:
        pass
    finally:
        inbound.cancel()
        if inbound.done() and not inbound.cancelled():
            inbound.exception()  # why the client's side ended; the socket closes either way
        with anyio.CancelScope(shield=True):  # the process dies however the socket ended
            await _close(call, proc, key)
    await _quietly(ws.close())


async def _inbound(ws: WebSocket, proc: Any, call: Call, key: str) -> None:
    while True:
        message = await ws.receive()
        if message["type"] == "websocket.disconnect":
            return
        if message.get("bytes") is not None:
            if len(message["bytes"]) > MAX_FRAME:
                return
            await call(proc.remote(key, "write_stdin", message["bytes"]))
            continue
        try:
            control = json.loads(message.get("text") or "{}")
        except ValueError:
            return
        if "resize" in control:
            rows, cols = (int(x) for x in control["resize"])
            await call(proc.remote(key, "resize", max(1, min(rows, 1000)),
                                   max(1, min(cols, 1000))))
        elif "signal" in control:
            await call(proc.remote(key, "kill", max(1, min(int(control["signal"]), 64))))
        elif control.get("eof"):
            await call(proc.remote(key, "close_stdin"))


async def _close(call: Call, proc: Any, key: str) -> None:
    await _quietly(call(proc.remote(key, "close")))


async def _quietly(aw: Any) -> None:
    try:
        await aw
    except Exception:  # the sandbox or the socket is gone already: nothing left to close
        pass
