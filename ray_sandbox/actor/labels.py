"""Names the Ray layer gives things (labels on sandboxes and snapshots, the host actors'
namespace and names) and the calling job: a leaf module, so a module that needs a name does
not import the host actor."""

from __future__ import annotations

import ray

NAMESPACE = "ray_sandbox"
HOST_PREFIX = "host-"  # a host actor's name: this, then its node's id
NAME_LABEL = "ray-sandbox/name"
OWNER_ACTOR_LABEL = "ray-sandbox/owner-actor"  # the proxy actor (Sandbox.remote) it dies with


def current_job() -> str:
    """The calling job: its sandboxes die with it, like its placement groups."""
    return ray.get_runtime_context().get_job_id()
