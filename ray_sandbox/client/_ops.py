"""The service's protocol without I/O: each operation is a generator that yields the HTTP
requests it needs and receives their responses, so the sync and the async client run the
same steps (``_sync.py``, ``_async.py``) and only the transport differs."""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

from ..runtime import archive, errors
from ..runtime.results import ExecResult, OutputChunk
from ..runtime.verbs import ExecRequest

POLL_SECONDS = 10.0  # one long-poll; the service caps it anyway
RETRY_DELAYS = (0.5, 1.0, 2.0)  # a request safe to repeat, after a lost connection or a 503


@dataclass(frozen=True)
class Call:
    """One request of an operation."""

    method: str
    path: str
    params: dict[str, Any] = field(default_factory=dict)
    json: Any = None
    content: bytes | None = None
    timeout: float = 60.0
    retries: int = 0  # safe to repeat (idempotent): again after a lost connection or a 503


def retry(call: Call, attempt: int, r: httpx.Response | None) -> float | None:
    """Seconds to wait before sending ``call`` again after attempt ``attempt`` (0-based)
    got ``r`` (None: the connection failed), or None to stop there."""
    if attempt >= min(call.retries, len(RETRY_DELAYS)):
        return None
    if r is not None and r.status_code != 503:
        return None
    return RETRY_DELAYS[attempt]


T = TypeVar("T")
Op = Generator[Call, httpx.Response, T]  # an operation that returns a T

# Codes the service gives its own refusals, as errors of the tree; every other code is the
# snake-case name of the tree's class that the service mapped (``sandbox_not_found``).
_ALIASES: dict[str, type[errors.SandboxError]] = {
    "invalid_request": errors.ConfigError,
    "unauthorized": errors.ConfigError,
    "not_found": errors.SandboxNotFoundError,
    "quota_exceeded": errors.CapacityError,
    "payload_too_large": errors.FileTooLargeError,
    "headers_too_large": errors.ConfigError,
    "conflict": errors.SandboxStateError,
}


def error_class(code: str) -> type[errors.SandboxError]:
    """The error class of an error code (``sandbox_not_found`` -> SandboxNotFoundError)."""
    if code in _ALIASES:
        return _ALIASES[code]
    name = "".join(p.capitalize() for p in code.split("_")) + "Error"
    cls = getattr(errors, name, None) if name in errors.__all__ else None
    return cls if cls is not None else errors.SandboxError


def check(r: httpx.Response, sandbox_id: str | None = None) -> httpx.Response:
    """``r`` if it succeeded, else the error it carries, raised as its class."""
    if r.is_success:
        return r
    try:
        err = r.json()["error"]
        code, message = str(err["code"]), str(err["message"])
    except (ValueError, KeyError, TypeError):
        code, message = "error", f"HTTP {r.status_code}: {r.text[:500]}"
    raise error_class(code)(f"{code}: {message}", sandbox_id=sandbox_id)


def create(options: Mapping[str, Any], timeout: float) -> Op[str]:
    """Create a sandbox and wait (up to ``timeout`` s) until it runs; returns its id. The
    request carries a client token (the caller's ``client_token``, else a new one), so it
    is sent again after a lost connection or a 503 without making a second sandbox."""
    body = {**options, "client_token": options.get("client_token") or secrets.token_hex(16)}
    r = check((yield Call("POST", "/sandboxes", json=body, retries=len(RETRY_DELAYS))))
    sandbox_id: str = r.json()["sandbox_id"]
    try:
        info = yield from wait(f"/sandboxes/{sandbox_id}", "pending", timeout, sandbox_id)
    except errors.AgentTimeoutError:
        yield Call("DELETE", f"/sandboxes/{sandbox_id}")  # gave up: it must not linger
        raise
    if info["status"] != "running":  # the service keeps a failed one until it is deleted
        yield Call("DELETE", f"/sandboxes/{sandbox_id}")
    if info["status"] == "error":
        code, _, message = (info.get("reason") or "").partition(": ")
        raise _create_error(code)(f"sandbox {sandbox_id} failed to start: {message or code}",
                                  sandbox_id=sandbox_id)
    if info["status"] != "running":
        raise errors.SandboxStateError(f"sandbox is {info['status']}: {info.get('reason')}",
                                       sandbox_id=sandbox_id)
    return sandbox_id


def _create_error(code: str) -> type[errors.SandboxError]:
    cls = error_class(code)
    return cls if cls is not errors.SandboxError else errors.SandboxCreationError


