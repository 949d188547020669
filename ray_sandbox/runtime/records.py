"""What the node knows about its sandboxes: ``sandboxes/<id>/record.json`` (written before
runsc starts a sandbox, so any process on the node can address it by id),
``sandboxes/<id>.tombstone`` (deleted, its teardown not finished yet), and one runtime's view
of which of them it owns and which it deleted."""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from . import procfs
from .bundle import SandboxDir
from .config import SandboxConfig
from .errors import SandboxNotFoundError
from .runsc import RunscFlags

ID_RE = re.compile(r"^[0-9a-f]{32}$")
# A sandbox dir younger than this without a record is being created by another process (a
# tombstone without content is being written by one).
CREATING_GRACE_S = 60.0
_TOMBSTONE = ".tombstone"
_TOMBSTONE_MAX = 4096


class SandboxRecord(BaseModel):
    """What the node knows about a sandbox; written before runsc starts it."""

    model_config = ConfigDict(extra="ignore")

    sandbox_id: str
    config: dict[str, Any]
    image: str
    image_digest: str
    rootfs: str  # the sandbox's own overlay root
    image_rootfs: str  # the shared, read-only image rootfs
    image_env: list[str] = Field(default_factory=list)
    image_user: str | None = None
    image_workdir: str | None = None
    created_at: float
    ttl_deadline: float | None = None
    owner_pid: int | None = None
    owner_start: int | None = None
    network: str = "none"
    overlay: str = "none"
    platform: str = "ptrace"
    rootless: bool = False
    directfs: bool = True
    oci_seccomp: bool = False  # the spec has a seccomp filter for the sentry to enforce
    phase: str = "creating"  # creating | created | paused
    endpoints: dict[int, tuple[str, int]] = Field(default_factory=dict)

    @property
    def sandbox_config(self) -> SandboxConfig:
        return SandboxConfig(**self.config)

    @property
    def runsc_flags(self) -> RunscFlags:
        return RunscFlags(network=self.network, overlay=self.overlay, rootless=self.rootless,
                          platform=self.platform, directfs=self.directfs,
                          oci_seccomp=self.oci_seccomp)

    def owner_alive(self) -> bool:
        """A detached sandbox (no owner) is only deleted explicitly or by its TTL."""
        return self.owner_pid is None or procfs.is_running(self.owner_pid, self.owner_start)

    def expired(self, now: float) -> bool:
        return self.ttl_deadline is not None and self.ttl_deadline < now


class Tombstone(BaseModel):
    """``sandboxes/<id>.tombstone``: the sandbox was deleted (``reason``), it can no longer
    run, and the process named here is finishing its teardown. Outside the sandbox dir and
    removed last, so a process that dies at any point of a teardown leaves it for gc."""

    reason: str
    owner_pid: int | None = None
    owner_start: int | None = None

    def owner_alive(self) -> bool:
        return self.owner_pid is not None and procfs.is_running(self.owner_pid,
                                                                self.owner_start)


def owner_fields(detach: bool) -> dict[str, int | None]:
    """``owner_pid``/``owner_start`` of a record or snapshot made by this process: none for
    a detached one, which outlives it."""
    if detach:
        return {"owner_pid": None, "owner_start": None}
    me = procfs.stat(os.getpid())
    return {"owner_pid": os.getpid(), "owner_start": me.start if me else None}


def tombstone_file(sandboxes_dir: Path, sandbox_id: str) -> Path:
    """Where a deleted sandbox's tombstone lies while its teardown runs."""
    return sandboxes_dir / f"{sandbox_id}{_TOMBSTONE}"


def present(sandboxes_dir: Path, sandbox_id: str) -> bool:
    """Whether a home still has the sandbox, in any state: its directory (being made, live, or
    dead and left for that home's gc) or its tombstone (a teardown not finished). What cannot
    be read counts as present: only a sandbox known to be gone frees its image pin."""
    for path in (sandboxes_dir / sandbox_id, tombstone_file(sandboxes_dir, sandbox_id)):
        try:
            os.lstat(path)
            return True
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError:
            return True
    return False


