"""The Ray Serve deployment: ``num_replicas`` replicas serving the app (with more than one,
they share their books through one state actor, ``_state``), and starting it on a running
Ray cluster. With the books in a SQLite file, whatever holds them (the one replica, or the
state actor) runs on the head node, where the file is."""

from __future__ import annotations

from typing import Any

import ray
from ray import serve

from ..actor import SandboxHandle
from ..runtime.errors import ConfigError
from . import _ports
from ._app import PREFIX, build_app
from ._config import ServiceConfig, from_env
from ._sandboxes import Sandboxes
from ._state import HEAD, connect, disconnect, on_head

APP_NAME = "ray-sandbox"


class SandboxService:
    """Builds the app in the replica, so nothing but the config crosses to it."""

    def __init__(self, config: ServiceConfig) -> None:
        app = serve.get_replica_context().app_name
        self._config = config
        self._sandboxes = Sandboxes(config, connect(config, app))
        self._app = build_app(config, self._sandboxes)
        self._modal = None
        if config.modal_port is not None:  # Modal's gRPC API beside HTTP, same Sandboxes
            from . import _grpc_serve  # the optional [modal] extra

            self._modal = _grpc_serve.serve(config, self._sandboxes)

    def __del__(self) -> None:
        modal = getattr(self, "_modal", None)
        if modal is not None:
            modal.close()

    def __serve_build_asgi_app__(self) -> Any:
        return self._app

    async def port_url(self, sandbox: SandboxHandle, port: int,
                       ttl_seconds: float | None = None) -> dict[str, Any]:
        """For Ray callers only (a DeploymentHandle; no HTTP route reaches it): a signed,
        expiring URL to ``port`` of a sandbox made through Ray, which no tenant owns (the
        Modal facade's ``encrypted_ports``; docs/service.md, "Ports of sandboxes made
        through Ray"). ``{url, token, expires_at}``, as the HTTP route answers."""
        base = self._config.public_url or self._config.served_at
        if base is None:
            raise ConfigError("the service has no public_url to put in port URLs "
                              "(RAY_SANDBOX_API_PUBLIC_URL, ServiceConfig.public_url)",
                              sandbox_id=sandbox.sandbox_id)
        if sandbox.node_id is None:
            raise ConfigError("this handle does not know its sandbox's node; get one from "
                              "ray_sandbox.create, get or list", sandbox_id=sandbox.sandbox_id)
        published = (await self._sandboxes.call(sandbox.get_config.remote())).expose_ports
        return _ports.ray_port_url(self._config, base + PREFIX, sandbox.sandbox_id,
                                   sandbox.node_id, tuple(published), port, ttl_seconds)


def application(config: ServiceConfig) -> Any:
    """The Serve application, for ``serve.run`` (or a RayService's import path)."""
    options: dict[str, Any] = {"num_cpus": 0}  # sandboxes reserve their own CPUs
    if config.modal_port is not None or (config.num_replicas == 1 and on_head(config)):
        # the books' SQLite file, and Modal's gRPC port (docs/modal.md), are the head's
        options["resources"] = HEAD
    more: dict[str, Any] = {}
    if config.max_replicas_per_node:
        more["max_replicas_per_node"] = config.max_replicas_per_node
    deployment = serve.deployment(
        name="SandboxService",
        num_replicas=config.num_replicas,
        max_ongoing_requests=config.max_ongoing_requests,  # long polls hold a request each
        ray_actor_options=options,
        **more,
    )(serve.ingress()(SandboxService))
    return deployment.bind(config)


def start(config: ServiceConfig, host: str = "127.0.0.1", port: int = 8000) -> str:
    """Start Serve's proxy on ``host:port`` and deploy the service (on the connected Ray
    cluster); returns its base URL. With ``modal_port`` Modal's gRPC API binds ``host``
    too."""
    reach = ray.util.get_node_ip_address() if host in ("0.0.0.0", "::") else host
    reach = f"[{reach}]" if ":" in reach else reach  # an IPv6 address
    config = config.model_copy(update={"served_at": f"http://{reach}:{port}",
                                       "modal_host": host})
    serve.start(http_options={"host": host, "port": port})
    serve.run(application(config), name=APP_NAME, route_prefix="/", blocking=False)
    return f"http://{host}:{port}{PREFIX}"


def stop() -> None:
    """Delete the service's app, its state actor, and stop Serve. The books' database stays
    (the next start reloads it)."""
    serve.delete(APP_NAME)
    disconnect(APP_NAME)
    serve.shutdown()


def app_builder(args: dict[str, Any]) -> Any:
    """``serve run ray_sandbox.service:app_builder`` and a RayService's ``serveConfigV2``:
    tokens from the environment (RAY_SANDBOX_API_TOKEN(S), a tokens file), ``args`` are
    ServiceConfig's fields plus ``quotas``, a list of ``[tenant:]sandboxes=N,...`` specs."""
    settings = dict(args)
    quotas = tuple(settings.pop("quotas", ()))
    return application(from_env(quotas=quotas, **settings))
