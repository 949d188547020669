"""The stock refills ahead of demand and counts its misses by cause (issue 40), on a real
one-node Ray cluster with real sandboxes: a steady caller's shelf holds more than one, every
miss has a cause, and under memory pressure the stock holds nothing. Counts, never times."""

from __future__ import annotations

import time

import pytest

import ray_sandbox as sandbox
from ray_sandbox.actor.stock import MISS_CAUSES
from tests.fx_hostile import heavy, wait_until
from tests.fx_ray import homes_cluster

OPTS = {"image": "ray-sandbox/busybox", "memory": "32Mi", "cpu": 0.1}
FILL_S = 60  # a hang guard for refills, not a speed claim


def _stock(ray, sb) -> dict:
    return ray.get(sb._host.stock.remote(), timeout=30)


def _create_and_end(ray) -> dict:
    sb = sandbox.create(**OPTS)
    try:
        assert ray.get(sb.exec.remote(["true"]), timeout=60).exit_code == 0
        return _stock(ray, sb)
    finally:
        ray.get(sb.terminate.remote(), timeout=60)


@heavy  # 10 s in CI, a paced scenario
def test_a_steady_caller_is_stocked_ahead_and_every_miss_has_a_cause(tmp_path):
    import ray

    env = {"RAY_SANDBOX_STOCK_MAX": "4", "RAY_SANDBOX_STOCK_PER_SHAPE": "4"}
    with homes_cluster([tmp_path / "home"], env, [{"object_store_memory": 100 * 2**20}]):
        first = _create_and_end(ray)
        assert first["misses"] == 1 and first["causes"] == {"new": 1}
        assert first["target"] == 1  # one miss, no rate yet
        stats = first
        for _ in range(4):  # a caller that creates again and again
            time.sleep(0.2)
            stats = _create_and_end(ray)
        # two takes make a rate: the shelf wants more than one (the demand over a
        # refill's latency, plus one), and fills to it
        assert stats["target"] >= 2
        host = sandbox.create(**OPTS)
        try:
            assert wait_until(lambda: _stock(ray, host)["stocked"] >= 2, FILL_S, interval=0.1)
            stats = _stock(ray, host)
        finally:
            ray.get(host.terminate.remote(), timeout=60)
        assert sum(stats["causes"].values()) == stats["misses"]
        assert set(stats["causes"]) <= set(MISS_CAUSES)
        assert stats["hits"] + stats["misses"] == 6

        # a create that came with its own placement group (no block had room, as admission
        # falls back to) takes a stocked sandbox of its boot; the stocked one's slot goes back
        from ray_sandbox.actor.hosts import call_host
        from ray_sandbox.actor.labels import current_job
        from ray_sandbox.actor.placement import reserve
        from ray_sandbox.actor.template import make_template

        t = make_template(**OPTS)
        stocked = ray.get(host._host.__ray_call__.remote(lambda self: self._stock.ids()),
                          timeout=30)
        assert stocked
        pg_hex, node = reserve(t.bundle, timeout=60)
        remote, sid = call_host(node, lambda h: h.create.remote(
            t.config, pg_hex, None, False, owner_job=current_job()), pg_hex)
        mine = sandbox.SandboxHandle(sid, remote, node_id=node)
        try:
            assert sid in stocked
            assert ray.get(mine.exec.remote(["true"]), timeout=60).exit_code == 0
        finally:
            ray.get(mine.terminate.remote(), timeout=60)


@pytest.mark.timeout(300)
@heavy  # 10 s in CI
def test_under_memory_pressure_nothing_is_stocked(tmp_path):
    """A node whose available memory is under the stock's floor (here: a floor no node has)
    boots nothing ahead; the next create's miss says why."""
    import ray

    env = {"RAY_SANDBOX_STOCK_MAX": "4", "RAY_SANDBOX_STOCK_MEM_FREE": str(1 << 50)}
    with homes_cluster([tmp_path / "home"], env, [{"object_store_memory": 100 * 2**20}]):
        sb = sandbox.create(**OPTS)
        try:
            assert wait_until(lambda: _stock(ray, sb)["memory_short"], FILL_S, interval=0.1)
            assert not wait_until(lambda: _stock(ray, sb)["stocked"] > 0, 3, interval=0.25)
        finally:
            ray.get(sb.terminate.remote(), timeout=60)
        stats = _create_and_end(ray)
        assert stats["causes"] == {"new": 1, "held": 1}
        assert stats["stocked"] == 0
