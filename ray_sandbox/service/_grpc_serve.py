"""Modal's API in a replica: the control plane and the router over the replica's
:class:`Sandboxes`, served on ``modal_port`` (docs/modal.md). Imported only when
``modal_port`` is set: it needs the ``[modal]`` extra."""

from __future__ import annotations

from ._config import ServiceConfig
from ._grpc import Ingress
from ._grpc_control import Control
from ._grpc_router import Router
from ._sandboxes import Sandboxes


def serve(config: ServiceConfig, sandboxes: Sandboxes) -> Ingress:
    """Start serving in the background of the running event loop (the replica's); the
    port is bound by one replica at a time (``Ingress.start``)."""
    control = Control(config, sandboxes)
    ingress = Ingress(config, control, Router(config, sandboxes, control))
    ingress.start()
    return ingress
