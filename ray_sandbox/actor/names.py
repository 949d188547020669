"""Names of sandboxes, unique in the cluster as Ray's named actors are: ``create(name=)``
claims the name in Ray's GCS key-value store (one atomic put that fails if the key exists),
the sandbox's host gives it back when the sandbox ends (delete, TTL, its owner's death),
and a claim whose sandbox is gone (a host that died, a creator killed mid-create) is taken
over by the next create of that name. A second live sandbox of one name is refused with
:class:`SandboxExistsError`, as Ray raises for a taken actor name and Modal
``AlreadyExistsError``.

A claim's value is the sandbox's id, or ``pending:<job id>`` while its create runs.
"""

from __future__ import annotations

from collections.abc import Callable

from ray.experimental import internal_kv

from ..runtime.errors import SandboxExistsError
from .labels import current_job

_NS = b"ray_sandbox_names"
_PENDING = "pending:"


def _key(name: str) -> bytes:
    return name.encode()


def claim(name: str, alive: Callable[[str], bool], dead_jobs: Callable[[], set[str]]) -> None:
    """Claim ``name`` for a create of this job, or raise SandboxExistsError. ``alive(id)``
    says whether the sandbox a claim names still exists (running or suspended);
    ``dead_jobs()`` the ids of finished jobs (a pending claim of one is stale)."""
    value = f"{_PENDING}{current_job()}".encode()
    for _ in range(2):
        if not internal_kv._internal_kv_put(_key(name), value, overwrite=False, namespace=_NS):
            return
        held = internal_kv._internal_kv_get(_key(name), namespace=_NS)
        if held is None:
            continue  # released meanwhile
        holder = held.decode()
        if holder.startswith(_PENDING):
            stale = holder.removeprefix(_PENDING) in dead_jobs()
        else:
            stale = not alive(holder)
        if not stale:
            break
        # only the stale value goes: a claim made meanwhile by another create is kept
        if internal_kv._internal_kv_get(_key(name), namespace=_NS) == held:
            internal_kv._internal_kv_del(_key(name), namespace=_NS)
    raise SandboxExistsError(f"a sandbox named {name!r} already exists; get it with "
                             "ray_sandbox.get(name), or create with get_if_exists=True")


def settle(name: str, sandbox_id: str) -> None:
    """The create of ``name`` made ``sandbox_id``: the claim names it now."""
    internal_kv._internal_kv_put(_key(name), sandbox_id.encode(), overwrite=True,
                                 namespace=_NS)


def release(name: str, holder: str | None = None) -> None:
    """Give ``name`` back if ``holder`` (a sandbox id, or this job's pending create; None:
    this job's pending create) still holds it."""
    want = (holder or f"{_PENDING}{current_job()}").encode()
    try:
        if internal_kv._internal_kv_get(_key(name), namespace=_NS) == want:
            internal_kv._internal_kv_del(_key(name), namespace=_NS)
    except Exception:  # noqa: BLE001 - the GCS away: the next create finds it stale
        pass
