"""Checkpointing a running sandbox: the hold that takes every host connection out of it
(gVisor cannot save a socket bound or connected to the host), ``runsc checkpoint``, and what
a sandbox suspended in place keeps on disk (:class:`SuspendState`).

While ``run/checkpoint.hold`` exists the agent closes its listener; new calls wait in the
client, calls already running get a drain timeout, and afterwards the agent listens again.
A suspend leaves the agent held inside the checkpoint: the sandbox's container is killed
before the hold file goes, and the restored agent, finding no hold file, listens at once.

A suspended sandbox's checkpoint lies in ``<sandbox dir>/suspend/`` (runsc's image files),
or, with ``RAY_SANDBOX_SUSPEND_DIR`` set, in ``$RAY_SANDBOX_SUSPEND_DIR/<id>/`` as a complete
snapshot (``snapshot.SnapshotDir``: image, upper, work, spec) that a host of another node
can restore when this node is gone; ``<sandbox dir>/suspend.json`` says where and since when.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic import BaseModel

from .agent.client import AgentClient
from .agent.conn import connect_agent_socket
from .bundle import SandboxDir
from .errors import CommandError, SandboxStateError, ToolMissingError
from .records import SandboxRecord
from .runsc import TARGET_VERSION, Runsc

HOLD_FILE = "checkpoint.hold"  # the agent's HOLD_NAME (agent.c)
SUSPEND_STATE = "suspend.json"  # in the sandbox dir: a suspended sandbox's checkpoint
SUSPEND_IMAGE = "suspend"  # in the sandbox dir: the checkpoint's files, unless shared
SHARED_ENV = "RAY_SANDBOX_SUSPEND_DIR"
_RETRY_S = 3.0
_SOCKET_WAIT_S = 10.0
_STATE_MAX = 64 * 1024


class SuspendState(BaseModel):
    """What a sandbox suspended in place left on disk (``<sandbox dir>/suspend.json``)."""

    image: str  # runsc's checkpoint files (a directory)
    snapshot: str | None = None  # a complete snapshot there (the shared path) to move it with
    size_bytes: int = 0  # disk blocks of the checkpoint (and of the snapshot's copies)
    since: float  # time.time() of the suspend
    last_used: float  # time.time() of the last call into it, for idle_timeout_seconds
    reason: str = "Suspended"  # "Suspended" (asked for) or "Idle" (idle_suspend_seconds)
    detached: bool = False  # whether it was detached before: a resume keeps that
    readdressed: bool = False  # its netns has its address back (network.reattach) already

    @classmethod
    def read(cls, sdir: SandboxDir) -> SuspendState | None:
        try:
            with open(sdir.path / SUSPEND_STATE, "rb") as f:
                return cls.model_validate_json(f.read(_STATE_MAX))
        except (OSError, ValueError):
            return None

    def write(self, sdir: SandboxDir) -> None:
        tmp = sdir.path / (SUSPEND_STATE + ".tmp")
        tmp.write_text(self.model_dump_json())
        os.replace(tmp, sdir.path / SUSPEND_STATE)


def shared_dir() -> Path | None:
    """``RAY_SANDBOX_SUSPEND_DIR``: where suspended sandboxes' checkpoints go as complete
    snapshots (a path every node mounts); None: in each sandbox's own directory."""
    raw = os.environ.get(SHARED_ENV, "").strip()
    return Path(raw) if raw else None


def suspend_image(sdir: SandboxDir, shared: Path | None) -> Path:
    """Where the checkpoint of the sandbox of ``sdir`` goes: its own directory's
    ``suspend/``, or ``<shared>/<id>/image`` (a snapshot directory: snapshot.SnapshotDir)."""
    return shared / sdir.path.name / "image" if shared else sdir.path / SUSPEND_IMAGE


def remove_suspended(sdir: SandboxDir) -> None:
    """Remove a suspended sandbox's checkpoint and its state file (a teardown, or a resume
    that needs them no more); a shared snapshot is removed only if it is the sandbox's own
    (``<shared>/<id>``: its name is the sandbox's id)."""
    state = SuspendState.read(sdir)
    if state is not None and state.snapshot and Path(state.snapshot).name == sdir.path.name:
        shutil.rmtree(state.snapshot, ignore_errors=True)
    shutil.rmtree(sdir.path / SUSPEND_IMAGE, ignore_errors=True)
    (sdir.path / SUSPEND_STATE).unlink(missing_ok=True)


def check_support(runsc: Runsc) -> None:
    version = runsc.version
    if not version.has_fast_checkpoint:
        raise ToolMissingError(
            f"snapshots need runsc {TARGET_VERSION} or newer; {runsc.binary} is "
            f"{version.version} (its checkpoint --leave-running blocks until the sandbox "
            "exits and it cannot write uncompressed images)"
        )


@contextmanager
def held(client: AgentClient, sdir: SandboxDir, drain_timeout: float,
         before_hold: Callable[[], None], *, stops: bool = False) -> Iterator[None]:
    """Hold new calls, drop every connection and have the agent close its listener; on exit
    it listens again and held calls go on. ``before_hold`` runs once running calls have
    drained, before the hold file appears (it stops what must not be carried across).
    ``stops``: the block ends the container (a suspend), so only a block that failed waits
    for the agent to listen again; the hold file goes either way."""
    hold = sdir.run / HOLD_FILE
    with client.pool.quiesce(drain_timeout):
        before_hold()
        hold.touch()
        ok = False
        try:
            client.pool.drop_connections()
            wait_socket(sdir, present=False, wake=True)
            yield
            ok = True
        finally:
            hold.unlink(missing_ok=True)
            if not (stops and ok):
                wait_socket(sdir, present=True, wake=False)


def accepts(path: Path) -> bool:
    """Whether the agent listens on its socket ``path`` (the probe connection is closed at
    once; the agent's handler for it sees EOF and exits)."""
    try:
        connect_agent_socket(path).close()
    except OSError:
        return False
    return True


def wait_socket(sdir: SandboxDir, *, present: bool, wake: bool,
                timeout: float = _SOCKET_WAIT_S) -> None:
    """Wait until the agent listens on its socket again (or has closed it). ``wake``
    connects once so the agent notices a new hold file without waiting for its next check.
    The socket file appears at bind(), a moment before listen(): until then a connect is
    refused, so reopening waits for a connect that succeeds."""
    if wake:
        accepts(sdir.socket)
    deadline = time.monotonic() + timeout
    while not (accepts(sdir.socket) if present else not sdir.socket.exists()):
        if time.monotonic() > deadline:
            raise SandboxStateError(
                f"the agent did not {'re-open' if present else 'close'} its socket "
                f"within {timeout:g}s", sandbox_id=sdir.path.name,
            )
        time.sleep(0.0005)


def checkpoint(runsc: Runsc, rec: SandboxRecord, image: Path) -> None:
    """``runsc checkpoint`` into ``image``, leaving the sandbox running. A handler may close
    its side of a dropped connection a moment after the drop: until then gVisor refuses to
    encode it ("encoding error"); the failed attempt leaves the sandbox running, so it is
    tried again for a short while. (Without ``--leave-running`` a failed save stops the
    sandbox for good, measured: a suspend saves with it too and ends the container itself.)"""
    deadline = time.monotonic() + _RETRY_S
    while True:
        try:
            runsc.checkpoint(rec.sandbox_id, image, rec.runsc_flags)
            return
        except CommandError as exc:
            if "encoding error" not in (exc.stderr or "") or time.monotonic() > deadline:
                raise
        for f in image.iterdir():
            f.unlink()
        time.sleep(0.01)
