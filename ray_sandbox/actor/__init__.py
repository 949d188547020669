"""Ray-native sandboxes: ``create()``, handles, named sandboxes, warm pools, snapshots/forks."""

from ..runtime.snapshot import Snapshot
from .api import (
    create,
    create_from_template,
    create_many,
    delete_snapshot,
    fork,
    get,
    list,
    restore,
    resume,
    shutdown,
)
from .handle import SandboxHandle
from .pool import SandboxPool
from .rollout import RolloutTree, branching_rollout
from .sandbox_class import Sandbox
from .template import SandboxTemplate, make_template

__all__ = [
    "RolloutTree",
    "Sandbox",
    "SandboxHandle",
    "SandboxPool",
    "SandboxTemplate",
    "Snapshot",
    "branching_rollout",
    "create",
    "create_from_template",
    "create_many",
    "delete_snapshot",
    "fork",
    "get",
    "list",
    "make_template",
    "restore",
    "resume",
    "shutdown",
]
