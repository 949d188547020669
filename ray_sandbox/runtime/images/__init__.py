"""Images for sandboxes: :mod:`.reference` parses what users write, :mod:`.models` holds what
the store knows about an image, :mod:`.store` is the node-local :class:`ImageStore`, whose
files, locks and work directories are in :mod:`.storedir`, whose pins (and when one is stale)
are in :mod:`.pins` and whose deletions are in :mod:`.eviction`; :mod:`.layers` stores an image
as its parent plus a directory of changes. See docs/images.md."""

from __future__ import annotations

from ..errors import ImageBusyError, ImageInUseError
from .models import Image, ImageConfig, Platform
from .reference import (
    BUILT_NAMESPACE,
    LOCAL_NAMESPACE,
    ImageRef,
    PullPolicy,
    Transport,
    built_name,
    is_loopback,
    parse_reference,
)
from .store import ImageStore

__all__ = [
    "BUILT_NAMESPACE",
    "LOCAL_NAMESPACE",
    "Image",
    "ImageBusyError",
    "ImageConfig",
    "ImageInUseError",
    "ImageRef",
    "ImageStore",
    "Platform",
    "PullPolicy",
    "Transport",
    "built_name",
    "is_loopback",
    "parse_reference",
]
