"""What a volume costs: the mount at create, and reading a shared cache beside the sandbox's
own root, each with its baseline in the same run.

    .venv/bin/python -m benchmarks.bench_volumes [--n 10] [--size-mb 64]

One node, busybox, a private home (the node's image cache):
- create → ready without volumes (baseline), with a read-write volume (loop + mount + bind),
  and with a read-only volume another sandbox already has mounted (one bind), rotated;
- reading a ``size-mb`` file with ``cat > /dev/null`` inside one sandbox, from its writable
  root (baseline: runsc's overlay filestore) and from a read-only volume, alternated.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks._harness import emit, summarize
from ray_sandbox.runtime import ImageStore, SandboxRuntime
from ray_sandbox.runtime.paths import images

IMAGE = "ray-sandbox/busybox"


def _timed(fn, *args, **kw) -> tuple[float, object]:
    """(milliseconds, result) of one call."""
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return (time.perf_counter() - t0) * 1000, out


def run(n: int, size_mb: int = 64) -> list[dict]:
    home = Path(tempfile.mkdtemp(prefix="bench-volumes-"))
    rt = SandboxRuntime(home, images=ImageStore(images()))
    try:
        rt.volumes.create("bench-rw", "64Mi")
        rt.volumes.create("bench-cache", f"{size_mb + 64}Mi")
        holder = rt.create(image=IMAGE, memory="64Mi", volumes={"/c": "bench-cache"})
        fill = f"dd if=/dev/urandom of=/c/blob bs=1M count={size_mb} 2>/dev/null"
        assert rt.exec(holder, fill, timeout=300).ok
        rt.delete(holder, wait=True)
        holder = rt.create(image=IMAGE, memory="64Mi", volumes={"/c": "bench-cache:ro"})
        shapes = {
            "create→ready, no volume (baseline)": {},
            "create→ready, read-write volume (mount + bind)": {"/w": "bench-rw"},
            "create→ready, read-only volume already mounted (bind)": {"/c": "bench-cache:ro"},
        }
        creates: dict[str, list[float]] = {label: [] for label in shapes}
        for _ in range(n):
            for label, volumes in shapes.items():
                ms, sid = _timed(rt.create, image=IMAGE, memory="64Mi", volumes=volumes)
                creates[label].append(ms)
                rt.delete(sid, wait=True)
        rt.delete(holder, wait=True)

        reader = rt.create(image=IMAGE, memory="128Mi", readonly=False,
                           volumes={"/c": "bench-cache:ro"})
        assert rt.exec(reader, "cp /c/blob /blob", timeout=300).ok
        reads: dict[str, list[float]] = {"read, own root (baseline)": [],
                                         "read, read-only volume": []}
        for _ in range(n):
            for label, path in zip(reads, ("/blob", "/c/blob"), strict=True):
                ms, _ = _timed(rt.exec, reader, f"cat {path} > /dev/null", timeout=300)
                reads[label].append(ms)
        rt.delete(reader, wait=True)
        rows = [summarize(label, s) for label, s in creates.items()]
        rows += [summarize(label, s, MBps=round(size_mb * 1000 / sorted(s)[len(s) // 2], 1))
                 for label, s in reads.items()]
        for name in ("bench-rw", "bench-cache"):
            rt.volumes.delete(name)
        return rows
    finally:
        rt.close()
        rt.gc()
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--size-mb", type=int, default=64)
    args = ap.parse_args()
    load0 = os.getloadavg()
    rows = run(args.n, args.size_mb)
    emit("bench_volumes", rows, notes=f"load average (1/5/15 min) at start {load0}, "
                                      f"at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
