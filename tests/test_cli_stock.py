"""``ray-sandbox ps`` on a node whose Ray host keeps a stock of booted, never-used sandboxes
(docs/ray.md, "Stock"): the stock is the host's, not the user's, so ``ps`` lists only the
sandboxes callers made (one real local Ray cluster, stock on, real gVisor sandboxes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ray_sandbox as sandbox
from tests.fx_hostile import wait_until
from tests.fx_ray import homes_cluster

CLI = str(Path(sys.executable).parent / "ray-sandbox")
OPTS = {"image": "ray-sandbox/busybox", "memory": "32Mi", "cpu": 0.1}
FILL_S = 60  # a hang guard for a refill (one boot), not a speed claim


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, default_image, busybox_image):
    import ray

    home = tmp_path_factory.mktemp("rsb-cli-stock")
    env = {"RAY_SANDBOX_STOCK_MAX": "2", "RAY_SANDBOX_STOCK_PER_SHAPE": "1"}
    with homes_cluster([home], env, [{"object_store_memory": 100 * 2**20}]):
        yield ray, home


def _ps(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RAY_SANDBOX_HOME": str(home), "COLUMNS": "200"}
    out = subprocess.run([CLI, "ps", *args], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out


def test_ps_lists_the_callers_sandboxes_not_the_hosts_stock(cluster):
    ray, home = cluster
    mine = sandbox.create(**OPTS)  # a miss: the host stocks one sandbox of this boot
    try:
        def stocked() -> set[str]:
            return ray.get(mine._host.__ray_call__.remote(lambda self: self._stock.ids()),
                           timeout=30)

        assert wait_until(lambda: len(stocked()) == 1, FILL_S, interval=0.1)
        (spare,) = stocked()
        rows = json.loads(_ps(home, "--json").stdout)
        assert [r["sandbox_id"] for r in rows] == [mine.sandbox_id]
        table = _ps(home).stdout
        assert mine.sandbox_id[:12] in table and spare[:12] not in table
        # --all shows the stock too, marked as the host's
        rows = {r["sandbox_id"]: r for r in json.loads(_ps(home, "--all", "--json").stdout)}
        assert set(rows) == {mine.sandbox_id, spare}
        assert (rows[spare]["stock"], rows[mine.sandbox_id]["stock"]) == (True, False)
        assert "stock" in _ps(home, "--all").stdout
    finally:
        ray.get(mine.terminate.remote(), timeout=60)


def test_the_cli_knows_the_stocks_label():
    from ray_sandbox.actor.stock import STOCK_LABEL
    from ray_sandbox.cli.sandboxes import STOCK_LABEL as CLI_STOCK_LABEL

    assert CLI_STOCK_LABEL == STOCK_LABEL
