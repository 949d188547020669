"""The books' execs (``_state``): each exec's result, kept among its sandbox's last
``max_execs_per_sandbox`` and its tenant's ``max_result_bytes_per_tenant`` where every replica
finds it, and which streamed exec runs where (its host's process key), so any replica can
signal it. A tenant's running execs, plain and streamed, count against
``max_running_execs_per_tenant`` together. Bounded: at most ``MAX_SANDBOXES`` sandboxes'
results per tenant, ``MAX_STREAMS`` streams; results age out (``Books._sweep``)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from ._bounds import GRACE, Bounds
from ._store import Store, count, js
from ._wakeups import Wakeups

MAX_SANDBOXES = 1024  # a tenant's sandboxes whose exec results are kept (least recent evicted)
MAX_STREAMS = 4096  # streamed execs findable by another replica (a replica caps its own)


class ExecBooks:
    """The ``execs`` and ``streams`` tables; every method is one atomic step of the books."""

    def __init__(self, db: Store, bounds: Bounds, wakeups: Wakeups,
                 sweep: Callable[[], None]) -> None:
        self._db = db
        self._b = bounds
        self._wakeups = wakeups
        self._sweep = sweep  # the books' age-based cleanup, due before an exec starts

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
            if not mine and count(tx, "(SELECT DISTINCT sandbox FROM execs WHERE tenant = ?)"
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
                   "exec = ?", js(info), size, time.time(), api_id, exec_id)
            total = int((tx.one("SELECT COALESCE(SUM(size), 0) FROM execs WHERE tenant = ? "
                                "AND finished IS NOT NULL", tenant) or (0,))[0])
            if total > self._b.max_result_bytes_per_tenant:
                for sid, ex, n in tx.all("SELECT sandbox, exec, size FROM execs WHERE tenant = ?"
                                         " AND finished IS NOT NULL ORDER BY finished", tenant):
                    if total <= self._b.max_result_bytes_per_tenant:
                        break
                    tx.run("DELETE FROM execs WHERE sandbox = ? AND exec = ?", sid, ex)
                    total -= n
        self._wakeups.wake(("exec", api_id, exec_id))

    async def exec_record(self, tenant: str, api_id: str, exec_id: str,
                          wait: float = 0.0) -> dict[str, Any] | None:
        """The tenant's exec as ExecInfo's fields (None: unknown, evicted or another
        tenant's), waiting up to ``wait`` s while it runs."""
        row = self._exec_row(api_id, exec_id)
        if row is None or row[0] != tenant:
            return None
        if row[1] is None and wait > 0:
            await self._wakeups.wait(("exec", api_id, exec_id), wait)
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
            if count(tx, "streams") > MAX_STREAMS:
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
