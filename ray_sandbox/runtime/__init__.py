"""The Ray-free sandbox runtime: images, OCI bundles, runsc lifecycle, exec and files.

Names are imported on first use: a process that needs one stdlib-only piece (the DNS helper
each public sandbox starts runs ``ray_sandbox.runtime.network.dns``) must not pay ~180 ms of
pydantic models first, and create waited for exactly that.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "DOCKER_DEFAULT_CAPABILITIES": "config", "EgressPolicy": "config",
    "SandboxConfig": "config", "make_config": "config",
    "Image": "images", "ImageBusyError": "images", "ImageConfig": "images",
    "ImageInUseError": "images", "ImageStore": "images", "PullPolicy": "images",
    "parse_reference": "images",
    "ExecResult": "results", "FileInfo": "results", "FileType": "results",
    "OutputChunk": "results", "SandboxLink": "results", "SandboxState": "results",
    "SandboxStatus": "results",
    "LimitNotEnforcedWarning": "sandbox", "SandboxRuntime": "sandbox",
}  # fmt: skip

if TYPE_CHECKING:
    from .config import DOCKER_DEFAULT_CAPABILITIES, EgressPolicy, SandboxConfig, make_config
    from .images import (
        Image,
        ImageBusyError,
        ImageConfig,
        ImageInUseError,
        ImageStore,
        PullPolicy,
        parse_reference,
    )
    from .results import (
        ExecResult,
        FileInfo,
        FileType,
        OutputChunk,
        SandboxLink,
        SandboxState,
        SandboxStatus,
    )
    from .sandbox import LimitNotEnforcedWarning, SandboxRuntime


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DOCKER_DEFAULT_CAPABILITIES",
    "EgressPolicy",
    "ExecResult",
    "FileInfo",
    "FileType",
    "Image",
    "ImageBusyError",
    "ImageConfig",
    "ImageInUseError",
    "ImageStore",
    "LimitNotEnforcedWarning",
    "OutputChunk",
    "PullPolicy",
    "SandboxConfig",
    "SandboxLink",
    "SandboxRuntime",
    "SandboxState",
    "SandboxStatus",
    "make_config",
    "parse_reference",
]
