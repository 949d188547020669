"""What tenants keep, in the books (``_state``): snapshots and filesystem images (``kind``),
each bounded per tenant (``max_snapshots``, ``max_fs_images``; lost ones count until
deleted), and the takes in progress: a snapshot or image being taken, so what a crash before
it is kept leaves on a node is known to be the tenant's (``_reconcile``). Bounded: at most
``MAX_TAKES`` takes."""

from __future__ import annotations

import json
import time
from typing import Any

from ._bounds import Bounds
from ._store import Store, count, js

MAX_TAKES = 4096  # snapshots and images being taken (what a crash mid-take leaves, for reconcile)


class KeptBooks:
    """The ``kept`` and ``takes`` tables; every method is one atomic step of the books."""

    def __init__(self, db: Store, bounds: Bounds) -> None:
        self._db = db
        self._b = bounds

    async def take_started(self, take: str, kind: str, tenant: str, source: str) -> None:
        """A snapshot or image is being taken of the sandbox ``source`` (its runtime id):
        what a crash before ``keep`` leaves on a node is then the tenant's, for reconcile."""
        with self._db.write("take_started") as tx:
            tx.run("INSERT INTO takes (id, kind, tenant, source, at) VALUES (?, ?, ?, ?, ?)",
                   take, kind, tenant, source, time.time())
            if count(tx, "takes") > MAX_TAKES:
                for (tid,) in tx.all("SELECT id FROM takes ORDER BY at DESC")[MAX_TAKES:]:
                    tx.run("DELETE FROM takes WHERE id = ?", tid)

    async def take_ended(self, take: str) -> None:
        with self._db.write("take_ended") as tx:
            tx.run("DELETE FROM takes WHERE id = ?", take)

    async def keep(self, kind: str, tenant: str, key: str, kept: dict[str, Any],
                   take: str | None = None) -> str | None:
        """Keep a snapshot or a filesystem image (``kind``) for the tenant (None), or why
        not: the tenant's limit of that kind is reached (lost ones count until deleted)."""
        with self._db.write("keep") as tx:
            if take is not None:
                tx.run("DELETE FROM takes WHERE id = ?", take)
            have = tx.all("SELECT lost FROM kept WHERE kind = ? AND tenant = ?", kind, tenant)
            if len(have) >= self._b.limit(kind):
                lost = sum(1 for (x,) in have if x)
                return (f"{len(have)} {kind}s kept, the limit; delete one"
                        + (f" ({lost} of them lost)" if lost else ""))
            tx.run("INSERT INTO kept (kind, tenant, key, value, at) VALUES (?, ?, ?, ?, ?)",
                   kind, tenant, key, js(kept), time.time())
        return None

    async def kept_keys(self, kind: str, tenant: str) -> list[str]:
        """The tenant's kept ``kind`` that are not lost, oldest first."""
        return (await self.kept_list(kind, tenant))["keys"]

    async def kept_list(self, kind: str, tenant: str) -> dict[str, list[str]]:
        """``{"keys": [...], "lost": [...]}``: the tenant's kept ``kind``, oldest first."""
        with self._db.read("kept_list") as tx:
            found = tx.all("SELECT key, lost FROM kept WHERE kind = ? AND tenant = ? ORDER BY "
                           "at", kind, tenant)
        return {"keys": [k for k, lost in found if not lost],
                "lost": [k for k, lost in found if lost]}

    async def kept_count(self, kind: str, tenant: str) -> int:
        with self._db.read("kept_count") as tx:
            return count(tx, "kept WHERE kind = ? AND tenant = ?", kind, tenant)

    async def kept(self, kind: str, tenant: str, key: str) -> dict[str, Any] | None:
        """The kept value (``"lost"``: why, if it is)."""
        with self._db.read("kept") as tx:
            row = tx.one("SELECT value, lost FROM kept WHERE kind = ? AND tenant = ? AND "
                         "key = ?", kind, tenant, key)
        if row is None:
            return None
        value: dict[str, Any] = json.loads(row[0])
        return {**value, "lost": row[1]} if row[1] else value

    async def drop(self, kind: str, tenant: str, key: str) -> dict[str, Any] | None:
        with self._db.write("drop") as tx:
            row = tx.one("SELECT value FROM kept WHERE kind = ? AND tenant = ? AND key = ?",
                         kind, tenant, key)
            tx.run("DELETE FROM kept WHERE kind = ? AND tenant = ? AND key = ?", kind, tenant,
                   key)
        return json.loads(row[0]) if row is not None else None

    async def kept_all(self) -> list[list[Any]]:
        """Every kept thing of every tenant: [kind, tenant, key, value, lost]."""
        with self._db.read("kept_all") as tx:
            return [[kind, tenant, key, json.loads(value), lost] for kind, tenant, key, value,
                    lost in tx.all("SELECT kind, tenant, key, value, lost FROM kept")]

    async def mark_lost(self, kind: str, tenant: str, key: str, why: str | None) -> None:
        """Mark a kept thing lost (``why``), or found again (None)."""
        with self._db.write("mark_lost") as tx:
            tx.run("UPDATE kept SET lost = ? WHERE kind = ? AND tenant = ? AND key = ?", why,
                   kind, tenant, key)

    async def takes(self) -> list[list[Any]]:
        """Takes begun and never kept nor ended: [id, kind, tenant, source, at]."""
        with self._db.read("takes") as tx:
            return [list(r) for r in tx.all("SELECT id, kind, tenant, source, at FROM takes")]
