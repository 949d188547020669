"""Modal's ``Tunnel`` for a published port, node-local: the sandbox's port is published on
its node (``expose_ports``, docs/network.md) at ``RAY_SANDBOX_NET_EXPOSE_ADDR`` (loopback by
default), so the endpoint is ``127.0.0.1`` on that node, and the node's address elsewhere
(reachable only when that address is routable). Plain TCP: no TLS, no HTTP/2."""

from __future__ import annotations

from dataclasses import dataclass

import ray

from ..runtime.errors import ModalNotFoundError


def node_address(node_id: str | None) -> str:
    """Where the caller reaches what a node publishes."""
    if node_id is None or node_id == ray.get_runtime_context().get_node_id():
        return "127.0.0.1"
    for node in ray.nodes():
        if node["NodeID"] == node_id and node["Alive"]:
            return node["NodeManagerAddress"]
    raise ModalNotFoundError(f"the sandbox's node {node_id} is gone")


@dataclass(frozen=True)
class Tunnel:
    """One published port: ``tcp_socket`` (and ``url`` for HTTP) reach it."""

    host: str
    port: int

    @property
    def unencrypted_host(self) -> str:
        return self.host

    @property
    def unencrypted_port(self) -> int:
        return self.port

    @property
    def tcp_socket(self) -> tuple[str, int]:
        return self.host, self.port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def tls_socket(self) -> tuple[str, int]:
        raise NotImplementedError("Tunnel.tls_socket: no TLS here; use tcp_socket")
