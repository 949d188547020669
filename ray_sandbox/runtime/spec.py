"""The OCI runtime spec (``config.json``) as typed models, and the builder for sandboxes.

Models cover what runsc reads; unknown fields are kept (``extra="allow"``) so a user's
``spec_transform`` may add anything the OCI spec allows. :func:`apply_transform` runs that hook
on the plain dict and validates the result.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import SandboxCreationError


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class User(_Model):
    uid: int = Field(0, ge=0)
    gid: int = Field(0, ge=0)
    additionalGids: list[int] | None = None


class Capabilities(_Model):
    bounding: list[str] = Field(default_factory=list)
    effective: list[str] = Field(default_factory=list)
    inheritable: list[str] = Field(default_factory=list)
    permitted: list[str] = Field(default_factory=list)
    ambient: list[str] = Field(default_factory=list)


class Rlimit(_Model):
    type: str
    hard: int = Field(ge=0)
    soft: int = Field(ge=0)


class Process(_Model):
    terminal: bool = False
    user: User = Field(default_factory=User)
    args: list[str] = Field(min_length=1)
    env: list[str] = Field(default_factory=list)
    cwd: str = "/"
    capabilities: Capabilities | None = None
    rlimits: list[Rlimit] | None = None
    noNewPrivileges: bool = False


class Root(_Model):
    path: str
    readonly: bool = True


class Mount(_Model):
    destination: str
    type: str | None = None
    source: str | None = None
    options: list[str] | None = None


class Namespace(_Model):
    type: str
    path: str | None = None


class IDMapping(_Model):
    """``linux.uidMappings``/``gidMappings`` entry of a user namespace."""

    containerID: int = Field(ge=0)
    hostID: int = Field(ge=0)
    size: int = Field(gt=0)


class MemoryResources(_Model):
    limit: int | None = None


class CpuResources(_Model):
    shares: int | None = None
    quota: int | None = None
    period: int | None = None


class PidsResources(_Model):
    limit: int = Field(gt=0)


class Resources(_Model):
    memory: MemoryResources | None = None
    cpu: CpuResources | None = None
    pids: PidsResources | None = None


class SeccompArg(_Model):
    index: int = Field(ge=0, le=5)
    value: int = Field(ge=0)
    valueTwo: int = Field(0, ge=0)
    op: str  # SCMP_CMP_*; for SCMP_CMP_MASKED_EQ value is the mask, valueTwo the result


class SeccompSyscall(_Model):
    names: list[str] = Field(min_length=1)
    action: str  # SCMP_ACT_*
    errnoRet: int | None = None
    args: list[SeccompArg] | None = None


class Seccomp(_Model):
    """``linux.seccomp``: enforced by the sentry on the container's init and everything it
    starts, only with ``runsc --oci-seccomp`` (processes started by ``runsc exec`` are not
    filtered)."""

    defaultAction: str
    architectures: list[str] | None = None
    syscalls: list[SeccompSyscall] | None = None


class Linux(_Model):
    namespaces: list[Namespace] = Field(default_factory=list)
    uidMappings: list[IDMapping] | None = None
    gidMappings: list[IDMapping] | None = None
    resources: Resources | None = None
    cgroupsPath: str | None = None
    sysctl: dict[str, str] | None = None
    seccomp: Seccomp | None = None


class Spec(_Model):
    ociVersion: str = "1.0.2"
    process: Process
    root: Root
    hostname: str | None = None
    mounts: list[Mount] = Field(default_factory=list)
    annotations: dict[str, str] | None = None
    linux: Linux = Field(default_factory=Linux)

    def to_json(self) -> str:
        return self.model_dump_json(exclude_none=True, by_alias=True, indent=1)


SpecTransform = Callable[[dict[str, Any]], dict[str, Any] | None]


def apply_transform(spec: Spec, fn: SpecTransform | None, *, sandbox_id: str) -> Spec:
    """Run the user's hook on a plain-dict copy of ``spec``; it may mutate it or return a new
    dict. The result must still be a valid spec."""
    if fn is None:
        return spec
    data = copy.deepcopy(spec.model_dump(exclude_none=True, by_alias=True))
    try:
        out = fn(data)
    except Exception as exc:
        raise SandboxCreationError(
            f"spec_transform raised {type(exc).__name__}: {exc}", sandbox_id=sandbox_id
        ) from exc
    result = data if out is None else out
    if not isinstance(result, dict):
        raise SandboxCreationError(
            f"spec_transform must return a dict or None, got {type(result).__name__}",
            sandbox_id=sandbox_id,
        )
    try:
        return Spec.model_validate(result)
    except ValidationError as exc:
        raise SandboxCreationError(
            f"spec_transform produced an invalid OCI spec: {exc}", sandbox_id=sandbox_id
        ) from None
