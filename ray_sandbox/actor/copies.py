"""New sandboxes from snapshots: ``restore`` copies, ``fork`` a running sandbox; and
``resume`` of a suspended one (its host resumes it, in place or by moving it: suspend.py).
Each copy holds its own Ray reservation, the source's resources.

Copies come back as :class:`Copy` (id, host, node), not handles, so that the handle module can
fork through this one.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import ray

from ..runtime.errors import ConfigError, ImageInUseError, SandboxError, SandboxNotFoundError
from ..runtime.records import ID_RE
from ..runtime.snapshot import Snapshot
from .hosts import all_hosts, ask_hosts, call_host, host_for_node, wake_hosts
from .labels import NAME_LABEL, current_job
from .placement import Placement, check_lifetime, copy_bundle, copy_node, remove_pg, reserve


class Copy(NamedTuple):
    sandbox_id: str
    host: Any
    node_id: str
    name: str | None = None


def _restore_on(node: str, pg_hex: str, snapshot: Snapshot, name: str | None = None,
                sandbox_id: str | None = None, lifetime: str | None = None) -> Copy:
    """One copy on ``node`` under the reservation ``pg_hex`` (released if it fails); it dies
    with the calling job unless ``lifetime="detached"``."""
    job = None if lifetime == "detached" else current_job()
    host, sid = call_host(node, lambda h: h.restore.remote(
        snapshot, pg_hex, name, sandbox_id, owner_job=job), pg_hex)
    return Copy(sid, host, node, name)


def restore(snapshot: Snapshot, k: int = 1, *, placement: Placement = "local",
            timeout: float | None = None, lifetime: str | None = None) -> list[Copy]:
    """``k`` copies of ``snapshot``, all or nothing: if one fails, the others are deleted
    and the error raised."""
    if k < 1:
        raise ConfigError(f"k must be at least 1, got {k}")
    check_lifetime(lifetime)
    bundle = copy_bundle(snapshot)
    node_id = copy_node(snapshot, placement)
    copies: list[Copy] = []
    reserved: list[tuple[str, str]] = []
    try:
        for _ in range(k):
            reserved.append(reserve(bundle, node_id=node_id, lifetime=lifetime,
                                    timeout=timeout))
        # from here each copy's reservation is released by call_host if the copy fails
        work, reserved = reserved, []
        with ThreadPoolExecutor(max_workers=min(k, 32)) as ex:
            futures = [ex.submit(_restore_on, node, pg_hex, snapshot, lifetime=lifetime)
                       for pg_hex, node in work]
        errors = []
        for f in futures:
            try:
                copies.append(f.result())
            except Exception as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)
        if errors:
            raise errors[0]
    except BaseException:
        for pg_hex, _ in reserved:
            remove_pg(pg_hex)
        if copies:
            ray.get([c.host.delete.remote(c.sandbox_id) for c in copies])
        raise
    return copies


def fork(host: Any, sandbox_id: str, k: int = 1, *, placement: Placement = "local",
         timeout: float | None = None, lifetime: str | None = None) -> list[Copy]:
    """``k`` running copies of a sandbox on ``host`` (snapshot + :func:`restore`; the
    snapshot is deleted afterwards)."""
    snap = ray.get(host.snapshot.remote(sandbox_id))
    try:
        return restore(snap, k, placement=placement, timeout=timeout, lifetime=lifetime)
    finally:
        delete_snapshot(snap)


def resume(key: str, *, placement: Placement = "any", timeout: float | None = None) -> Copy:
    """The suspended sandbox with id or name ``key``, resumed by the host that holds it:
    on its node when there is room (or ``placement`` says so), else on a node with room,
    where it moves (same id and name, a new reservation). A sandbox that runs already is
    returned as it is."""
    # suspended on the shared path (RAY_SANDBOX_SUSPEND_DIR) by a node that is gone: the
    # host of the caller's node takes it over (asked first: a dead node's host would keep
    # the questions below waiting for their timeout)
    here = ray.get_runtime_context().get_node_id()
    host, taken = call_host(here, lambda h: h.take_over.remote(key, placement))
    if taken is not None:
        where, name = taken
        return Copy(key if ID_RE.match(key) else _id_of(host, name), host, where, name)
    for node, host, sid in ask_hosts("find_suspended", key):
        if sid is not None:
            where, name = ray.get(host.wake.remote(sid, placement, timeout))
            return Copy(sid, host if where == node else host_for_node(where), where, name)
    for node, host, items in ask_hosts("list", None):
        for sid, labels in items:
            if key in (sid, labels.get(NAME_LABEL)):
                return Copy(sid, host, node, labels.get(NAME_LABEL))
    raise SandboxNotFoundError(f"no suspended sandbox {key!r}")


def _id_of(host: Any, name: str) -> str:
    found = [sid for sid, labels in ray.get(host.list.remote({NAME_LABEL: name}))]
    if not found:
        raise SandboxNotFoundError(f"no sandbox named {name!r}")
    return found[0]


def delete_snapshot(snapshot: Snapshot) -> None:
    """Delete a snapshot from its node and every copy fetched to other nodes. Idempotent."""
    ask_hosts("delete_snapshot", snapshot.snapshot_id)


def delete_filesystem_image(ref: str) -> None:
    """Delete an image made by ``snapshot_filesystem`` from its node and every node that
    fetched it. Idempotent. ImageInUseError, with no copy deleted, while a sandbox on any
    node runs from it; SandboxError if a host did not answer (its copy may remain). Nodes
    whose host retired get one again for this (their copies would stay on disk)."""
    wake_hosts()
    users = sorted(node for node, _, used in ask_hosts("filesystem_image_in_use", ref) if used)
    if users:
        raise ImageInUseError(f"{ref} is in use by sandboxes on node(s) {users}")
    asked = all_hosts()
    answered = {node for node, _, _ in ask_hosts("delete_filesystem_image", ref)}
    if missing := sorted(set(asked) - answered):
        raise SandboxError(f"the hosts of node(s) {missing} did not answer; {ref} may remain "
                           "there (delete it again)")
