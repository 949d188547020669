"""How creates are admitted: planned over the hosts' blocks by the :data:`routing.router`,
one call per node for any number of sandboxes, with no GCS operation per sandbox. What no
block has room for falls back to a placement group per sandbox, which waits as pending Ray
demand (the autoscaler adds nodes for it) up to ``timeout``."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import ray

from ..runtime.errors import CapacityError, SandboxCreationError, SandboxError
from .handle import SandboxHandle
from .hosts import ask_hosts, call_host
from .labels import current_job
from .placement import reserve
from .routing import router
from .template import SandboxTemplate

_ROUNDS = 3  # plans per call: a node that turned out full sends its share elsewhere
_PARALLEL_NODES = 64  # node calls in flight from one caller
_PARALLEL_WAITS = 32  # per-sandbox reservations waiting at once from one caller

Result = SandboxHandle | SandboxError


def admit(t: SandboxTemplate, n: int, *, name: str | None = None,
          namespace: str | None = None, lifetime: str | None = None,
          timeout: float | None = None) -> list[Result]:
    """``n`` sandboxes of ``t``: each one's handle or error, in order."""
    deadline = None if timeout is None else time.monotonic() + timeout
    detached = lifetime == "detached"
    job = current_job()
    results: list[Result | None] = [None] * n
    todo = list(range(n))
    asked = False
    for _ in range(_ROUNDS):
        chosen = router.place(t, len(todo))
        if not chosen and not asked:
            # slots freed by deletes are not in this process's view: ask the hosts once
            # (one call each) before waiting for Ray to find room, and have them give back
            # their empty blocks, whose resources a create of another shape may need (it
            # waited ~11 s for their idle limit with nothing running)
            asked = True
            router.learn(b for _, _, blocks in ask_hosts("blocks", True) for b in blocks)
            chosen = router.place(t, len(todo))
        if not chosen:
            break
        parts, start = [], 0
        for node, k in chosen:
            parts.append((node, todo[start:start + k]))
            start += k
        left = todo[start:]

        def on_node(part: tuple[str, list[int]]) -> list[int]:
            node, idx = part
            try:
                host, (made, slots) = call_host(node, lambda h: h.create_many.remote(
                    t.config, t.bundle, len(idx), detached, owner_job=job, name=name))
            except (SandboxError, ray.exceptions.RayError):
                router.no_room(node, t)  # its host failed: send its share elsewhere
                return idx
            router.advertised(node, slots)
            retry = []
            for i, r in zip(idx, made, strict=True):
                if isinstance(r, CapacityError):
                    retry.append(i)
                elif isinstance(r, SandboxError):
                    results[i] = r
                else:
                    results[i] = SandboxHandle(r, host, name=name, node_id=node)
            if retry:
                router.no_room(node, t)
            return retry

        if len(parts) == 1:  # one node: no thread to start (most single creates)
            todo = on_node(parts[0]) + left
        else:
            with ThreadPoolExecutor(max_workers=min(len(parts), _PARALLEL_NODES)) as ex:
                todo = [i for retry in ex.map(on_node, parts) for i in retry] + left
        if not todo:
            break
    if todo:
        waits = min(len(todo), _PARALLEL_WAITS)
        with ThreadPoolExecutor(max_workers=waits) as ex:
            for i, r in zip(todo, ex.map(lambda _: _reserved(
                    t, name, namespace, lifetime, deadline, job), todo), strict=True):
                results[i] = r
    return results  # type: ignore[return-value] - every index got a handle or an error


def _reserved(t: SandboxTemplate, name: str | None, namespace: str | None,
              lifetime: str | None, deadline: float | None, job: str) -> Result:
    """One sandbox under its own placement group, placed by Ray when room appears."""
    try:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        pg_hex, node = reserve(t.bundle, node_id=t.node_id, label_selector=t.label_selector,
                               name=name, namespace=namespace, lifetime=lifetime,
                               timeout=left)
        host, sid = call_host(node, lambda h: h.create.remote(
            t.config, pg_hex, name, lifetime == "detached", owner_job=job), pg_hex)
    except SandboxError as exc:
        return exc
    except ray.exceptions.RayError as exc:  # its host died: this one failed, not the batch
        return SandboxCreationError(f"{type(exc).__name__}: {exc}")
    return SandboxHandle(sid, host, name=name, node_id=node)
