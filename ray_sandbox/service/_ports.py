"""A sandbox's published port through the service: a URL carrying a signed token scoped to
that sandbox and port and expiring (``_signing``), and the proxy behind it.

``/api/v1/ports/{sandbox_id}/{port}/{token}/{path}`` needs no bearer token: the signed one
is the authorization, checked against the sandbox and port in the URL, so a token for one
sandbox or port opens no other. The sandbox publishes the port on its node
(``expose_ports``, docs/network.md) at ``RAY_SANDBOX_NET_EXPOSE_ADDR`` (loopback by default:
then only a replica on the sandbox's node reaches it).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import ray
from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from ..runtime.errors import ConfigError
from . import _errors, _signing
from ._config import ServiceConfig
from ._entry import Entry

# Not forwarded either way: they describe one connection, not the request.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization",
                        "te", "trailer", "transfer-encoding", "upgrade", "host",
                        "content-length", "authorization"})


def port_url(config: ServiceConfig, base: str, entry: Entry, port: int,
             ttl: float | None) -> dict[str, Any]:
    """A URL for ``port`` of the tenant's sandbox, valid for ``ttl`` seconds (capped)."""
    if port not in entry.ports:
        raise _errors.refusal(400, _unpublished(port, entry.ports))
    return _signed(config, base, {"sid": entry.api_id, "port": port, "tenant": entry.tenant},
                   ttl)


def ray_port_url(config: ServiceConfig, base: str, sandbox_id: str, node_id: str,
                 published: tuple[int, ...], port: int, ttl: float | None) -> dict[str, Any]:
    """A URL for ``port`` of a sandbox made through Ray, not by a tenant (the Modal facade's
    ``encrypted_ports``). Only Ray callers get one (``SandboxService.port_url``): they hold
    the cluster already. The claims name no tenant, so none of these opens a tenant's
    sandbox, and they name the node, whose host the proxy asks on every request whether the
    sandbox still runs."""
    if port not in published:
        raise ConfigError(_unpublished(port, published), sandbox_id=sandbox_id)
    return _signed(config, base, {"sid": sandbox_id, "port": port, "node": node_id}, ttl)


def _unpublished(port: int, ports: tuple[int, ...]) -> str:
    return f"port {port} is not published by this sandbox (expose_ports={list(ports)})"


def _signed(config: ServiceConfig, base: str, claims: dict[str, Any],
            ttl: float | None) -> dict[str, Any]:
    expires = time.time() + min(ttl or config.max_port_url_seconds, config.max_port_url_seconds)
    token = _signing.sign(config.signing_key.get_secret_value().encode(),
                          {**claims, "exp": expires})
    # no trailing slash: Modal's tunnel URLs have none, and f"{url}/api" must not be //api
    out = {"url": f"{base}/ports/{claims['sid']}/{claims['port']}/{token}", "token": token,
           "expires_at": expires}
    if config.port_host_suffix:  # the host form: the app's own origin
        where = urlsplit(base)
        port = f":{where.port}" if where.port else ""
        name = _signing.label(config.signing_key.get_secret_value().encode(), claims["sid"],
                              claims["port"], int(expires))
        out["host_url"] = f"{where.scheme}://{name}.{config.port_host_suffix}{port}"
    return out


def port_host(config: ServiceConfig, host_header: str) -> str | None:
    """The label of a request made to ``<label>.<port_host_suffix>``, or None."""
    suffix = config.port_host_suffix
    host = host_header.rsplit(":", 1)[0].lower() if not host_header.startswith("[") else ""
    if not suffix or not host.endswith("." + suffix):
        return None
    name = host[:-len(suffix) - 1]
    return name if name and "." not in name else None


def label_for(config: ServiceConfig, name: str) -> tuple[str, int]:
    """The sandbox and port of a genuine, unexpired host label; else a 401."""
    found, why = _signing.verify_label(config.signing_key.get_secret_value().encode(), name,
                                       time.time())
    if found is None:
        raise _errors.refusal(401, f"port host refused: {why}")
    return found


def claims_for(config: ServiceConfig, sandbox_id: str, port: int, token: str) -> dict[str, Any]:
    """The token's claims if it is genuine, unexpired and for this sandbox and port."""
    claims, why = _signing.verify(config.signing_key.get_secret_value().encode(), token,
                                  time.time())
    if claims is None:
        raise _errors.refusal(401, f"port token refused: {why}")
    if claims.get("sid") != sandbox_id or claims.get("port") != port:
        raise _errors.refusal(401, "port token refused: it is for another sandbox or port")
    return claims


class Proxy:
    """Forwards requests to published ports; one connection pool per replica."""

    def __init__(self, config: ServiceConfig) -> None:
        self._http = httpx.AsyncClient(timeout=config.call_timeout, follow_redirects=False)
        self._addresses: dict[str, str] = {}

    async def _address(self, node_id: str | None) -> str:
        here = ray.get_runtime_context().get_node_id()
        if node_id is None or node_id == here:
            return "127.0.0.1"
        if node_id not in self._addresses:
            nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
            self._addresses.update(nodes)
        if node_id not in self._addresses:
            raise _errors.refusal(503, "the sandbox's node is gone")
        return self._addresses[node_id]

    async def forward(self, request: Request, node_id: str | None, port: int,
                      path: str) -> Response:
        host = await self._address(node_id)
        url = httpx.URL(f"http://{host}:{port}/{path}")
        if request.url.query:  # an empty one reached the app as "/?"
            url = url.copy_with(query=request.url.query.encode())
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP]
        req = self._http.build_request(request.method, url, headers=headers,
                                       content=await request.body())  # bounded by the guard
        try:
            upstream = await self._http.send(req, stream=True)
        except httpx.HTTPError as exc:
            raise _errors.refusal(502, f"nothing answered on port {port}: {exc}") from None
        out = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
        return StreamingResponse(_body(upstream), status_code=upstream.status_code,
                                 headers=out)

    async def close(self) -> None:
        await self._http.aclose()


async def _body(upstream: httpx.Response) -> AsyncIterator[bytes]:
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    finally:
        await upstream.aclose()
