"""``create``, ``get``, ``list``, ``shutdown``, and copies of running sandboxes (``fork``,
``restore``, ``resume`` after a suspend): sandboxes placed by Ray's scheduler."""

from __future__ import annotations

import builtins
import json
import logging
import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table

from ..runtime.config import SandboxConfig
from ..runtime.errors import ConfigError, SandboxCreationError, SandboxNotFoundError
from ..runtime.snapshot import Snapshot
from .handle import SandboxHandle
from .host import (
    BUNDLE_LABEL,
    NAME_LABEL,
    NAMESPACE,
    SUSPENDED_LABEL,
    all_hosts,
    ask_hosts,
    call_host,
    forget_hosts,
    node_alive,
    remove_pg,
)
from .template import SandboxTemplate, make_template

_log = logging.getLogger(__name__)
_NODE_ID_LABEL = "ray.io/node-id"  # every Ray node carries it


def _job_id() -> str:
    """The calling job: its sandboxes die with it, like its placement groups."""
    return ray.get_runtime_context().get_job_id()


def _pg_name(name: str | None, namespace: str | None) -> str:
    return f"ray_sandbox:{namespace or ''}:{name}" if name else ""


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
    pg, node = _reserve(t.bundle, node_id=t.node_id, label_selector=t.label_selector,
                        name=name, namespace=namespace, lifetime=lifetime, timeout=timeout)
    pg_hex, job = pg.id.hex(), _job_id()
    host, sid = call_host(node, lambda h: h.create.remote(
        t.config, pg_hex, name, lifetime == "detached", owner_job=job), pg_hex)
    return SandboxHandle(sid, host, name=name, node_id=node)


def _reserve(
    bundle: Mapping[str, float], *, node_id: str | None = None,
    label_selector: Mapping[str, str] | None = None, name: str | None = None,
    namespace: str | None = None, lifetime: str | None = None, timeout: float | None = None,
) -> tuple[PlacementGroup, str]:
    """A one-bundle placement group for a sandbox, ready; returns it and its node."""
    bundle = dict(bundle)
    selector = dict(label_selector or {})
    if node_id:
        if not node_alive(node_id):
            raise ConfigError(f"no live Ray node {node_id}")
        # The node-id label, not the node:<ip> resource: nodes may share an address.
        selector[_NODE_ID_LABEL] = node_id
    pg = placement_group(
        [bundle],
        strategy="STRICT_PACK",
        name=_pg_name(name, namespace),
        lifetime=lifetime,
        bundle_label_selector=[selector] if selector else None,
    )
    try:
        ready = _wait_placed(pg, bundle, timeout)
    except BaseException:
        remove_pg(pg.id.hex())
        raise
    if not ready:
        remove_pg(pg.id.hex())
        raise SandboxCreationError(
            f"no node could reserve {bundle} within {timeout}s: {_shortfall(bundle)}"
        )
    return pg, placement_group_table(pg)["bundles_to_node_id"][0]


def _wait_placed(pg: PlacementGroup, bundle: Mapping[str, float], timeout: float | None) -> bool:
    """Wait for ``pg`` (forever when ``timeout`` is None), saying every
    ``RAY_SANDBOX_WAIT_REPORT_S`` seconds (default 10) what the reservation waits for."""
    every = float(os.environ.get("RAY_SANDBOX_WAIT_REPORT_S", 10))
    start = time.monotonic()
    while True:
        left = None if timeout is None else timeout - (time.monotonic() - start)
        if pg.wait(timeout_seconds=every if left is None else max(0.0, min(every, left))):
            return True
        if left is not None and left <= every:
            return False
        _log.warning("sandbox waiting %.0f s for a node to reserve %s: %s",
                     time.monotonic() - start, dict(bundle), _shortfall(bundle))


def _shortfall(bundle: Mapping[str, float]) -> str:
    """What the cluster lacks for ``bundle``, in words: a node too small for it never
    fits (only the autoscaler adding a bigger one helps); otherwise it waits for capacity
    (the autoscaler sees it as pending demand)."""
    totals = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    free = ray.available_resources()
    too_big = {k: v for k, v in bundle.items()
               if not any(t.get(k, 0.0) >= v for t in totals)}
    if too_big:
        largest = {k: max((t.get(k, 0.0) for t in totals), default=0.0) for k in too_big}
        return (f"no live node is big enough for {too_big} (largest: {largest}); it is "
                "placed only if the autoscaler adds a node that has it")
    short = {k: f"{free.get(k, 0.0):g} free of {v:g} needed" for k, v in bundle.items()
             if free.get(k, 0.0) < v}
    return (f"the cluster is full ({short or 'no single node has all of it free'}); "
            "pending demand the autoscaler can see")


# --- snapshots, copies, suspension ------------------------------------------------------------

Placement = str  # "local" (the snapshot's node), "any" (Ray decides) or a node id


