"""``Sandbox``: Ray's sandbox actor class (``ray.experimental.sandbox.Sandbox``) over
:func:`create`. ``Sandbox.remote(image, ...)`` and ``Sandbox.options(num_cpus=…,
memory=…).remote(...)`` create a sandbox and return its handle, called like the actor's
(``exec``, ``read_file``, ``write_file``, ``upload_file``, ``download_file``,
``get_status``, ``get_instance_id``, ``get_config``, ``delete``, ``terminate``).

No Ray actor is started per sandbox (docs/ray.md, "Design"): the actor options that mean
something for a sandbox map onto :func:`create`'s arguments in :func:`create_options`, the
rest are refused by name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..runtime.config import parse_size
from ..runtime.errors import ConfigError
from .api import create
from .handle import SandboxHandle

# actor option -> create() argument, where the meaning is the same
_SAME = {"num_cpus": "cpu", "memory": "memory", "resources": "resources", "name": "name",
         "namespace": "namespace", "lifetime": "lifetime", "get_if_exists": "get_if_exists",
         "label_selector": "label_selector"}
# Accepted as already true: every call to a sandbox runs concurrently on its node's host.
_ALREADY = frozenset({"max_concurrency"})


def create_options(actor_options: Mapping[str, Any], kwargs: Mapping[str, Any]) -> dict:
    """:func:`create` keyword arguments for ``Sandbox.options(**actor_options).remote(
    **kwargs)``. A sandbox reserves in Ray what it may use, so ``num_cpus``/``memory`` are
    its ``cpu``/``memory`` (a ConfigError if both are given and differ); an option with no
    meaning here raises NotImplementedError naming it."""
    out = dict(kwargs)
    for key, value in actor_options.items():
        if key in _ALREADY or value is None:
            continue
        if key == "num_gpus":
            if value:
                raise NotImplementedError("num_gpus: sandboxes have no GPU access here")
            continue
        if key == "scheduling_strategy":
            out["node_id"] = _node_of(value)
            continue
        if key not in _SAME:
            raise NotImplementedError(f"Sandbox.options({key}=...) is not supported "
                                      "(docs/compat.md)")
        arg = _SAME[key]
        if arg not in out:
            out[arg] = value
        elif _norm(arg, out[arg]) != _norm(arg, value):
            raise ConfigError(f"{key}={value!r} and {arg}={out[arg]!r} differ: a sandbox "
                              f"reserves in Ray exactly what it may use")
    return out


def _norm(arg: str, value: Any) -> Any:
    return parse_size(value) if arg == "memory" and value else value


def _node_of(strategy: Any) -> str:
    if isinstance(strategy, NodeAffinitySchedulingStrategy) and not strategy.soft:
        return strategy.node_id
    raise NotImplementedError(f"scheduling_strategy={strategy!r}: only a hard "
                              "NodeAffinitySchedulingStrategy (a node id) is supported")


class SandboxClass:
    """What ``Sandbox`` is: ``.options(...)`` returns one with more actor options,
    ``.remote(...)`` creates the sandbox."""

    def __init__(self, actor_options: Mapping[str, Any] | None = None) -> None:
        self._actor_options = dict(actor_options or {})

    def options(self, **actor_options: Any) -> SandboxClass:
        return SandboxClass({**self._actor_options, **actor_options})

    def remote(self, image: str | None = None, **kwargs: Any) -> SandboxHandle:
        """Create the sandbox; ``kwargs`` are :func:`create`'s (SandboxConfig fields)."""
        return create(image, **create_options(self._actor_options, kwargs))


Sandbox = SandboxClass()
