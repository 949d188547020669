"""The Ray Serve deployment: ``num_replicas`` replicas serving the app (with more than one,
they share their books through one state actor, ``_state``), and starting it on a running
Ray cluster."""

from __future__ import annotations

from typing import Any

from ray import serve

from ._app import build_app
from ._config import ServiceConfig, from_env
from ._state import connect, disconnect

APP_NAME = "ray-sandbox"


class SandboxService:
    """Builds the app in the replica, so nothing but the config crosses to it."""

    def __init__(self, config: ServiceConfig) -> None:
        app = serve.get_replica_context().app_name
        self._app = build_app(config, connect(config, app))

    def __serve_build_asgi_app__(self) -> Any:
        return self._app


def application(config: ServiceConfig) -> Any:
    """The Serve application, for ``serve.run`` (or a RayService's import path)."""
    deployment = serve.deployment(
        name="SandboxService",
        num_replicas=config.num_replicas,
        max_ongoing_requests=config.max_ongoing_requests,  # long polls hold a request each
        ray_actor_options={"num_cpus": 0},  # sandboxes reserve their own CPUs
    )(serve.ingress()(SandboxService))
    return deployment.bind(config)


def start(config: ServiceConfig, host: str = "127.0.0.1", port: int = 8000) -> str:
    """Start Serve's proxy on ``host:port`` and deploy the service (on the connected Ray
    cluster); returns its base URL."""
    serve.start(http_options={"host": host, "port": port})
    serve.run(application(config), name=APP_NAME, route_prefix="/", blocking=False)
    return f"http://{host}:{port}/api/v1"


def stop() -> None:
    """Delete the service's app, its state actor, and stop Serve."""
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
