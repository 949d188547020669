"""Suspend and resume speed (issue 36), each beside its baselines in the same run.

    .venv/bin/python -m benchmarks.bench_suspend [--n 20] [--no-python] [--no-ray]
        [--breakdown 5] [--density 2000 --awake 100 --seconds 120 [--density-only]]

One node, runtime (no Ray), for an idle busybox sandbox and (unless ``--no-python``) a
Debian+python sandbox whose Python process has imported numpy:
- suspend: ``runtime.suspensions.suspend`` until it returns (the Ray host runs it on its own
  threads: no caller waits on it); checkpoint size on disk;
- resume -> first exec: ``exec("true")`` of the suspended sandbox until it returns (the
  runtime resumes it first), with its steps (network, runsc restore, CPU share, agent ready,
  bookkeeping) and the first exec itself;
- baselines: bare ``runsc restore`` of the same checkpoint (same bundle, id and flags, the
  same page-cache state: run right before ours, then its container removed again), and a
  fresh ``create()`` -> first exec of the same config;
- python only: the same resume with the checkpoint's pages evicted from the page cache first
  (``posix_fadvise(DONTNEED)`` on our own files; a cold disk read), and a checkpoint taken
  with ``--exclude-committed-zero-pages`` (its size and bare restore).
With Ray (one-node local cluster, stock off): resume -> first exec through a handle's actor
call and through ``run()`` (the node-local channel), suspend through the handle, and
``ray_sandbox.create()`` -> first exec.
``--breakdown K``: K bare restores with runsc's debug log, split into its phases.
``--density N --awake M``: N sandboxes on the node, at most M awake (the least recently used
suspended, ``idle_suspend_seconds`` would do the same over time), a driver execing into random
ones for ``--seconds``; every exec's output checked; wakeups/s, memory and disk per suspended
sandbox (MemAvailable delta; checkpoint sizes).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks._harness import emit, summarize
from ray_sandbox.runtime import ImageStore, SandboxRuntime, checkpoint, network
from ray_sandbox.runtime.paths import images

BUSYBOX = {"image": "ray-sandbox/busybox", "cpu": 1.0, "memory": "128Mi", "readonly": False}
PYTHON = {"image": "ray-sandbox/python", "cpu": 1.0, "memory": "512Mi", "readonly": False}
NUMPY_HOLDER = ("setsid python3 -c 'import numpy, time; open(\"/tmp/np\", \"w\").write("
                "numpy.__version__); time.sleep(10**9)' >/dev/null 2>&1 &")


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# --- the runtime ----------------------------------------------------------------------------


def _bare_restore(rt: SandboxRuntime, sid: str, *, debug_dir: Path | None = None) -> float:
    """``runsc restore`` of the suspended sandbox's checkpoint as it is (same bundle, id,
    flags, netns), timed until the command returns; its container is then removed, so the
    sandbox is suspended as before."""
    rec = rt.record(sid)
    sdir = rt.records.sdir(sid)
    state = rt.suspensions.state(sid)
    assert state is not None
    prefix = network.reattach(sid, sdir.path)
    argv = rt.runsc._argv("restore", f"--image-path={state.image}", f"--bundle={sdir.bundle}",
                          "--detach", sid, flags=rec.runsc_flags)
    if debug_dir is not None:
        argv[1:1] = ["--debug", f"--debug-log={debug_dir}/"]
    with open(sdir.path / "runsc.out", "ab") as out, open(sdir.path / "runsc.err", "ab") as err:
        t0 = time.perf_counter()
        subprocess.run([*prefix, *argv], stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                       check=True, timeout=120)
        took = _ms(t0)
    rt.runsc.kill_sandbox(sid)
    rt.runsc.delete(sid)
    (sdir.run / "agent.sock").unlink(missing_ok=True)  # the agent may have bound it again
    return took


def _evict(path: Path) -> None:
    """Drop our checkpoint's pages from the page cache (nothing else's)."""
    for f in path.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def runtime_rows(rt: SandboxRuntime, what: str, config: dict[str, Any], n: int,
                 prepare: Any = None, cold: bool = False) -> list[dict]:
    sid = rt.create(**config)
    try:
        if prepare is not None:
            prepare(rt, sid)
        rt.exec(sid, "true")
        suspend, resume, bare, sizes, cold_resume = [], [], [], [], []
        steps: dict[str, list[float]] = {}
        for i in range(n + 1):  # the first round warms up
            t0 = time.perf_counter()
            state = rt.suspensions.suspend(sid)
            s = _ms(t0)
            b = _bare_restore(rt, sid)
            if cold and i % 2 == 1:
                _evict(Path(state.image))
            t0 = time.perf_counter()
            rt.exec(sid, "true")
            r = _ms(t0)
            if i == 0:
                continue
            suspend.append(s)
            bare.append(b)
            sizes.append(state.size_bytes)
            (cold_resume if cold and i % 2 == 1 else resume).append(r)
            for k, v in rt.suspensions.timings.items():
                steps.setdefault(k, []).append(v * 1000)
        creates = []
        for _ in range(max(3, n // 2)):
            t0 = time.perf_counter()
            other = rt.create(**config)
            rt.exec(other, "true")
            creates.append(_ms(t0))
            rt.delete(other)
        mib = statistics.median(sizes) / 2**20
        rows = [summarize(f"{what}: suspend (nobody waits on it)", suspend,
                          checkpoint_mib=round(mib, 2)),
                summarize(f"{what}: resume -> first exec", resume),
                summarize(f"{what}: baseline bare runsc restore, same checkpoint", bare),
                summarize(f"{what}: baseline create() -> first exec", creates)]
        if cold_resume:
            rows.insert(2, summarize(f"{what}: resume -> first exec, pages evicted (cold)",
                                     cold_resume))
        steps_p50 = {k: round(statistics.median(v), 1) for k, v in steps.items()}
        rows.append({"label": f"{what}: resume steps p50 (ms)", "n": len(resume), **steps_p50})
        return rows
    finally:
        rt.delete(sid)


def zero_pages_rows(rt: SandboxRuntime, what: str, config: dict[str, Any], n: int,
                    prepare: Any) -> list[dict]:
    """Checkpoint size and bare restore (in place, as a resume does it) with runsc
    0.0~20240729's ``--exclude-committed-zero-pages``, beside the same without it."""
    sid = rt.create(**config)
    out = []
    try:
        prepare(rt, sid)
        rec = rt.record(sid)
        sdir = rt.records.sdir(sid)
        img = sdir.path / "bench-ckpt"
        flags = ((), ("--exclude-committed-zero-pages",))
        sizes: dict[tuple[str, ...], list[int]] = {f: [] for f in flags}
        saves: dict[tuple[str, ...], list[float]] = {f: [] for f in flags}
        restores: dict[tuple[str, ...], list[float]] = {f: [] for f in flags}
        for _ in range(n):
            for flag in flags:  # interleaved: both see the same load and page cache
                shutil.rmtree(img, ignore_errors=True)
                img.mkdir()
                with checkpoint.held(rt._client(sid), sdir, 30, lambda: None, stops=True):
                    argv = rt.runsc._argv("checkpoint", f"--image-path={img}",
                                          "--leave-running", "--compression=none", *flag, sid,
                                          flags=rec.runsc_flags)
                    t0 = time.perf_counter()
                    subprocess.run(argv, check=True, capture_output=True, timeout=120)
                    saves[flag].append(_ms(t0))
                    rt.runsc.kill_sandbox(sid)
                rt._connections.close(sid)
                rt.runsc.delete(sid)
                (sdir.run / "agent.sock").unlink(missing_ok=True)
                sizes[flag].append(sum(f.stat().st_blocks * 512 for f in img.iterdir()))
                t0 = time.perf_counter()
                rt.runsc.restore_detached(sid, sdir.bundle, img, rec.runsc_flags,
                                          log_dir=sdir.path)
                restores[flag].append(_ms(t0))
                rt._launcher._wait_ready(sid, sdir)
                rt.exec(sid, "true")
        for flag in flags:
            label = " ".join(flag) or "default"
            mib = round(statistics.median(sizes[flag]) / 2**20, 2)
            out.append(summarize(f"{what}: checkpoint ({label})", saves[flag],
                                 checkpoint_mib=mib))
            out.append(summarize(f"{what}: bare restore of it ({label})", restores[flag]))
        shutil.rmtree(img, ignore_errors=True)
    finally:
        rt.delete(sid)
    return out


