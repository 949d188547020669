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

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..runtime.config import parse_size
from ..runtime.errors import ConfigError
from ..runtime.verbs import VERBS
from .api import create
from .labels import OWNER_ACTOR_LABEL

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


class SandboxActor:
    """The body of the proxy actor ``Sandbox.remote(...)`` starts (``__ray_actor_class__``):
    one sandbox, on this actor's node, whose verbs its methods forward to the node's host
    (through the node-local channel where it can). ``ray.kill`` of the actor ends the
    sandbox (the host watches the actor); ``delete``/``terminate`` end it and keep the actor.
    Instantiated outside Ray it is a plain object owning a sandbox, as Ray's is."""

    def __init__(self, image: str | None = None, **kwargs: Any) -> None:
        bad = sorted(k for k in kwargs if k.startswith("_") and k != "_oci_spec_transform_fn")
        if bad:  # Ray's class takes no private keyword: a TypeError, as Python raises
            raise TypeError(f"Sandbox() got unexpected keyword argument(s) {bad}")
        here = ray.get_runtime_context()
        actor = here.get_actor_id() if ray.is_initialized() else None
        if actor is not None:  # the sandbox lives beside its actor, and dies with it
            kwargs.setdefault("node_id", here.get_node_id())
            kwargs["labels"] = {**kwargs.get("labels", {}), OWNER_ACTOR_LABEL: actor}
        self._sb = create(image, **kwargs)

    def get_instance_id(self) -> str:
        return ray.get(self._sb.get_instance_id.remote())

    def get_config(self) -> Any:
        return ray.get(self._sb.get_config.remote())

    def exec(self, command: str | list[str], **kwargs: Any) -> Any:
        return self._sb.run(command, **kwargs)

    def upload_file(self, local_path: str, remote_path: str) -> None:
        ray.get(self._sb.upload_file.remote(local_path, remote_path))

    def download_file(self, remote_path: str, local_path: str, **kwargs: Any) -> None:
        ray.get(self._sb.download_file.remote(remote_path, local_path, **kwargs))

    def terminate(self) -> None:
        ray.get(self._sb.terminate.remote())

    delete = terminate


def _forward(name: str) -> Any:
    def method(self: SandboxActor, *args: Any, **kwargs: Any) -> Any:
        return ray.get(getattr(self._sb, name).remote(*args, **kwargs))

    method.__name__ = name
    return method


for _row in VERBS.values():  # the table's verbs, as the handle has them
    if not _row.streams and not hasattr(SandboxActor, _row.name):
        setattr(SandboxActor, _row.name, _forward(_row.name))
SandboxActor.get_status = SandboxActor.status  # type: ignore[attr-defined]  # Ray's name
_ProxyActor = ray.remote(SandboxActor)
_PROXY_OPTIONS = {"num_cpus": 0, "max_concurrency": 64}  # a worker process, no CPU


class SandboxClass:
    """What ``Sandbox`` is, as Ray's actor class: ``.options(...)`` returns one with more
    actor options, ``.remote(...)`` starts a light proxy actor (no CPU) that owns the
    sandbox and returns its real ``ActorHandle`` (``isinstance``, ``ray.kill`` work as with
    Ray). :func:`create` stays the fast path: a handle without an actor per sandbox."""

    __ray_actor_class__ = SandboxActor

    def __init__(self, actor_options: Mapping[str, Any] | None = None) -> None:
        self._actor_options = dict(actor_options or {})

    def options(self, **actor_options: Any) -> SandboxClass:
        return SandboxClass({**self._actor_options, **actor_options})

    def remote(self, image: str | None = None, **kwargs: Any) -> Any:
        """Start the proxy actor, which makes the sandbox; ``kwargs`` are :func:`create`'s
        (SandboxConfig fields). Returns at once, as Ray's does: a failed create is the
        error of the actor's first call."""
        options = create_options(self._actor_options, kwargs)
        # the actor holds the name, as Ray's does; a detached one keeps its sandbox too
        actor_opts = {k: options.pop(k) for k in ("name", "namespace", "get_if_exists")
                      if k in options}
        if options.get("lifetime"):
            actor_opts["lifetime"] = options["lifetime"]
        if "node_id" in options:
            actor_opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                options["node_id"], soft=False)
        return _ProxyActor.options(**_PROXY_OPTIONS, **actor_opts).remote(image, **options)


Sandbox = SandboxClass()
