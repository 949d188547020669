"""The books every replica of one service shares: creates in flight and failed, the quota
ledger, client tokens, exec results, which streamed exec runs where, kept snapshots and
filesystem images, volumes, recent deletes and leases.

They are kept in a database (``_store``: a SQLite file by default, PostgreSQL with
``state_db``), so a restart of whatever holds them forgets nothing. One process holds them at
a time: with one replica the replica itself, with more one named, detached Ray actor per
service app (``ray_sandbox_service_state:<app>:v<version>``, zero CPUs, restarted by Ray;
on the head node with SQLite, whose file is there). Every replica calls it with a bound
(``state_timeout``): books that do not answer are a 503, never a hang.

Each step of :class:`Books` is one atomic method: its reads and writes are one database
transaction under the writers' lock, and no ``await`` comes between a check and its change.
:class:`Books` holds the sandboxes' records (creates, the quota, client tokens, deletes),
leases and volumes; its parts hold the exec results and streams (``_books_execs``) and what
tenants keep (``_books_kept``), over the same database. A replica names a step
(``Shared("keep", ...)``) and :meth:`Books.step` runs it, whichever part has it. The
database is the durable record; memory holds only the wake-ups of long polls (``_wakeups``:
events set when a create or exec ends). Every table is bounded per tenant or by age.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import time
from typing import Any

import ray
from ray.exceptions import RayError

from . import _errors
from ._books_execs import ExecBooks
from ._books_kept import KeptBooks
from ._bounds import GRACE, Bounds
from ._config import Quota, ServiceConfig
from ._quota import Charge, over_quota
from ._store import Store, Timings, count, is_postgres, js, open_store, row_counts
from ._wakeups import Wakeups

log = logging.getLogger(__name__)

NAMESPACE = "ray_sandbox_service"
UNSEEDED = "unseeded"  # admit's answer when the books do not know the tenant's sandboxes yet
STATE_CONCURRENCY = 4096  # long polls wait inside the actor, one slot each
MAX_TOMBSTONES = 4096  # recent deletes, so every replica answers 404 for them
TOMBSTONE_SECONDS = 86400.0  # and for at most this long
SWEEP_SECONDS = 60.0  # age-based cleanup and row counts, at most this often
BOOKS_VERSION = 5  # raise it with every change to the books' steps or their meaning
CHARGED = ("pending", "made", "copy")  # sandbox rows that count against the quota
HEAD = {"node:__internal_head__": 0.001}  # Ray's resource of the head node
LOST = ("lost: no node has it any more (its node died, or it was deleted outside the "
        "service); DELETE forgets it")


class Books:
    """The shared state over its database; every step is one atomic method (no await
    between a check and its change, one transaction under the writers' lock), so two
    replicas cannot both pass a check that only one may. ``execs`` and ``kept`` are its
    parts over the same database; :meth:`step` runs any part's step by its name."""

    def __init__(self, bounds: Bounds, db: str | None = None, app: str = "ray-sandbox",
                 store: Store | None = None) -> None:
        self._b = bounds
        self.timings = Timings()
        self.timings.observer = _observe_step
        self._db = store if store is not None else open_store(db, app, self.timings)
        self._wakeups = Wakeups()
        self._swept = 0.0
        self.counts: dict[str, int] = {}
        self._sweep()  # what a restart finds: old rows go, the row counts are exported
        self.execs = ExecBooks(self._db, bounds, self._wakeups, self._sweep)
        self.kept = KeptBooks(self._db, bounds)
        # every step by its name (the public coroutine methods of the books and their parts)
        self._steps: dict[str, Any] = {}
        for part in (self, self.execs, self.kept):
            for name, _ in inspect.getmembers(type(part), inspect.iscoroutinefunction):
                if not name.startswith("_") and name != "step":
                    assert name not in self._steps, f"two steps of the books named {name}"
                    self._steps[name] = getattr(part, name)

    def close(self) -> None:
        self._db.close()

    async def step(self, name: str, *args: Any) -> Any:
        """Run the step ``name`` (a method of the books or one of their parts) with ``args``:
        the one call the replicas make of the state actor."""
        return await self._steps[name](*args)

    # --- creates and the quota ---------------------------------------------------------------

    async def admit(self, tenant: str, quota: dict[str, Any], keys: list[str], cpu: float,
                    memory: int, pending: dict[str, Any] | None = None,
                    token: list[str] | None = None) -> str | dict[str, str] | None:
        """Charge ``keys`` (one sandbox each) if they fit the tenant's quota: None, or why
        not (``UNSEEDED``: look the tenant's sandboxes up and ``reconcile`` first).
        ``pending`` makes the one key a create others see as pending (its ``ttl`` is kept
        to tell a sandbox its TTL ended from a lost one); without it the keys are copies'
        placeholders until ``settle``. ``token`` ([client token, digest of the body]): the
        tenant's create with that token within ``client_token_seconds`` is answered instead,
        ``{"same": id}``, or ``{"conflict": why}`` when its body differed."""
        self._sweep()
        now = time.time()
        with self._db.write("admit") as tx:
            if token is not None:
                found = self._token(tx, tenant, token, now)
                if found is not None:
                    return found
            if tx.one("SELECT 1 FROM counters WHERE name = ?", f"seeded:{tenant}") is None:
                return UNSEEDED
            charges = [Charge(c, m) for c, m in tx.all(
                "SELECT cpu, memory FROM sandboxes WHERE tenant = ? AND state IN "
                "('pending', 'made', 'copy')", tenant)]
            cost = Charge(cpu, memory)
            for _ in keys:
                reason = over_quota(Quota.model_validate(quota), charges, cost)
                if reason is not None:
                    return reason
                charges.append(cost)
            deadline = now + self._b.create_timeout + GRACE
            info = dict(pending or {})
            ttl = info.pop("ttl", None)  # after it, its absence is its own end (0: any time)
            expires = now + ttl if ttl is not None else None
            for key in keys:
                tx.run("INSERT INTO sandboxes (key, tenant, state, cpu, memory, info, deadline,"
                       " expires, changed) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", key, tenant,
                       "copy" if pending is None else "pending", cpu, memory, js(info),
                       deadline, expires, now)
            if token is not None:
                tx.run("DELETE FROM tokens WHERE tenant = ? AND token = ?", tenant, token[0])
                tx.run("INSERT INTO tokens (tenant, token, digest, sandbox, at) VALUES "
                       "(?, ?, ?, ?, ?)", tenant, token[0], token[1], keys[0], now)
                if count(tx, "tokens WHERE tenant = ?", tenant) > self._b.max_client_tokens:
                    old = tx.all("SELECT token FROM tokens WHERE tenant = ? ORDER BY at DESC",
                                 tenant)[self._b.max_client_tokens:]
                    for (tok,) in old:
                        tx.run("DELETE FROM tokens WHERE tenant = ? AND token = ?", tenant, tok)
        return None

    def _token(self, tx: Any, tenant: str, token: list[str],
               now: float) -> dict[str, str] | None:
        row = tx.one("SELECT digest, sandbox, at FROM tokens WHERE tenant = ? AND token = ?",
                     tenant, token[0])
        if row is None or row[2] < now - self._b.client_token_seconds:
            return None
        if row[0] != token[1]:
            return {"conflict": f"client_token {token[0]!r} was used for another request "
                                f"(sandbox {row[1]}) within "
                                f"{self._b.client_token_seconds:g} s; use a new token"}
        return {"same": row[1]}

    async def client_token(self, tenant: str, token: list[str]) -> dict[str, str] | None:
        """The tenant's create made with this client token (``admit``'s answer), if any."""
        with self._db.read("client_token") as tx:
            return self._token(tx, tenant, token, time.time())

    async def epoch(self) -> int:
        self._sweep()
        with self._db.read("epoch") as tx:
            return int(tx.one("SELECT value FROM counters WHERE name = 'epoch'")[0])

    def _bump(self, tx: Any) -> int:
        tx.run("UPDATE counters SET value = value + 1 WHERE name = 'epoch'")
        return int(tx.one("SELECT value FROM counters WHERE name = 'epoch'")[0])

    async def reconcile(self, tenant: str, live: dict[str, Any], epoch: int) -> list[str]:
        """The tenant's sandboxes the hosts list (``live``: key -> [cpu, memory] or [cpu,
        memory, info], looked up after ``epoch``) are charged (a lost or failed record of
        one is made again; a deleted one is not revived); a sandbox the books hold as made
        that is not listed, and whose create finished before the look began, ended: forgotten
        if its TTL passed, else marked lost (shown as such, no longer charged). Those being
        made are kept. Returns the keys marked lost."""
        now = time.time()
        lost = []
        with self._db.write("reconcile") as tx:
            self._expire(tx, tenant, now)
            current = self._bump(tx)
            for key, settled, expires in tx.all(
                    "SELECT key, settled, expires FROM sandboxes WHERE tenant = ? AND "
                    "state = 'made'", tenant):
                if key in live or settled is None or settled > epoch:
                    continue
                if expires is not None and expires <= now:
                    tx.run("DELETE FROM sandboxes WHERE key = ?", key)
                else:
                    tx.run("UPDATE sandboxes SET state = 'lost', error = ?, changed = ? "
                           "WHERE key = ?", LOST, now, key)
                    lost.append(key)
            for key, found in live.items():
                if tx.one("SELECT 1 FROM tombstones WHERE sandbox = ?", key) is not None:
                    continue
                cpu, memory = found[0], found[1]
                info = found[2] if len(found) > 2 else {"cpu": cpu, "memory": memory}
                row = tx.one("SELECT state, tenant FROM sandboxes WHERE key = ?", key)
                if row is None:
                    tx.run("INSERT INTO sandboxes (key, tenant, state, cpu, memory, info, "
                           "settled, changed) VALUES (?, ?, 'made', ?, ?, ?, ?, ?)", key,
                           tenant, cpu, memory, js(info), current, now)
                elif row[1] == tenant and row[0] in ("lost", "error", "pending"):
                    tx.run("UPDATE sandboxes SET state = 'made', error = NULL, settled = ?, "
                           "changed = ? WHERE key = ?", current, now, key)
                    self._wakeups.wake(("create", key))
            self._trim(tx, tenant, "lost")
            tx.run("DELETE FROM counters WHERE name = ?", f"seeded:{tenant}")
            tx.run("INSERT INTO counters (name, value) VALUES (?, ?)", f"seeded:{tenant}", 1)
        return lost

    async def vanished(self, tenant: str, api_id: str, epoch: int) -> dict[str, Any] | None:
        """A sandbox of the tenant the hosts did not list (looked up after ``epoch``): its
        record if the books hold it as made before that (now marked lost), or lost already;
        None if the books have no such sandbox of the tenant, or its TTL ended."""
        now = time.time()
        with self._db.write("vanished") as tx:
            row = tx.one("SELECT state, settled, expires, tenant, info, error, deleted FROM "
                         "sandboxes WHERE key = ?", api_id)
            if row is None or row[3] != tenant or row[6]:
                return None
            state, settled, expires = row[0], row[1], row[2]
            if state == "made" and settled is not None and settled <= epoch:
                if expires is not None and expires <= now:
                    tx.run("DELETE FROM sandboxes WHERE key = ?", api_id)
                    return None
                tx.run("UPDATE sandboxes SET state = 'lost', error = ?, changed = ? WHERE "
                       "key = ?", LOST, now, api_id)
                self._trim(tx, tenant, "lost")
                state = "lost"
            if state != "lost":
                return None
            return {**json.loads(row[4]), "sandbox_id": api_id, "error": LOST, "lost": True}

    async def settle(self, tenant: str, keys: list[str], ids: list[str],
                     info: dict[str, Any] | None = None) -> None:
        """Copies were made: their placeholder charges become their ids' (``info``: what GET
        shows of each)."""
        now = time.time()
        with self._db.write("settle") as tx:
            epoch = self._bump(tx)
            for key, sid in zip(keys, ids, strict=False):
                # a listing may have taken the copy in already (its labels name the tenant)
                tx.run("DELETE FROM sandboxes WHERE key = ? AND tenant = ?", sid, tenant)
                tx.run("UPDATE sandboxes SET key = ?, state = 'made', settled = ?, info = ?, "
                       "deadline = NULL, changed = ? WHERE key = ? AND tenant = ?", sid, epoch,
                       js({**(info or {}), "created_at": now}), now, key, tenant)

    async def release(self, tenant: str, keys: list[str]) -> None:
        with self._db.write("release") as tx:
            for key in keys:
                tx.run("DELETE FROM sandboxes WHERE key = ? AND tenant = ? AND state IN "
                       "('pending', 'copy')", key, tenant)

    async def created(self, api_id: str, error: str | None) -> bool:
        """A create finished (or failed, with ``error``); True if a delete came meanwhile,
        so the replica that made it ends it."""
        now = time.time()
        with self._db.write("created") as tx:
            epoch = self._bump(tx)
            row = tx.one("SELECT tenant, deleted FROM sandboxes WHERE key = ?", api_id)
            if row is None:  # expired and forgotten: a reconcile counts it again
                return tx.one("SELECT 1 FROM tombstones WHERE sandbox = ?",
                              api_id) is not None
            tenant, deleted = row[0], bool(row[1])
            if error is not None and deleted:
                tx.run("DELETE FROM sandboxes WHERE key = ?", api_id)
            elif error is not None:
                tx.run("UPDATE sandboxes SET state = 'error', error = ?, deadline = NULL, "
                       "changed = ? WHERE key = ?", error, now, api_id)
                self._trim(tx, tenant, "error")
            else:
                tx.run("UPDATE sandboxes SET state = 'made', error = NULL, settled = ?, "
                       "deadline = NULL, changed = ? WHERE key = ?", epoch, now, api_id)
        self._wakeups.wake(("create", api_id))
        return deleted

    def _trim(self, tx: Any, tenant: str, state: str) -> None:
        """A tenant keeps its last ``max_errored`` failed creates, and as many lost ones."""
        for (key,) in tx.all("SELECT key FROM sandboxes WHERE tenant = ? AND state = ? "
                             "ORDER BY changed DESC", tenant, state)[self._b.max_errored:]:
            tx.run("DELETE FROM sandboxes WHERE key = ?", key)

    def _expire(self, tx: Any, tenant: str, now: float, key: str | None = None) -> None:
        """A create (or copy) whose replica went away never reports: past its bound it
        failed (a copy's placeholder is forgotten)."""
        sql = ("SELECT key, state FROM sandboxes WHERE tenant = ? AND state IN "
               "('pending', 'copy') AND deadline < ?")
        for k, state in tx.all(sql + (" AND key = ?" if key else ""),
                               *((tenant, now, key) if key else (tenant, now))):
            if state == "copy":
                tx.run("DELETE FROM sandboxes WHERE key = ?", k)
                continue
            tx.run("UPDATE sandboxes SET state = 'error', error = ?, deadline = NULL, "
                   "changed = ? WHERE key = ?",
                   "unavailable: the replica making it went away", now, k)
            self._wakeups.wake(("create", k))
        self._trim(tx, tenant, "error")

    async def create_record(self, tenant: str, api_id: str,
                            wait: float = 0.0) -> dict[str, Any] | None:
        """The tenant's create of ``api_id`` if pending, failed or lost (None: made,
        deleted, unknown or another tenant's), waiting up to ``wait`` s for a pending one to
        end."""
        row = self._create_row(api_id)
        if row is None or row[0] != tenant or row[3]:
            return None
        if row[1] == "pending" and wait > 0:
            await self._wakeups.wait(("create", api_id), min(wait, (row[5] or 0) - time.time()))
            row = self._create_row(api_id)
        now = time.time()
        if row is not None and row[1] == "pending" and (row[5] or 0) < now:
            with self._db.write("create_record", durable=False) as tx:
                self._expire(tx, tenant, now, api_id)
                row = self._create_row(api_id, tx)
        if row is None or row[0] != tenant or row[3] or row[1] in ("made", "copy"):
            return None
        return {**json.loads(row[4]), "sandbox_id": api_id, "error": row[2],
                "lost": row[1] == "lost"}

    def _create_row(self, api_id: str, tx: Any = None) -> tuple[Any, ...] | None:
        sql = "SELECT tenant, state, error, deleted, info, deadline FROM sandboxes WHERE key = ?"
        if tx is not None:
            return tx.one(sql, api_id)
        with self._db.read("create_record") as rtx:
            return rtx.one(sql, api_id)

    async def creates(self, tenant: str) -> list[dict[str, Any]]:
        """The tenant's creates pending, failed or lost, for a listing."""
        now = time.time()
        with self._db.read("creates") as tx:
            late = tx.one("SELECT 1 FROM sandboxes WHERE tenant = ? AND state IN ('pending', "
                          "'copy') AND deadline < ?", tenant, now)
        with contextlib.ExitStack() as stack:
            tx = stack.enter_context(self._db.write("creates", durable=False) if late
                                     else self._db.read("creates"))
            if late:
                self._expire(tx, tenant, now)
            found = tx.all("SELECT key, state, error, info FROM sandboxes WHERE tenant = ? "
                           "AND state IN ('pending', 'error', 'lost') AND deleted = 0 "
                           "ORDER BY changed", tenant)
        return [{**json.loads(info), "sandbox_id": key, "error": error,
                 "lost": state == "lost"} for key, state, error, info in found]

    async def delete_create(self, tenant: str, api_id: str, wait: float = 0.0) -> str | None:
        """Delete a create that is pending, or finished without this replica knowing yet
        (its replica ends it once made: ``"pending"``, after waiting up to ``wait`` s for
        that), or failed or lost (forgotten: ``"error"``); None if the books have no such
        create."""
        with self._db.write("delete_create") as tx:
            row = tx.one("SELECT tenant, state FROM sandboxes WHERE key = ?", api_id)
            if row is None or row[0] != tenant:
                return None
            self._tomb(tx, api_id)
            if row[1] in ("error", "lost"):
                tx.run("DELETE FROM sandboxes WHERE key = ?", api_id)
                return "error"
            tx.run("UPDATE sandboxes SET deleted = 1 WHERE key = ?", api_id)
        if row[1] == "pending":
            await self._wakeups.wait(("create", api_id), wait)
        return "pending"

    async def gone(self, tenant: str, api_id: str) -> None:
        """A sandbox was deleted: its charge, exec results and streams go, and every replica
        answers 404 for it from now on."""
        with self._db.write("gone") as tx:
            tx.run("DELETE FROM sandboxes WHERE key = ? AND tenant = ?", api_id, tenant)
            self._tomb(tx, api_id)
            tx.run("DELETE FROM execs WHERE sandbox = ?", api_id)
            tx.run("DELETE FROM streams WHERE sandbox = ?", api_id)

    async def was_deleted(self, api_id: str) -> bool:
        with self._db.read("was_deleted") as tx:
            return tx.one("SELECT 1 FROM tombstones WHERE sandbox = ?", api_id) is not None

    def _tomb(self, tx: Any, api_id: str) -> None:
        tx.run("DELETE FROM tombstones WHERE sandbox = ?", api_id)
        tx.run("INSERT INTO tombstones (sandbox, at) VALUES (?, ?)", api_id, time.time())

    # --- leases ----------------------------------------------------------------------------

    async def lease(self, key: str, holder: str, ttl: float) -> bool:
        """Hold ``key`` for ``holder`` for ``ttl`` s (True) unless someone else holds it: a
        check-then-act on the hosts (a tenant's volume count) done by one replica at a time.
        Keys are per tenant and expire, so the table stays bounded."""
        now = time.time()
        with self._db.write("lease", durable=False) as tx:
            tx.run("DELETE FROM leases WHERE until < ?", now)
            row = tx.one("SELECT holder FROM leases WHERE key = ?", key)
            if row is not None and row[0] != holder:
                return False
            tx.run("DELETE FROM leases WHERE key = ?", key)
            tx.run("INSERT INTO leases (key, holder, until) VALUES (?, ?, ?)", key, holder,
                   now + ttl)
        return True

    async def unlease(self, key: str, holder: str) -> None:
        with self._db.write("unlease", durable=False) as tx:
            tx.run("DELETE FROM leases WHERE key = ? AND holder = ?", key, holder)

    # --- volumes -----------------------------------------------------------------------------

    async def volume_made(self, tenant: str, name: str, node: str | None, size: int) -> None:
        with self._db.write("volume_made") as tx:
            tx.run("DELETE FROM volumes WHERE tenant = ? AND name = ?", tenant, name)
            tx.run("INSERT INTO volumes (tenant, name, node, size, at) VALUES (?, ?, ?, ?, ?)",
                   tenant, name, node, size, time.time())

    async def volume_gone(self, tenant: str, name: str) -> None:
        with self._db.write("volume_gone") as tx:
            tx.run("DELETE FROM volumes WHERE tenant = ? AND name = ?", tenant, name)

    async def volumes_seen(self, tenant: str, live: dict[str, list[Any]]) -> list[str]:
        """The tenant's volumes the nodes hold (``live``: name -> [node, size]) are in the
        books (one made before them is taken in); returns the names the books hold that no
        live node has: lost."""
        now = time.time()
        with self._db.write("volumes_seen") as tx:
            known = {n: node for n, node in tx.all(
                "SELECT name, node FROM volumes WHERE tenant = ?", tenant)}
            for name, (node, size) in live.items():
                if name not in known or known[name] != node:
                    tx.run("DELETE FROM volumes WHERE tenant = ? AND name = ?", tenant, name)
                    tx.run("INSERT INTO volumes (tenant, name, node, size, at) VALUES "
                           "(?, ?, ?, ?, ?)", tenant, name, node, size, now)
        return sorted(set(known) - set(live))

    async def volume_rows(self) -> list[list[Any]]:
        """Every tenant's volumes: [tenant, name, node]."""
        with self._db.read("volume_rows") as tx:
            return [list(r) for r in tx.all("SELECT tenant, name, node FROM volumes")]

    # --- for reconcile and the metrics -------------------------------------------------------

    async def sandbox_rows(self) -> list[list[Any]]:
        """Every sandbox record: [key, tenant, state]."""
        with self._db.read("sandbox_rows") as tx:
            return [list(r) for r in tx.all("SELECT key, tenant, state FROM sandboxes")]

    async def tombstoned(self) -> list[str]:
        with self._db.read("tombstoned") as tx:
            return [k for (k,) in tx.all("SELECT sandbox FROM tombstones")]

    async def tenants(self) -> list[str]:
        """Every tenant the books have a record of."""
        with self._db.read("tenants") as tx:
            found: set[str] = set()
            for table in ("sandboxes", "kept", "volumes", "execs"):
                found.update(t for (t,) in tx.all(f"SELECT DISTINCT tenant FROM {table}"))
            return sorted(found)

    async def stats(self) -> dict[str, Any]:
        """Rows per table and database seconds per operation (calls, total)."""
        self._sweep(force=True)
        return {"rows": dict(self.counts), "where": self._db.where,
                "seconds": {k: list(v) for k, v in self.timings.seconds.items()}}

    def _sweep(self, force: bool = False) -> None:
        """Age-based cleanup (finished exec results past ``max_exec_result_age``, client
        tokens past their life, old tombstones, expired leases and streams) and the row
        counts, at most every ``SWEEP_SECONDS``."""
        now = time.time()
        if not force and now - self._swept < SWEEP_SECONDS:
            return
        self._swept = now
        with self._db.write("sweep", durable=False) as tx:
            tx.run("DELETE FROM execs WHERE finished IS NOT NULL AND finished < ?",
                   now - self._b.max_exec_result_age)
            tx.run("DELETE FROM execs WHERE finished IS NULL AND deadline < ?", now)
            tx.run("DELETE FROM tokens WHERE at < ?", now - self._b.client_token_seconds)
            tx.run("DELETE FROM tombstones WHERE at < ?", now - TOMBSTONE_SECONDS)
            old = tx.all("SELECT sandbox FROM tombstones ORDER BY at DESC")[MAX_TOMBSTONES:]
            for (sid,) in old:
                tx.run("DELETE FROM tombstones WHERE sandbox = ?", sid)
            tx.run("DELETE FROM leases WHERE until < ?", now)
            tx.run("DELETE FROM streams WHERE deadline < ?", now)
        self.counts = row_counts(self._db)
        _export_rows(self.counts)


# --- metrics ---------------------------------------------------------------------------------

_BOUNDS = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5]