def numpy_image(rt: SandboxRuntime) -> str:
    """``ray-sandbox/python`` with the driver's numpy installed, as a filesystem image (so
    numpy's files are the image's, read through the gofer, not writes held in the sandbox's
    memory-backed overlay)."""
    import numpy

    sid = rt.create(**PYTHON)
    try:
        site = Path(numpy.__file__).parent.parent
        dest = "/usr/local/lib/python3.11/dist-packages"
        rt.exec(sid, f"mkdir -p {dest}")
        for name in ("numpy", "numpy.libs"):
            rt.upload_dir(sid, site / name, f"{dest}/{name}")
        return rt.snapshot_filesystem(sid).ref
    finally:
        rt.delete(sid)


def _with_numpy(rt: SandboxRuntime, sid: str) -> None:
    rt.exec(sid, NUMPY_HOLDER)
    deadline = time.monotonic() + 120
    while not rt.exec(sid, "cat /tmp/np 2>/dev/null").stdout:
        assert time.monotonic() < deadline, "numpy did not import"
        time.sleep(0.2)


# --- runsc's own phases ---------------------------------------------------------------------

_LINE = re.compile(r"^[IWDE]\d{4} (\d\d):(\d\d):(\d\d\.\d+)\s+\d+\s+\S+\] (.*)$")
_MARKS = [  # (phase ends at the first line matching, in the restore/boot/gofer logs)
    ("runsc starts, loads the spec", r"Creating new sandbox for container"),
    ("cgroups made, gofer started", r"Gofer started"),
    ("sandbox process started", r"Sandbox started, PID"),
    ("sentry boots (two re-execs)", r"Restore: "),
    ("kernel state loaded", r"Kernel load took"),
    ("mounts, memory ready", r"Overall load took"),
    ("tasks restarted", r"Restore successful"),
    ("runsc exits", r"Exiting with status"),
]


