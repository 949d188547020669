"""Sandbox metrics exported through ``ray.util.metrics`` (Prometheus via Ray's dashboard agent).

    ray_sandbox_create_seconds   histogram  sandbox create latency on the host
    ray_sandbox_exec_seconds     histogram  exec latency on the host
    ray_sandbox_live             gauge      live sandboxes per node
    ray_sandbox_oom_kills        counter    sandboxes OOM-killed, counted when the host deletes them
    ray_sandbox_pool_acquires    counter    pool acquires, tagged hit=true|false
    ray_sandbox_stock_takes      counter    creates that asked a host's stock, tagged hit=true|false
    ray_sandbox_stock_misses     counter    creates the stock did not serve, tagged cause (stock.py)
    ray_sandbox_stock            gauge      booted, never-used sandboxes in stock per node
    ray_sandbox_suspends         counter    suspends, tagged reason=idle|asked and
                                            result=ok|refused|failed (refused: in use, or past
                                            the node's disk budget; it stays running)
    ray_sandbox_resumes          counter    resumes, tagged where=here|moved and result=ok|failed
    ray_sandbox_suspend_seconds  histogram  a suspend's time on the host (no caller waits on it)
    ray_sandbox_resume_seconds   histogram  a resume's time until the sandbox answers, as the
                                            caller that woke it waits (reservation included)
    ray_sandbox_suspended        gauge      suspended sandboxes per node
    ray_sandbox_suspended_bytes  gauge      their checkpoints' disk per node
"""

from __future__ import annotations

import functools

from ray.util import metrics as rm

_BOUNDS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]


@functools.cache
def _create() -> rm.Histogram:
    return rm.Histogram("ray_sandbox_create_seconds", "sandbox create latency", _BOUNDS)


@functools.cache
def _exec() -> rm.Histogram:
    return rm.Histogram("ray_sandbox_exec_seconds", "exec latency", _BOUNDS)


@functools.cache
def _live() -> rm.Gauge:
    return rm.Gauge("ray_sandbox_live", "live sandboxes on a node", tag_keys=("node",))


@functools.cache
def _oom() -> rm.Counter:
    return rm.Counter("ray_sandbox_oom_kills", "sandboxes OOM-killed")


@functools.cache
def _pool() -> rm.Counter:
    return rm.Counter("ray_sandbox_pool_acquires", "pool acquires", tag_keys=("hit",))


@functools.cache
def _stock_takes() -> rm.Counter:
    return rm.Counter("ray_sandbox_stock_takes", "creates that asked the stock",
                      tag_keys=("hit",))


@functools.cache
def _stock_misses() -> rm.Counter:
    return rm.Counter("ray_sandbox_stock_misses", "creates the stock did not serve",
                      tag_keys=("cause",))


@functools.cache
def _stock() -> rm.Gauge:
    return rm.Gauge("ray_sandbox_stock", "stocked sandboxes on a node", tag_keys=("node",))


def observe_create(seconds: float) -> None:
    _create().observe(seconds)


def observe_exec(seconds: float) -> None:
    _exec().observe(seconds)


def set_live(node_id: str, n: int) -> None:
    _live().set(n, tags={"node": node_id})


def count_oom() -> None:
    _oom().inc()


def count_acquire(hit: bool) -> None:
    _pool().inc(tags={"hit": "true" if hit else "false"})


def count_stock_take(hit: bool) -> None:
    _stock_takes().inc(tags={"hit": "true" if hit else "false"})


def count_stock_miss(cause: str) -> None:
    _stock_misses().inc(tags={"cause": cause})


def set_stock(node_id: str, n: int) -> None:
    _stock().set(n, tags={"node": node_id})


@functools.cache
def _suspends() -> rm.Counter:
    return rm.Counter("ray_sandbox_suspends", "sandbox suspends", tag_keys=("reason", "result"))


@functools.cache
def _resumes() -> rm.Counter:
    return rm.Counter("ray_sandbox_resumes", "sandbox resumes", tag_keys=("where", "result"))


@functools.cache
def _suspend_seconds() -> rm.Histogram:
    return rm.Histogram("ray_sandbox_suspend_seconds", "suspend latency on the host", _BOUNDS)


@functools.cache
def _resume_seconds() -> rm.Histogram:
    return rm.Histogram("ray_sandbox_resume_seconds", "resume latency until the sandbox answers",
                        _BOUNDS)


@functools.cache
def _suspended() -> rm.Gauge:
    return rm.Gauge("ray_sandbox_suspended", "suspended sandboxes on a node",
                    tag_keys=("node",))


@functools.cache
def _suspended_bytes() -> rm.Gauge:
    return rm.Gauge("ray_sandbox_suspended_bytes", "disk of suspended sandboxes on a node",
                    tag_keys=("node",))


def count_suspend(reason: str, result: str, seconds: float | None = None) -> None:
    _suspends().inc(tags={"reason": reason, "result": result})
    if seconds is not None:
        _suspend_seconds().observe(seconds)


def count_resume(where: str, result: str, seconds: float | None = None) -> None:
    _resumes().inc(tags={"where": where, "result": result})
    if seconds is not None:
        _resume_seconds().observe(seconds)


def set_suspended(node_id: str, n: int, size_bytes: int) -> None:
    _suspended().set(n, tags={"node": node_id})
    _suspended_bytes().set(size_bytes, tags={"node": node_id})
