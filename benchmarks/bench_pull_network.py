"""Isolated pulls (``pull_network="public"``) against pulls on the node's network: the same
images from the same registry in the same run, alternated, each into a fresh store (resolve,
copy, verify, unpack, publish); the namespace alone (made and removed, nothing run in it); and
re-resolving an unchanged tag, the cheapest fetch there is.

The registry is Debian's ``docker-registry`` in a namespace of the benchmark's own, on a veth
at 198.18.92.2 (an address the ``public`` tiers let through; a loopback registry is what an
isolated pull can never reach).

Run: ``cd /work/main && .venv/bin/python -m benchmarks.bench_pull_network [--n 10]``
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from benchmarks._harness import emit, measure
from benchmarks.bench_images import interleaved
from ray_sandbox.runtime import _proc
from ray_sandbox.runtime.image_builders import export_layout, write_busybox_layout
from ray_sandbox.runtime.images import ImageStore, PullPolicy
from ray_sandbox.runtime.network import ip, pull
from ray_sandbox.runtime.network import netns as _netns

NS, NODE_END, FAR_END = "rsbb-pull", "rsbb-p0", "rsbb-p1"
NODE_SIDE, REGISTRY = "198.18.92.1", "198.18.92.2"


@contextmanager
def registry(root: Path) -> Iterator[str]:
    """docker-registry on REGISTRY:5000 in netns NS, reached from the node through a veth."""
    ip.link_delete(None, NODE_END)
    ip.netns_delete(NS)
    ip.netns_add(NS)
    proc = None
    try:
        ip.batch(None, [f"link add {NODE_END} type veth peer name {FAR_END} netns {NS}",
                        f"addr add {NODE_SIDE}/30 dev {NODE_END}", f"link set {NODE_END} up"])
        ip.batch(NS, ["link set lo up", f"addr add {REGISTRY}/30 dev {FAR_END}",
                      f"link set {FAR_END} up"])
        root.mkdir(parents=True)
        addr = f"{REGISTRY}:5000"
        config = root / "config.yml"
        config.write_text(json.dumps({
            "version": 0.1, "log": {"level": "warn"}, "http": {"addr": addr},
            "storage": {"filesystem": {"rootdirectory": str(root / "data")}}}))
        with (root / "registry.log").open("ab") as log:
            proc = _proc.spawn([*_netns.enter(NS), "docker-registry", "serve", str(config)],
                               stdout=log, stderr=log)
        deadline = time.monotonic() + 15
        while _proc.run(["curl", "-sf", f"http://{addr}/v2/"], timeout=5,
                        check=False).returncode != 0:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"docker-registry did not start: {root / 'registry.log'}")
            time.sleep(0.1)
        yield addr
    finally:
        if proc is not None:
            _proc.kill_group(proc)
            proc.wait()
            _proc.forget(proc)
        ip.link_delete(None, NODE_END)
        ip.netns_delete(NS)


def bench_image(name: str, ref: str, addr: str, n: int, root: Path) -> list[dict]:
    def store(d: Path) -> ImageStore:
        return ImageStore(d, insecure_registries=[addr])

    cold = {f"{name} cold get, network node": lambda d: store(d).get(ref),
            f"{name} cold get, network public": lambda d: store(d).get(ref, network="public")}
    rows = interleaved(cold, root, n)
    warm = store(root / f"store-{name}")
    warm.get(ref)
    for network in ("node", "public"):
        rows.append(measure(f"{name} get(policy=always), tag unchanged, network {network}",
                            lambda network=network: warm.get(ref, policy=PullPolicy.ALWAYS,
                                                             network=network), 10))
    return rows


def bare() -> None:
    with pull.isolated(60):
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=10, help="cold pulls of busybox per network")
    parser.add_argument("--n-python", type=int, default=3)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="rsb-bench-pull-") as tmp:
        root = Path(tmp)
        write_busybox_layout(root / "busybox", "latest")
        python_image = ImageStore().get("ray-sandbox/python:latest")  # the node cache
        with registry(root / "registry") as addr:
            rows.append(measure("namespace alone: made and removed (pull.isolated)", bare, 20,
                                warmup=2))
            images = {"busybox": (root / "busybox", "latest", args.n),
                      "python": (python_image.rootfs.parent / "oci", "image", args.n_python)}
            for name, (layout, tag, n) in images.items():
                ref = f"{addr}/bench/{name}:v1"
                export_layout(layout, tag, f"docker://{ref}", tls_verify=False)
                rows += bench_image(name, ref, addr, n, root)
    emit("bench_pull_network", rows, notes=(
        "cold: fresh store per iteration, node and public alternated; public = the pull "
        "in a network namespace of its own (slirp4netns, the public tiers, a DNS helper); "
        "the namespace row makes and removes one with nothing run in it; always: one "
        "skopeo inspect of an unchanged tag."))


if __name__ == "__main__":
    main()
