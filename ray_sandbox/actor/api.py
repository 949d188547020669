"""``create``, ``get``, ``list``, ``shutdown``, and copies of running sandboxes (``fork``,
``restore``, ``resume`` after a suspend): sandboxes placed by Ray's scheduler."""

from __future__ import annotations

import builtins
from collections.abc import Mapping
from typing import Any, Literal

import ray

from ..runtime.config import SandboxConfig
from ..runtime.errors import ConfigError, SandboxNotFoundError
from ..runtime.snapshot import Snapshot
from . import copies
from .copies import delete_snapshot
from .handle import SandboxHandle
from .host import NAME_LABEL, NAMESPACE, current_job
from .hosts import all_hosts, ask_hosts, call_host, forget_hosts
from .placement import Placement, reserve
from .template import SandboxTemplate, make_template


def create(
    image: str | None = None,
    *,
    config: SandboxConfig | None = None,
    name: str | None = None,
    namespace: str | None = None,
    lifetime: Literal["detached"] | None = None,
    get_if_exists: bool = False,
    template: SandboxTemplate | None = None,
    timeout: float | None = None,
    **options: Any,
) -> SandboxHandle:
    """Create a sandbox somewhere in the Ray cluster and return its handle.

    ``options`` are :class:`SandboxConfig` fields (``cpu``, ``memory``, ``disk``,
    ``pids_limit``, ``directfs``, ``network``, …, each meaning what it means there) and Ray
    placement fields (``resources``, ``label_selector``, ``node_id``); an unknown one is a
    ConfigError naming it. They apply over ``config`` or ``template`` when given. Through Ray
    the root is writable by default, capped by ``disk="4Gi"``.

    Its CPU, memory and ``resources`` are reserved in Ray (a placement group), so placement,
    queueing when the cluster is full (waits up to ``timeout`` seconds, forever by default,
    saying what it waits for) and the autoscaler all see it. By default the sandbox dies
    with the job that created it; ``lifetime="detached"`` lets it outlive the driver.
    ``name`` makes it findable with :func:`get`; with ``get_if_exists`` an existing one of
    that name is returned.
    """
    if lifetime not in (None, "detached"):
        raise ConfigError("lifetime must be None or 'detached'")
    if name and get_if_exists:
        try:
            return get(name, namespace=namespace)
        except SandboxNotFoundError:
            pass
    if config is not None:
        if template is not None:
            raise ConfigError("give config= or template=, not both")
        template = SandboxTemplate(config=config)
    if image is not None:
        options["image"] = image
    t = make_template(template, **options)
    return create_from_template(t, name=name, namespace=namespace, lifetime=lifetime,
                                timeout=timeout)


def create_from_template(
    t: SandboxTemplate, *, name: str | None = None, namespace: str | None = None,
    lifetime: str | None = None, timeout: float | None = None,
) -> SandboxHandle:
    pg_hex, node = reserve(t.bundle, node_id=t.node_id, label_selector=t.label_selector,
                           name=name, namespace=namespace, lifetime=lifetime, timeout=timeout)
    job = current_job()
    host, sid = call_host(node, lambda h: h.create.remote(
        t.config, pg_hex, name, lifetime == "detached", owner_job=job), pg_hex)
    return SandboxHandle(sid, host, name=name, node_id=node)


# --- snapshots, copies, suspension ------------------------------------------------------------

def restore(
    snapshot: Snapshot, k: int = 1, *, placement: Placement = "local",
    timeout: float | None = None,
) -> builtins.list[SandboxHandle]:
    """``k`` new sandboxes from a snapshot, each with its own Ray reservation (the source's
    resources). ``placement`` is ``"local"`` (the snapshot's node), ``"any"`` or a node id;
    on another node the snapshot's files are fetched from the node that holds them, once.
    All or nothing: if one copy fails, the others are deleted and the error raised."""
    return [SandboxHandle(**c._asdict())
            for c in copies.restore(snapshot, k, placement=placement, timeout=timeout)]


def fork(
    handle: SandboxHandle, k: int = 1, *, placement: Placement = "local",
    timeout: float | None = None,
) -> builtins.list[SandboxHandle]:
    """``k`` running copies of a sandbox (snapshot + ``restore``; the snapshot is deleted
    afterwards). See :func:`restore` for ``placement``."""
    return handle.fork(k, placement=placement, timeout=timeout)


def resume(
    sandbox: SandboxHandle | str, *, placement: Placement = "any",
    timeout: float | None = None,
) -> SandboxHandle:
    """Bring back a suspended sandbox (by handle, id or name): reserve its resources again
    (on any node by default), restore it under its old id and name, delete the snapshot."""
    key = sandbox.sandbox_id if isinstance(sandbox, SandboxHandle) else sandbox
    copy = copies.resume(key, placement=placement, timeout=timeout)
    return SandboxHandle(**copy._asdict())


def get(name: str, *, namespace: str | None = None) -> SandboxHandle:
    """The handle of the named sandbox (searched on every node)."""
    for h, found in ask_hosts("list", {NAME_LABEL: name}):
        if found:
            return SandboxHandle(found[0][0], h, name=name)
    raise SandboxNotFoundError(f"no sandbox named {name!r}")


def list(labels: Mapping[str, str] | None = None) -> builtins.list[SandboxHandle]:  # noqa: A001
    """Handles of every live sandbox in the cluster (optionally only those with ``labels``)."""
    out = []
    for h, items in ask_hosts("list", dict(labels) if labels else None):
        for sid, lbls in items:
            out.append(SandboxHandle(sid, h, name=lbls.get(NAME_LABEL)))
    return out


def shutdown() -> int:
    """Delete every sandbox on every node and stop the host actors; returns how many.
    Hosts on dead nodes are skipped (their node's next host reaps what they left)."""
    answered = ask_hosts("shutdown")
    for h in all_hosts():  # also those that did not answer in time
        ray.kill(h, no_restart=True)
    forget_hosts()
    return sum(n for _, n in answered)


__all__ = ["create", "create_from_template", "delete_snapshot", "fork", "get", "list", "restore",
           "resume", "shutdown", "NAMESPACE"]
