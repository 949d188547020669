"""The books every replica of one service shares: creates in flight and failed, the quota
ledger, client tokens, exec results, which streamed exec runs where, kept snapshots and
filesystem images, volumes, recent deletes and leases.

They are kept in a database (``_store``: a SQLite file by default, PostgreSQL with
``state_db``), so a restart of whatever holds them forgets nothing. One process holds them at
a time: with one replica the replica itself, with more one named, detached Ray actor per
service app (``ray_sandbox_service_state:<app>:v<version>``, zero CPUs, restarted by Ray;
on the head node with SQLite, whose file is there). Every replica calls it with a bound
(``state_timeout``): books that do not answer are a 503, never a hang.

Each method of :class:`Books` is one atomic step: its reads and writes are one database
transaction under the writers' lock, and no ``await`` comes between a check and its change.
The database is the durable record; memory holds only the wake-ups of long polls (events set
when a create or exec ends). Every table is bounded per tenant or by age.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from typing import Any

import ray
from pydantic import BaseModel, ConfigDict
from ray.exceptions import RayError

from . import _errors
from ._config import Quota, ServiceConfig
from ._quota import Charge, over_quota
from ._store import Store, Timings, is_postgres, open_store, row_counts

log = logging.getLogger(__name__)

NAMESPACE = "ray_sandbox_service"
UNSEEDED = "unseeded"  # admit's answer when the books do not know the tenant's sandboxes yet
STATE_CONCURRENCY = 4096  # long polls wait inside the actor, one slot each
MAX_SANDBOXES = 1024  # a tenant's sandboxes whose exec results are kept (least recent evicted)
MAX_TOMBSTONES = 4096  # recent deletes, so every replica answers 404 for them
TOMBSTONE_SECONDS = 86400.0  # and for at most this long
MAX_STREAMS = 4096  # streamed execs findable by another replica (a replica caps its own)
MAX_TAKES = 4096  # snapshots and images being taken (what a crash mid-take leaves, for reconcile)
GRACE = 60.0  # a create or exec past its own bound by this much lost its replica
SWEEP_SECONDS = 60.0  # age-based cleanup and row counts, at most this often
BOOKS_VERSION = 4  # raise it with every change to Books' methods or their meaning
SNAPSHOT, FS_IMAGE = "snapshot", "filesystem image"  # the kinds of things a tenant keeps
CHARGED = ("pending", "made", "copy")  # sandbox rows that count against the quota
HEAD = {"node:__internal_head__": 0.001}  # Ray's resource of the head node
LOST = ("lost: no node has it any more (its node died, or it was deleted outside the "
        "service); DELETE forgets it")


class Bounds(BaseModel):
    """What the books are held to (from ServiceConfig; no tokens cross to the actor)."""

    model_config = ConfigDict(frozen=True)

    max_execs_per_sandbox: int
    max_errored: int
    max_snapshots: int
    max_fs_images: int
    create_timeout: float
    max_running_execs_per_tenant: int
    max_result_bytes_per_tenant: int
    max_exec_timeout: float = 3600.0
    max_exec_result_age: float = 86400.0
    max_client_tokens: int = 4096
    client_token_seconds: float = 86400.0

    @classmethod
    def of(cls, config: ServiceConfig) -> Bounds:
        return cls(**{k: getattr(config, k) for k in cls.model_fields})

    def limit(self, kind: str) -> int:
        """How many of ``kind`` (SNAPSHOT, FS_IMAGE) one tenant keeps."""
        return self.max_snapshots if kind == SNAPSHOT else self.max_fs_images


def _count(tx: Any, where: str, *args: Any) -> int:
    return int(tx.one(f"SELECT COUNT(*) FROM {where}", *args)[0])


def _js(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


class Books:
    """The shared state over its database; every method is one atomic step (no await
    between a check and its change, one transaction under the writers' lock), so two
    replicas cannot both pass a check that only one may."""

    def __init__(self, bounds: Bounds, db: str | None = None, app: str = "ray-sandbox",
                 store: Store | None = None) -> None:
        self._b = bounds
        self.timings = Timings()
        self.timings.observer = _observe_step
        self._db = store if store is not None else open_store(db, app, self.timings)
        # wake-ups of long polls: key -> (event, waiters); set and dropped when it ends
        self._events: dict[tuple[str, ...], tuple[asyncio.Event, list[int]]] = {}
        self._swept = 0.0
        self.counts: dict[str, int] = {}
        self._sweep()  # what a restart finds: old rows go, the row counts are exported

    def close(self) -> None:
        self._db.close()

    # --- wake-ups (memory only) ------------------------------------------------------------

    async def _wait(self, key: tuple[str, ...], timeout: float) -> None:
        if timeout <= 0:
            return
        got = self._events.get(key)
        if got is None:
            got = self._events[key] = (asyncio.Event(), [0])
        event, waiters = got
        waiters[0] += 1
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            pass
        finally:
            waiters[0] -= 1
            if not waiters[0] and self._events.get(key) is got:
                del self._events[key]

    def _wake(self, key: tuple[str, ...]) -> None:
        got = self._events.pop(key, None)
        if got is not None:
            got[0].set()

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
                       "copy" if pending is None else "pending", cpu, memory, _js(info),
                       deadline, expires, now)
            if token is not None:
                tx.run("DELETE FROM tokens WHERE tenant = ? AND token = ?", tenant, token[0])
                tx.run("INSERT INTO tokens (tenant, token, digest, sandbox, at) VALUES "
                       "(?, ?, ?, ?, ?)", tenant, token[0], token[1], keys[0], now)
                if _count(tx, "tokens WHERE tenant = ?", tenant) > self._b.max_client_tokens:
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
                           tenant, cpu, memory, _js(info), current, now)
                elif row[1] == tenant and row[0] in ("lost", "error", "pending"):
                    tx.run("UPDATE sandboxes SET state = 'made', error = NULL, settled = ?, "
                           "changed = ? WHERE key = ?", current, now, key)
                    self._wake(("create", key))
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
                       _js({**(info or {}), "created_at": now}), now, key, tenant)

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
        self._wake(("create", api_id))
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
            self._wake(("create", k))
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
            await self._wait(("create", api_id), min(wait, (row[5] or 0) - time.time()))
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
            await self._wait(("create", api_id), wait)
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

    # --- execs -----------------------------------------------------------------------------

    async def exec_started(self, tenant: str, api_id: str, exec_id: str,
                           timeout: float) -> str | None:
        """Record a running exec (None), or why there is no room: the tenant runs
        ``max_running_execs_per_tenant`` already, or the sandbox's last
        ``max_execs_per_sandbox`` are all running (else the oldest finished one is
        evicted)."""
        self._sweep()
        now = time.time()
        with self._db.write("exec_started", durable=False) as tx:
            reason = self._over_running(tx, tenant, now)
            if reason is not None:
                return reason
            mine = tx.all("SELECT exec, finished FROM execs WHERE sandbox = ? ORDER BY started",
                          api_id)
            if len(mine) >= self._b.max_execs_per_sandbox:
                done = next((x for x, finished in mine if finished is not None), None)
                if done is None:
                    return (f"{len(mine)} execs are running in this sandbox, its limit; wait "
                            "for one to finish")
                tx.run("DELETE FROM execs WHERE sandbox = ? AND exec = ?", api_id, done)
            tx.run("INSERT INTO execs (sandbox, exec, tenant, deadline, started) VALUES "
                   "(?, ?, ?, ?, ?)", api_id, exec_id, tenant, now + timeout + GRACE, now)
            if not mine and _count(tx, "(SELECT DISTINCT sandbox FROM execs WHERE tenant = ?)"
                                   " AS s", tenant) > MAX_SANDBOXES:
                # a sandbox new among the tenant's: the least recently used go past the cap
                held = tx.all("SELECT sandbox, MAX(started) FROM execs WHERE tenant = ? GROUP "
                              "BY sandbox ORDER BY MAX(started)", tenant)
                for sid, _ in held[:max(0, len(held) - MAX_SANDBOXES)]:
                    tx.run("DELETE FROM execs WHERE sandbox = ?", sid)
        return None

    def _over_running(self, tx: Any, tenant: str, now: float) -> str | None:
        limit = self._b.max_running_execs_per_tenant
        running = self._running(tx, tenant)
        if running >= limit:  # those whose replica went away count no more
            tx.run("DELETE FROM execs WHERE tenant = ? AND finished IS NULL AND deadline < ?",
                   tenant, now)
            tx.run("DELETE FROM streams WHERE tenant = ? AND deadline < ?", tenant, now)
            running = self._running(tx, tenant)
        if running >= limit:
            return (f"{running} execs of this tenant are running, its limit "
                    "(max_running_execs_per_tenant); wait for one to finish")
        return None

    def _running(self, tx: Any, tenant: str) -> int:
        return int(tx.one("SELECT (SELECT COUNT(*) FROM execs WHERE tenant = ? AND finished IS "
                          "NULL) + (SELECT COUNT(*) FROM streams WHERE tenant = ?)", tenant,
                          tenant)[0])

    async def exec_finished(self, api_id: str, exec_id: str, info: dict[str, Any]) -> None:
        size = sum(len(info.get(k) or "") for k in ("stdout", "stderr"))
        with self._db.write("exec_finished", durable=False) as tx:
            row = tx.one("SELECT tenant FROM execs WHERE sandbox = ? AND exec = ? AND "
                         "finished IS NULL", api_id, exec_id)
            if row is None:  # evicted or deleted meanwhile
                return
            tenant = row[0]
            tx.run("UPDATE execs SET info = ?, size = ?, finished = ? WHERE sandbox = ? AND "
                   "exec = ?", _js(info), size, time.time(), api_id, exec_id)
            total = int(tx.one("SELECT COALESCE(SUM(size), 0) FROM execs WHERE tenant = ? AND "
                               "finished IS NOT NULL", tenant)[0])
            if total > self._b.max_result_bytes_per_tenant:
                for sid, ex, n in tx.all("SELECT sandbox, exec, size FROM execs WHERE tenant = ?"
                                         " AND finished IS NOT NULL ORDER BY finished", tenant):
                    if total <= self._b.max_result_bytes_per_tenant:
                        break
                    tx.run("DELETE FROM execs WHERE sandbox = ? AND exec = ?", sid, ex)
                    total -= n
        self._wake(("exec", api_id, exec_id))

    async def exec_record(self, tenant: str, api_id: str, exec_id: str,
                          wait: float = 0.0) -> dict[str, Any] | None:
        """The tenant's exec as ExecInfo's fields (None: unknown, evicted or another
        tenant's), waiting up to ``wait`` s while it runs."""
        row = self._exec_row(api_id, exec_id)
        if row is None or row[0] != tenant:
            return None
        if row[1] is None and wait > 0:
            await self._wait(("exec", api_id, exec_id), wait)
            row = self._exec_row(api_id, exec_id)
            if row is None:
                return None
        if row[1] is not None:
            found: dict[str, Any] = json.loads(row[1])
            return found
        if time.time() > row[2]:  # its replica went away before it could report
            return {"exec_id": exec_id, "status": "failed", "error": {
                "code": "unavailable", "message": "the replica running it went away"}}
        return {"exec_id": exec_id, "status": "running"}

    def _exec_row(self, api_id: str, exec_id: str) -> tuple[Any, ...] | None:
        with self._db.read("exec_record") as tx:
            return tx.one("SELECT tenant, info, deadline FROM execs WHERE sandbox = ? AND "
                          "exec = ?", api_id, exec_id)

    async def stream_started(self, tenant: str, api_id: str, exec_id: str,
                             key: str) -> str | None:
        """Record a running streamed exec (None), or why not (the tenant's running execs)."""
        now = time.time()
        with self._db.write("stream_started", durable=False) as tx:
            reason = self._over_running(tx, tenant, now)
            if reason is not None:
                return reason
            tx.run("DELETE FROM streams WHERE sandbox = ? AND exec = ?", api_id, exec_id)
            tx.run("INSERT INTO streams (sandbox, exec, tenant, key, deadline) VALUES "
                   "(?, ?, ?, ?, ?)", api_id, exec_id, tenant, key,
                   now + self._b.max_exec_timeout + GRACE)
            if _count(tx, "streams") > MAX_STREAMS:
                old = tx.all("SELECT sandbox, exec FROM streams ORDER BY deadline DESC")
                for sid, ex in old[MAX_STREAMS:]:
                    tx.run("DELETE FROM streams WHERE sandbox = ? AND exec = ?", sid, ex)
        return None

    async def stream_ended(self, api_id: str, exec_id: str) -> None:
        with self._db.write("stream_ended", durable=False) as tx:
            tx.run("DELETE FROM streams WHERE sandbox = ? AND exec = ?", api_id, exec_id)

    async def stream_key(self, tenant: str, api_id: str, exec_id: str) -> str | None:
        """The host's process key of a running streamed exec of the tenant, so any replica
        can signal or cancel it through the sandbox's handle."""
        with self._db.read("stream_key") as tx:
            row = tx.one("SELECT tenant, key FROM streams WHERE sandbox = ? AND exec = ?",
                         api_id, exec_id)
        return row[1] if row is not None and row[0] == tenant else None

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

    # --- what tenants keep: snapshots and filesystem images --------------------------------

    async def take_started(self, take: str, kind: str, tenant: str, source: str) -> None:
        """A snapshot or image is being taken of the sandbox ``source`` (its runtime id):
        what a crash before ``keep`` leaves on a node is then the tenant's, for reconcile."""
        with self._db.write("take_started") as tx:
            tx.run("INSERT INTO takes (id, kind, tenant, source, at) VALUES (?, ?, ?, ?, ?)",
                   take, kind, tenant, source, time.time())
            if _count(tx, "takes") > MAX_TAKES:
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
                   kind, tenant, key, _js(kept), time.time())
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
            return int(tx.one("SELECT COUNT(*) FROM kept WHERE kind = ? AND tenant = ?", kind,
                              tenant)[0])

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
                return await getattr(self._books, method)(*args)
            except ConnectionError as exc:
                log.warning("the service's books failed on %s: %s", method, exc)
                raise _errors.refusal(503, "the service's shared state did not answer; "
                                           "retry shortly") from None
        ref = getattr(self._actor, method).remote(*args)
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