@functools.cache
def _step_seconds() -> Any:
    from ray.util import metrics

    return metrics.Histogram("ray_sandbox_service_books_seconds", "one step of the service's "
                             "books in their database", _BOUNDS, tag_keys=("op",))


@functools.cache
def _rows() -> Any:
    from ray.util import metrics

    return metrics.Gauge("ray_sandbox_service_books_rows", "rows of a table of the service's "
                         "books", tag_keys=("table",))


def _observe_step(op: str, seconds: float) -> None:
    if ray.is_initialized():
        _step_seconds().observe(seconds, tags={"op": op})


def _export_rows(counts: dict[str, int]) -> None:
    if ray.is_initialized():
        for table, n in counts.items():
            _rows().set(n, tags={"table": table})


class Shared:
    """The replica's way to the books: in-process, or the state actor with a bound on each
    call (unreachable, too slow or its database failing: 503 ``unavailable``)."""

    def __init__(self, books: Books | None = None, actor: Any = None,
                 timeout: float = 10.0) -> None:
        self._books = books
        self._actor = actor
        self._timeout = timeout

    async def __call__(self, method: str, *args: Any, wait: float = 0.0) -> Any:
        if self._books is not None:
            try:
                return await self._books.step(method, *args)
            except ConnectionError as exc:
                log.warning("the service's books failed on %s: %s", method, exc)
                raise _errors.refusal(503, "the service's shared state did not answer; "
                                           "retry shortly") from None
        ref = self._actor.step.remote(method, *args)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()),
                                          self._timeout + wait)
        except (RayError, TimeoutError) as exc:
            log.warning("the service's state actor failed on %s: %s", method, exc)
            raise _errors.refusal(503, "the service's shared state did not answer; retry "
                                       "shortly") from None


