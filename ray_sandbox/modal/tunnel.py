"""Modal's ``Tunnel``, two ways:

- ``unencrypted_ports``: node-local. The sandbox's port is published on its node
  (``expose_ports``, docs/network.md) at ``RAY_SANDBOX_NET_EXPOSE_ADDR`` (loopback by
  default), so the endpoint is ``127.0.0.1`` on that node, and the node's address elsewhere
  (reachable only when that address is routable). Plain TCP.
- ``encrypted_ports``: through the HTTP service (docs/service.md) named by
  ``RAY_SANDBOX_SERVICE_APP``: a signed, expiring URL for that sandbox and port, reached
  wherever the service is. HTTP by URL only; TLS is whatever fronts the service (``url``
  says which).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import ray

from ..runtime.errors import ModalInvalidError, ModalNotFoundError
from ._refuse import refused_property

SERVICE_APP_ENV = "RAY_SANDBOX_SERVICE_APP"  # the Serve app of `ray-sandbox serve`: ray-sandbox


def node_address(node_id: str | None) -> str:
    """Where the caller reaches what a node publishes."""
    if node_id is None or node_id == ray.get_runtime_context().get_node_id():
        return "127.0.0.1"
    for node in ray.nodes():
        if node["NodeID"] == node_id and node["Alive"]:
            return node["NodeManagerAddress"]
    raise ModalNotFoundError(f"the sandbox's node {node_id} is gone")


def service_app() -> str | None:
    """The service that ``encrypted_ports`` go through, if one is configured."""
    return os.environ.get(SERVICE_APP_ENV) or None


def require_service(ports: Any) -> None:
    """``encrypted_ports`` need the service; refused at create when none is named."""
    if ports and service_app() is None:
        raise NotImplementedError(
            "Sandbox.create(encrypted_ports=...): encrypted tunnels go through the ray_sandbox "
            f"service; run `ray-sandbox serve` and set {SERVICE_APP_ENV}=ray-sandbox "
            "(docs/compat.md, 'tunnels')")


@dataclass(frozen=True)
class Tunnel:
    """One published port, as Modal's: ``url`` and ``tls_socket`` for an encrypted port,
    ``tcp_socket`` (``unencrypted_host``/``unencrypted_port``) for an unencrypted one."""

    host: str
    port: int
    unencrypted_host: str = ""
    unencrypted_port: int = 0
    url: str = ""
    expires_at: float | None = None  # a service URL's; tunnels() again gives a fresh one

    @classmethod
    def _node_local(cls, host: str, port: int) -> Tunnel:
        return cls(host, port, host, port, f"http://{host}:{port}")

    @classmethod
    def _through_service(cls, handle: Any, port: int, timeout: float) -> Tunnel:
        """A signed URL to ``port`` of ``handle``'s sandbox, from the service."""
        try:
            from ray import serve
            from ray.serve.exceptions import RayServeException
        except ImportError as exc:
            raise NotImplementedError(f"encrypted tunnels need Ray Serve ({exc}): "
                                      "pip install 'ray_sandbox[service]'") from None
        app = service_app()
        if app is None:
            raise ModalInvalidError(f"encrypted tunnels need the service ({SERVICE_APP_ENV})")
        try:
            service = serve.get_app_handle(app)
        except RayServeException as exc:
            raise ModalNotFoundError(f"no ray_sandbox service {app!r} runs on this cluster "
                                     f"({SERVICE_APP_ENV}): {exc}") from None
        signed = service.port_url.remote(handle, port).result(timeout_s=timeout)
        # the host form when the service has one: the app owns its whole origin, as at Modal
        url = signed.get("host_url") or signed["url"]
        where = urlsplit(url)
        default = 443 if where.scheme == "https" else 80
        return cls(where.hostname or "", where.port or default, url=url,
                   expires_at=signed["expires_at"])

    @property
    def tcp_socket(self) -> tuple[str, int]:
        if not self.unencrypted_host:
            raise ModalInvalidError("this tunnel is not configured for unencrypted TCP; "
                                    "use unencrypted_ports")
        return self.unencrypted_host, self.unencrypted_port

    # an unencrypted port has no TLS, and the service routes by the URL's path: a bare TLS
    # socket to it would reach the service, not the sandbox's port
    tls_socket = refused_property("Tunnel.tls_socket", "no TLS socket here; use url")
