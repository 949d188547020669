"""SandboxTemplate: a sandbox config plus how Ray should place it; shared by create and pools."""

from __future__ import annotations

import os
from typing import Any

import ray
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..runtime.config import DEFAULT_DISK, SandboxConfig, make_config
from ..runtime.errors import ConfigError
from .volumes import volume_node

_MIN_CPU_RESERVATION = 0.0001  # Ray's resource granularity


class SandboxTemplate(BaseModel):
    """What to create (``config``) and what to reserve in Ray for it.

    Each sandbox reserves ``config.cpu`` CPUs, ``config.memory`` bytes of Ray ``memory`` and
    ``resources`` (custom resources) in a placement group, so Ray's scheduler, its queueing
    and the autoscaler see sandbox demand like any other Ray work.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    config: SandboxConfig = Field(default_factory=SandboxConfig)
    resources: dict[str, float] = Field(default_factory=dict)
    label_selector: dict[str, str] = Field(default_factory=dict)
    node_id: str | None = Field(None, description="pin to this Ray node (hex id)")

    @property
    def bundle(self) -> dict[str, float]:
        b: dict[str, float] = {"CPU": max(self.config.cpu or 0.0, _MIN_CPU_RESERVATION)}
        if self.config.memory:
            b["memory"] = float(self.config.memory)
        b.update(self.resources)
        return b


_RAY_FIELDS = ("resources", "label_selector", "node_id")


def make_template(template: SandboxTemplate | None = None, **kwargs: Any) -> SandboxTemplate:
    """Build a template from another one and/or keyword arguments (config fields and the Ray
    placement fields ``resources``, ``label_selector``, ``node_id``). Without a base template
    ``readonly`` defaults to False here. A config with volumes and no ``node_id`` is pinned to
    the node holding them (volumes live on one node; needs Ray connected)."""
    ray_kw = {k: kwargs.pop(k) for k in _RAY_FIELDS if k in kwargs and kwargs[k] is not None}
    if template is None:
        # Agent workloads write anywhere (pip install, mkdir /app): through Ray the default
        # root is a private copy-on-write layer. SandboxRuntime keeps read-only as default.
        kwargs.setdefault("readonly", False)
        if not kwargs["readonly"] and os.geteuid() == 0:
            # ...and what it writes lands on the node's disk, so it is capped by default:
            # one rollout must not fill the disk under its neighbours (disk= needs root).
            kwargs.setdefault("disk", DEFAULT_DISK)
    base = template or SandboxTemplate()
    config = make_config(base.config, **kwargs) if kwargs else base.config
    ray_kw = {**base.model_dump(include=set(_RAY_FIELDS)), **ray_kw}
    if config.volumes and not ray_kw.get("node_id") and ray.is_initialized():
        ray_kw["node_id"] = volume_node(v.name for v in config.volumes.values())
    try:
        return SandboxTemplate(config=config, **ray_kw)
    except ValidationError as exc:
        raise ConfigError(f"invalid sandbox template: {exc}") from None
