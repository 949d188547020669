"""Where ray_sandbox keeps its node-local state.

``$RAY_SANDBOX_HOME`` (default ``/var/lib/ray_sandbox``) holds:

    images/      the image store (see docs/images.md); ``$RAY_SANDBOX_IMAGES`` moves it, e.g.
                 to share one image cache between several homes on a node
    sandboxes/   one directory per live sandbox (see ray_sandbox.runtime.bundle)
    runsc/       runsc's --root state directory
    disks/       one formatted ext4 image per disk= size, copied into each sandbox's disk

Network state belongs to the node, not to a home: ``/run/ray_sandbox/network``
(ray_sandbox.runtime.network.settings).
"""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    return Path(os.environ.get("RAY_SANDBOX_HOME", "/var/lib/ray_sandbox"))


def images(base: Path | None = None) -> Path:
    """The image store root: ``$RAY_SANDBOX_IMAGES``, else ``<home>/images``."""
    env = os.environ.get("RAY_SANDBOX_IMAGES")
    return Path(env) if env else (base or home()) / "images"
