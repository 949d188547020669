"""``ray-sandbox serve --reconcile``: one pass comparing the service's books with what the
nodes hold, reported, and with ``delete_after`` the orphans older than that deleted.

- **Lost** (the books name it, no node has it): sandboxes, snapshots, filesystem images and
  volumes are marked so in the books (tenants see them as lost; ``DELETE`` forgets them).
- **Taken in**: a sandbox or volume of a tenant the service serves that the books do not
  name (made before they existed) is entered in them, as a starting replica does.
- **Orphans** (on a node, the service's, named by no book): a sandbox whose tenant the
  service no longer serves, or one deleted through the service that still runs; a snapshot
  of a service sandbox no tenant keeps (a fork's while it runs, a take whose keeping was cut
  short); a filesystem image a take began and never kept; a volume of no known tenant.
- **Foreign**: filesystem images no book names and no take of the service began (made
  through the Ray layer): reported, never touched.

It runs where the books are (with SQLite, on the head node: ``run_pass``), beside a running
service if there is one: the databases' own locks keep both consistent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray

from .. import actor
from ..actor import volumes as ray_volumes
from ..actor.hosts import ask_hosts
from ..actor.labels import NAME_LABEL
from ..runtime import fs_image
from ..runtime.snapshot import Snapshot
from ..runtime.volumes import VolumeInfo
from . import _inventory
from ._bounds import FS_IMAGE, SNAPSHOT, Bounds
from ._config import ServiceConfig
from ._entry import CPU_LABEL, MEMORY_LABEL, TENANT_LABEL
from ._state import HEAD, LOST, Books, db_spec, on_head
from ._volumes import prefix

log = logging.getLogger(__name__)


def run_pass(config: ServiceConfig, app: str, delete_after: float | None = None,
             timeout: float = 600.0) -> dict[str, Any]:
    """The report of one pass (module docstring), run as a zero-CPU task where the books
    are (the head node for SQLite)."""
    options: dict[str, Any] = {"num_cpus": 0, "max_retries": 0}
    if on_head(config):
        options["resources"] = HEAD
    ref = ray.remote(_task).options(**options).remote(config, app, delete_after)
    report: dict[str, Any] = ray.get(ref, timeout=timeout)
    return report


def _task(config: ServiceConfig, app: str, delete_after: float | None) -> dict[str, Any]:
    books = Books(Bounds.of(config), db_spec(config), app)
    try:
        return asyncio.run(_pass(books, config, delete_after))
    finally:
        books.close()


def _old(age: float | None, delete_after: float | None) -> bool:
    return delete_after is not None and age is not None and age >= delete_after


async def _pass(books: Books, config: ServiceConfig,
                delete_after: float | None) -> dict[str, Any]:
    now = time.time()
    served = set(config.tokens)
    report: dict[str, Any] = {
        "books": (await books.stats())["where"], "delete_after": delete_after,
        "lost": {}, "taken_in": {}, "orphans": {}, "foreign": {}}

    # --- sandboxes ---------------------------------------------------------------------------
    epoch = await books.epoch()
    listed = await asyncio.to_thread(ask_hosts, "list", None)
    rows = {key: (tenant, state) for key, tenant, state in await books.sandbox_rows()}
    deleted = set(await books.tombstoned())
    live: dict[str, dict[str, list[Any]]] = {}
    orphans, taken = [], []
    for node, host, items in listed:
        for sid, labels in items:
            tenant = labels.get(TENANT_LABEL)
            if tenant is None:
                continue  # not the service's
            key = labels.get(NAME_LABEL) or sid
            row = [float(labels.get(CPU_LABEL, 0)), int(labels.get(MEMORY_LABEL, 0))]
            if key in deleted or (tenant not in served and key not in rows):
                why = "deleted through the service" if key in deleted else \
                    f"tenant {tenant!r} is not served"
                h = actor.SandboxHandle(sid, host, name=labels.get(NAME_LABEL), node_id=node)
                orphans.append(await _sandbox_orphan(h, key, tenant, why, now, delete_after))
                continue
            live.setdefault(tenant, {})[key] = row
            if key not in rows:
                taken.append({"id": key, "tenant": tenant})
    lost_sandboxes = []
    for tenant in sorted({t for t, _ in rows.values()} | served | set(live)):
        for key in await books.reconcile(tenant, live.get(tenant, {}), epoch):
            lost_sandboxes.append({"id": key, "tenant": tenant})
    report["orphans"]["sandboxes"] = orphans
    report["taken_in"]["sandboxes"] = taken
    report["lost"]["sandboxes"] = lost_sandboxes

    # --- snapshots and filesystem images -----------------------------------------------------
    inv = await asyncio.to_thread(_inventory.collect, TENANT_LABEL, config.call_timeout)
    kept = await books.kept.kept_all()
    named = {(kind, key) for kind, _, key, _, _ in kept}
    lost_kept: dict[str, list[dict[str, str]]] = {"snapshots": [], "filesystem_images": []}
    for kind, tenant, key, value, was_lost in kept:
        if kind == SNAPSHOT:
            here = _inventory.presence(inv, "snapshots", key,
                                       (value.get("snapshot") or {}).get("node_id"))
        else:
            parsed = fs_image.parse(str(value.get("ref", "")))
            here = _inventory.presence(inv, "fs_images", key, parsed[0] if parsed else None)
        if here is False:
            if not was_lost:
                await books.kept.mark_lost(kind, tenant, key, LOST)
            lost_kept["snapshots" if kind == SNAPSHOT else "filesystem_images"].append(
                {"id": key, "tenant": tenant})
        elif here is True and was_lost:
            await books.kept.mark_lost(kind, tenant, key, None)
    report["lost"].update(lost_kept)

    snap_orphans: dict[str, dict[str, Any]] = {}
    image_orphans: dict[str, dict[str, Any]] = {}
    foreign: dict[str, dict[str, Any]] = {}
    takes = {t[3]: t for t in await books.kept.takes()}  # source sandbox -> take
    for node, held in inv["nodes"].items():
        for snap in held["snapshots"]:
            if snap["tenant"] is None or (SNAPSHOT, snap["id"]) in named:
                continue
            item = snap_orphans.setdefault(snap["id"], {
                "id": snap["id"], "tenant": snap["tenant"], "nodes": [],
                "age": now - snap["created_at"], "snapshot": snap["snapshot"]})
            item["nodes"].append(node)
        for image in held["fs_images"]:
            if (FS_IMAGE, image["id"]) in named:
                continue
            take = takes.get(image["source"] or "")
            into = image_orphans if take is not None else foreign
            item = into.setdefault(image["id"], {
                "id": image["id"], "tenant": take[2] if take else None, "nodes": [],
                "age": now - image["created_at"], "ref": image["ref"],
                "take": take[0] if take else None})
            item["nodes"].append(node)
    for item in snap_orphans.values():
        snap = item.pop("snapshot")
        if _old(item["age"], delete_after):
            item["action"] = await _delete(
                lambda snap=snap: actor.delete_snapshot(Snapshot.model_validate(snap)))
    for item in image_orphans.values():
        if _old(item["age"], delete_after):
            item["action"] = await _delete(
                lambda ref=item["ref"]: actor.delete_filesystem_image(ref))
            if item["action"] == "deleted":
                await books.kept.take_ended(item.pop("take"))
    for take_id, _, _, _, at in takes.values():  # a take that left nothing behind
        if _old(now - at, delete_after) and not any(
                i.get("take") == take_id for i in image_orphans.values()):
            await books.kept.take_ended(take_id)
    report["orphans"]["snapshots"] = list(snap_orphans.values())
    report["orphans"]["filesystem_images"] = list(image_orphans.values())
    report["foreign"]["filesystem_images"] = [
        {k: v for k, v in i.items() if k not in ("take", "tenant")} for i in foreign.values()]

    # --- volumes -----------------------------------------------------------------------------
    volumes: list[VolumeInfo] = await asyncio.to_thread(ray_volumes.list_volumes)
    known = {}
    for tenant, _, _ in await books.volume_rows():
        known[prefix(tenant)] = tenant
    for tenant in served:
        known[prefix(tenant)] = tenant
    mine: dict[str, dict[str, list[Any]]] = {t: {} for t in set(known.values())}
    vol_orphans = []
    for v in volumes:
        if not v.name.startswith("tv-"):
            continue
        pre = v.name[:len(prefix(""))]
        tenant = known.get(pre)
        if tenant is None:
            item = {"id": v.name, "node": v.node, "age": now - v.created_at,
                    "why": "no tenant of the books or the service has its prefix"}
            if _old(item["age"], delete_after):
                item["action"] = await _delete(
                    lambda name=v.name: ray_volumes.delete_volume(name))
            vol_orphans.append(item)
            continue
        mine[tenant][v.name.removeprefix(pre)] = [v.node, v.size]
    lost_volumes = []
    for tenant, seen in sorted(mine.items()):
        for name in await books.volumes_seen(tenant, seen):
            lost_volumes.append({"id": name, "tenant": tenant})
    report["orphans"]["volumes"] = vol_orphans
    report["lost"]["volumes"] = lost_volumes
    report["rows"] = (await books.stats())["rows"]
    return report


async def _sandbox_orphan(h: Any, key: str, tenant: str, why: str, now: float,
                          delete_after: float | None) -> dict[str, Any]:
    item: dict[str, Any] = {"id": key, "tenant": tenant, "node": h.node_id, "why": why,
                            "age": None}
    try:
        status: Any = await asyncio.to_thread(ray.get, h.status.remote(), timeout=60)
    except Exception as exc:  # noqa: BLE001 - gone meanwhile, or its host is down
        item["action"] = f"no status: {exc}"[:500]
        return item
    if status.created_at is not None:
        item["age"] = now - status.created_at.timestamp()
    if _old(item["age"], delete_after):
        item["action"] = await _delete(lambda: ray.get(h.terminate.remote(), timeout=120))
    return item


async def _delete(fn: Any) -> str:
    try:
        await asyncio.to_thread(fn)
    except Exception as exc:  # noqa: BLE001 - reported, the next pass tries again
        return f"failed: {exc}"[:500]
    return "deleted"
