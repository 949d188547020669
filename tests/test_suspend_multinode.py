"""Suspend and resume on a two-node local Ray cluster (issue 36): a sandbox whose node is
full when it is called resumes on the other node (same id and name; the old handle keeps
working through its old host), and each node's disk budget for suspended state."""

from __future__ import annotations

import time

import pytest

from ray_sandbox.actor import api
from ray_sandbox.runtime import SandboxState
from ray_sandbox.runtime.errors import CapacityError, SandboxNotFoundError
from tests.fx_ray import homes_cluster

COUNTER = ("setsid sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/c.tmp; "
           "mv /tmp/c.tmp /tmp/c; sleep 0.05; done' >/dev/null 2>&1 &")


def _wait(cond, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _state(ray, sb) -> SandboxState:
    return ray.get(sb.status.remote()).state


def _stats(ray, sb) -> dict:
    return ray.get(sb._host.suspended.remote())

@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, default_image, busybox_image):
    import ray

    homes = [tmp_path_factory.mktemp(f"rsb-sus{i}") for i in range(2)]
    args = [{"resources": {f"snode{i}": 1}, "object_store_memory": 150 * 2**20}
            for i in range(2)]
    # past 256 KiB of suspended state a node refuses new suspends: one busybox sandbox's
    # checkpoint (~0.7 MiB on disk) puts a node past it
    env = {"RAY_SANDBOX_SUSPEND_DISK": "256Ki", "RAY_SANDBOX_BLOCK_IDLE_S": "2"}
    with homes_cluster(homes, env=env, node_args=args):
        by_res = {next(r for r in n["Resources"] if r.startswith("snode")): n["NodeID"]
                  for n in ray.nodes() if n["Alive"]}
        yield ray, homes, [by_res["snode0"], by_res["snode1"]]


def test_resume_on_another_node_when_the_first_is_full(two_nodes):
    ray, homes, nodes = two_nodes
    sb = api.create(image="ray-sandbox/busybox", cpu=1, memory="128Mi", name="mover",
                    node_id=nodes[0])
    fillers = []
    try:
        sb.run("echo kept > /root/f")
        sb.run(COUNTER)
        ray.get(sb.suspend.remote())
        fillers = [api.create(image="ray-sandbox/busybox", cpu=1, memory="128Mi",
                              node_id=nodes[0]) for _ in range(2)]  # node 0 is full
        # the old handle: its host resumes it on node 1 and forwards the call there
        assert ray.get(sb.exec.remote("cat /root/f")).stdout == "kept\n"
        assert api.get("mover").node_id == nodes[1]
        assert _stats(ray, sb)["moved"] == 1
        _wait(lambda: int(ray.get(sb.exec.remote("cat /tmp/c")).stdout or 0) > 1,
              what="the counter on node 1")
        assert ray.get(sb.status.remote()).state == SandboxState.RUNNING
        assert sb.run("cat /root/f").stdout == "kept\n"  # forwarded, not the channel
        assert not (homes[0] / "sandboxes" / sb.sandbox_id).exists()  # nothing left there
        assert (homes[1] / "sandboxes" / sb.sandbox_id).is_dir()
    finally:
        ray.get([f.terminate.remote() for f in fillers])
        ray.get(sb.terminate.remote())  # through the old handle: forwarded, then forgotten
    with pytest.raises(SandboxNotFoundError):
        api.get("mover")
    assert _stats(ray, sb)["moved"] == 0


def test_past_the_disk_budget_suspends_are_refused_and_nothing_is_deleted(two_nodes):
    ray, _, nodes = two_nodes
    a, b = (api.create(image="ray-sandbox/busybox", cpu=0.5, memory="64Mi", node_id=nodes[1])
            for _ in range(2))
    idle = api.create(image="ray-sandbox/busybox", cpu=0.5, memory="64Mi", node_id=nodes[1],
                      idle_suspend_seconds=1)
    try:
        ray.get(a.suspend.remote())  # within the budget: the node is past it afterwards
        with pytest.raises(CapacityError, match="disk budget"):
            ray.get(b.suspend.remote())
        assert _state(ray, b) == SandboxState.RUNNING
        refused = _stats(ray, idle)["refused"]
        _wait(lambda: _stats(ray, idle)["refused"] > refused, what="the idle suspend")
        assert _state(ray, idle) == SandboxState.RUNNING  # refused: it stays running
        assert _state(ray, a) == SandboxState.SUSPENDED  # and nothing was deleted
        ray.get(a.terminate.remote())  # room again
        ray.get(b.suspend.remote())
        assert _state(ray, b) == SandboxState.SUSPENDED
    finally:
        ray.get([s.terminate.remote() for s in (a, b, idle)])