def wait(path: str, pending: str, timeout: float, sandbox_id: str) -> Op[dict[str, Any]]:
    """Long-poll ``path`` while its status is ``pending``, up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        poll = max(0.0, min(POLL_SECONDS, left))
        r = check((yield Call("GET", path, params={"wait_seconds": poll},
                              timeout=poll + 60)), sandbox_id)
        info: dict[str, Any] = r.json()
        if info["status"] != pending:
            return info
        if left <= 0:
            raise errors.AgentTimeoutError(f"still {pending} after {timeout:g} s",
                                           sandbox_id=sandbox_id)


def exec_body(command: str | list[str] | ExecRequest, options: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON body of an exec: the runtime's ExecRequest (checked here, before anything is
    sent), with HTTP's names (``timeout_seconds``) and text for stdin."""
    req = ExecRequest.of((command,), options)
    if isinstance(req.stdin, bytes):
        req = req.model_copy(update={"stdin": req.stdin.decode()})
    return req.model_dump(mode="json", by_alias=True, exclude_none=True)


def run(sandbox_id: str, body: dict[str, Any]) -> Op[ExecResult]:
    """Start a command, wait for it, return its ExecResult (a non-zero exit is a result)."""
    base = f"/sandboxes/{sandbox_id}"
    r = check((yield Call("POST", f"{base}/execs", json=body,
                          params={"wait_seconds": POLL_SECONDS}, timeout=POLL_SECONDS + 60)),
              sandbox_id)
    if r.status_code == 200:  # it ended within the first wait: the result came back at once
        return exec_result(r.json(), sandbox_id)
    exec_id = r.json()["exec_id"]
    # its own timeout bounds the command; the margin covers queueing and the poll itself
    limit = (body.get("timeout_seconds") or 3600.0) + 120
    info = yield from wait(f"{base}/execs/{exec_id}", "running", limit, sandbox_id)
    return exec_result(info, sandbox_id)


def exec_result(info: Mapping[str, Any], sandbox_id: str) -> ExecResult:
    if info["status"] == "failed":
        err = info.get("error") or {}
        code = str(err.get("code", "error"))
        raise error_class(code)(f"{code}: {err.get('message', '')}", sandbox_id=sandbox_id)
    return ExecResult(exit_code=info["exit_code"], stdout_bytes=info["stdout"].encode(),
                      stderr_bytes=info["stderr"].encode(), timed_out=info["status"] ==
                      "timed_out", truncated=info.get("truncated", False),
                      duration_seconds=info.get("duration_seconds") or 0.0)


def one(method: str, path: str, sandbox_id: str | None = None, **kw: Any) -> Op[httpx.Response]:
    """A single request; returns its response once it succeeded."""
    return check((yield Call(method, path, **kw)), sandbox_id)


def fs_image_path(image: str) -> str:
    """``fs-image://<id>`` (or the bare id) -> its resource path."""
    return f"/filesystem-images/{image.rpartition('/')[2]}"


def api_url(base_url: str) -> str:
    """``http://host:port`` or ``.../api/v1`` -> ``.../api/v1``."""
    base = base_url.rstrip("/")
    return base if re.search(r"/api/v1$", base) else base + "/api/v1"


def stream_timeout(body: Mapping[str, Any]) -> httpx.Timeout:
    """A streamed exec may be silent for as long as its command runs."""
    return httpx.Timeout(60.0, read=(body.get("timeout_seconds") or 3600.0) + 120)


def stream_item(line: str, sandbox_id: str) -> OutputChunk | ExecResult | None:
    """One NDJSON line of a streamed exec as what ``SandboxHandle.exec_stream`` yields: an
    OutputChunk, the final ExecResult, or None (the start line); an error line raises."""
    if not line.strip():
        return None
    item = json.loads(line)
    kind = item.get("type")
    if kind in ("stdout", "stderr"):
        return OutputChunk(stream=kind, data=item["data"].encode())
    if kind == "exit":
        return ExecResult(exit_code=item["exit_code"], stdout_bytes=item["stdout"].encode(),
                          stderr_bytes=item["stderr"].encode(), timed_out=item["timed_out"],
                          truncated=item.get("truncated", False), signal=item.get("signal"),
                          duration_seconds=item.get("duration_seconds") or 0.0)
    if kind == "error":
        code = str(item.get("code", "error"))
        raise error_class(code)(f"{code}: {item.get('message', '')}", sandbox_id=sandbox_id)
    return None


def pack(local_dir: str | Path) -> bytes:
    """A local directory as a tar (modes, symlinks and empty directories kept)."""
    return b"".join(archive.pack_local(Path(local_dir)))


def unpack(data: bytes, local_dir: str | Path) -> None:
    """A tar from the service into ``local_dir``; nothing lands outside it."""
    archive.extract_local([data], Path(local_dir))
