"""Ray-native sandboxes: ``create()``, handles, named sandboxes, warm pools, snapshots/forks."""

from ..runtime.snapshot import Snapshot
from .api import (
    create,
    create_from_template,
    create_many,
    delete_filesystem_image,
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
from .volumes import (
    copy_volume,
    create_volume,
    delete_volume,
    fill_volume,
    inspect_volume,
    list_volumes,
    move_volume,
)

__all__ = [
    "RolloutTree",
    "Sandbox",
    "SandboxHandle",
    "SandboxPool",
    "SandboxTemplate",
    "Snapshot",
    "branching_rollout",
    "copy_volume",
    "create",
    "create_from_template",
    "create_many",
    "create_volume",
    "delete_filesystem_image",
    "delete_snapshot",
    "delete_volume",
    "fill_volume",
    "fork",
    "get",
    "inspect_volume",
    "list",
    "list_volumes",
    "make_template",
    "move_volume",
    "restore",
    "resume",
    "shutdown",
]