def _copy_bundle(snap: Snapshot) -> dict[str, float]:
    """What a copy reserves: the source's placement-group bundle (its CPU, memory and
    custom resources) without the node pin, or else what its config asks for."""
    raw = snap.labels.get(BUNDLE_LABEL)
    if raw:
        return {k: v for k, v in json.loads(raw).items() if not k.startswith("node:")}
    return SandboxTemplate(config=SandboxConfig(**snap.config)).bundle


def _placement_node(snap: Snapshot, placement: Placement) -> str | None:
    if placement == "local":
        return snap.node_id
    if placement == "any":
        return None
    return placement


def restore(
    snapshot: Snapshot, k: int = 1, *, placement: Placement = "local",
    timeout: float | None = None,
) -> builtins.list[SandboxHandle]:
    """``k`` new sandboxes from a snapshot, each with its own Ray reservation (the source's
    resources). ``placement`` is ``"local"`` (the snapshot's node), ``"any"`` or a node id;
    on another node the snapshot's files are fetched from the node that holds them, once.
    All or nothing: if one copy fails, the others are deleted and the error raised."""
    if k < 1:
        raise ConfigError(f"k must be at least 1, got {k}")
    bundle = _copy_bundle(snapshot)
    node_id = _placement_node(snapshot, placement)
    handles: builtins.list[SandboxHandle] = []
    pgs: builtins.list[tuple[PlacementGroup, str]] = []
    job = _job_id()

    def one(pg_hex: str, node: str) -> SandboxHandle:
        host, sid = call_host(node, lambda h: h.restore.remote(snapshot, pg_hex,
                                                               owner_job=job), pg_hex)
        return SandboxHandle(sid, host, node_id=node)

    try:
        for _ in range(k):
            pgs.append(_reserve(bundle, node_id=node_id, timeout=timeout))
        # from here each copy's reservation is released by call_host if the copy fails
        work, pgs = [(pg.id.hex(), node) for pg, node in pgs], []
        with ThreadPoolExecutor(max_workers=min(k, 32)) as ex:
            futures = [ex.submit(one, pg_hex, node) for pg_hex, node in work]
        errors = []
        for f in futures:
            try:
                handles.append(f.result())
            except Exception as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)
        if errors:
            raise errors[0]
    except BaseException:
        for pg, _ in pgs:
            remove_pg(pg.id.hex())
        if handles:
            ray.get([h.terminate.remote() for h in handles])
        raise
    return handles


def fork(
    handle: SandboxHandle, k: int = 1, *, placement: Placement = "local",
    timeout: float | None = None,
) -> builtins.list[SandboxHandle]:
    """``k`` running copies of a sandbox (snapshot + ``restore``; the snapshot is deleted
    afterwards). See :func:`restore` for ``placement``."""
    snap = ray.get(handle.snapshot.remote())
    try:
        return restore(snap, k, placement=placement, timeout=timeout)
    finally:
        delete_snapshot(snap)


def delete_snapshot(snapshot: Snapshot) -> None:
    """Delete a snapshot from its node and every copy fetched to other nodes. Idempotent."""
    ask_hosts("delete_snapshot", snapshot.snapshot_id)


def _find_suspended(key: str) -> tuple[Any, Snapshot]:
    for h, snap in ask_hosts("find_suspended", key):
        if snap is not None:
            return h, snap
    raise SandboxNotFoundError(f"no suspended sandbox {key!r}")


def resume(
    sandbox: SandboxHandle | str, *, placement: Placement = "any",
    timeout: float | None = None,
) -> SandboxHandle:
    """Bring back a suspended sandbox (by handle, id or name): reserve its resources again
    (on any node by default), restore it under its old id and name, delete the snapshot."""
    key = sandbox.sandbox_id if isinstance(sandbox, SandboxHandle) else sandbox
    _, snap = _find_suspended(key)
    name = snap.labels.get(NAME_LABEL)
    pg, node = _reserve(_copy_bundle(snap), node_id=_placement_node(snap, placement),
                        name=name, timeout=timeout)
    pg_hex, job = pg.id.hex(), _job_id()
    host, sid = call_host(node, lambda h: h.restore.remote(
        snap, pg_hex, name, snap.labels[SUSPENDED_LABEL], owner_job=job), pg_hex)
    delete_snapshot(snap)
    return SandboxHandle(sid, host, name=name, node_id=node)


def get(name: str, *, namespace: str | None = None) -> SandboxHandle:
    """The handle of the named sandbox (searched on every node)."""
    for h, sid in ask_hosts("find", name):
        if sid:
            return SandboxHandle(sid, h, name=name)
    raise SandboxNotFoundError(f"no sandbox named {name!r}")


def list(labels: Mapping[str, str] | None = None) -> builtins.list[SandboxHandle]:  # noqa: A001
    """Handles of every live sandbox in the cluster (optionally only those with ``labels``)."""
    out = []
    for h, items in ask_hosts("list", dict(labels) if labels else None):
        for sid, lbls in items:
            out.append(SandboxHandle(sid, h, name=lbls.get("ray-sandbox/name")))
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
