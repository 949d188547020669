"""ray_sandbox: isolated gVisor sandboxes for Ray programs.

    import ray, ray_sandbox as sandbox
    sb = sandbox.create(image="ray-sandbox/python", cpu=1, memory="512Mi")
    print(ray.get(sb.exec.remote("python3 -c 'print(1)'")).stdout)
    ray.get(sb.terminate.remote())

The Ray layer (``create``, ``get``, ``list``, ``SandboxPool``, …) is imported on first use, so
``ray_sandbox.runtime`` works without paying for ``import ray``.
"""

from __future__ import annotations

import importlib
from typing import Any

from .runtime import (
    DOCKER_DEFAULT_CAPABILITIES,
    EgressPolicy,
    ExecResult,
    OutputChunk,
    SandboxConfig,
    SandboxRuntime,
    SandboxState,
    SandboxStatus,
)
from .runtime.errors import *  # noqa: F403 - the error tree is public API
from .runtime.errors import __all__ as _errors

_LAZY = {
    name: "ray_sandbox.actor"
    for name in (
        "create", "create_from_template", "get", "list", "shutdown",
        "fork", "restore", "resume", "delete_snapshot", "branching_rollout",
        "SandboxHandle", "SandboxPool", "SandboxTemplate", "Snapshot", "RolloutTree",
        "make_template",
    )
}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ray_sandbox' has no attribute {name!r}")


__all__ = [
    "DOCKER_DEFAULT_CAPABILITIES",
    "EgressPolicy",
    "ExecResult",
    "OutputChunk",
    "SandboxConfig",
    "SandboxRuntime",
    "SandboxState",
    "SandboxStatus",
    *_errors,
    *_LAZY,
]
