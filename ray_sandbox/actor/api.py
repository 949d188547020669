"""``create``, ``get``, ``list`` and ``shutdown``: sandboxes placed by Ray's scheduler."""

from __future__ import annotations

import builtins
from collections.abc import Mapping
from typing import Any, Literal

import ray
from ray.util.placement_group import placement_group, placement_group_table

from ..runtime.config import EgressPolicy
from ..runtime.errors import ConfigError, SandboxCreationError, SandboxNotFoundError
from .handle import SandboxHandle
from .host import NAMESPACE, all_hosts, forget_hosts, host_for_node, remove_pg
from .template import SandboxTemplate, config_fields, make_template


def _node_ip(node_id: str) -> str:
    for n in ray.nodes():
        if n["NodeID"] == node_id and n["Alive"]:
            return n["NodeManagerAddress"]
    raise ConfigError(f"no live Ray node {node_id}")


def _pg_name(name: str | None, namespace: str | None) -> str:
    return f"ray_sandbox:{namespace or ''}:{name}" if name else ""


def create(
    image: str | None = None,
    *,
    cpu: float | None = None,
    memory: int | str | None = None,
    env: Mapping[str, str] | None = None,
    workdir: str | None = None,
    readonly: bool | None = None,
    capabilities: builtins.list[str] | None = None,
    user: str | None = None,
    ttl_seconds: float | None = None,
    timeout_seconds: float | None = None,
    network: str | None = None,
    dns: builtins.list[str] | None = None,
    egress: EgressPolicy | Mapping[str, Any] | None = None,
    expose_ports: builtins.list[int] | None = None,
    rootless: bool | Literal["auto"] | None = None,
    labels: Mapping[str, str] | None = None,
    spec_transform: Any = None,
    resources: Mapping[str, float] | None = None,
    label_selector: Mapping[str, str] | None = None,
    node_id: str | None = None,
    name: str | None = None,
    namespace: str | None = None,
    lifetime: Literal["detached"] | None = None,
    get_if_exists: bool = False,
    template: SandboxTemplate | None = None,
    timeout: float | None = None,
) -> SandboxHandle:
    """Create a sandbox somewhere in the Ray cluster and return its handle.

    Its CPU, memory and ``resources`` are reserved in Ray (a placement group), so placement,
    queueing when the cluster is full (waits up to ``timeout`` seconds, forever by default)
    and the autoscaler all see it. By default the sandbox dies with the job that created it;
    ``lifetime="detached"`` lets it outlive the driver. ``name`` makes it findable with
    :func:`get`; with ``get_if_exists`` an existing one of that name is returned.
    """
    if lifetime not in (None, "detached"):
        raise ConfigError("lifetime must be None or 'detached'")
    if name and get_if_exists:
        try:
            return get(name, namespace=namespace)
        except SandboxNotFoundError:
            pass
    t = make_template(
        template,
        **config_fields(dict(
            image=image, cpu=cpu, memory=memory, env=env, workdir=workdir, readonly=readonly,
            capabilities=capabilities, user=user, ttl_seconds=ttl_seconds,
            timeout_seconds=timeout_seconds, network=network, dns=dns, egress=egress,
            expose_ports=expose_ports, rootless=rootless, labels=labels,
            spec_transform=spec_transform, resources=resources, label_selector=label_selector,
            node_id=node_id,
        )),
    )
    return create_from_template(t, name=name, namespace=namespace, lifetime=lifetime,
                                timeout=timeout)


def create_from_template(
    t: SandboxTemplate, *, name: str | None = None, namespace: str | None = None,
    lifetime: str | None = None, timeout: float | None = None,
) -> SandboxHandle:
    bundle = dict(t.bundle)
    if t.node_id:
        bundle[f"node:{_node_ip(t.node_id)}"] = 0.001
    pg = placement_group(
        [bundle],
        strategy="STRICT_PACK",
        name=_pg_name(name, namespace),
        lifetime=lifetime,
        bundle_label_selector=[dict(t.label_selector)] if t.label_selector else None,
    )
    try:
        ready = pg.wait(timeout_seconds=timeout if timeout is not None else 10**9)
    except BaseException:
        remove_pg(pg.id.hex())
        raise
    if not ready:
        remove_pg(pg.id.hex())
        raise SandboxCreationError(
            f"no node could reserve {bundle} within {timeout}s (the cluster is full)"
        )
    node = placement_group_table(pg)["bundles_to_node_id"][0]
    host = host_for_node(node)
    sid = ray.get(host.create.remote(t.config, pg.id.hex(), name, lifetime == "detached"))
    return SandboxHandle(sid, host, name=name, node_id=node)


def get(name: str, *, namespace: str | None = None) -> SandboxHandle:
    """The handle of the named sandbox (searched on every node)."""
    hosts = all_hosts()
    found = ray.get([h.find.remote(name) for h in hosts]) if hosts else []
    for h, sid in zip(hosts, found, strict=True):
        if sid:
            return SandboxHandle(sid, h, name=name)
    raise SandboxNotFoundError(f"no sandbox named {name!r}")


def list(labels: Mapping[str, str] | None = None) -> builtins.list[SandboxHandle]:  # noqa: A001
    """Handles of every live sandbox in the cluster (optionally only those with ``labels``)."""
    hosts = all_hosts()
    results = ray.get([h.list.remote(dict(labels) if labels else None) for h in hosts])
    out = []
    for h, items in zip(hosts, results, strict=True):
        for sid, lbls in items:
            out.append(SandboxHandle(sid, h, name=lbls.get("ray-sandbox/name")))
    return out


def shutdown() -> int:
    """Delete every sandbox on every node and stop the host actors; returns how many."""
    hosts = all_hosts()
    n = sum(ray.get([h.shutdown.remote() for h in hosts])) if hosts else 0
    for h in hosts:
        ray.kill(h, no_restart=True)
    forget_hosts()
    return n


__all__ = ["create", "create_from_template", "get", "list", "shutdown", "NAMESPACE"]
