"""Image store benchmarks: cold pull + unpack (busybox and the Debian+python image from a local
registry), re-resolving an unchanged tag, and the cached lookup every sandbox create does, each
next to the raw baseline of ``skopeo copy`` + ``umoci unpack`` per call.

Run: ``cd /work/main && .venv/bin/python -m benchmarks.bench_images``
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks._harness import emit, measure, summarize
from ray_sandbox.runtime.image_builders import export_layout, serve_registry, write_busybox_layout
from ray_sandbox.runtime.images import ImageStore, PullPolicy


def interleaved(fns: dict[str, Callable[[Path], object]], root: Path, n: int,
                **extra: object) -> list[dict]:
    """Time each ``fn(fresh_dir)`` n times, alternating between them so machine noise (page
    cache, writeback of the previous run's deletion) hits all alike; cleanup is not timed."""
    samples: dict[str, list[float]] = {label: [] for label in fns}
    for _ in range(n):
        for label, fn in fns.items():
            scratch = root / "run"
            t0 = time.perf_counter()
            fn(scratch)
            samples[label].append((time.perf_counter() - t0) * 1000)
            shutil.rmtree(scratch)
    return [summarize(label, s, **extra) for label, s in samples.items()]


def baseline(ref: str) -> Callable[[Path], object]:
    """What a caller without a store does on every create: copy, then unpack."""
    def run(scratch: Path) -> None:
        scratch.mkdir()
        subprocess.run(["skopeo", "copy", "--quiet", "--src-tls-verify=false", f"docker://{ref}",
                        f"oci:{scratch}/oci:image"], check=True)
        subprocess.run(["umoci", "unpack", "--image", f"{scratch}/oci:image",
                        str(scratch / "bundle")], check=True, capture_output=True)
    return run


def bench_image(name: str, ref: str, n: int, root: Path) -> list[dict]:
    store = ImageStore(root / f"store-{name}")
    size = round(store.get(ref).size_bytes / 2**20, 1)
    cold = {f"{name} cold pull+unpack (ImageStore.get)": lambda d: ImageStore(d).get(ref),
            f"{name} skopeo copy + umoci unpack (baseline)": baseline(ref)}
    return [
        *interleaved(cold, root, n, size_mib=size),
        measure(f"{name} cached ImageStore.get", lambda: store.get(ref), 2000, warmup=20),
        measure(f"{name} get(policy=always), tag unchanged",
                lambda: store.get(ref, policy=PullPolicy.ALWAYS), 10),
    ]


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory(prefix="rsb-bench-images-") as tmp:
        root = Path(tmp)
        write_busybox_layout(root / "busybox", "latest")
        python_image = ImageStore().get("ray-sandbox/python:latest")  # the node cache
        with serve_registry(root / "registry") as addr:
            images = {"busybox": (root / "busybox", "latest", 10),
                      "python": (python_image.rootfs.parent / "oci", "image", 5)}
            for name, (layout, tag, n) in images.items():
                ref = f"{addr}/bench/{name}:v1"
                export_layout(layout, tag, f"docker://{ref}", tls_verify=False)
                rows += bench_image(name, ref, n, root)
    emit("bench_images", rows, notes=(
        "cold: fresh store per iteration (resolve + copy + verify + unpack + publish); "
        "baseline: skopeo copy + umoci unpack into a fresh dir, what every create would cost "
        "without the store; cached: the lookup SandboxRuntime.create does (no subprocess); "
        "always: skopeo inspect of the tag, no copy when the digest is unchanged."))


if __name__ == "__main__":
    main()
