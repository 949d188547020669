"""Network modes side by side: attach latency, sandbox create latency, 64 MB download, and
what the public sentry's own user namespace costs.

    .venv/bin/python -m benchmarks.bench_network [--n 10]

Runs as root. Builds the same fake internet as the tests (test namespaces rsbt-node/rsbt-inet,
all traffic stays in them or on loopback), points the sandboxes' upstream at it and downloads a
64 MB body with a static 1 MiB-buffer client inside gVisor (busybox nc reads 1 KiB at a time and
would measure syscalls, not the network). Baselines in the same run: the same download with the
kernel stack in the upstream namespace, and through slirp4netns' tap without gVisor.
"""

from __future__ import annotations

import argparse
import os
import secrets
import tempfile
import time
from pathlib import Path

from benchmarks._harness import emit, summarize
from ray_sandbox.runtime import ImageStore, SandboxRuntime, _proc, _subreaper, network
from ray_sandbox.runtime.config import make_config
from ray_sandbox.runtime.network import netns as _netns
from tests.fx_network import (
    BLOB,
    NODE,
    WEB,
    Sandboxes,
    build_rootfs,
    host_http,
    running_fake_internet,
)

MODES = ("none", "host", "public", "sandbox")


def _mb_s(samples_ms: list[float]) -> float:
    return round(BLOB / 2**20 / (sorted(samples_ms)[len(samples_ms) // 2] / 1000), 1)


def bench_attach(n: int, base: Path) -> list[dict]:
    rows = []
    for mode in MODES:
        config = make_config(network=mode)
        samples = []
        for _ in range(n):
            sid = secrets.token_hex(16)
            d = base / "attach" / sid
            d.mkdir(parents=True)
            t0 = time.perf_counter()
            network.attach(sid, config, d)
            samples.append((time.perf_counter() - t0) * 1000)
            network.detach(sid, d)
        rows.append(summarize(f"attach {mode}", samples))
    return rows


def bench_sandboxes(n: int, sandboxes: Sandboxes, host_port: int) -> list[dict]:
    rows = []
    for mode in MODES:
        create, download = [], []
        for _ in range(n):
            t0 = time.perf_counter()
            with sandboxes.run(make_config(network=mode)) as box:
                create.append((time.perf_counter() - t0) * 1000)
                if mode == "none":
                    continue
                target = ("127.0.0.1", host_port) if mode == "host" else (WEB, 80)
                nbytes, seconds = box.fetch(*target)
                assert nbytes > BLOB, nbytes
                download.append(seconds * 1000)
        rows.append(summarize(f"create {mode} (attach + runsc run)", create))
        if download:
            rows.append(summarize(f"download 64 MB, {mode}", download, MB_s=_mb_s(download)))
    return rows


def _fetch_argv(rootfs: Path, host: str, port: int) -> list[str]:
    return [str(rootfs / "bin" / "fetch"), host, str(port), "/blob"]


def bench_baselines(n: int, rootfs: Path, base: Path) -> list[dict]:
    """The same download without gVisor: from the upstream netns, and through slirp4netns."""
    rows = []
    kernel = []
    for _ in range(n):
        out = _proc.run([*_netns.enter(NODE), *_fetch_argv(rootfs, WEB, 80)], timeout=60)
        kernel.append(float(out.stdout.split()[1]) * 1000)
    rows.append(summarize("download 64 MB, upstream netns (no sandbox)", kernel,
                          MB_s=_mb_s(kernel)))
    sid = secrets.token_hex(16)
    d = base / "slirp" / sid
    d.mkdir(parents=True)
    att = network.attach(sid, make_config(network="public"), d)
    try:
        via_tap = []
        netns_name = Path(att.netns_path).name
        for _ in range(n):
            out = _proc.run([*_netns.enter(netns_name), *_fetch_argv(rootfs, WEB, 80)],
                            timeout=60)
            via_tap.append(float(out.stdout.split()[1]) * 1000)
    finally:
        network.detach(sid, d)
    rows.append(summarize("download 64 MB, slirp4netns tap (no gVisor)", via_tap,
                          MB_s=_mb_s(via_tap)))
    return rows


def _without_userns(spec: dict) -> None:
    """The spec as it was before public sandboxes got a user namespace of their own."""
    linux = spec["linux"]
    linux["namespaces"] = [ns for ns in linux["namespaces"] if ns["type"] != "user"]
    linux.pop("uidMappings", None)
    linux.pop("gidMappings", None)


def bench_public_userns(n: int, base: Path, images: ImageStore) -> list[dict]:
    """A public sandbox with its sentry in its own identity-mapped user namespace (ours) vs
    in the node's (the spec without it): create and exec ``true``, alternated."""
    rt = SandboxRuntime(base / "userns-home", images=images)
    arms = {"own user namespace": None, "node's user namespace (before)": _without_userns}
    samples: dict[str, tuple[list[float], list[float]]] = {a: ([], []) for a in arms}
    try:
        for i in range(n):
            for arm in (list(arms) if i % 2 == 0 else list(arms)[::-1]):
                t0 = time.perf_counter()
                sid = rt.create(image="ray-sandbox/busybox", memory="64Mi", network="public",
                                spec_transform=arms[arm])
                samples[arm][0].append((time.perf_counter() - t0) * 1000)
                try:
                    for _ in range(20):
                        t0 = time.perf_counter()
                        rt.exec(sid, ["true"])
                        samples[arm][1].append((time.perf_counter() - t0) * 1000)
                finally:
                    rt.delete(sid)
    finally:
        rt.close()
    rows = []
    for arm, (create, exe) in samples.items():
        rows.append(summarize(f"create public, sentry in {arm}", create))
        rows.append(summarize(f"exec true public, sentry in {arm}", exe))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10, help="repetitions per row")
    args = parser.parse_args()
    _subreaper.ensure()
    images = ImageStore()  # the node's cache, before RAY_SANDBOX_HOME moves below
    with tempfile.TemporaryDirectory(prefix="rsb-bench-") as tmp:
        base = Path(tmp)
        os.environ["RAY_SANDBOX_HOME"] = str(base / "home")
        rootfs = build_rootfs(base / "img")
        with running_fake_internet(), host_http() as host_port:
            os.environ["RAY_SANDBOX_NET_UPSTREAM"] = NODE
            try:
                rows = bench_attach(args.n, base)
                rows += bench_sandboxes(args.n, Sandboxes(base / "sbx", rootfs), host_port)
                rows += bench_baselines(max(3, args.n // 2), rootfs, base)
                rows += bench_public_userns(args.n, base, images)
            finally:
                network.gc(set())
                del os.environ["RAY_SANDBOX_NET_UPSTREAM"]
    emit("network", rows, notes="ptrace platform; download = static 1 MiB-buffer client; "
         "public = slirp4netns + runsc --network=host in the sandbox netns; sandbox = gVisor "
         "netstack on a veth + nft masquerade.")


if __name__ == "__main__":
    main()
