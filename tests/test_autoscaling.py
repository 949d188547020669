"""The autoscaling scenario, end to end: ``examples/autoscaling_demo.py`` on a real Ray
autoscaler (fake multi-node provider) scales from zero worker nodes on sandbox demand, runs
every sandbox on a worker node, and scales back to zero once they are terminated."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ray_sandbox.runtime import ImageStore, SandboxRuntime
from ray_sandbox.runtime.paths import images
from tests.fx_hostile import heavy
from tests.fx_runtime import leftovers

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _cmdlines_with(needle: str) -> list[str]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if needle in cmd:
                out.append(f"{p.name}: {cmd[:120]}")
    return out


@pytest.mark.timeout(600)
@heavy  # 27 s in CI: a scenario, not a regression guard
def test_sandbox_demand_scales_the_cluster_up_from_zero_and_back_down(
        tmp_path, default_image):
    home = tmp_path / "home"
    out = tmp_path / "result.json"
    env = {**os.environ, "RAY_SANDBOX_HOME": str(home), "RAY_SANDBOX_IMAGES": str(images())}
    proc = subprocess.run(
        [sys.executable, "autoscaling_demo.py", "--sandboxes", "6", "--cpu", "1",
         "--node-cpus", "2", "--max-nodes", "3", "--work-seconds", "5", "--json", str(out)],
        cwd=EXAMPLES, env=env, capture_output=True, text=True, timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    try:
        assert r["start_workers"] == 0
        # 6 overlapping one-CPU sandboxes on two-CPU nodes: the autoscaler had to add nodes
        assert r["peak_workers"] >= 2, r["timeline"]
        assert [x["exit_code"] for x in r["runs"]] == [0] * 6, r["runs"]
        assert all(x["stdout"].split()[0] == str(sum(i * i for i in range(200_000)))
                   for x in r["runs"])
        assert r["nodes_used"] >= 2
        fake_head = "f" * 51 + "00000"
        assert fake_head not in {x["node"] for x in r["runs"]}  # the head has no CPUs
        assert r["end_workers"] == 0 and r["scaled_down_s"] is not None, r["timeline"]
        assert _cmdlines_with(r["temp_dir"]) == []  # every process of the cluster is gone
    finally:
        SandboxRuntime(home, images=ImageStore(images()))  # reap what a failed run left
    ids = {x["sandbox_id"] for x in r["runs"]}
    assert leftovers(home, ids) == {}, leftovers(home, ids)
