"""Request and response bodies: the REST shape of Ray's proposed sandbox API (``/api/v1``),
validated at the boundary (unknown fields are refused)."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from ..runtime.config import MAX_TIMEOUT, SandboxConfig, check_text
from ..runtime.verbs import ExecRequest

CLIENT_TOKEN_MAX = 128
SandboxStatusName = Literal["pending", "running", "paused", "suspended", "error", "terminated"]
ExecStatusName = Literal["running", "completed", "timed_out", "failed"]


def _texts(value: Any, where: str = "body") -> None:
    """Every string in a request body must be valid Unicode: JSON's ``"\\ud800"`` decodes to
    a lone surrogate, which fails wherever it is later written (a 500, or a stored value
    that breaks every read after)."""
    if isinstance(value, str):
        check_text(value, where)
    elif isinstance(value, dict):
        for k, v in value.items():
            _texts(k, where)
            _texts(v, f"{where}.{k}" if isinstance(k, str) else where)
    elif isinstance(value, list | tuple):
        for v in value:
            _texts(v, where)


class TextOnly(BaseModel):
    """Every string of the body is valid Unicode (``_texts``)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        _texts(data)
        return data


class Body(TextOnly):
    """A request body: unknown fields refused, text checked."""

    model_config = ConfigDict(extra="forbid")


class CreateSandbox(TextOnly, SandboxConfig):
    """``POST /sandboxes``: every :class:`SandboxConfig` option, as there, held to the
    tenant's policy (``_policy``). A ``spec_transform`` is code and cannot cross HTTP.
    ``client_token`` is the request's, not the sandbox's (the policy never sees it)."""

    spec_transform: SkipJsonSchema[None] = Field(None, exclude=True)
    client_token: str | None = Field(
        None, min_length=1, max_length=CLIENT_TOKEN_MAX, pattern=r"^[\x21-\x7e]+$",
        description="idempotency key (Ray's name): the tenant's create with the same token "
                    "within client_token_seconds [24 h] answers with the same sandbox, also "
                    "while it is being made; the same token with another body is a 409")


REQUEST_FIELDS = frozenset({"client_token"})  # of CreateSandbox, not of the sandbox's config


class Created(BaseModel):
    sandbox_id: str
    status: SandboxStatusName = "pending"


class SandboxInfo(BaseModel):
    """``GET /sandboxes/{id}``."""

    sandbox_id: str
    status: SandboxStatusName
    reason: str | None = None
    image: str
    cpu: float
    memory: int
    labels: dict[str, str] = Field(default_factory=dict)
    created_at: float | None = Field(None, description="Unix time the create was accepted")


class SandboxList(BaseModel):
    sandboxes: list[SandboxInfo]


class Deleted(BaseModel):
    sandbox_id: str
    status: Literal["terminated"] = "terminated"


class CreateExec(TextOnly, ExecRequest):
    """``POST /sandboxes/{id}/execs`` and ``.../execs/stream``: the runtime's
    :class:`~ray_sandbox.runtime.verbs.ExecRequest` itself (``timeout`` is
    ``timeout_seconds`` here, as in Ray's REST API). What HTTP asks more of it, and why:
    text only (JSON carries no bytes, so ``stdin`` is text and a lone surrogate is refused),
    an absolute ``cwd``, a non-empty command without NUL bytes (a 400 before anything
    runs); the service caps ``timeout`` at ``max_exec_timeout`` and ``max_output_bytes`` at
    its own."""

    @field_validator("command")
    @classmethod
    def _command_ok(cls, v: list[str] | str) -> list[str] | str:
        items = [v] if isinstance(v, str) else v
        if not items or any("\0" in a for a in items):
            raise ValueError("command is empty or contains a NUL byte")
        if isinstance(v, str) and not v.strip():
            raise ValueError("command is empty")
        return v

    @field_validator("cwd")
    @classmethod
    def _cwd(cls, v: str | None) -> str | None:
        if v is not None:
            check_path(v)
        return v

    @field_validator("timeout")
    @classmethod
    def _timeout(cls, v: float | None) -> float | None:
        if v is not None and not 0 < v <= MAX_TIMEOUT:
            raise ValueError(f"timeout_seconds must be in (0, {MAX_TIMEOUT:.0f}]")
        return v


class Signal(Body):
    """``POST .../execs/{exec_id}/signal`` (a streamed exec)."""

    model_config = ConfigDict(extra="forbid")

    signal: int = Field(ge=1, le=64)


class CreateLink(Body):
    """``POST .../links``: let this sandbox reach ``port`` of the tenant's sandbox ``to``
    (both ``network="sandbox"``, on one node)."""

    model_config = ConfigDict(extra="forbid")

    to: str
    port: int = Field(gt=0, lt=65536)


class LinkInfo(BaseModel):
    """Where the linking sandbox connects: ``host:port``."""

    to: str
    host: str
    port: int


class PortUrl(Body):
    """``POST .../ports/{port}/url``: how long the URL stays valid (capped)."""

    model_config = ConfigDict(extra="forbid")

    ttl_seconds: float | None = Field(None, gt=0)


class Copies(Body):
    """``POST .../fork`` and ``POST /snapshots/{id}/restore``: how many copies."""

    model_config = ConfigDict(extra="forbid")

    count: int = Field(1, ge=1)


class ExecCreated(BaseModel):
    exec_id: str
    status: ExecStatusName = "running"


class ExecInfo(BaseModel):
    """``GET /sandboxes/{id}/execs/{exec_id}``."""

    exec_id: str
    status: ExecStatusName
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    truncated: bool = False
    duration_seconds: float | None = None
    error: dict[str, str] | None = Field(None, description="{code, message} when failed")


def check_path(path: str) -> str:
    """An absolute path inside the sandbox, normalized; a relative one, an empty one or one
    with a NUL byte is refused (the sandbox's own root bounds where it can lead)."""
    if not path.startswith("/") or "\0" in path or len(path) > 4096:
        raise ValueError(f"path must be absolute, without NUL, at most 4096 bytes: {path!r}")
    return os.path.normpath(path)


class CreateVolume(Body):
    """``POST /volumes``: a size-capped volume of the caller's tenant."""

    model_config = ConfigDict(extra="forbid")

    name: str
    size: str | int = Field(description="bytes, or '256Mi'")
