"""A short soak in CI: 40 create -> exec -> files -> delete cycles, 4 at a time, must leak
nothing — no runsc process, cgroup, mount, sandbox dir or runsc state of a finished sandbox at
any sample, and no driver fd or thread afterwards. The long run is
``python -m benchmarks.soak --cycles 2000 --concurrency 8``. (Issue 10.)"""

from __future__ import annotations

from benchmarks.soak import run
from tests.fx_runtime import leftovers


def test_short_soak_leaks_nothing(tmp_path, image_store, busybox_image):
    home = tmp_path / "soak"
    result = run(40, 4, home=home, sample_every=10, images=image_store)
    assert result.failures == []
    assert [s.leaked for s in result.samples] == [0] * len(result.samples)
    assert result.final.leaked == 0
    assert result.fd_growth == 0 and result.thread_growth == 0
    assert result.final.home_disk_kib <= result.baseline.home_disk_kib
    assert leftovers(home) == {}
