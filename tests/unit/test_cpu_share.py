"""The CPU limits of a sandbox: what the spec gives the boot, and that every share the config
accepts is a CFS bandwidth the kernel takes."""

import pytest

from ray_sandbox.runtime.bundle import CPU_PERIOD_US, boot_cpu
from ray_sandbox.runtime.config import make_config

# The kernel's bounds (kernel/sched/core.c): period 1 ms .. 1 s, quota at least 1 ms.
MIN_US, MAX_PERIOD_US = 1_000, 1_000_000


@pytest.mark.parametrize(("cpu", "quota"), [(0.01, CPU_PERIOD_US), (0.1, CPU_PERIOD_US),
                                            (1, CPU_PERIOD_US), (2.5, 5 * CPU_PERIOD_US // 2)])
def test_boot_gets_at_least_one_core(cpu, quota):
    res = boot_cpu(cpu)
    assert (res.period, res.quota) == (CPU_PERIOD_US, quota)


def test_smallest_share_is_a_bandwidth_the_kernel_takes():
    assert MIN_US <= CPU_PERIOD_US <= MAX_PERIOD_US
    with pytest.raises(ValueError):
        make_config(cpu=0.009)
    assert round(make_config(cpu=0.01).cpu * CPU_PERIOD_US) >= MIN_US
