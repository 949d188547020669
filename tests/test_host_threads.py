"""A node's host keeps threads for every kind of call (actor/host.py, "work", "create" and
the default group): commands that last as long as a sandbox's code wants cannot take the
threads that status, list, create and delete need. 1,088 sleeping execs in 17 sandboxes (64
each, within the per-sandbox bound) wedged every caller of the node for ~30 s while all calls
shared one pool of 1,024. Real Ray, real sandboxes."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

import ray_sandbox as sandbox
from ray_sandbox.runtime import SandboxState
from tests.fx_hostile import heavy

OPTS = {"image": "ray-sandbox/busybox", "memory": "32Mi", "cpu": 0.05}
ANSWER_S = 45  # a hang guard, not a speed claim: the control calls must not wait for the
# sleeps (90 s)


@pytest.fixture(scope="module")
def small_work_group(ray_home):
    """The module's host gets 4 work threads, so a handful of sleeps fills them."""
    old = os.environ.get("RAY_SANDBOX_HOST_WORK_THREADS")
    os.environ["RAY_SANDBOX_HOST_WORK_THREADS"] = "4"
    yield 4
    if old is None:
        os.environ.pop("RAY_SANDBOX_HOST_WORK_THREADS")
    else:
        os.environ["RAY_SANDBOX_HOST_WORK_THREADS"] = old


def _wedge_and_check(ray, boxes: list, sleeps_per_box: int) -> None:
    sleeping = [b.exec.remote("sleep 90", timeout=120) for b in boxes
                for _ in range(sleeps_per_box)]
    # the work threads are all sleeping; every other kind of call is still answered

    def control() -> None:
        other = sandbox.create(**OPTS)
        assert ray.get(other.status.remote()).state == SandboxState.RUNNING
        assert len(sandbox.list()) == len(boxes) + 1
        ray.get(other.terminate.remote())

    with ThreadPoolExecutor(1) as pool:
        pool.submit(control).result(timeout=ANSWER_S)  # waited for the sleeps before
    for b in boxes:
        ray.get(b.terminate.remote(), timeout=ANSWER_S)  # and ends the sleeps
    ray.wait(sleeping, num_returns=len(sleeping), timeout=120)


def test_sleeping_execs_leave_the_control_calls_their_threads(small_work_group, ray_cluster):
    boxes = [sandbox.create(**OPTS) for _ in range(2)]
    _wedge_and_check(ray_cluster, boxes, sleeps_per_box=small_work_group)


@heavy
def test_a_thousand_sleeping_execs_leave_the_node_answering(ray_cluster):
    """The probe's own numbers, with the host's default groups."""
    boxes = sandbox.create_many(17, **{**OPTS, "memory": "256Mi"})  # 64 sleeps fit
    _wedge_and_check(ray_cluster, boxes, sleeps_per_box=64)
