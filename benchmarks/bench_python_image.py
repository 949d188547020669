"""The offline Python images beside the one they replace, built and measured in one run:
size (unpacked rootfs, compressed layer), build time, create → first exec (boot), and the
interpreter's start inside.

    .venv/bin/python -m benchmarks.bench_python_image [--n 20 | --quick]

Baseline: the image ``ray-sandbox/python`` was before (Debian bookworm with python3, bash and
ca-certificates only; no ``python``, ``pip`` or ``venv``), built by the same builder from that
recipe. Ours: ``ray-sandbox/python:3.11`` (``latest``) and ``:3.13`` as the store builds
them. Every image is built fresh into a scratch store (nothing is taken from the node's), and
the boots alternate between the images, in a changing order, so machine noise hits all alike.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from benchmarks._harness import emit, summarize
from ray_sandbox.runtime import SandboxRuntime
from ray_sandbox.runtime.image_builders import PYTHON_IMAGES, DebianImage
from ray_sandbox.runtime.images import Image, ImageStore

BEFORE = DebianImage("bookworm", ("python3", "bash", "ca-certificates"), ("/usr/bin/python3",))
IMAGES = {"before (python3 only)": BEFORE, "3.11 (latest)": PYTHON_IMAGES["3.11"],
          "3.13": PYTHON_IMAGES["3.13"]}


def _disk_usage(root: Path) -> int:
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def _layer_bytes(image: Image) -> int:
    """The compressed size of the image's layers, as its manifest gives them."""
    blobs = image.rootfs.parent / "oci" / "blobs" / "sha256"
    manifest = json.loads((blobs / image.digest.split(":", 1)[1]).read_text())
    return sum(layer["size"] for layer in manifest["layers"])


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=20, help="boots per image")
    parser.add_argument("--quick", action="store_true", help="5 boots per image")
    args = parser.parse_args()
    args.n = 5 if args.quick else args.n
    load_before = loadavg()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="rsb-bench-pyimg-", dir="/var/tmp") as tmp:
        root = Path(tmp)
        store = ImageStore(root / "images")
        images: dict[str, Image] = {}
        for label, recipe in IMAGES.items():
            t0 = time.perf_counter()
            recipe.write_layout(root / "layouts", label.split()[0])
            built_s = time.perf_counter() - t0
            images[label] = store.get(f"oci:{root / 'layouts'}:{label.split()[0]}")
            rows.append({"label": f"{label}: size", "build_s": round(built_s, 1),
                         "rootfs_mib": round(_disk_usage(images[label].rootfs) / 2**20, 1),
                         "layer_gzip_mib": round(_layer_bytes(images[label]) / 2**20, 1)})
        rt = SandboxRuntime(root / "home", images=store)
        boots: dict[str, list[float]] = {label: [] for label in images}
        starts: dict[str, list[float]] = {label: [] for label in images}
        try:
            order = list(images)
            for i in range(args.n + 1):  # the first round warms caches, not counted
                for label in order[i % len(order):] + order[:i % len(order)]:
                    t0 = time.perf_counter()
                    sid = rt.create(image=images[label].ref, memory="256Mi", cpu=1)
                    res = rt.exec(sid, "true")
                    booted = time.perf_counter() - t0
                    t1 = time.perf_counter()
                    started = rt.exec(sid, ["python3", "-c", "pass"])
                    python_s = time.perf_counter() - t1
                    rt.delete(sid)
                    assert res.exit_code == 0 and started.exit_code == 0, (res, started)
                    if i:
                        boots[label].append(booted * 1000)
                        starts[label].append(python_s * 1000)
        finally:
            rt.close()
            store.prune(all_images=True)
        base = summarize("", boots["before (python3 only)"])["p50_ms"]
        for label in images:
            row = summarize(f"{label}: create -> first exec", boots[label])
            rows.append({**row, "vs_before": round(row["p50_ms"] / base, 3)})
        for label in images:
            rows.append(summarize(f"{label}: exec python3 -c pass", starts[label]))
    emit("bench_python_image", rows, notes=(
        f"SandboxRuntime, memory=256Mi cpu=1, network none, read-only root; {args.n} boots "
        f"per image, alternated; load average before {load_before}, after {loadavg()}. "
        "rootfs: disk usage of the unpacked root; layer: the gzip layer the builder wrote."))


if __name__ == "__main__":
    main()
