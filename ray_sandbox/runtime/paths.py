"""Where ray_sandbox keeps its node-local state.

``$RAY_SANDBOX_HOME`` (default ``/var/lib/ray_sandbox``) holds:

    images/      the image store (see ray_sandbox.runtime.images)
    sandboxes/   one directory per live sandbox (bundle, config.json, logs, agent socket)
    runsc/       runsc's --root state directory
"""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    return Path(os.environ.get("RAY_SANDBOX_HOME", "/var/lib/ray_sandbox"))
