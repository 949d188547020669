"""Block reservations against a placement group per sandbox (issue 17), side by side in one
run, and real boots through ``create_many`` against bare ``runsc run``.

    .venv/bin/python -m benchmarks blocks [--quick]

``control``: simulated raylets (``bench_scale.local_cluster``) whose hosts **skip the gVisor
boot** (``_NoBootRuntime``, this benchmark only: every row says so), so what is measured is
the control plane: routing, blocks, Ray calls and the GCS. The GCS's CPU is read from its
process around each run. ``boots``: one real node, real runsc, the busybox image.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import benchmarks.bench_scale as scale
from benchmarks._harness import BARE_RUNSC, emit
from ray_sandbox.runtime import ImageStore, SandboxRuntime
from ray_sandbox.runtime.errors import SandboxNotFoundError
from tests.fx_runtime import leftovers

SIMULATED = "SIMULATED BOOT (no gVisor)"
BLOCK_IDLE_S = 5.0
BOOT_PARALLEL = 16  # the host's own bound on boots in flight (actor/host.py)


class _NoBootRuntime:
    """The host's runtime with the gVisor boot skipped (benchmark only, never in a test):
    sandboxes are ids in a set, so the rows measure routing, blocks and Ray alone."""

    def __init__(self, home: Any = None, reap: bool = False) -> None:
        self.home = Path(tempfile.mkdtemp(prefix="rsb-noboot-"))
        self.snapshots_dir = self.home / "snapshots"
        self._ids: set[str] = set()

    def create(self, config: Any, detach: bool = False) -> str:
        sid = uuid.uuid4().hex
        self._ids.add(sid)
        return sid

    def delete(self, sandbox_id: str) -> None:
        self._ids.discard(sandbox_id)

    def list(self, all: bool = False, labels: Any = None) -> list[str]:  # noqa: A002
        return sorted(self._ids)

    def record(self, sandbox_id: str) -> Any:
        raise SandboxNotFoundError("simulated", sandbox_id=sandbox_id)

    def oom_killed(self, sandbox_id: str) -> bool:
        return False

    def gc(self) -> list[str]:
        return []

    def list_snapshots(self) -> list:
        return []


def _start_noboot_hosts() -> None:
    """A host on every node whose runtime skips the boot, started before any create so that
    ``hosts.host_for_node`` finds it under the host's name."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ray_sandbox.actor import host as host_module

    class NoBootHost(host_module.SandboxHost):
        def __init__(self, home: str | None = None) -> None:
            host_module.SandboxRuntime = _NoBootRuntime  # this actor's process only
            super().__init__(home)

    if __name__ != "__main__":  # run as a module: ship _NoBootRuntime to the workers
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    remote = ray.remote(NoBootHost)
    hosts = [remote.options(
        name=f"host-{n['NodeID']}", namespace=host_module.NAMESPACE, lifetime="detached",
        num_cpus=0, max_concurrency=1024, enable_task_events=False,  # as start_host does
        scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False),
    ).remote() for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")]
    ray.get([h.ping.remote() for h in hosts])


