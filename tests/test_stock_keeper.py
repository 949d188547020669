"""Stocked sandboxes die with their host (issue 20): a script that starts a local Ray cluster,
creates and deletes a sandbox and exits takes its hosts down with the cluster, and nobody
runs gc afterwards; the stock the host booted meanwhile must not outlive it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from ray_sandbox.runtime.paths import images
from tests.fx_hostile import wait_until
from tests.fx_ray import assert_reaped_clean
from tests.fx_runtime import leftovers

GONE_S = 60  # a hang guard for the keeper's deletes, not a speed claim

SCRIPT = textwrap.dedent("""
    import json, sys, time
    import ray, ray_sandbox as sandbox

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=100 * 2**20)
    sb = sandbox.create(image="ray-sandbox/busybox", memory="32Mi", cpu=0.1)  # a miss
    deadline = time.monotonic() + 60
    while ray.get(sb._host.stock.remote())["stocked"] < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    stocked = ray.get(sb._host.__ray_call__.remote(lambda self: sorted(self._stock.ids())))
    ray.get(sb.terminate.remote())
    print(json.dumps(stocked))
    # no ray_sandbox.shutdown(): the script ends and takes its local cluster with it
""")


def test_stocked_sandboxes_die_with_their_host(tmp_path, busybox_image):
    home = tmp_path / "home"
    env = {**os.environ, "RAY_SANDBOX_HOME": str(home), "RAY_SANDBOX_IMAGES": str(images()),
           "RAY_SANDBOX_STOCK_MAX": "2", "RAY_SANDBOX_STOCK_PER_SHAPE": "2"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    stocked = out.stdout.strip().splitlines()[-1]
    assert stocked != "[]", "the host stocked nothing: the test would prove nothing"
    try:
        # nothing here runs gc: only the keeper can have deleted them
        assert wait_until(lambda: not leftovers(home), GONE_S, interval=0.2), \
            (stocked, leftovers(home))
    finally:
        assert_reaped_clean(home)
