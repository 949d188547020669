"""Secrets for credential injection through Ray: every node keeps its own store
(``runtime/secrets.py``: ``<home>/secrets`` of the node's ``RAY_SANDBOX_HOME``, where its
sandboxes' egress proxies read them at each request), so a put or a delete runs as a zero-CPU
task pinned to every live node, at once. An ``EgressPolicy.inject`` rule then names the
secret, wherever its sandbox lands (docs/network.md, "Credential injection").

This is the hook of every caller that holds values: the service's tenants (``service/
_secrets.py``, each in a scope of its own), and Modal's ``Secret``s (``Secret.from_dict`` and
named ones) for the Modal facade and wire API. Values cross the cluster as task arguments, in
Ray's object store. A node that joins later has none of them until the next put: its
proxies answer 502 ("not available on this node") meanwhile."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..runtime import paths
from ..runtime.errors import ConfigError
from ..runtime.secrets import SecretStore, check_name, check_values

_TIMEOUT_S = 60.0


@ray.remote(num_cpus=0)
def _on_node(op: str, *args: Any) -> Any:
    """``SecretStore.<op>(*args)`` in the home of the node this task runs on."""
    return getattr(SecretStore.of_home(paths.home()), op)(*args)


def _everywhere(op: str, *args: Any) -> list[Any]:
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    refs = [_on_node.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node, soft=False)).remote(op, *args) for node in nodes]
    return ray.get(refs, timeout=_TIMEOUT_S)


def put_secret(name: str, values: Mapping[str, str]) -> None:
    """Create or replace secret ``name`` (``KEY -> value``) on every live node; the next
    request of every sandbox whose rule names it uses the new values."""
    try:
        check_name(name)
        values = check_values(values)
    except ValueError as exc:
        raise ConfigError(f"secret {name!r}: {exc}") from None
    _everywhere("put", name, values)


def delete_secret(name: str) -> bool:
    """Remove secret ``name`` from every live node (injection with it stops at the next
    request); whether any node had it."""
    return any(_everywhere("delete", name))


def secret_names(scope: str | None = None) -> list[str]:
    """The names (never the values) of the secrets any live node holds, of ``scope`` only if
    given."""
    return sorted({n for names in _everywhere("names", scope) for n in names})
