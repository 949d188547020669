"""Every failure as an HTTP answer ``{"error": {"code", "message"}}``, mapped in this one
place: errors of the tree in ``runtime/errors.py`` by class, the service's own refusals
(401, 404, 413, 429) as HTTP exceptions with a status, request validation as 400."""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.exceptions import GetTimeoutError, RayActorError
from starlette.exceptions import HTTPException

from ..runtime import errors as e

log = logging.getLogger(__name__)

# Most specific first: the first class an error is an instance of gives its status.
STATUS: tuple[tuple[type[e.SandboxError], int], ...] = (
    (e.SandboxNotFoundError, 404),
    (e.SandboxFileNotFoundError, 404),
    (e.FileTooLargeError, 413),
    (e.AgentTimeoutError, 504),
    (e.ConfigError, 400),
    (e.ImageReferenceError, 400),
    (e.ImageNotFoundError, 400),
    (e.ImageInUseError, 409),  # a filesystem image a sandbox runs from
    (e.UnsafePathError, 400),
    (e.ExecError, 400),
    (e.SandboxFileError, 409),  # is a directory, not a directory, exists, permission
    (e.SandboxStateError, 409),
    (e.SandboxDiedError, 409),
    (e.CapacityError, 503),
    (e.ImageError, 502),  # registry unreachable or refusing, damaged image
)

# The service's own refusals, by status: the code a client matches on.
CODES = {400: "invalid_request", 401: "unauthorized", 404: "not_found",
         405: "method_not_allowed", 409: "conflict", 413: "payload_too_large",
         429: "quota_exceeded", 431: "headers_too_large", 502: "bad_gateway",
         503: "unavailable", 504: "timeout"}


def code_of(exc: e.SandboxError) -> str:
    """``SandboxNotFoundError`` -> ``sandbox_not_found``: the class's name, so a client can
    raise the same class from the code (``ray_sandbox.client``). An error a host raised
    arrives as Ray's subclass of it (``RayTaskError(X)``): the public class names it."""
    cls = next(c for c in type(exc).__mro__ if c.__module__ == "ray_sandbox")
    name = cls.__name__.removesuffix("Error")
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def status_of(exc: e.SandboxError) -> int:
    return next((status for cls, status in STATUS if isinstance(exc, cls)), 500)


def body(code: str, message: str) -> dict[str, dict[str, str]]:
    return {"error": {"code": code, "message": message}}


def refusal(status: int, message: str) -> HTTPException:
    """The service's own refusal (unauthorized, unknown id, too large, over quota)."""
    return HTTPException(status, message)


def install(app: FastAPI) -> None:
    """Register the handlers that turn every exception into the error body."""

    async def sandbox_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, e.SandboxError)
        status = status_of(exc)
        if status >= 500:
            log.warning("request failed: %s", exc)
        message = exc.message
        if isinstance(exc, e.CapacityError):  # it lists the cluster's resources: not theirs
            message = "no room in the cluster for this now; retry later or ask for less"
        return JSONResponse(body(code_of(exc), message), status)

    async def http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        headers = {"WWW-Authenticate": 'Bearer realm="ray-sandbox"'} \
            if exc.status_code == 401 else None
        return JSONResponse(body(CODES.get(exc.status_code, "error"), str(exc.detail)),
                            exc.status_code, headers=headers)

    async def invalid(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        parts = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"] if p != "body") or "body"
            msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
            parts.append(f"{loc}: {msg}")
        return JSONResponse(body("invalid_request", "; ".join(parts)[:2000]), 400)

    async def unavailable(_: Request, exc: Exception) -> JSONResponse:
        # a host died or did not answer within the call's bound: the caller may retry
        log.warning("a sandbox host failed: %s", exc)
        return JSONResponse(body("unavailable", f"the sandbox's host failed: {exc}"[:2000]),
                            503)

    async def timed_out(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(body("timeout", "the sandbox's host did not answer in time"), 504)

    app.add_exception_handler(e.SandboxError, sandbox_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(RayActorError, unavailable)
    app.add_exception_handler(GetTimeoutError, timed_out)
    app.add_exception_handler(TimeoutError, timed_out)