def _phases(debug_dir: Path) -> dict[str, float]:
    lines: list[tuple[float, str]] = []
    for f in debug_dir.glob("runsc.log.*"):
        for line in f.read_text(errors="replace").splitlines():
            if m := _LINE.match(line):
                h, mi, sec, msg = m.groups()
                lines.append((int(h) * 3600 + int(mi) * 60 + float(sec), msg))
    lines.sort()
    if not lines:
        return {}
    start, prev, out = lines[0][0], lines[0][0], {}
    for name, pattern in _MARKS:
        hit = next((t for t, msg in lines if t >= prev and re.search(pattern, msg)), None)
        if hit is None:
            continue
        out[name] = (hit - prev) * 1000
        prev = hit
    out["total"] = (prev - start) * 1000
    extra = {"memory files load": r"Memory files load took \[([\d.]+)(µs|ms|s)\]",
             "kernel load": r"Kernel load took \[([\d.]+)(µs|ms|s)\]"}
    for name, pattern in extra.items():
        for _, msg in lines:
            if m := re.search(pattern, msg):
                scale = {"µs": 0.001, "ms": 1.0, "s": 1000.0}[m.group(2)]
                out[f"({name}, runsc's own count)"] = float(m.group(1)) * scale
                break
    return out


def breakdown_rows(rt: SandboxRuntime, k: int) -> list[dict]:
    sid = rt.create(**BUSYBOX)
    phases: dict[str, list[float]] = {}
    try:
        rt.exec(sid, "true")
        rt.suspensions.suspend(sid)
        for _ in range(k):
            d = Path(tempfile.mkdtemp(prefix="rsb-bench-debug-"))
            try:
                _bare_restore(rt, sid, debug_dir=d)
                for name, ms in _phases(d).items():
                    phases.setdefault(name, []).append(ms)
            finally:
                shutil.rmtree(d, ignore_errors=True)
    finally:
        rt.delete(sid)
    return [{"label": f"runsc restore (--debug): {name}", "n": len(v),
             "p50_ms": round(statistics.median(v), 1)} for name, v in phases.items()]


