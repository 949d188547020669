"""Quota arithmetic (pure): what a tenant holds and whether one more sandbox fits."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..runtime.config import SandboxConfig
from ..runtime.errors import ConfigError
from ._config import Quota


@dataclass(frozen=True)
class Charge:
    """What one sandbox counts against its tenant's quota."""

    cpu: float
    memory: int


def charge(config: SandboxConfig) -> Charge:
    """A sandbox's charge; one without a CPU or memory limit cannot be counted, so it is
    refused (a tenant could otherwise take a node)."""
    if config.cpu is None or config.memory is None:
        raise ConfigError("the service needs a cpu and a memory limit for every sandbox "
                          "(cpu=0 or memory=null would be unbounded)")
    return Charge(cpu=config.cpu, memory=config.memory)


def over_quota(quota: Quota, held: Iterable[Charge], new: Charge) -> str | None:
    """Why ``new`` does not fit beside ``held`` (a message naming the limit), or None."""
    held = list(held)
    cpu = sum(c.cpu for c in held) + new.cpu
    memory = sum(c.memory for c in held) + new.memory
    if len(held) + 1 > quota.sandboxes:
        return f"quota: at most {quota.sandboxes} sandboxes; {len(held)} held"
    # a small tolerance: sums of fractional cores are not exact in binary
    if cpu > quota.cpu + 1e-9:
        return f"quota: at most {quota.cpu:g} CPUs; {cpu - new.cpu:g} held, {new.cpu:g} asked"
    if memory > quota.memory:
        return (f"quota: at most {quota.memory} bytes of memory; {memory - new.memory} held, "
                f"{new.memory} asked")
    return None
