"""Whether a sandbox runs now, asked of its node's host, and whose it is: what a request to a
sandbox's published port needs before it is forwarded (``_ports``). A port of a sandbox that
ended may be published by another sandbox meanwhile, so the host is asked on every request;
a suspended sandbox is woken by it. What was learned of nodes and owners is kept briefly
(``NODE_SEEN_S``, at most ``MAX_NODES_SEEN`` each)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from ray.exceptions import RayActorError

from .. import actor
from ..actor.hosts import host_for_node
from ..actor.placement import node_alive
from ..runtime.errors import SandboxNotFoundError
from ..runtime.results import SandboxState
from ..runtime.verbs import NoRequest
from . import _errors
from ._entry import TENANT_LABEL, Entry

NODE_SEEN_S = 10.0  # how long a node seen alive is believed alive (port traffic)
MAX_NODES_SEEN = 4096


class Liveness:
    """A replica's way to ask hosts whether their sandboxes run, and whose they are."""

    def __init__(self, entries: Mapping[str, Entry], blocking: Callable[..., Any],
                 call: Callable[[Any], Any]) -> None:
        self._entries = entries  # the replica's sandboxes (``Sandboxes``), read only
        self._blocking = blocking  # a blocking lookup in the replica's threads
        self._call = call  # a host call's result, bounded
        self._nodes_seen: dict[str, float] = {}  # node id -> when last seen alive
        # sandbox id -> (tenant, node, when seen): whose a port's host form is
        self._owners: dict[str, tuple[str | None, str | None, float]] = {}

    async def wake_on(self, node_id: str, sandbox_id: str) -> str:
        """Resume a suspended sandbox through its node's host; the node it runs on now."""
        host = await self._blocking(partial(host_for_node, node_id))
        node, _ = await self._call(host.wake.options(concurrency_group="create").remote(
            sandbox_id))
        return str(node)

    async def state_on(self, node_id: str, sandbox_id: str) -> SandboxState:
        """The sandbox's state, asked of its node's host now. A host this replica holds a
        handle of may have retired (idle) and been replaced: the handle is looked up again
        once, so a port URL keeps working across host retirement (it answered 503)."""
        for fresh in (False, True):
            host = await self._blocking(partial(host_for_node, node_id, fresh=fresh))
            try:
                return (await self._call(host.call.options(concurrency_group="control").remote(
                    "status", sandbox_id, NoRequest()))).state
            except SandboxNotFoundError:
                return SandboxState.TERMINATED
            except RayActorError:
                if fresh:
                    raise
        raise AssertionError("unreachable")

    async def ray_alive(self, sandbox_id: str, node_id: str) -> str:
        """``node_id`` if the sandbox made through Ray (no tenant's) still runs there, asked
        of its host now for the reason ``Sandboxes.alive`` gives; else 404."""
        gone = _errors.refusal(404, f"no sandbox {sandbox_id!r}")
        # a port's traffic asks often: a node seen alive lately is not asked Ray's GCS again
        # (a node that died since fails the host call below: 503)
        if self._nodes_seen.get(node_id, 0.0) < time.monotonic() - NODE_SEEN_S:
            if not await self._blocking(node_alive, node_id):
                raise gone
            if len(self._nodes_seen) >= MAX_NODES_SEEN:
                self._nodes_seen.clear()
            self._nodes_seen[node_id] = time.monotonic()
        state = await self.state_on(node_id, sandbox_id)
        if state == SandboxState.TERMINATED:
            raise gone
        if state == SandboxState.SUSPENDED:  # its port's request wakes it
            return await self.wake_on(node_id, sandbox_id)
        return node_id

    async def port_owner(self, sandbox_id: str) -> tuple[str | None, str | None]:
        """Whose sandbox this is, for a port's host form (its label names no tenant):
        ``(tenant, None)`` for a tenant's, ``(None, node)`` for one made through Ray; looked
        up on the hosts once and kept for ``NODE_SEEN_S``; unknown: 404."""
        known = self._owners.get(sandbox_id)
        if known is not None and known[2] > time.monotonic() - NODE_SEEN_S:
            return known[0], known[1]
        entry = self._entries.get(sandbox_id)
        found: tuple[str | None, str | None] | None = (entry.tenant, None) if entry else None
        if found is None:
            for h in await self._blocking(actor.list, None):
                if sandbox_id == h.name:  # a tenant's: its API id is its name
                    status = await self._call(h.status.remote())
                    found = (status.labels.get(TENANT_LABEL), None)
                elif sandbox_id == h.sandbox_id:
                    found = (None, h.node_id)
                if found is not None:
                    break
        if found is None or found == (None, None):
            raise _errors.refusal(404, f"no sandbox {sandbox_id!r}")
        if len(self._owners) >= MAX_NODES_SEEN:
            self._owners.clear()
        self._owners[sandbox_id] = (*found, time.monotonic())
        return found

    def port_payer(self, sandbox_id: str) -> str | None:
        """The tenant whose share a request to this sandbox's port counts against, if
        this replica knows it already (the guard cannot wait for a lookup)."""
        known = self._owners.get(sandbox_id)
        return known[0] if known is not None else None
