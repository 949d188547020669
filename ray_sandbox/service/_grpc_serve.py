"""Modal's API in a replica: the control plane and the router over the replica's
:class:`Sandboxes`, served on ``modal_port`` (docs/modal.md). Imported only when
``modal_port`` is set: it needs the ``[modal]`` extra."""

from __future__ import annotations

from ._config import ServiceConfig
from ._grpc import Ingress
from ._grpc_apps import Apps
from ._grpc_images import Images
from ._grpc_lifecycle import Lifecycle
from ._grpc_router import Router
from ._grpc_sandboxes import WireSandboxes
from ._grpc_secrets import Secrets
from ._grpc_volumes import Volumes
from ._sandboxes import Sandboxes


def serve(config: ServiceConfig, sandboxes: Sandboxes) -> Ingress:
    """Start serving in the background of the running event loop (the replica's); the
    port is bound by one replica at a time (``Ingress.start``). The control plane's RPCs
    are declared by one object per concept (apps, images, secrets, volumes, the sandboxes'
    lifecycle), the router's by :class:`Router`."""
    wire = WireSandboxes(config, sandboxes)
    apps = Apps(config, wire)
    images = Images(config, sandboxes.check_image)
    secrets = Secrets()
    control = (apps, images, secrets, Volumes(config, sandboxes),
               Lifecycle(config, sandboxes, wire, apps, images, secrets))
    ingress = Ingress(config, control, (Router(config, sandboxes, wire, secrets),))
    ingress.start()
    return ingress
