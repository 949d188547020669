"""Checkpointing a running sandbox: the hold that takes every host connection out of it
(gVisor cannot save a socket bound or connected to the host) and ``runsc checkpoint``.

While ``run/checkpoint.hold`` exists the agent closes its listener; new calls wait in the
client, calls already running get a drain timeout, and afterwards the agent listens again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .agent.client import AgentClient
from .agent.conn import connect_agent_socket
from .bundle import SandboxDir
from .errors import CommandError, SandboxStateError, ToolMissingError
from .records import SandboxRecord
from .runsc import TARGET_VERSION, Runsc

HOLD_FILE = "checkpoint.hold"  # the agent's HOLD_NAME (agent.c)
_RETRY_S = 3.0
_SOCKET_WAIT_S = 10.0


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
         before_hold: Callable[[], None]) -> Iterator[None]:
    """Hold new calls, drop every connection and have the agent close its listener; on exit
    it listens again and held calls go on. ``before_hold`` runs once running calls have
    drained, before the hold file appears (it stops what must not be carried across)."""
    hold = sdir.run / HOLD_FILE
    with client.quiesce(drain_timeout):
        before_hold()
        hold.touch()
        try:
            client.drop_connections()
            wait_socket(sdir, present=False, wake=True)
            yield
        finally:
            hold.unlink(missing_ok=True)
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
    tried again for a short while."""
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