def actor_name(app: str) -> str:
    # versioned: replicas of a new release must not call an older release's books (an in-place
    # RayService upgrade keeps the detached actor), whose methods may differ
    return f"{_actor_prefix(app)}{BOOKS_VERSION}"


def _actor_prefix(app: str) -> str:
    return f"ray_sandbox_service_state:{app}:v"


def db_spec(config: ServiceConfig) -> str | None:
    return config.state_db.get_secret_value() if config.state_db is not None else None


def on_head(config: ServiceConfig) -> bool:
    """Whether whatever holds the books must run on the head node: a SQLite file is there
    (on KubeRay, the head's volume)."""
    return not is_postgres(db_spec(config))


def connect(config: ServiceConfig, app: str | None) -> Shared:
    """The books of the service app ``app``: in-process for one replica, else its state
    actor, made by whichever replica comes first (the others get the same one)."""
    if config.num_replicas == 1 or app is None:
        return Shared(books=Books(Bounds.of(config), db_spec(config), app or "ray-sandbox"))
    options: dict[str, Any] = {"resources": HEAD} if on_head(config) else {}
    actor = ray.remote(Books).options(
        name=actor_name(app), namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
        num_cpus=0, max_restarts=-1, max_concurrency=STATE_CONCURRENCY, **options,
    ).remote(Bounds.of(config), db_spec(config), app)
    return Shared(actor=actor, timeout=config.state_timeout)


def disconnect(app: str) -> None:
    """End the state actor of ``app`` (it is detached: nothing else ends it). Its database
    stays: the next start of the app reloads it."""
    for info in ray.util.list_named_actors(all_namespaces=True):  # older releases' too
        name = info.get("name", "")
        if info.get("namespace") == NAMESPACE and name.startswith(_actor_prefix(app)):
            with contextlib.suppress(ValueError):  # gone meanwhile
                ray.kill(ray.get_actor(name, namespace=NAMESPACE))