def check_id(sandbox_id: object) -> None:
    if not isinstance(sandbox_id, str) or not ID_RE.match(sandbox_id):
        raise SandboxNotFoundError(f"not a sandbox id: {sandbox_id!r}", sandbox_id=None)


# Ray's sandboxes name theirs "ray-sandbox-<hex>". Ours stay 32 hex characters (runsc matches
# ids by prefix, so they have one length; directories and records are keyed by them); the
# compatibility layers show the prefixed form and take either (docs/compat.md, "Ids").
RAY_ID_PREFIX = "ray-sandbox-"


def parse_id(text: object) -> str:
    """The sandbox id in ``text``: ``<32 hex>`` or ``ray-sandbox-<32 hex>``."""
    if isinstance(text, str):
        text = text.removeprefix(RAY_ID_PREFIX)
    check_id(text)
    return str(text)


def ray_id(sandbox_id: str) -> str:
    """``sandbox_id`` in Ray's form, ``ray-sandbox-<32 hex>``."""
    return RAY_ID_PREFIX + parse_id(sandbox_id)


def labels_match(have: Mapping[str, str], want: Mapping[str, str]) -> bool:
    return all(have.get(k) == v for k, v in want.items())


class Records:
    """The records of one home's sandboxes, cached for the ones this runtime owns, plus
    tombstones that say why a deleted id is gone. Thread-safe."""

    def __init__(self, sandboxes_dir: Path) -> None:
        self.dir = sandboxes_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._cache: dict[str, SandboxRecord] = {}
        self._owned: set[str] = set()
        self._tombstones: dict[str, str] = {}

    def sdir(self, sandbox_id: str) -> SandboxDir:
        return SandboxDir(self.dir / sandbox_id)

    def load(self, sandbox_id: str) -> SandboxRecord | None:
        """The record of a sandbox that is not deleted."""
        with self._lock:
            rec = self._cache.get(sandbox_id)
        if rec is not None:
            return rec
        if self._tombstone_path(sandbox_id).exists():
            return None
        return self.read(sandbox_id)

    def read(self, sandbox_id: str) -> SandboxRecord | None:
        """``record.json`` as it is on disk, deleted or not (a teardown needs it)."""
        try:
            return SandboxRecord.model_validate_json(self.sdir(sandbox_id).record.read_text())
        except (OSError, ValueError):
            return None

    def get(self, sandbox_id: str) -> SandboxRecord:
        """The record, or SandboxNotFoundError saying why the id is gone."""
        check_id(sandbox_id)
        rec = self.load(sandbox_id)
        if rec is None:
            reason = self.tombstone(sandbox_id)
            msg = f"sandbox was deleted ({reason})" if reason else "no such sandbox"
            raise SandboxNotFoundError(msg, sandbox_id=sandbox_id)
        return rec

    def write(self, rec: SandboxRecord) -> None:
        """Replace the record on disk (atomically) and in the cache if it is cached."""
        path = self.sdir(rec.sandbox_id).record
        tmp = path.with_suffix(".tmp")
        tmp.write_text(rec.model_dump_json())
        os.replace(tmp, path)
        with self._lock:
            if rec.sandbox_id in self._cache:
                self._cache[rec.sandbox_id] = rec

    def set_phase(self, rec: SandboxRecord, phase: str) -> SandboxRecord:
        rec = rec.model_copy(update={"phase": phase})
        self.write(rec)
        return rec

    def adopt(self, rec: SandboxRecord) -> None:
        """This runtime owns the sandbox now (made or restored under this id)."""
        with self._lock:
            self._cache[rec.sandbox_id] = rec
            self._owned.add(rec.sandbox_id)
            self._tombstones.pop(rec.sandbox_id, None)

    def forget(self, sandbox_id: str, reason: str | None = None) -> None:
        """No longer owned or cached; ``reason`` is kept as its tombstone."""
        with self._lock:
            self._cache.pop(sandbox_id, None)
            self._owned.discard(sandbox_id)
            if reason:
                self._tombstones[sandbox_id] = reason

    def tombstone(self, sandbox_id: str) -> str | None:
        """Why the id is gone: this runtime deleted it, or some process is tearing it down."""
        with self._lock:
            reason = self._tombstones.get(sandbox_id)
        if reason is None and (stone := self.read_tombstone(sandbox_id)) is not None:
            reason = stone.reason
        return reason

    def bury(self, sandbox_id: str, reason: str) -> None:
        """Write the sandbox's tombstone, naming this process as the one finishing its
        teardown: from now on no process loads its record, and if this one dies first, gc
        finishes the teardown."""
        stone = Tombstone(reason=reason, **owner_fields(detach=False))
        self._tombstone_path(sandbox_id).write_text(stone.model_dump_json())

    def read_tombstone(self, sandbox_id: str) -> Tombstone | None:
        """The sandbox's tombstone; a torn one names no owner (its writer died or is
        writing: :meth:`live_and_dead` gives it CREATING_GRACE_S)."""
        try:
            with open(self._tombstone_path(sandbox_id), "rb") as f:
                raw = f.read(_TOMBSTONE_MAX)
        except OSError:
            return None
        try:
            return Tombstone.model_validate_json(raw)
        except ValueError:
            return Tombstone(reason="Deleted")

    def buried(self) -> list[str]:
        """Ids whose tombstone is on disk: teardowns not finished (by any process)."""
        return sorted(n.removesuffix(_TOMBSTONE) for n in os.listdir(self.dir)
                      if n.endswith(_TOMBSTONE) and ID_RE.match(n.removesuffix(_TOMBSTONE)))

    def unbury(self, sandbox_id: str) -> None:
        """Remove the tombstone: the last step of a finished teardown."""
        self._tombstone_path(sandbox_id).unlink(missing_ok=True)

    def _tombstone_path(self, sandbox_id: str) -> Path:
        return tombstone_file(self.dir, sandbox_id)

    def tombstoned(self) -> set[str]:
        with self._lock:
            return set(self._tombstones)

    def owns(self, sandbox_id: str) -> bool:
        with self._lock:
            return sandbox_id in self._owned

    def owned(self) -> list[str]:
        with self._lock:
            return sorted(self._owned)

    def on_disk(self) -> list[str]:
        """Every sandbox id of this home, owned by any process, that is not deleted."""
        names = set(os.listdir(self.dir))
        return sorted(n for n in names if ID_RE.match(n) and n + _TOMBSTONE not in names)

    def select(self, ids: list[str], labels: Mapping[str, str] | None) -> list[str]:
        if not labels:
            return ids
        return [i for i in ids
                if (rec := self.load(i)) and labels_match(rec.config.get("labels", {}), labels)]

    def live_and_dead(self) -> tuple[set[str], list[tuple[str, str]]]:
        """Which sandboxes of this home still have a reason to exist, and which do not
        (their creator died or their TTL passed), with the reason."""
        now = time.time()
        live: set[str] = set()
        dead: list[tuple[str, str]] = []
        stems = {n.removesuffix(_TOMBSTONE) for n in os.listdir(self.dir)}
        for sid in sorted(s for s in stems if ID_RE.match(s)):
            stone = self.read_tombstone(sid)
            if stone is not None:  # a teardown a live process is finishing counts as live
                if stone.owner_alive() or (stone.owner_pid is None and _younger_than(
                        self._tombstone_path(sid), CREATING_GRACE_S, now)):
                    live.add(sid)
                else:
                    dead.append((sid, stone.reason))
                continue
            rec = self.load(sid)
            if self.owns(sid) or (rec is not None and rec.owner_alive() and not rec.expired(now)):
                live.add(sid)
            elif rec is None and _younger_than(self.sdir(sid).path, CREATING_GRACE_S, now):
                live.add(sid)
            else:
                dead.append((sid, "TTLExpired" if rec is not None and rec.expired(now)
                             else "OwnerDied"))
        return live, dead


def _younger_than(path: Path, seconds: float, now: float) -> bool:
    try:
        return now - path.stat().st_mtime < seconds
    except FileNotFoundError:
        return True  # removed meanwhile: nothing left to collect
