"""What a filesystem image (``snapshot_filesystem``) costs, beside its baselines in the same run.

    .venv/bin/python -m benchmarks.bench_fs_image [--n 5]

One node, a private home (the node's image cache), for busybox and the Python image:
- ``snapshot_filesystem`` of a sandbox that wrote one small file, beside ``snapshot``
  (memory, processes and files; the baseline for "keep this sandbox's state");
- create → ready from the filesystem image, beside create → ready from its source image.
Each image made is deleted again.
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

IMAGES = ("ray-sandbox/busybox", "ray-sandbox/python")


def _ms(fn, *args, **kw) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return (time.perf_counter() - t0) * 1000, out


def run(n: int) -> list[dict]:
    home = Path(tempfile.mkdtemp(prefix="bench-fs-image-"))
    rt = SandboxRuntime(home, images=ImageStore(images()))
    rows: list[dict] = []
    try:
        for image in IMAGES:
            opts = {"memory": "256Mi", "readonly": False}
            src = rt.create(image=image, **opts)
            assert rt.exec(src, "echo state > /root/state").ok
            samples: dict[str, list[float]] = {
                f"{image}: snapshot (baseline)": [], f"{image}: snapshot_filesystem": [],
                f"{image}: create→ready from the image (baseline)": [],
                f"{image}: create→ready from the filesystem image": []}
            sizes = []
            for _ in range(n):
                ms, snap = _ms(rt.snapshot, src)
                samples[f"{image}: snapshot (baseline)"].append(ms)
                rt.snapshots.delete(snap)
                ms, fs = _ms(rt.snapshot_filesystem, src)
                samples[f"{image}: snapshot_filesystem"].append(ms)
                sizes.append(fs.size_bytes)
                for label, ref in ((f"{image}: create→ready from the image (baseline)", image),
                                   (f"{image}: create→ready from the filesystem image",
                                    fs.ref)):
                    ms, sid = _ms(rt.create, image=ref, **opts)
                    samples[label].append(ms)
                    rt.delete(sid, wait=True)
                rt.delete_filesystem_image(fs.ref)
            rt.delete(src, wait=True)
            for label, s in samples.items():
                extra = {"image_MiB": round(sizes[0] / 2**20, 1)} if "snapshot_f" in label else {}
                rows.append(summarize(label, s, **extra))
        return rows
    finally:
        rt.close()
        rt.gc()
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=5)
    args = ap.parse_args()
    load0 = os.getloadavg()
    rows = run(args.n)
    emit("bench_fs_image", rows, notes=f"load average (1/5/15 min) at start {load0}, "
                                       f"at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
