"""What a filesystem image (``snapshot_filesystem``) costs, beside its baselines in the same run.

    .venv/bin/python -m benchmarks.bench_fs_image [--n 5]

One node, a private home (the node's image cache), the Python image. The source sandbox gets
``pip install``-sized changes: installed package trees copied from this checkout's venv into
its site-packages (what ``pip install pydantic pygments aiohttp rich`` leaves: ~21 MB, ~700
files), a line appended to an existing file of the image and one of its files deleted. Rows:
- ``snapshot_filesystem`` (what changed since boot, as a layer on the source image), beside
  the whole-root copy it replaced (``fs_image.capture`` then the store's skopeo + umoci
  ingest: the path images that cannot be layered on still take), same sandbox, same run;
- create → ready from the filesystem image, beside create → ready from its source image.
Each image made is deleted again.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tarfile
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
import multidict
import pydantic
import pydantic_core
import pygments
import rich
import yarl

from benchmarks._harness import emit, summarize
from ray_sandbox.runtime import ImageStore, SandboxRuntime, fs_image
from ray_sandbox.runtime.paths import images

IMAGE = "ray-sandbox/python"
PACKAGES = (pydantic, pydantic_core, pygments, aiohttp, multidict, yarl, rich)
OPTS = {"memory": "512Mi", "readonly": False}


def _ms(fn, *args, **kw) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn(*args, **kw)
    return (time.perf_counter() - t0) * 1000, out


def _install(rt: SandboxRuntime, sid: str, tmp: Path) -> tuple[int, int]:
    """Copy the packages (and their dist-info) into the sandbox's site-packages, as pip
    would leave them; (files, bytes)."""
    where = rt.exec(sid, ["python3", "-c", "import os, site; print(site.getsitepackages()[0]); "
                                         "print(os.path.dirname(os.__file__))"])
    dest, stdlib = where.stdout.split()
    tar_path = tmp / "packages.tar"
    files = size = 0
    with tarfile.open(tar_path, "w") as tar:
        for module in PACKAGES:
            top = Path(module.__file__).parent
            dist = list(top.parent.glob(f"{top.name.replace('_', '[_-]')}-*.dist-info"))
            for path in [top, *dist]:
                tar.add(path, arcname=path.name,
                        filter=lambda ti: None if "__pycache__" in ti.name else ti)
        for member in tar.getmembers():
            files += member.isfile()
            size += member.size
    with open(tar_path, "rb") as f:
        rt.put_archive(sid, dest, f)
    done = rt.exec(sid, f"echo '# installed' >> {stdlib}/os.py && rm {stdlib}/this.py")
    assert done.exit_code == 0, done.stderr
    return files, size


def _whole_root(rt: SandboxRuntime, sid: str) -> str:
    """The whole-root copy: what ``snapshot_filesystem`` did before, and still does where no
    layer can be added (the store unpacks it with umoci)."""
    base = rt.images.inspect(rt.records.get(sid).image_digest)
    dest = fs_image.layout("local", uuid.uuid4().hex, rt.home)
    dest.parent.mkdir(parents=True, exist_ok=True)
    ref = fs_image.capture(rt._client(sid), sid, base.config, dest,
                           max_bytes=fs_image.MAX_BYTES)
    return rt.images.get(ref).ref


def run(n: int) -> list[dict]:
    home = Path(tempfile.mkdtemp(prefix="bench-fs-image-"))
    rt = SandboxRuntime(home, images=ImageStore(images()))
    rows: list[dict] = []
    samples: dict[str, list[float]] = {
        "snapshot_filesystem (what changed)": [],
        "whole-root copy + umoci unpack (baseline: before)": [],
        "create→ready from the source image (baseline)": [],
        "create→ready from the filesystem image": []}
    try:
        src = rt.create(image=IMAGE, **OPTS)
        files, size = _install(rt, src, home)
        layer_mib = 0.0
        for _ in range(n):
            ms, diff = _ms(rt.snapshot_filesystem, src)
            samples["snapshot_filesystem (what changed)"].append(ms)
            layer_mib = _layer_mib(diff.ref)
            ms, whole = _ms(_whole_root, rt, src)
            samples["whole-root copy + umoci unpack (baseline: before)"].append(ms)
            rt.delete_filesystem_image(whole)
            for label, ref in (("create→ready from the source image (baseline)", IMAGE),
                               ("create→ready from the filesystem image", diff.ref)):
                ms, sid = _ms(rt.create, image=ref, **OPTS)
                samples[label].append(ms)
                rt.delete(sid, wait=True)
            rt.delete_filesystem_image(diff.ref)
        rt.delete(src, wait=True)
        extra = {"snapshot_filesystem (what changed)": {
            "changed_files": files, "changed_MiB": round(size / 2**20, 1),
            "layer_MiB": layer_mib}}
        for label, s in samples.items():
            rows.append(summarize(label, s, **extra.get(label, {})))
        return rows
    finally:
        rt.close()
        rt.gc()
        shutil.rmtree(home, ignore_errors=True)


def _layer_mib(ref: str) -> float:
    """The size of the layout's last layer (the changes)."""
    import json

    layout = Path(ref.removeprefix("oci:").rsplit(":", 1)[0])
    index = json.loads((layout / "index.json").read_text())
    blobs = layout / "blobs" / "sha256"
    manifest = json.loads((blobs / index["manifests"][0]["digest"][7:]).read_text())
    return round(manifest["layers"][-1]["size"] / 2**20, 1)


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
