"""ray_sandbox: isolated gVisor sandboxes for Ray programs.

    import ray, ray_sandbox as sandbox
    sb = sandbox.create(image="ray-sandbox/python", cpu=1, memory="512Mi")
    print(ray.get(sb.exec.remote("python3 -c 'print(1)'")).stdout)
    ray.get(sb.terminate.remote())

Every name is imported on first use: ``ray_sandbox.runtime`` works without paying for
``import ray``, and a helper process that needs one stdlib-only module (the DNS helper of a
public sandbox) starts without the runtime's pydantic models.
"""

from __future__ import annotations

import importlib
from typing import Any

from .runtime.errors import *  # noqa: F403 - the error tree is public API
from .runtime.errors import __all__ as _errors

_RUNTIME = ("DOCKER_DEFAULT_CAPABILITIES", "EgressPolicy", "ExecResult", "OutputChunk",
            "SandboxConfig", "SandboxLink", "SandboxRuntime", "SandboxState", "SandboxStatus")
_LAZY = {name: "ray_sandbox.runtime" for name in _RUNTIME} | {
    name: "ray_sandbox.actor"
    for name in (
        "create", "create_from_template", "create_many", "get", "list", "shutdown",
        "fork", "restore", "resume", "delete_snapshot", "delete_filesystem_image",
        "branching_rollout",
        "SandboxHandle", "SandboxPool", "SandboxTemplate", "Snapshot", "RolloutTree",
        "make_template", "Sandbox", "create_volume", "list_volumes", "inspect_volume",
        "delete_volume", "copy_volume", "move_volume", "fill_volume",
    )
} | {"ExecutionResult": "ray_sandbox.runtime.results"}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        try:
            module = importlib.import_module(_LAZY[name])
        except ModuleNotFoundError as exc:
            if exc.name != "ray":
                raise
            raise ImportError(f"ray_sandbox.{name} is the Ray layer, which needs Ray: pip "
                              "install 'ray_sandbox[ray]' (the runtime, the CLI and the "
                              "client work without it)", name="ray") from None
        return getattr(module, name)
    raise AttributeError(f"module 'ray_sandbox' has no attribute {name!r}")


__all__ = [*_errors, *_LAZY]