def control(nodes: int, quick: bool, tmp: Path) -> list[dict]:
    import ray

    import ray_sandbox as sandbox
    from ray_sandbox.actor.admission import _reserved
    from ray_sandbox.actor.labels import current_job
    from ray_sandbox.actor.template import make_template

    n_blocks = 500 if quick else 2000
    n_base = 200 if quick else 500
    bundle = dict(scale.BUNDLE)
    opts = {"image": scale.BUSYBOX, "cpu": bundle["CPU"], "memory": "256Mi",
            "resources": {scale.SLOT: 1.0}}
    rows = []
    os.environ["RAY_SANDBOX_BLOCK_IDLE_S"] = str(BLOCK_IDLE_S)  # kept across the two rounds
    with scale.local_cluster(nodes, tmp) as cluster:
        gcs = scale._gcs_pid(cluster)
        _start_noboot_hosts()
        t = make_template(**opts)
        job = current_job()

        def per_sandbox_pg(_: int) -> None:  # today's path: reserve, create, delete
            sb = _reserved(t, None, None, None, None, job)
            ray.get(sb.terminate.remote())

        per_sandbox_pg(0)
        rows.append(_in_flight_row(gcs, per_sandbox_pg, n_base, "baseline: a placement group "
                                   f"per sandbox, create+delete, 8 in flight ({SIMULATED})"))

        ray.get([h.terminate.remote() for h in sandbox.create_many(8, **opts)])  # warm routes
        # The GCS also works when nobody creates (raylet reports): its idle rate over the
        # same run is given so the per-sandbox figure can be read net of it.
        cpu0, t0 = scale._cpu_seconds(gcs), time.perf_counter()
        time.sleep(3.0)
        idle_cpu_per_s = (scale._cpu_seconds(gcs) - cpu0) / (time.perf_counter() - t0)
        for phase in ("cold blocks (grown in the call)", "warm blocks (slots reused)"):
            cpu0, t0 = scale._cpu_seconds(gcs), time.perf_counter()
            made = sandbox.create_many(n_blocks, **opts)
            admit_s = time.perf_counter() - t0
            ray.get([h.terminate.remote() for h in made])
            secs = time.perf_counter() - t0
            gcs_s = scale._cpu_seconds(gcs) - cpu0
            rows.append({
                "label": f"blocks: create_many({n_blocks}) over {nodes} nodes + delete all, "
                         f"{phase} ({SIMULATED})", "n": n_blocks,
                "admissions_per_s": round(n_blocks / admit_s, 1),
                "admit_seconds": round(admit_s, 3),
                "gcs_cpu_ms_per_sandbox": round(gcs_s / n_blocks * 1000, 4),
                "gcs_cpu_ms_per_sandbox_net_of_idle":
                    round(max(0.0, gcs_s - idle_cpu_per_s * secs) / n_blocks * 1000, 4),
                "gcs_idle_cpu_ms_per_s": round(idle_cpu_per_s * 1000, 2)})
        hosts = {h._host for h in made}
        cpu0, t0 = scale._cpu_seconds(gcs), time.perf_counter()
        while any(ray.get(h.blocks.remote()) for h in hosts):  # given back after the idle time
            time.sleep(0.2)
        secs = time.perf_counter() - t0
        rows.append({"label": f"blocks given back after {BLOCK_IDLE_S:g} s idle, "
                              f"{nodes} nodes ({SIMULATED})",
                     "seconds": round(secs, 2),
                     "gcs_cpu_ms_net_of_idle": round(max(0.0, scale._cpu_seconds(gcs) - cpu0
                                                         - idle_cpu_per_s * secs) * 1000, 2)})

        def one(_: int) -> None:
            ray.get(sandbox.create(**opts).terminate.remote())

        rows.append(_in_flight_row(gcs, one, n_base, "blocks: create()+delete one at a time, "
                                   f"8 in flight ({SIMULATED})"))
        sandbox.shutdown()
    return rows


def _in_flight_row(gcs: int, cycle: Any, n: int, label: str) -> dict:
    """``cycle`` run ``n`` times, 8 in flight: its rate and the GCS's CPU per cycle."""
    cpu0, t0 = scale._cpu_seconds(gcs), time.perf_counter()
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(cycle, range(n)))
    secs = time.perf_counter() - t0
    return {"label": label, "n": n, "sandboxes_per_s": round(n / secs, 1),
            "gcs_cpu_ms_per_sandbox": round((scale._cpu_seconds(gcs) - cpu0) / n * 1000, 4)}


