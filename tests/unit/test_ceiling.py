"""The node's sandbox ceiling (``doctor``): the arithmetic over measured per-sandbox costs, and
the reader of this node's limits."""

from __future__ import annotations

import pytest

from ray_sandbox.runtime.config import node_pid_max
from ray_sandbox.runtime.doctor import (
    HOST_BASE_FDS,
    IDLE_SANDBOX,
    NodeLimits,
    SandboxCost,
    ceiling,
    diagnose,
    node_limits,
)

GiB = 2**30
COST = SandboxCost(tasks=50, memory=10 * 2**20, files=100, mounts=3, host_fds=1)


def limits(**kw) -> NodeLimits:
    """A roomy node: every limit far away unless a test sets it."""
    base = dict(pid_max=4_194_304, threads_max=4_194_304, tasks=1_000, mem_available=1024 * GiB,
                file_max=10**9, files=0, mount_max=10**6, mounts=0, host_nofile=10**6)
    return NodeLimits(**{**base, **kw})


def test_stock_pid_max_binds_first():
    c = ceiling(limits(pid_max=32_768, tasks=2_300), COST)
    assert c.limit == "kernel.pid_max"
    assert c.sandboxes == (32_768 - 300 - 2_300) // 50 == 603
    assert c.limits[0].name == c.limit and c.limits == sorted(c.limits, key=lambda x: x.room)


def test_threads_max_binds_when_pid_max_is_raised():
    c = ceiling(limits(threads_max=192_730, tasks=1_400), COST)
    assert (c.limit, c.sandboxes) == ("kernel.threads-max", (192_730 - 1_400) // 50)


def test_memory_binds_on_a_small_node():
    c = ceiling(limits(mem_available=22 * GiB, threads_max=192_730), COST)
    assert (c.limit, c.sandboxes) == ("MemAvailable", 22 * GiB // (10 * 2**20))
    assert c.limits[0].unit == "bytes"
    assert "22.0 GiB free, 10 MiB per sandbox" in c.summary()


def test_host_actor_fds_bind_with_a_low_nofile():
    c = ceiling(limits(host_nofile=1024), COST)
    assert (c.limit, c.sandboxes) == ("host actor RLIMIT_NOFILE", 1024 - HOST_BASE_FDS)


def test_files_and_mounts():
    assert ceiling(limits(file_max=100_000, files=20_000), COST).sandboxes == 800
    c = ceiling(limits(mount_max=3_000, mounts=30), COST)
    assert (c.limit, c.sandboxes) == ("fs.mount-max", 990)


def test_a_cgroup_limit_above_the_sandboxes_counts():
    c = ceiling(limits(cgroup_pids_max=10_000, cgroup_pids=500), COST)
    assert (c.limit, c.sandboxes) == ("cgroup pids.max", 190)
    c = ceiling(limits(cgroup_memory_max=8 * GiB, cgroup_memory=3 * GiB), COST)
    assert (c.limit, c.sandboxes) == ("cgroup memory limit", 512)
    names = {lim.name for lim in ceiling(limits(), COST).limits}
    assert not names & {"cgroup pids.max", "cgroup memory limit", "RLIMIT_NPROC"}


def test_nproc_counts_only_when_set():
    c = ceiling(limits(nproc=4_096, nproc_used=96), COST)
    assert (c.limit, c.sandboxes) == ("RLIMIT_NPROC", 80)


def test_a_full_node_has_no_room():
    c = ceiling(limits(pid_max=2_000, tasks=5_000), COST)
    assert c.sandboxes == 0 and c.limits[0].room == 0


def test_the_measured_cost_gives_about_a_thousand_on_this_machine_kind():
    """24 GiB, threads-max from RAM, pid_max raised: memory binds, above 1,000 (issue 17)."""
    c = ceiling(limits(mem_available=23 * GiB, threads_max=192_730, tasks=1_500))
    assert c.limit == "MemAvailable" and 1_000 < c.sandboxes < 2_000


@pytest.mark.parametrize("field", SandboxCost._fields)
def test_measured_costs_are_positive(field):
    assert getattr(IDLE_SANDBOX, field) > 0


def test_reads_this_node():
    node = node_limits()
    assert node.pid_max == node_pid_max()
    assert node.threads_max > 0 and node.tasks > 0 and node.mem_available > 0
    assert node.mounts > 0 and node.files > 0 and node.host_nofile > 0
    c = ceiling(node)
    assert c.sandboxes >= 0 and {lim.name for lim in c.limits} >= {
        "kernel.pid_max", "kernel.threads-max", "MemAvailable"}


def test_doctor_reports_the_ceiling():
    report = diagnose()
    assert report.ceiling is not None
    check = next(c for c in report.checks if c.name == "ceiling")
    assert report.ceiling.limit in check.detail
    assert f"{report.ceiling.sandboxes:,}" in check.detail