# --- Ray ------------------------------------------------------------------------------------


def ray_rows(n: int, home: Path) -> list[dict]:
    import ray

    import ray_sandbox

    os.environ["RAY_SANDBOX_HOME"] = str(home / "ray")
    os.environ["RAY_SANDBOX_STOCK_MAX"] = "0"  # a create is a boot: what it is compared with
    os.environ.setdefault("RAY_SANDBOX_IMAGES", str(images()))
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        opts = {**BUSYBOX, "cpu": 0.5}
        sb = ray_sandbox.create(**opts)
        sb.run("true")
        suspend, via_call, via_run = [], [], []
        for i in range(2 * n + 1):
            t0 = time.perf_counter()
            ray.get(sb.suspend.remote())
            s = _ms(t0)
            t0 = time.perf_counter()
            if i % 2:
                sb.run("true")
            else:
                ray.get(sb.exec.remote("true"))
            r = _ms(t0)
            if i == 0:
                continue
            suspend.append(s)
            (via_run if i % 2 else via_call).append(r)
        ray.get(sb.terminate.remote())
        creates = []
        for _ in range(max(3, n // 2)):
            t0 = time.perf_counter()
            other = ray_sandbox.create(**opts)
            other.run("true")
            creates.append(_ms(t0))
            ray.get(other.terminate.remote())
        return [summarize("ray: suspend through the handle", suspend),
                summarize("ray: resume -> first exec, exec.remote (actor call)", via_call),
                summarize("ray: resume -> first exec, run() (node-local channel)", via_run),
                summarize("ray: baseline create() -> first exec (stock off)", creates)]
    finally:
        ray_sandbox.shutdown()
        ray.shutdown()


# --- density --------------------------------------------------------------------------------


def _meminfo() -> dict[str, int]:
    """The node's /proc/meminfo (bytes) and this process's RSS."""
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, _, v = line.partition(":")
        out[k] = int(v.split()[0]) * 1024
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            out["driver_rss"] = int(line.split()[1]) * 1024
    return out


def density_rows(rt: SandboxRuntime, n: int, awake: int, seconds: float) -> list[dict]:
    config = {"image": "ray-sandbox/busybox", "cpu": 0.1, "memory": "64Mi"}
    before = _meminfo()
    ids: list[str] = []
    lru: OrderedDict[str, None] = OrderedDict()
    lock = threading.Lock()
    errors: list[str] = []
    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            def make(_: int) -> str:
                sid = rt.create(**config)
                rt.suspensions.suspend(sid)
                return sid

            ids = list(pool.map(make, range(n)))
        settled = _meminfo()
        sizes = [s.size_bytes for sid in ids if (s := rt.suspensions.state(sid))]
        wakes = execs = 0
        lat: list[float] = []
        stop = time.monotonic() + seconds
        sleeper = ThreadPoolExecutor(max_workers=2)

        def one(k: int) -> None:
            nonlocal wakes, execs
            sid = random.choice(ids)
            with lock:
                asleep = sid not in lru
                lru[sid] = None
                lru.move_to_end(sid)
                victims = []
                while len(lru) > awake:
                    victims.append(lru.popitem(last=False)[0])
            t0 = time.perf_counter()
            try:
                out = rt.exec(sid, f"echo {k}").stdout
            except Exception as exc:  # noqa: BLE001 - counted, reported
                errors.append(f"{sid[:8]}: {exc}")
                return
            ms = _ms(t0)
            with lock:
                execs += 1
                if asleep:
                    wakes += 1
                    lat.append(ms)
                if out != f"{k}\n":
                    errors.append(f"{sid[:8]}: {out!r} for {k}")
            for v in victims:
                sleeper.submit(_suspend_quietly, rt, v)

        k = 0
        t_start = time.monotonic()
        with ThreadPoolExecutor(max_workers=4) as drivers:
            while time.monotonic() < stop:
                list(drivers.map(one, range(k, k + 8)))
                k += 8
        took = time.monotonic() - t_start
        sleeper.shutdown(wait=True)
        def per(key: str, sign: int = 1) -> float:  # KiB per suspended sandbox
            return round(sign * (settled[key] - before[key]) / max(1, n) / 1024, 1)

        return [summarize(f"density {n}, <= {awake} awake: resume -> exec of a sleeping one",
                          lat or [0.0], wakeups_per_s=round(wakes / took, 2),
                          execs_per_s=round(execs / took, 2), errors=len(errors)),
                {"label": f"density {n}: per suspended sandbox", "n": n,
                 "mem_available_kib": per("MemAvailable", -1), "shmem_kib": per("Shmem"),
                 "slab_kib": per("Slab"), "driver_rss_kib": per("driver_rss"),
                 "disk_kib": round(statistics.median(sizes) / 1024, 1) if sizes else None,
                 "first_error": errors[0] if errors else ""}]
    finally:
        for sid in ids:
            try:
                rt.delete(sid)
            except Exception:  # noqa: BLE001 - gc gets the rest
                pass


def _suspend_quietly(rt: SandboxRuntime, sid: str) -> None:
    try:
        rt.suspensions.suspend(sid, drain_timeout=5.0)
    except Exception:  # noqa: BLE001 - a busy one stays awake; the driver goes on
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--no-python", action="store_true")
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument("--breakdown", type=int, default=0)
    ap.add_argument("--density", type=int, default=0)
    ap.add_argument("--awake", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--density-only", action="store_true",
                    help="only the density run (with --density)")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="rsb-bench-suspend-"))
    rows: list[dict] = []
    loads = [loadavg()]
    rt = SandboxRuntime(home / "rt", images=ImageStore(images()))
    latency = not args.density_only
    try:
        if latency:
            rows += runtime_rows(rt, "busybox", BUSYBOX, args.n)
            loads.append(loadavg())
        if latency and not args.no_python:
            ref = numpy_image(rt)
            try:
                py = {**PYTHON, "image": ref}
                rows += runtime_rows(rt, "python+numpy", py, args.n, _with_numpy, cold=True)
                rows += zero_pages_rows(rt, "python+numpy", py, max(3, args.n // 4),
                                        _with_numpy)
            finally:
                rt.delete_filesystem_image(ref)
            loads.append(loadavg())
        if latency and args.breakdown:
            rows += breakdown_rows(rt, args.breakdown)
        if args.density:
            rows += density_rows(rt, args.density, args.awake, args.seconds)
            loads.append(loadavg())
    finally:
        rt.close()
    if latency and not args.no_ray:
        rows += ray_rows(args.n, home)
        loads.append(loadavg())
    shutil.rmtree(home, ignore_errors=True)
    name = "bench_suspend_density" if args.density_only else "bench_suspend"
    emit(name, rows, notes="load averages (1/5/15 min) during the run: " + " -> ".join(loads))


if __name__ == "__main__":
    main()
