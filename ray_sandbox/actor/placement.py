"""Ray reservations for sandboxes: a sandbox's CPU, memory and custom resources are a bundle of
a placement group, so Ray's scheduler, its queueing and the autoscaler see it. Most sandboxes
take a slot of their host's block (``blocks``); this module reserves the one-bundle placement
group of a sandbox no block has room for (it waits as pending demand), and of a copy of a
snapshot, and removes reservations."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

from ..runtime import SandboxRuntime
from ..runtime.config import SandboxConfig
from ..runtime.errors import CapacityError, ConfigError, SandboxError
from ..runtime.snapshot import Snapshot
from .template import SandboxTemplate
from .volumes import volume_node

PG_LABEL = "ray-sandbox/placement-group"  # sandbox label: the hex id of its reservation
BUNDLE_LABEL = "ray-sandbox/bundle"  # snapshot label: the source's Ray reservation (JSON)
NODE_ID_LABEL = "ray.io/node-id"  # every Ray node carries it

Placement = str  # "local" (the snapshot's node), "any" (Ray decides) or a node id

log = logging.getLogger(__name__)


def _pg(pg_hex: str) -> PlacementGroup:
    return PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_hex)))


def _pg_name(name: str | None, namespace: str | None) -> str:
    return f"ray_sandbox:{namespace or ''}:{name}" if name else ""


def node_alive(node_id: str) -> bool:
    return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())


def check_lifetime(lifetime: str | None) -> None:
    """Ray's two lifetimes: the caller's job's (None) or ``"detached"``."""
    if lifetime not in (None, "detached"):
        raise ConfigError("lifetime must be None or 'detached'")


def reserve(
    bundle: Mapping[str, float], *, node_id: str | None = None,
    label_selector: Mapping[str, str] | None = None, name: str | None = None,
    namespace: str | None = None, lifetime: str | None = None, timeout: float | None = None,
) -> tuple[str, str]:
    """A one-bundle placement group for a sandbox, ready; returns its hex id and its node."""
    bundle = dict(bundle)
    selector = dict(label_selector or {})
    if node_id:
        if not node_alive(node_id):
            raise ConfigError(f"no live Ray node {node_id}")
        # The node-id label, not the node:<ip> resource: nodes may share an address.
        selector[NODE_ID_LABEL] = node_id
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
        raise CapacityError(
            f"no node could reserve {bundle} within {timeout}s: {_shortfall(bundle)}"
        )
    return pg.id.hex(), placement_group_table(pg)["bundles_to_node_id"][0]


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
        log.warning("sandbox waiting %.0f s for a node to reserve %s: %s",
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


def pg_gone(pg_hex: str) -> bool:
    try:
        info = placement_group_table(_pg(pg_hex))
    except Exception:  # noqa: BLE001 - GCS hiccup: assume alive, retry next round
        return False
    return not info or info.get("state") == "REMOVED"


def remove_pg(pg_hex: str) -> None:
    try:
        remove_placement_group(_pg(pg_hex))
    except Exception:  # noqa: BLE001 - already gone
        pass


def release_reaped(rt: SandboxRuntime) -> None:
    """Run the runtime's gc and release the reservation of each sandbox it removed (a
    restarted host: the dead incarnation's sandboxes)."""
    stale_pgs = []
    for sid in rt.list(all=True):
        try:
            rec = rt.record(sid)
        except SandboxError:
            continue
        pg_hex = rec.config.get("labels", {}).get(PG_LABEL)
        if pg_hex:
            stale_pgs.append((sid, pg_hex))
    removed = set(rt.gc())
    for sid, pg_hex in stale_pgs:
        if sid in removed:
            remove_pg(pg_hex)


def bundle_label(pg_hex: str, bundle: Mapping[str, float] | None = None) -> dict[str, str]:
    """The snapshot label that carries a sandbox's reservation to copies: ``bundle`` (a block
    slot's), else the bundle of its own placement group ``pg_hex``."""
    if bundle is None:
        bundles = (placement_group_table(_pg(pg_hex)) or {}).get("bundles") or {}
        bundle = next(iter(bundles.values()), None)
    return {BUNDLE_LABEL: json.dumps(dict(bundle))} if bundle else {}


def copy_bundle(snap: Snapshot) -> dict[str, float]:
    """What a copy reserves: the source's placement-group bundle (its CPU, memory and
    custom resources) without the node pin, or else what its config asks for."""
    raw = snap.labels.get(BUNDLE_LABEL)
    if raw:
        return {k: v for k, v in json.loads(raw).items() if not k.startswith("node:")}
    return SandboxTemplate(config=SandboxConfig(**snap.config)).bundle


def copy_node(snap: Snapshot, placement: Placement) -> str | None:
    """The node a copy must land on (None: wherever Ray places it). A sandbox with volumes
    runs where they are, whatever ``placement`` says, unless it names another node (an
    error: volumes live on one node)."""
    if names := [v["name"] for v in (snap.config.get("volumes") or {}).values()]:
        node = volume_node(names)
        if placement not in ("local", "any", node):
            raise ConfigError(f"the sandbox mounts volume(s) {', '.join(sorted(names))} of "
                              f"node {node}; its copies cannot run on node {placement}")
        return node
    if placement == "local":
        return snap.node_id
    if placement == "any":
        return None
    return placement
