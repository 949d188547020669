"""Deprecated alias: the network layer now lives in :mod:`ray_sandbox.runtime.network`, where
its imports put it (it is built on the runtime's config, errors and subprocess chokepoint, and
the runtime drives it). ``from ray_sandbox import network`` keeps working."""

from __future__ import annotations

import warnings
from typing import Any

from ..runtime import network as _network

__all__ = _network.__all__


def __getattr__(name: str) -> Any:
    warnings.warn("ray_sandbox.network moved to ray_sandbox.runtime.network",
                  DeprecationWarning, stacklevel=2)
    return getattr(_network, name)
