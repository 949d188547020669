"""Sandboxes as a service: an HTTP API (``/api/v1``, the shape of Ray's proposed sandbox REST
API) on Ray Serve over the Ray layer, with tenants, quotas and an audit log (docs/service.md).

    ray-sandbox serve --host 0.0.0.0 --port 8000     # RAY_SANDBOX_API_TOKEN=... in the env
"""

from ._app import build_app
from ._config import Quota, ServiceConfig, from_env, parse_quota, parse_tokens
from ._deploy import APP_NAME, app_builder, application, start, stop
from ._reconcile import run_pass as reconcile

__all__ = ["APP_NAME", "Quota", "ServiceConfig", "app_builder", "application", "build_app",
           "from_env", "parse_quota", "parse_tokens", "reconcile", "start", "stop"]
