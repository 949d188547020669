"""Ending what should not run any more: sandboxes past their TTL, and everything dead
owners left behind (sandboxes whose creator died, runsc containers and processes without a
record, network state, snapshots, mounts of volumes no sandbox uses), and image pins of
sandboxes that no longer exist in any home on the store (:mod:`.images.pins`)."""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from . import _subreaper, network, procfs
from .errors import SandboxError
from .images import ImageStore
from .images.pins import Pin, stale
from .launch import Launcher
from .network import pull as network_pull
from .records import ID_RE, Records, present
from .runsc import Runsc
from .snapshot import SnapshotStore

_log = logging.getLogger(__name__)
_MAX_WAIT_S = 3600.0  # a far deadline must not overflow a wait; earlier ones notify anyway
_KILL_WAIT_S = 5.0


class TtlTimer:
    """Calls ``expire(sandbox_id)`` at each scheduled deadline, on one daemon thread started
    on first use. A failing ``expire`` is logged and never ends the other deadlines."""

    def __init__(self, expire: Callable[[str], None]) -> None:
        self._expire = expire
        self._cv = threading.Condition()
        self._heap: list[tuple[float, str]] = []
        self._thread: threading.Thread | None = None

    def schedule(self, sandbox_id: str, deadline: float) -> None:
        with self._cv:
            heapq.heappush(self._heap, (deadline, sandbox_id))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="ray-sandbox-ttl",
                                                daemon=True)
                self._thread.start()
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._heap:
                    self._cv.wait()
                deadline, sid = self._heap[0]
                delay = deadline - time.time()
                if delay > 0:
                    self._cv.wait(timeout=min(delay, _MAX_WAIT_S))
                    continue
                heapq.heappop(self._heap)
            try:
                self._expire(sid)
            except Exception:  # one failed teardown must not end every other TTL
                _log.exception("TTL teardown of sandbox %s failed", sid)


def gc(records: Records, launcher: Launcher, snapshots: SnapshotStore) -> list[str]:
    """Remove what dead owners left behind in this home; returns the ids removed."""
    live, dead = records.live_and_dead()
    runsc = launcher.runsc
    # A dead owner's `runsc run` may still be running: stop it first, or it would go on to
    # create cgroups after we cleaned up.
    kill_stray_runsc(runsc, live)
    removed: list[str] = []
    for sid, reason in dead:
        launcher.destroy(sid, reason=reason)
        removed.append(sid)
    removed += launcher.finish_teardowns()  # this process's own, if one failed part-way
    try:
        containers = runsc.list()
    except SandboxError:
        containers = []
    for c in containers:
        if c.id not in live and ID_RE.match(c.id):
            launcher.destroy(c.id, reason="Orphaned")
            removed.append(c.id)
    kill_stray_runsc(runsc, live)
    network.gc(live, records.dir)
    network_pull.reap()  # isolated pulls of processes that died (of any home)
    removed += snapshots.gc()
    unpin_stale(launcher.images, launcher.home)
    launcher.volumes.release_idle()  # e.g. a creator that died between mount and bind
    return sorted(set(removed))


def kill_stray_runsc(runsc: Runsc, live: set[str]) -> None:
    """Kill, and wait out, runsc processes of this root that belong to no live sandbox:
    sandbox/gofer processes runsc does not list (a ``runsc run`` killed half-way:
    docs/platform.md, "Leftovers of a killed runsc run") and runsc commands a dead owner left
    running."""
    def stray(args: list[str]) -> bool:
        ids = [a for a in args if ID_RE.match(a)]
        return bool(ids) and not any(i in live for i in ids)

    killed = [pid for pid in runsc.processes() if runsc.kill_if(pid, stray)]
    deadline = time.monotonic() + _KILL_WAIT_S
    while killed and time.monotonic() < deadline:
        _subreaper.reap_orphans()
        killed = [pid for pid in killed if (st := procfs.stat(pid)) is not None and st.state != "Z"]
        if killed:
            time.sleep(0.01)
    _subreaper.reap_orphans()


def _present(home: Path, sandbox_id: str) -> bool:
    return present(home / "sandboxes", sandbox_id)


def stale_pins(images: ImageStore, home: Path, *, unknown: bool = False) -> list[Pin]:
    """The pins in ``images`` of sandboxes that no home has any more (any home's, not only
    ``home``'s, whose key also maps this home's old pins that name no home)."""
    return [p for p in images.pin_list()
            if stale(p, _present, own_home=home, unknown=unknown)]


def unpin_stale(images: ImageStore, home: Path, *, unknown: bool = False) -> list[Pin]:
    """Remove :func:`stale_pins`, each checked again under its image's lock; returns them."""
    removed = images.unpin_stale(_present, own_home=home, unknown=unknown)
    for p in removed:
        _log.info("removed the stale image pin %s of %s (home %s)", p.owner, p.digest,
                  p.home or "unknown")
    return removed
