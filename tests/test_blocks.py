"""Block reservations on a real two-node Ray cluster with real sandboxes (issue 17): hosts
reserve capacity in blocks and admit sandboxes into free slots without a placement group
each; blocks grow and are given back; a full cluster is pending Ray demand; create_many is
all or nothing; a dead node or a restarted host frees its blocks and nobody else's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import ray_sandbox as sandbox
from ray_sandbox.runtime.errors import BatchCreateError, CapacityError
from tests.fx_hostile import heavy, wait_until
from tests.fx_ray import homes_cluster, host_pid

RAY_CLI = str(Path(sys.executable).with_name("ray"))
IDLE_S = 2  # RAY_SANDBOX_BLOCK_IDLE_S here: blocks are given back within seconds
BUSYBOX = {"image": "ray-sandbox/busybox", "memory": "32Mi"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, default_image, busybox_image):
    import ray

    homes = [tmp_path_factory.mktemp(f"rsb-block{i}") for i in range(2)]
    env = {"RAY_SANDBOX_BLOCK_IDLE_S": str(IDLE_S), "RAY_SANDBOX_PG_SWEEP_S": "2"}
    args = [{"object_store_memory": 100 * 2**20}] * 2
    with homes_cluster(homes, env, args) as c:
        yield ray, c, homes, [c.head_node.node_id, next(iter(c.worker_nodes)).node_id]


def _blocks(ray, host) -> list[tuple[str, int, int]]:
    return [(b.pg_hex, b.size, b.used) for b in ray.get(host.blocks.remote())]


def _free_cpu(ray, node: str) -> float:
    return ray._private.state.state.available_resources_per_node().get(node, {}).get("CPU", 0)


def _terminate(ray, handles) -> None:
    ray.get([sb.terminate.remote() for sb in handles])


def test_slots_are_taken_without_a_reservation_each_and_given_back(cluster):
    ray, _, _, nodes = cluster
    node = nodes[0]
    made = [sandbox.create(**BUSYBOX, cpu=0.5, node_id=node) for _ in range(3)]
    host = made[0]._host
    try:
        # capacity doubles: 1, then 1 more, then 2; every bundle is reserved in Ray
        assert sorted(s for _, s, _ in _blocks(ray, host)) == [1, 1, 2]
        assert wait_until(lambda: _free_cpu(ray, node) == pytest.approx(0.0), 10)
        fourth = sandbox.create(**BUSYBOX, cpu=0.5, node_id=node)
        made.append(fourth)
        blocks = _blocks(ray, host)
        assert len(blocks) == 3 and sum(u for _, _, u in blocks) == 4  # a free slot, no new PG
        assert all(ray.get(sb.exec.remote("echo ok")).stdout == "ok\n" for sb in made)
    finally:
        _terminate(ray, made)
    assert wait_until(lambda: _blocks(ray, host) == [], IDLE_S + 10)
    assert wait_until(lambda: _free_cpu(ray, node) == pytest.approx(2.0), 10)


def test_create_many_spreads_over_nodes_one_call_each(cluster):
    ray, _, _, nodes = cluster
    made = sandbox.create_many(6, **BUSYBOX, cpu=0.5)
    try:
        assert len(made) == 6 and len({sb.sandbox_id for sb in made}) == 6
        assert {sb.node_id for sb in made} == set(nodes)  # neither node has room for six
        outs = ray.get([sb.exec.remote("echo $((6*7))") for sb in made])
        assert [o.stdout for o in outs] == ["42\n"] * 6
    finally:
        _terminate(ray, made)


@heavy  # 25 s in CI
def test_a_full_cluster_is_pending_ray_demand_then_a_capacity_error(cluster):
    ray, c, _, nodes = cluster
    # the earlier tests' blocks are given back first, or they would hold some of the CPUs
    assert wait_until(lambda: sum(_free_cpu(ray, n) for n in nodes) == pytest.approx(4.0),
                      IDLE_S + 15)
    full = sandbox.create_many(4, **BUSYBOX, cpu=1)
    try:
        caught: list[BaseException] = []

        def wait_for_room() -> None:
            try:
                sandbox.create(**BUSYBOX, cpu=1, timeout=20)
            except BaseException as exc:  # noqa: BLE001 - checked below
                caught.append(exc)

        t = threading.Thread(target=wait_for_room)
        t.start()

        def ray_status() -> str:  # what the autoscaler reports (it refreshes every few s)
            return subprocess.run([RAY_CLI, "status", "--address", c.address],
                                  capture_output=True, text=True, timeout=30).stdout

        def pending() -> bool:  # the demand the autoscaler reads: a pending placement group
            from ray.util.placement_group import placement_group_table

            return any(info["state"] == "PENDING"
                       and list(info["bundles"].values()) == [{"CPU": 1.0, "memory": 32 * 2**20}]
                       for info in placement_group_table().values())

        assert wait_until(pending, 18, interval=0.5), caught
        # Ray's own accounting (what `ray status` and the autoscaler show): the four blocks'
        # bundles, reserved; ray status refreshes every few seconds
        assert wait_until(lambda: "4.0 reserved in placement groups" in ray_status(), 15), \
            ray_status()
        t.join(30)
        assert len(caught) == 1 and isinstance(caught[0], CapacityError)
        assert "cluster is full" in str(caught[0]) and "CPU" in str(caught[0])

        # all or nothing: one free slot, two asked for; the one made is deleted again
        ray.get(full.pop().terminate.remote())
        with pytest.raises(BatchCreateError) as info:
            sandbox.create_many(2, **BUSYBOX, cpu=1, timeout=2)
        assert list(info.value.errors) == [1]
        assert isinstance(info.value.errors[1], CapacityError)
        partial = sandbox.create_many(2, **BUSYBOX, cpu=1, timeout=2, allow_partial=True)
        assert len(partial) == 1
        full += partial
    finally:
        _terminate(ray, full)


def test_a_restarted_host_gives_back_its_old_blocks(cluster):
    ray, _, homes, nodes = cluster
    sb = sandbox.create(**BUSYBOX, cpu=1, node_id=nodes[0])
    old_blocks = {pg for pg, _, _ in _blocks(ray, sb._host)}
    os.kill(host_pid(ray, sb._host), signal.SIGKILL)  # Ray restarts the host at once
    from ray.util.placement_group import PlacementGroup, placement_group_table

    def removed(pg: str) -> bool:
        table = placement_group_table(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg))))
        return table.get("state") == "REMOVED"

    assert wait_until(lambda: all(removed(pg) for pg in old_blocks), 60, interval=0.5)
    assert wait_until(lambda: not (homes[0] / "sandboxes" / sb.sandbox_id).exists(), 30)
    again = sandbox.create(**BUSYBOX, cpu=1, node_id=nodes[0])
    ray.get(again.terminate.remote())


def test_a_dead_node_frees_its_blocks_and_no_other_nodes_sandboxes(cluster):
    """Last in this module: it removes the second node."""
    ray, c, _, nodes = cluster
    keep = sandbox.create(**BUSYBOX, cpu=0.5, node_id=nodes[0])
    lost = sandbox.create(**BUSYBOX, cpu=0.5, node_id=nodes[1])
    lost_blocks = {pg for pg, _, _ in _blocks(ray, lost._host)}
    from ray.util.placement_group import placement_group_table

    c.remove_node(next(iter(c.worker_nodes)))
    try:
        def gone() -> bool:
            table = placement_group_table()
            return all(table.get(pg, {}).get("state") in (None, "REMOVED") for pg in lost_blocks)

        assert wait_until(gone, 60, interval=0.5)  # swept by the live node's host
        assert ray.get(keep.exec.remote("echo alive")).stdout == "alive\n"
    finally:
        ray.get(keep.terminate.remote())
