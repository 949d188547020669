"""``create``, ``get``, ``list``, ``shutdown``, and copies of running sandboxes (``fork``,
``restore``, ``resume`` after a suspend): sandboxes placed by Ray's scheduler."""

from __future__ import annotations

import builtins
import logging
from collections.abc import Mapping
from typing import Any, Literal

import ray

from ..runtime.config import SandboxConfig
from ..runtime.errors import (
    BatchCreateError,
    ConfigError,
    SandboxError,
    SandboxExistsError,
    SandboxNotFoundError,
)
from ..runtime.snapshot import Snapshot
from . import copies, names
from .admission import admit
from .copies import delete_filesystem_image, delete_snapshot
from .handle import SandboxHandle
from .hosts import all_hosts, ask_hosts, forget_hosts
from .labels import NAME_LABEL, NAMESPACE
from .placement import Placement, check_lifetime
from .routing import router
from .template import SandboxTemplate, make_template

log = logging.getLogger(__name__)


def create(
    image: str | None = None,
    *,
    config: SandboxConfig | None = None,
    name: str | None = None,
    namespace: str | None = None,
    lifetime: Literal["detached"] | None = None,
    get_if_exists: bool = False,
    template: SandboxTemplate | None = None,
    timeout: float | None = None,
    **options: Any,
) -> SandboxHandle:
    """Create a sandbox somewhere in the Ray cluster and return its handle.

    ``options`` are :class:`SandboxConfig` fields (``cpu``, ``memory``, ``disk``,
    ``pids_limit``, ``directfs``, ``network``, …, each meaning what it means there) and Ray
    placement fields (``resources``, ``label_selector``, ``node_id``); an unknown one is a
    ConfigError naming it. They apply over ``config`` or ``template`` when given. Through Ray
    the root is writable by default, capped by ``disk="4Gi"``.

    Its CPU, memory and ``resources`` are reserved in Ray (a slot of its node host's block, or
    its own placement group when it has to wait for room), so placement, queueing when the
    cluster is full (waits up to ``timeout`` seconds, forever by default, saying what it waits
    for; then CapacityError naming what is missing) and the autoscaler all see it. By default
    the sandbox dies with the job that created it; ``lifetime="detached"`` lets it outlive the
    driver. ``name`` makes it findable with :func:`get`; with ``get_if_exists`` an existing one
    of that name is returned.
    """
    check_lifetime(lifetime)
    if name and get_if_exists:
        try:
            return get(name, namespace=namespace)
        except SandboxNotFoundError:
            pass
    t = _template(image, config, template, options)
    if not name:
        return create_from_template(t, lifetime=lifetime, timeout=timeout)
    try:
        names.claim(name, _exists, _dead_jobs)
    except SandboxExistsError:
        if get_if_exists:  # made meanwhile by another caller: that one is ours to use
            return get(name, namespace=namespace)
        raise
    try:
        handle = create_from_template(t, name=name, namespace=namespace, lifetime=lifetime,
                                      timeout=timeout)
    except BaseException:
        names.release(name)
        raise
    names.settle(name, handle.sandbox_id)
    return handle


def _exists(sandbox_id: str) -> bool:
    """Whether the sandbox runs, or is suspended, on any node (a name it holds is taken)."""
    for _, _, items in ask_hosts("list", None):  # suspended ones are listed too
        if any(sid == sandbox_id for sid, _ in items):
            return True
    return False


def _dead_jobs() -> set[str]:
    try:
        return {j["JobID"] for j in ray._private.state.jobs() if j.get("IsDead")}
    except Exception:  # noqa: BLE001 - GCS hiccup: no pending claim is taken for stale
        return set()


def _template(image: str | None, config: SandboxConfig | None,
              template: SandboxTemplate | None, options: dict[str, Any]) -> SandboxTemplate:
    if config is not None:
        if template is not None:
            raise ConfigError("give config= or template=, not both")
        template = SandboxTemplate(config=config)
    if image is not None:
        options["image"] = image
    return make_template(template, **options)


def create_from_template(
    t: SandboxTemplate, *, name: str | None = None, namespace: str | None = None,
    lifetime: str | None = None, timeout: float | None = None,
) -> SandboxHandle:
    result = admit(t, 1, name=name, namespace=namespace, lifetime=lifetime, timeout=timeout)[0]
    if isinstance(result, SandboxError):
        raise result
    return result


