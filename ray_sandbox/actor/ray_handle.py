"""SandboxActorHandle: the handle ``create()`` and ``Sandbox.remote()`` return, a
:class:`SandboxHandle` that also answers the two methods of Ray's sandbox actor that need
what the creator knows: ``get_instance_id`` and ``get_config``."""

from __future__ import annotations

from typing import Any

import ray

from ..runtime.config import SandboxConfig
from ..runtime.records import ray_id
from .handle import SandboxHandle


class _Known:
    """``.remote()`` of a value the handle already holds: an ObjectRef to it, as an actor
    method's call would return (``ray.get`` and ``await`` work the same)."""

    def __init__(self, value: Any) -> None:
        self._value = value

    def remote(self) -> ray.ObjectRef:
        return ray.put(self._value)


class SandboxActorHandle(SandboxHandle):
    """A sandbox handle that carries the config it was created with."""

    def __init__(self, sandbox_id: str, host: Any, *, config: SandboxConfig,
                 name: str | None = None, node_id: str | None = None) -> None:
        super().__init__(sandbox_id, host, name=name, node_id=node_id)
        self.config = config

    @classmethod
    def of(cls, handle: SandboxHandle, config: SandboxConfig) -> SandboxActorHandle:
        return cls(handle.sandbox_id, handle._host, config=config, name=handle.name,
                   node_id=handle.node_id)

    def __reduce__(self):  # stay this class through pickling (the base rebuilds a base)
        return (_rebuild, (self.sandbox_id, self._host, self.config, self.name, self.node_id))

    @property
    def get_instance_id(self) -> _Known:
        """Ray's form of the id, ``ray-sandbox-<32 hex>`` (docs/compat.md, "Ids")."""
        return _Known(ray_id(self.sandbox_id))

    @property
    def get_config(self) -> _Known:
        """The :class:`SandboxConfig` the sandbox was created with."""
        return _Known(self.config)


def _rebuild(sandbox_id: str, host: Any, config: SandboxConfig, name: str | None,
             node_id: str | None) -> SandboxActorHandle:
    return SandboxActorHandle(sandbox_id, host, config=config, name=name, node_id=node_id)
