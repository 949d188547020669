"""Finding the host actors from a caller: the one of a node (started there on first use and
cached in this process), all of them, and calling them when some retire or die."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from ..runtime.errors import HostRetiringError
from .host import start_host
from .labels import HOST_PREFIX, NAMESPACE
from .placement import node_alive, remove_pg

_CALL_ATTEMPTS = 8  # a host retiring while called: try a fresh one, ~5 s in all

log = logging.getLogger(__name__)

_host_lock = threading.Lock()
_hosts: dict[str, Any] = {}


def host_for_node(node_id: str, *, home: str | None = None, fresh: bool = False) -> Any:
    """The host actor of ``node_id``, started there if it does not exist yet (``fresh``:
    look it up again instead of trusting this process's cached handle)."""
    with _host_lock:
        if node_id in _hosts and not fresh:
            return _hosts[node_id]
        handle = start_host(node_id, home)
        _hosts[node_id] = handle
        return handle


def forget_hosts() -> None:
    with _host_lock:
        _hosts.clear()


def call_host(node_id: str, call: Callable[[Any], ray.ObjectRef],
              pg_hex: str | None = None) -> tuple[Any, Any]:
    """``ray.get(call(host))`` on the host of ``node_id``; returns (host, result). A host
    that is retiring, or that retired after this process cached its handle, is replaced by a
    fresh one and the call repeated. On any other failure the caller's reservation
    ``pg_hex``, if any, is released (the host releases it itself when the call reached it;
    this covers a host that died) and the error raised."""
    delay = 0.05
    for attempt in range(_CALL_ATTEMPTS):
        host = host_for_node(node_id, fresh=attempt > 0)
        try:
            return host, ray.get(call(host))
        except (HostRetiringError, ray.exceptions.ActorDiedError) as exc:
            # A dead host on a live node retired (a crashed one restarts instead).
            retry = isinstance(exc, HostRetiringError) or node_alive(node_id)
            if not retry or attempt == _CALL_ATTEMPTS - 1:
                _release(pg_hex)
                raise
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        except BaseException:
            _release(pg_hex)
            raise
    raise AssertionError("unreachable")


def _release(pg_hex: str | None) -> None:
    if pg_hex:
        remove_pg(pg_hex)


def all_hosts() -> dict[str, Any]:
    """Host actors of every node that has one, by node id."""
    out = {}
    for info in ray.util.list_named_actors(all_namespaces=True):
        name = info.get("name", "")
        if info.get("namespace") == NAMESPACE and name.startswith(HOST_PREFIX):
            try:
                out[name.removeprefix(HOST_PREFIX)] = ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                continue
    return out


def wake_hosts() -> None:
    """Start the host of every live node that has none (they retire when idle): a call that
    must reach every node's files (deleting a filesystem image) would miss theirs."""
    for node in ray.nodes():
        if node.get("Alive"):
            host_for_node(node["NodeID"])


def ask_hosts(method: str, *args: Any,
              timeout: float = 60.0) -> list[tuple[str, Any, Any]]:
    """``method(*args)`` on every host, concurrently; (node id, host, result) for each that
    answered. Hosts that are dead or unreachable (their node died, they retired) are
    skipped."""
    hosts = all_hosts()
    refs = {node: getattr(h, method).remote(*args) for node, h in hosts.items()}
    out = []
    deadline = time.monotonic() + timeout
    for node, ref in refs.items():
        try:
            out.append((node, hosts[node],
                        ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            log.info("a sandbox host did not answer %s: %s", method, type(exc).__name__)
    return out
