"""Idleness: ``idle_timeout_seconds`` deletes a sandbox nothing used for that long,
``idle_suspend_seconds`` suspends it (``runtime.suspensions``; a Ray host's ``idle`` hook
suspends it in the host's threads instead).

A sandbox is looked at when its idle limit could first pass, and again when it next could.
"Used" is the agent client's last call or process (``AgentClient.pool``); a sandbox in
use is looked at each second, so its idle time counts from within a second of its last use.
A suspended sandbox's idle time counts from its last use before the suspend.
"""

from __future__ import annotations

import time

from . import reaper
from .connections import Connections
from .errors import SandboxError
from .launch import Launcher
from .records import Records, SandboxRecord
from .suspension import SUSPENDED, Suspensions

# A sandbox in use (a call or process running) is looked at this often for idleness; its
# idle time counts from the last look that found it in use, within this much.
_IDLE_BUSY_RECHECK_S = 1.0


class IdleWatch:
    """The idle checks of one runtime's sandboxes (a timer thread)."""

    def __init__(self, records: Records, launcher: Launcher, connections: Connections,
                 suspensions: Suspensions) -> None:
        self._records = records
        self._launcher = launcher
        self._connections = connections
        self.suspensions = suspensions
        self._timer = reaper.TtlTimer(self._check)

    def watch(self, rec: SandboxRecord) -> None:
        """Look at the sandbox's idleness when its idle limit could first pass (also after a
        resume in place: ``suspensions``)."""
        limits = [v for k in ("idle_timeout_seconds", "idle_suspend_seconds")
                  if (v := rec.config.get(k))]
        if limits:
            self._timer.schedule(rec.sandbox_id, time.time() + min(limits))

    def _check(self, sandbox_id: str) -> None:
        """Delete the sandbox if nothing used it for its ``idle_timeout_seconds``, suspend it
        (``suspensions.idle``, a Ray host's; else in place here) if nothing used it for its
        ``idle_suspend_seconds``, else look again when that could next be true (each second
        while a call or process runs)."""
        if not self._records.owns(sandbox_id):
            return  # deleted, or handed to another owner
        try:
            rec = self._records.get(sandbox_id)
        except SandboxError:
            return
        delete_after = rec.config.get("idle_timeout_seconds")
        asleep = rec.phase == SUSPENDED
        suspend_after = None if asleep else rec.config.get("idle_suspend_seconds")
        if not (delete_after or suspend_after):
            return  # personalized without one, or suspended without a deadline
        now = time.monotonic()
        since = now - max(time.time() - rec.created_at, 0.0)  # handed out or created
        client = self._connections.peek(sandbox_id)
        if asleep:
            state = self.suspensions.state(sandbox_id)
            if state is not None:
                since = now - max(time.time() - state.last_used, 0.0)
        elif client is not None:
            used = client.pool.idle_since()
            if used is None or self.suspensions.busy(sandbox_id):
                # in use: idle time counts from now at the earliest
                client.pool.touch()
                limit = min(v for v in (delete_after, suspend_after) if v)
                self._timer.schedule(sandbox_id,
                                     time.time() + min(limit, _IDLE_BUSY_RECHECK_S))
                return
            since = max(since, used)
        idle_for = now - since
        if delete_after and idle_for >= delete_after:
            self._launcher.destroy(sandbox_id, reason="IdleTimeout")
            return
        if suspend_after and idle_for >= suspend_after:
            if self._suspend(sandbox_id, time.time() - idle_for):
                if delete_after:  # its idle timeout still counts while it sleeps
                    self._timer.schedule(sandbox_id, time.time() + (delete_after - idle_for))
            else:  # refused for now (in use meanwhile, no disk budget): later
                self._timer.schedule(sandbox_id, time.time() + suspend_after)
            return
        wait = min(v for v in (delete_after, suspend_after) if v) - idle_for
        self._timer.schedule(sandbox_id, time.time() + wait)

    def _suspend(self, sandbox_id: str, last_used: float) -> bool:
        """Whether the idle sandbox was suspended (or a Ray host took it to suspend)."""
        if self.suspensions.idle is not None:
            return self.suspensions.idle(sandbox_id)
        try:
            self.suspensions.suspend(sandbox_id, reason="Idle", drain_timeout=0.0,
                                     last_used=last_used)
            return True
        except SandboxError:
            return False