def boots(tmp: Path, quick: bool, reps: int = 3) -> list[dict]:
    """Real boots on this node: ``create_many(64)`` against 64 bare ``runsc run`` with the
    host's parallelism, interleaved so noise hits both."""
    import ray

    import ray_sandbox as sandbox
    from ray_sandbox.runtime import paths

    n = 16 if quick else 64
    # Stock off: every create here must be a boot, and no refill may compete with the baseline.
    env = {"RAY_SANDBOX_HOME": str(tmp / "ray-home"), "RAY_SANDBOX_IMAGES": str(paths.images()),
           "RAY_SANDBOX_STOCK_MAX": "0"}
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             _temp_dir=str(tmp / "ray-local"), runtime_env={"env_vars": env})
    opts = {"image": scale.BUSYBOX, "cpu": 0.1, "memory": "64Mi"}
    # The bare bundle's root is read-only with no filestore or disk: this variant boots the
    # same shape, the default one (writable root, disk=4Gi) does more work than bare runsc.
    same = {**opts, "readonly": True, "disk": None}
    rows = []
    with SandboxRuntime(tmp / "bare-home", images=ImageStore()) as rt:
        ref = rt.create(image=scale.BUSYBOX, memory="64Mi", cpu=0.1)  # its root: the bundle's
        bundle = scale._baseline_bundle(rt, ref, tmp / "baseline-bundle")
        try:
            ray.get([h.terminate.remote() for h in sandbox.create_many(4, **opts)])  # warm
            ours, ours_same, bare = [], [], []
            for _ in range(1 if quick else reps):
                for out, o in ((ours, opts), (ours_same, same)):
                    t0 = time.perf_counter()
                    made = sandbox.create_many(n, **o)
                    out.append(n / (time.perf_counter() - t0))
                    ray.get([h.terminate.remote() for h in made])
                    _settled(tmp / "ray-home")
                bare.append(_bare_boots(rt, bundle, tmp, n))
        finally:
            sandbox.shutdown()
            ray.shutdown()
            rt.delete(ref)
    bare_med = sorted(bare)[len(bare) // 2]
    for label, runs in ((f"create_many({n}), real runsc, busybox, defaults (writable root, "
                         "disk=4Gi): boots/s", ours),
                        (f"create_many({n}), the bare bundle's shape (readonly, no disk): "
                         "boots/s", ours_same)):
        med = sorted(runs)[len(runs) // 2]
        rows.append({"label": label, "n": n, "boots_per_s_median": round(med, 2),
                     "boots_per_s_runs": [round(r, 2) for r in runs],
                     "ratio_to_bare_runsc": round(med / bare_med, 3)})
    rows.append({"label": f"bare runsc run x{n}, {BOOT_PARALLEL} in flight (baseline): boots/s",
                 "n": n, "boots_per_s_median": round(bare_med, 2),
                 "boots_per_s_runs": [round(r, 2) for r in bare]})
    return rows


def _settled(home: Path, timeout: float = 120.0) -> None:
    """Wait until the background teardowns of terminated sandboxes are done, so that they do
    not take CPU from the next timed phase (they did: whichever phase came next lost ~10 %)."""
    deadline = time.monotonic() + timeout
    while leftovers(home) and time.monotonic() < deadline:
        time.sleep(0.1)


def _bare_boots(rt: SandboxRuntime, bundle: Path, tmp: Path, n: int) -> float:
    ids = [os.urandom(16).hex() for _ in range(n)]

    def run(bid: str) -> None:
        logs = tmp / "baseline-logs" / bid
        logs.mkdir(parents=True)
        rt.runsc.run_detached(bid, bundle, BARE_RUNSC, log_dir=logs)

    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(BOOT_PARALLEL) as ex:
            list(ex.map(run, ids))
        return n / (time.perf_counter() - t0)
    finally:
        for bid in ids:
            rt.runsc.delete(bid)
        shutil.rmtree(tmp / "baseline-logs")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="control,boots")
    ap.add_argument("--nodes", type=int, default=None, help="simulated raylets (8; quick 4)")
    ap.add_argument("--reps", type=int, default=3, help="boots: interleaved runs of each")
    args = ap.parse_args()
    only = set(args.only.split(","))
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="rsb-bench-blocks-") as tmpd:
        tmp = Path(tmpd)
        if "control" in only:
            rows += control(args.nodes or (4 if args.quick else 8), args.quick, tmp)
        if "boots" in only:
            rows += boots(tmp, args.quick, args.reps)
    emit("bench_blocks", rows, notes=(
        "2-core VM shared with other engineers' work. control rows: simulated raylets, 1 GCS, "
        f"hosts whose runtime skips the gVisor boot ({SIMULATED}); bundle {scale.BUNDLE}. "
        "boots rows: real runsc, busybox, ptrace, network none, one node."))


if __name__ == "__main__":
    main()