def create_many(
    n: int,
    image: str | None = None,
    *,
    config: SandboxConfig | None = None,
    template: SandboxTemplate | None = None,
    lifetime: Literal["detached"] | None = None,
    timeout: float | None = None,
    allow_partial: bool = False,
    **options: Any,
) -> builtins.list[SandboxHandle]:
    """``n`` sandboxes at once, options as for :func:`create`. They are spread over nodes by
    the free slots their hosts advertise, with one call per node (no Ray operation per
    sandbox); what no node has room for waits as pending Ray demand, up to ``timeout``.

    All or nothing by default: if any fails, the others are deleted and BatchCreateError
    raised, its ``errors`` mapping each failed index to its error. ``allow_partial=True``
    returns the handles that were made (their order kept) and logs the failures instead.
    """
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"n must be a positive int, got {n!r}")
    t = _template(image, config, template, options)
    check_lifetime(lifetime)
    results = admit(t, n, lifetime=lifetime, timeout=timeout)
    errors = {i: r for i, r in enumerate(results) if isinstance(r, SandboxError)}
    made = [r for r in results if isinstance(r, SandboxHandle)]
    if not errors:
        return made
    first = next(iter(errors.values()))
    if allow_partial:
        log.warning("create_many: %d of %d sandboxes failed; first: %s", len(errors), n, first)
        return made
    ray.get([sb.terminate.remote() for sb in made])
    err = BatchCreateError(f"{len(errors)} of {n} sandboxes failed (the {len(made)} made "
                           f"were deleted); first: {first}")
    err.errors = errors
    raise err


# --- snapshots, copies, suspension ------------------------------------------------------------

def restore(
    snapshot: Snapshot, k: int = 1, *, placement: Placement = "local",
    timeout: float | None = None, lifetime: Literal["detached"] | None = None,
) -> builtins.list[SandboxHandle]:
    """``k`` new sandboxes from a snapshot, each with its own Ray reservation (the source's
    resources). ``placement`` is ``"local"`` (the snapshot's node), ``"any"`` or a node id;
    on another node the snapshot's files are fetched from the node that holds them, once.
    All or nothing: if one copy fails, the others are deleted and the error raised. Copies
    die with the calling job unless ``lifetime="detached"``, as with :func:`create`."""
    return [SandboxHandle(**c._asdict()) for c in copies.restore(
        snapshot, k, placement=placement, timeout=timeout, lifetime=lifetime)]


def fork(
    handle: SandboxHandle, k: int = 1, *, placement: Placement = "local",
    timeout: float | None = None, lifetime: Literal["detached"] | None = None,
) -> builtins.list[SandboxHandle]:
    """``k`` running copies of a sandbox (snapshot + ``restore``; the snapshot is deleted
    afterwards). See :func:`restore` for ``placement`` and ``lifetime``."""
    return handle.fork(k, placement=placement, timeout=timeout, lifetime=lifetime)


def resume(
    sandbox: SandboxHandle | str, *, placement: Placement = "any",
    timeout: float | None = None,
) -> SandboxHandle:
    """Bring back a suspended sandbox (by handle, id or name) now rather than at its next
    call: its host resumes it on its node when there is room there, else on a node with
    room (``placement``: "any", "local" or a node id), where it moves under its id and name.
    Handles made before keep working either way (the old host forwards). A running sandbox
    is returned as it is."""
    key = sandbox.sandbox_id if isinstance(sandbox, SandboxHandle) else sandbox
    copy = copies.resume(key, placement=placement, timeout=timeout)
    return SandboxHandle(**copy._asdict())


def get(name: str, *, namespace: str | None = None) -> SandboxHandle:
    """The handle of the named sandbox (searched on every node)."""
    for node, h, found in ask_hosts("list", {NAME_LABEL: name}):
        if found:
            return SandboxHandle(found[0][0], h, name=name, node_id=node)
    raise SandboxNotFoundError(f"no sandbox named {name!r}")


def list(labels: Mapping[str, str] | None = None) -> builtins.list[SandboxHandle]:  # noqa: A001
    """Handles of every live sandbox in the cluster (optionally only those with ``labels``)."""
    out = []
    for node, h, items in ask_hosts("list", dict(labels) if labels else None):
        for sid, lbls in items:
            out.append(SandboxHandle(sid, h, name=lbls.get(NAME_LABEL), node_id=node))
    return out


def shutdown() -> int:
    """Delete every sandbox on every node and stop the host actors; returns how many.
    Hosts on dead nodes are skipped (their node's next host reaps what they left)."""
    answered = ask_hosts("shutdown")
    for h in all_hosts().values():  # also those that did not answer in time
        ray.kill(h, no_restart=True)
    forget_hosts()
    router.forget()
    return sum(n for _, _, n in answered)


__all__ = ["create", "create_from_template", "create_many", "delete_filesystem_image",
           "delete_snapshot", "fork", "get",
           "list", "restore",
           "resume", "shutdown", "NAMESPACE"]
