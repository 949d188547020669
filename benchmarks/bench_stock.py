"""create() → first exec with the hosts' stock (issues 20 and 40), beside a fresh boot and bare
runsc measured in the same run.

    .venv/bin/python -m benchmarks.bench_stock [--quick] [--n N] [--steady N] [--only-steady]

Rows (busybox, cpu=1, 48Mi, one local Ray node that advertises 32 logical CPUs so that the
stock's quarter share is 8 sandboxes of this shape; the machine has 2 cores):
- ``warm node, sequential`` and ``warm node, paced 5/s``: after 10 warm-up creates (0.2 s
  apart: a node warmed by the demand it then serves, not by a burst), 200
  (``--steady``) creates one after another (each terminated outside the timed part, the next
  0.2 s later, as the issue measured), then 200 started every 0.2 s; each row gives p50, p99,
  the misses and
  their causes (``stock.MISS_CAUSES``, counted by the host) and the load average;
- ``create()→first exec, stock``: N sequential creates, each sandbox terminated outside the
  timed part, 0.2 s apart (as bench_ray's create row); the row says how many were hits;
- the same with 8 concurrent callers;
- ``fresh boot (baseline)``: the same create, but with a config no stocked sandbox can serve
  (an identity ``spec_transform``), so every one boots;
- ``neighbour exec``: exec ``true`` in another sandbox of the node while the stock is full and
  quiet, then while it refills what 4 hand-outs took (the refill must not starve it);
- ``bare runsc run → runsc exec (baseline)``: no Ray, no agent, the same bundle shape.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ray

import ray_sandbox as sandbox
from benchmarks._harness import BARE_RUNSC, emit, summarize
from benchmarks.bench_scale import _baseline_bundle
from ray_sandbox.runtime import ImageStore, SandboxRuntime
from tests.fx_runtime import leftovers

OPTS = {"image": "ray-sandbox/busybox", "cpu": 1, "memory": "48Mi"}
STOCK_MAX = "32"  # the default, set so that a caller's environment cannot change it
PAUSE_S = 0.2  # between sequential creates: the delete is outside the timed part
REFILL_WAIT_S = 20.0  # how long a burst round waits for the stock to fill (then runs anyway)
WARMUP = 10  # creates before the warm-node rows
PACED_S = 0.2  # the paced row: a create every 0.2 s (5/s)


def _identity(spec: dict) -> dict:
    return spec


def _create_exec(opts: dict) -> tuple[float, sandbox.SandboxHandle]:
    t0 = time.perf_counter()
    sb = sandbox.create(**opts)
    r = ray.get(sb.exec.remote(["/bin/true"]))
    ms = (time.perf_counter() - t0) * 1000
    if r.exit_code != 0:
        raise RuntimeError(f"exec failed: {r.stderr}")
    return ms, sb


def _hits(host: ray.actor.ActorHandle) -> int:
    return ray.get(host.stock.remote())["hits"]


def _misses(host: ray.actor.ActorHandle) -> tuple[int, dict[str, int]]:
    stats = ray.get(host.stock.remote())
    return stats["misses"], stats.get("causes", {})


def steady(n: int, label: str, host: ray.actor.ActorHandle, pace_s: float | None) -> dict:
    """``n`` creates → first exec on a warm node: one after another, PAUSE_S after the last
    one's terminate (outside the timed part), or one started every ``pace_s`` seconds; with
    the misses the host counted over them and their causes."""
    m0, c0 = _misses(host)
    load = os.getloadavg()
    samples = []
    start = time.perf_counter()
    for i in range(n):
        if pace_s is not None:
            time.sleep(max(0.0, start + i * pace_s - time.perf_counter()))
        ms, sb = _create_exec(OPTS)
        samples.append(ms)
        ray.get(sb.terminate.remote())
        if pace_s is None:
            time.sleep(PAUSE_S)
    m1, c1 = _misses(host)
    causes = {k: v - c0.get(k, 0) for k, v in c1.items() if v - c0.get(k, 0)}
    return summarize(label, samples, misses=m1 - m0, causes=causes,
                     load_before=round(load[0], 2), load_after=round(os.getloadavg()[0], 2))


def sequential(n: int, opts: dict, label: str, host: ray.actor.ActorHandle,
               ended: list[str] | None = None, terminates: list[float] | None = None) -> dict:
    """``n`` creates one after another; the ids and terminate() times go to ``ended`` and
    ``terminates`` if given."""
    samples, hits0 = [], _hits(host)
    for _ in range(n):
        ms, sb = _create_exec(opts)
        samples.append(ms)
        t0 = time.perf_counter()
        ray.get(sb.terminate.remote())
        if terminates is not None:
            terminates.append((time.perf_counter() - t0) * 1000)
        if ended is not None:
            ended.append(sb.sandbox_id)
        time.sleep(PAUSE_S)
    return summarize(label, samples, stock_hits=_hits(host) - hits0)


def concurrent(n: int, callers: int, opts: dict, label: str,
               host: ray.actor.ActorHandle) -> dict:
    """Rounds of ``callers`` creates at once, each round once the stock holds that many
    again (a burst; two cores boot ~9 sandboxes/s, so no stock keeps up with 8 callers that
    create back to back — the sequential row shows a steady caller)."""
    hits0 = _hits(host)

    def one(_: int) -> float:
        ms, sb = _create_exec(opts)
        ray.get(sb.terminate.remote())
        time.sleep(PAUSE_S)
        return ms

    samples: list[float] = []
    stocked_at_start: list[int] = []
    with ThreadPoolExecutor(callers) as ex:
        while len(samples) < n:
            deadline = time.monotonic() + REFILL_WAIT_S
            while (ray.get(host.stock.remote())["stocked"] < callers
                   and time.monotonic() < deadline):
                time.sleep(0.1)
            stocked_at_start.append(ray.get(host.stock.remote())["stocked"])
            samples += ex.map(one, range(min(callers, n - len(samples))))
    return summarize(label, samples, callers=callers, stock_hits=_hits(host) - hits0,
                     stocked_per_round=stocked_at_start)


def neighbour(n: int, host: ray.actor.ActorHandle) -> list[dict]:
    """A neighbour's exec latency while the stock is full and quiet, then while it refills
    (``k`` hand-outs in a row empty part of it; the refills boot while the neighbour runs)."""
    nb = sandbox.create(**{**OPTS, "memory": "128Mi"})  # room for gVisor's ~100 KB per exec
    ray.get(nb.exec.remote(["/bin/true"]))

    def execs(until) -> list[float]:
        out: list[float] = []
        while not until(out):
            t0 = time.perf_counter()
            ray.get(nb.exec.remote(["/bin/true"]))
            out.append((time.perf_counter() - t0) * 1000)
        return out

    def full() -> bool:
        return ray.get(host.stock.remote())["stocked"] >= ray.get(host.stock.remote())["target"]

    deadline = time.monotonic() + REFILL_WAIT_S
    while not full() and time.monotonic() < deadline:
        time.sleep(0.1)
    quiet = execs(lambda out: len(out) >= n)
    k = min(4, ray.get(host.stock.remote())["stocked"])
    taken = [sandbox.create(**OPTS) for _ in range(k)]
    deadline = time.monotonic() + REFILL_WAIT_S
    refilling = execs(lambda out: len(out) >= 5 and (full() or time.monotonic() > deadline))
    ray.get([sb.terminate.remote() for sb in [*taken, nb]])
    return [summarize("neighbour exec, stock full and quiet", quiet),
            summarize(f"neighbour exec while the stock refills {k}", refilling, refills=k)]


def bare(n: int, tmp: Path) -> dict:
    with SandboxRuntime(tmp / "bare-home", images=ImageStore()) as rt:
        ref = rt.create(image=OPTS["image"], memory=OPTS["memory"], cpu=OPTS["cpu"])
        bundle = _baseline_bundle(rt, ref, tmp / "bundle")
        samples = []
        for _ in range(n):
            bid = os.urandom(16).hex()
            logs = tmp / "logs" / bid
            logs.mkdir(parents=True)
            t0 = time.perf_counter()
            rt.runsc.run_detached(bid, bundle, BARE_RUNSC, log_dir=logs)
            rt.runsc.exec(bid, ["/bin/true"], timeout=30)
            samples.append((time.perf_counter() - t0) * 1000)
            rt.runsc.delete(bid)
            shutil.rmtree(logs)
            time.sleep(PAUSE_S)
        rt.delete(ref)
    return summarize("bare runsc run → runsc exec (baseline)", samples)


def _left_of(home: Path, ids: list[str]) -> int:
    """How many processes, cgroups, mounts, files of these sandboxes are left (the stock's
    live sandboxes share the home, so only what names one of the ids counts)."""
    left = leftovers(home, set(ids))
    return sum(1 for items in left.values() for item in items
               if any(sid in item for sid in ids))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--n", type=int, default=None, help="the older rows' creates (100)")
    ap.add_argument("--steady", type=int, default=200, help="warm-node creates per row")
    ap.add_argument("--only-steady", action="store_true", help="only the warm-node rows")
    args = ap.parse_args()
    n = args.n or (20 if args.quick else 100)
    load = os.getloadavg()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="rsb-bench-stock-") as d:
        tmp = Path(d)
        os.environ["RAY_SANDBOX_HOME"] = str(tmp / "home")
        os.environ["RAY_SANDBOX_STOCK_MAX"] = STOCK_MAX
        ray.init(address="local", num_cpus=32, include_dashboard=False, log_to_driver=False)
        try:
            warm = sandbox.create(**OPTS)  # host up, image pinned; the first miss
            ray.get(warm.terminate.remote())
            time.sleep(2)
            host = warm._host
            for _ in range(WARMUP):  # the node warms up to the rows' demand
                ray.get(_create_exec(OPTS)[1].terminate.remote())
                time.sleep(PAUSE_S)
            rows.append(steady(args.steady, f"warm node, sequential ({args.steady})", host,
                               None))
            rows.append(steady(args.steady, f"warm node, paced 5/s ({args.steady})", host,
                               PACED_S))
            if args.only_steady:
                return emit_rows(rows, load)
            ended: list[str] = []
            terminates: list[float] = []
            rows.append(sequential(n, OPTS, f"create()→first exec, stock ({n} sequential)",
                                   host, ended, terminates))
            time.sleep(2)  # the bound: nothing of a terminated sandbox 2 s later
            rows.append(summarize("terminate() through Ray (sequential)", terminates,
                                  leftovers_2s_after_last=_left_of(tmp / "home", ended)))
            rows.append(concurrent(n, 8, OPTS, f"create()→first exec, stock, bursts of 8 ({n})",
                                   host))
            rows += neighbour(n, host)
            fresh = {**OPTS, "spec_transform": _identity}
            rows.append(sequential(n, fresh, "create()→first exec, fresh boot (baseline)",
                                   host))
        finally:
            sandbox.shutdown()
            ray.shutdown()
        rows.append(bare(n, tmp))
    emit_rows(rows, load)


def emit_rows(rows: list[dict], load: tuple[float, float, float]) -> None:
    emit("stock", rows, notes=f"2-core VM, load average before {load[0]:.1f}, after "
         f"{os.getloadavg()[0]:.1f}; Ray node advertises 32 logical CPUs (stock share 0.25 = "
         f"8 of cpu=1); busybox, 48Mi; sandboxes terminated outside the timed part.")


if __name__ == "__main__":
    main()
