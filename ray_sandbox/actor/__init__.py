"""Ray-native sandboxes: ``create()``, handles, named sandboxes and warm pools."""

from .api import create, create_from_template, get, list, shutdown
from .handle import SandboxHandle
from .pool import SandboxPool
from .template import SandboxTemplate, make_template

__all__ = [
    "SandboxHandle",
    "SandboxPool",
    "SandboxTemplate",
    "create",
    "create_from_template",
    "get",
    "list",
    "make_template",
    "shutdown",
]
