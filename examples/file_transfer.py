"""Moving files between the caller and a sandbox through Ray: a project bundle goes in, is
unpacked and built inside, and the build output comes back — byte for byte, wherever Ray put
the sandbox (the bytes travel through the object store in 4 MiB pieces).

    .venv/bin/python examples/file_transfer.py [--workdir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import tarfile
import tempfile
from pathlib import Path

import ray

import ray_sandbox as sandbox

TRAIN = """\
import json, pathlib, random
random.seed(0)
out = pathlib.Path("/app/out"); out.mkdir(exist_ok=True)
weights = bytes(random.randrange(256) for _ in range(1 << 20))
(out / "weights.bin").write_bytes(weights)
(out / "metrics.json").write_text(json.dumps({"loss": 0.125, "steps": 100}))
print("Training complete")
"""


def main() -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", help="where to build the bundle and receive results")
    args = p.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="rsb-files-"))
    src = work / "project"
    src.mkdir(parents=True, exist_ok=True)
    (src / "train.py").write_text(TRAIN)
    (src / "data.bin").write_bytes(bytes(range(256)) * 40_000)  # ~10 MB: several chunks
    bundle = work / "bundle.tar.gz"
    with tarfile.open(bundle, "w:gz") as tar:
        tar.add(src, arcname=".")

    ray.init(log_to_driver=False)
    sb = sandbox.create(image="ray-sandbox/python", cpu=1, memory="512Mi")
    try:
        ray.get(sb.upload_file.remote(str(bundle), "/tmp/bundle.tar.gz"))
        ray.get(sb.exec.remote("mkdir -p /app && tar -xzf /tmp/bundle.tar.gz -C /app"))
        run = ray.get(sb.exec.remote(["python3", "/app/train.py"], timeout=60))
        print(run.stdout, end="")
        ray.get(sb.download_dir.remote("/app/out", str(work / "out")))
        ray.get(sb.download_file.remote("/app/data.bin", str(work / "data.back")))
    finally:
        ray.get(sb.terminate.remote())
        ray.shutdown()
    same = (work / "data.back").read_bytes() == (src / "data.bin").read_bytes()
    result = {
        "exit_code": run.exit_code,
        "round_trip_identical": same,
        "outputs": sorted(p.name for p in (work / "out").iterdir()),
        "weights_sha256": hashlib.sha256((work / "out" / "weights.bin").read_bytes()).hexdigest(),
    }
    print(result)
    return result


if __name__ == "__main__":
    main()
