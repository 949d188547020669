"""SandboxRuntime speed, side by side with bare runsc in the same run.

    .venv/bin/python -m benchmarks.bench_runtime [--quick] [--hardening]

Rows: create→ready and delete (ours: SandboxRuntime; baseline: ``runsc run --detach`` of a
sleep bundle + ``runsc delete``), delete → nothing left (the background teardown done), what
``disk=`` adds to a writable-root create and delete (and
its mkfs.ext4 + loop + mount alone), what the hardening settings cost (``directfs=False``, and
the mknod seccomp filter ``capabilities=[]`` brings; ``--hardening`` runs only these), exec
``true`` (agent vs one ``runsc exec`` per command), 1 KiB file read/write (agent vs ``runsc
exec cat``), warm ``run_python`` (vs ``python3 -c`` per call), 100 MB upload/download, and 16
concurrent callers on one sandbox and on 16 sandboxes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks._harness import BARE_RUNSC, emit, measure, summarize
from ray_sandbox.runtime import SandboxRuntime, _mount, disk, procfs

_TEARDOWN_GUARD_S = 60.0


def _baseline_bundle(rt: SandboxRuntime, sid: str, tmp: Path) -> Path:
    """A copy of a live sandbox's bundle whose init is plain ``sleep`` (no agent)."""
    spec = json.loads((rt.sandboxes_dir / sid / "bundle" / "config.json").read_text())
    spec["process"]["args"] = ["/bin/sleep", "100000"]
    spec["mounts"] = [m for m in spec["mounts"] if not m["destination"].startswith("/.rsb")]
    b = tmp / "bundle"
    b.mkdir()
    (b / "config.json").write_text(json.dumps(spec))
    return b


def _until_torn_down(rt: SandboxRuntime, sid: str) -> float:
    """Wait for the background teardown of a deleted sandbox (its tombstone goes last) and
    return when it ended (``perf_counter``), once checked that nothing of it is left: no
    runsc process or state, mount, cgroup or files (a network is detached before that)."""
    deadline = time.monotonic() + _TEARDOWN_GUARD_S
    while rt.records.read_tombstone(sid) is not None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"teardown of {sid} not done after {_TEARDOWN_GUARD_S:g}s")
        time.sleep(0.001)
    ended = time.perf_counter()
    sdir = rt.sandboxes_dir / sid
    left = [*procfs.cgroup_dirs(sid), *_mount.mounts_under(sdir), *rt.runsc.root.glob(f"*{sid}*"),
            *(pid for pid, args in rt.runsc.processes().items() if any(sid in a for a in args)),
            *([sdir] if sdir.exists() else [])]
    if left:
        raise RuntimeError(f"left after the teardown of {sid}: {left}")
    return ended


def _disk_rows(rt: SandboxRuntime, tmp: Path, n: int, size: str = "1Gi") -> list[dict]:
    """Writable-root create→ready, delete and delete → nothing left, without and with
    ``disk=``, alternated so load from elsewhere on the machine hits both alike; then the
    disk setup on its own."""
    samples: dict[str, list[float]] = {}
    for i in range(n + 1):  # the first round is warmup
        for label, extra in (("", {}), (f", disk={size}", {"disk": size})):
            t0 = time.perf_counter()
            sid = rt.create(image="ray-sandbox/busybox", memory="128Mi", cpu=1, readonly=False,
                            **extra)
            t1 = time.perf_counter()
            rt.delete(sid)
            t2 = time.perf_counter()
            t3 = _until_torn_down(rt, sid)
            if i:
                samples.setdefault(f"create→ready readonly=False{label} (ours)", []).append(
                    (t1 - t0) * 1000)
                samples.setdefault(f"delete readonly=False{label} (ours)", []).append(
                    (t2 - t1) * 1000)
                samples.setdefault(f"delete → nothing left{label} (ours)", []).append(
                    (t3 - t1) * 1000)
    rows = [summarize(label, ms) for label, ms in samples.items()]
    size_b = 1 << 30
    image, mnt = tmp / "disk.img", tmp / "disk"

    def attach_detach() -> None:
        disk.attach(image, mnt, size_b, templates=tmp / "disks", sandbox_id="bench")
        _mount.unmount(mnt)
        mnt.rmdir()
        image.unlink()

    def mkfs_only() -> None:
        with open(image, "wb") as f:
            f.truncate(size_b)
        disk.mkfs_ext4(image, sandbox_id="bench")
        image.unlink()

    rows.append(measure(f"mkfs.ext4 of a sparse {size} image", mkfs_only, n))
    rows.append(measure(f"disk setup + teardown {size} (template copy, loop, mount, unmount)",
                        attach_detach, n))
    return rows


def _drop_seccomp(spec: dict) -> None:
    spec["linux"].pop("seccomp", None)


def _allow_only_seccomp(spec: dict) -> None:
    spec["linux"]["seccomp"] = {"defaultAction": "SCMP_ACT_ALLOW"}


HARDENING = {
    "default": {},
    "directfs=False": {"directfs": False},
    "capabilities=[]": {"capabilities": []},
    "capabilities=[] without the mknod filter": {"capabilities": [],
                                                 "spec_transform": _drop_seccomp},
    # what having any filter costs, whatever its rules
    "capabilities=[], an allow-only filter": {"capabilities": [],
                                              "spec_transform": _allow_only_seccomp},
}
_SYSCALLS = 10_000  # dd bs=1: one read and one write each
_IMPORTS = ["python3", "-c", "import json, sqlite3, http.client, email.mime.text, xml.dom"]


def _hardening_rows(rt: SandboxRuntime, n: int) -> list[dict]:
    """create→ready, exec ``true`` (agent and ``runsc exec``), a read of an image file
    (host-backed: the gofer serves it without directfs), a syscall loop, a fork+exec loop,
    and Python imports in a fresh sandbox (many image files opened the first time), for each
    setting in rotation (reversed every other round), so load from elsewhere on the machine
    and position in the round hit all alike."""
    samples: dict[str, list[float]] = {}

    def rotation(i: int, items: dict) -> list:
        order = list(items.items())
        return order if i % 2 else order[::-1]

    def timed(label: str, fn, keep: bool):
        t0 = time.perf_counter()
        out = fn()
        if keep:
            samples.setdefault(label, []).append((time.perf_counter() - t0) * 1000)
        return out

    def create(cfg: dict) -> str:
        # 256Mi: the sentry grows ~0.1 MiB per process started (docs/security.md)
        return rt.create(image="ray-sandbox/busybox", memory="256Mi", cpu=1, **cfg)

    for i in range(n + 1):  # the first round is warmup
        for name, cfg in rotation(i, HARDENING):
            rt.delete(timed(f"create→ready, {name}", lambda cfg=cfg: create(cfg), i > 0))
    sids = {name: create(cfg) for name, cfg in HARDENING.items()}
    dd = f"dd if=/dev/zero of=/dev/null bs=1 count={_SYSCALLS} 2>/dev/null"
    forks = "i=0; while [ $i -lt 50 ]; do /bin/true; i=$((i+1)); done"
    for i in range(n * 5 + 1):
        for name, sid in rotation(i, sids):
            timed(f"exec true, {name}", lambda sid=sid: rt.exec(sid, ["/bin/true"]), i > 0)
            timed(f"read_file /etc/passwd, {name}",
                  lambda sid=sid: rt.read_file(sid, "/etc/passwd"), i > 0)
            if i <= n:
                timed(f"exec true (baseline runsc exec), {name}",
                      lambda sid=sid: rt.runsc.exec(sid, ["/bin/true"], timeout=30), i > 0)
    for i in range(6):
        for name, sid in rotation(i, sids):
            timed(f"{2 * _SYSCALLS} syscalls (dd bs=1), {name}",
                  lambda sid=sid: rt.exec(sid, dd, timeout=120), i > 0)
            timed(f"50 fork+exec of true in sh, {name}",
                  lambda sid=sid: rt.exec(sid, forks, timeout=120), i > 0)
    for sid in sids.values():
        rt.delete(sid)
    for i in range(n + 1):
        for name in ("default", "directfs=False"):
            sid = rt.create(image="ray-sandbox/python", memory="256Mi", cpu=1, **HARDENING[name])
            for when in ("first", "again"):
                timed(f"python3 imports ({when} in the sandbox), {name}",
                      lambda sid=sid: rt.exec(sid, _IMPORTS), i > 0)
            rt.delete(sid)
    return [summarize(label, ms) for label, ms in samples.items()]


def _ops_per_s(fn, workers: int, seconds: float) -> float:
    stop = time.monotonic() + seconds
    counts = [0] * workers

    def loop(i: int) -> None:
        while time.monotonic() < stop:
            fn(i)
            counts[i] += 1

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / seconds


def _cpu_per_op(rt: SandboxRuntime, sid: str, fn, n: int) -> tuple[float, float]:
    """CPU milliseconds per call: (inside the sandbox's cgroup, this process + children).
    CPU time, unlike wall time, barely moves when other work shares the machine."""
    usage = Path(f"/sys/fs/cgroup/cpuacct/{sid}/cpuacct.usage")

    def host() -> float:
        r, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
            resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime + c.ru_utime + c.ru_stime

    fn()
    c0, h0 = int(usage.read_text()), host()
    for _ in range(n):
        fn()
    return (int(usage.read_text()) - c0) / n / 1e6, (host() - h0) / n * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--hardening", action="store_true", help="only the hardening rows")
    args = ap.parse_args()
    n = 10 if args.quick else 40
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="rsb-bench-") as tmpd, SandboxRuntime(
        Path(tmpd) / "home"
    ) as rt:
        if args.hardening:
            emit("runtime_hardening", _hardening_rows(rt, max(5, n // 2)))
            return
        tmp = Path(tmpd)
        ids: list[str] = []

        def create():
            ids.append(rt.create(image="ray-sandbox/busybox", memory="128Mi", cpu=1))

        rows.append(measure("create→ready (ours)", create, max(5, n // 4), warmup=1))
        rows.append(measure("delete (ours)", lambda: rt.delete(ids.pop()), max(5, n // 4),
                            warmup=0))
        rows += _disk_rows(rt, tmp, max(5, n // 2))
        rows += _hardening_rows(rt, max(5, n // 2))
        sid = rt.create(image="ray-sandbox/busybox", memory="1Gi", cpu=2)
        bundle = _baseline_bundle(rt, sid, tmp)
        base_ids: list[str] = []

        def base_create():
            bid = os.urandom(16).hex()
            rt.runsc.run_detached(bid, bundle, BARE_RUNSC, log_dir=tmp)
            base_ids.append(bid)

        rows.append(measure("create (baseline runsc run)", base_create, max(5, n // 4)))
        rows.append(measure("delete (baseline runsc delete)",
                            lambda: rt.runsc.delete(base_ids.pop()), max(5, n // 4), warmup=0))
        for bid in base_ids:
            rt.runsc.delete(bid)

        rows.append(measure("exec true (ours)", lambda: rt.exec(sid, ["/bin/true"]), n * 5))
        rows.append(measure("exec true (baseline runsc exec)",
                            lambda: rt.runsc.exec(sid, ["/bin/true"], timeout=30), n))
        for label, fn in (("ours", lambda: rt.exec(sid, ["/bin/true"])),
                          ("baseline runsc exec",
                           lambda: rt.runsc.exec(sid, ["/bin/true"], timeout=30))):
            inside, outside = _cpu_per_op(rt, sid, fn, n * 2)
            rows.append({"label": f"CPU per exec true ({label})",
                         "sandbox_cpu_ms": round(inside, 2), "host_cpu_ms": round(outside, 2),
                         "total_cpu_ms": round(inside + outside, 2)})
        kib = os.urandom(1024)
        rows.append(measure("write 1 KiB (ours)", lambda: rt.write_file(sid, "/tmp/k", kib),
                            n * 5))
        rows.append(measure("read 1 KiB (ours)", lambda: rt.read_file(sid, "/tmp/k"), n * 5))
        rows.append(measure("write 1 KiB (baseline runsc exec)",
                            lambda: rt.runsc.exec(sid, ["/bin/sh", "-c", "cat > /tmp/k2"],
                                                  stdin=kib, timeout=30), n))
        rows.append(measure("read 1 KiB (baseline runsc exec)",
                            lambda: rt.runsc.exec(sid, ["/bin/cat", "/tmp/k"], timeout=30), n))

        big = tmp / "big.bin"
        with open(big, "wb") as f:
            for _ in range(100):
                f.write(os.urandom(1 << 20))
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        rows.append(measure("upload 100 MB (ours)",
                            lambda: rt.upload_file(sid, big, "/tmp/big.bin"), 3, warmup=0))
        rows.append(measure("download 100 MB (ours)",
                            lambda: rt.download_file(sid, "/tmp/big.bin", tmp / "back.bin"), 3,
                            warmup=0))
        grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
        rows[-1]["host_maxrss_growth_mb"] = round(grew, 1)
        rt.remove(sid, "/tmp/big.bin")
        (tmp / "back.bin").unlink()

        secs = 3.0 if args.quick else 6.0
        ours = _ops_per_s(lambda i: rt.exec(sid, ["/bin/true"]), 16, secs)
        base = _ops_per_s(lambda i: rt.runsc.exec(sid, ["/bin/true"], timeout=60), 16, secs)
        rows.append({"label": "16 callers, 1 sandbox: exec true ops/s", "ours": round(ours, 1),
                     "baseline": round(base, 1), "ratio": round(ours / base, 2)})
        many = [rt.create(image="ray-sandbox/busybox", memory="64Mi", cpu=0.1)
                for _ in range(16)]
        ours = _ops_per_s(lambda i: rt.exec(many[i], ["/bin/true"]), 16, secs)
        base = _ops_per_s(lambda i: rt.runsc.exec(many[i], ["/bin/true"], timeout=60), 16,
                          secs)
        rows.append({"label": "16 callers, 16 sandboxes: exec true ops/s", "ours": round(ours, 1),
                     "baseline": round(base, 1), "ratio": round(ours / base, 2)})
        with ThreadPoolExecutor(8) as ex:
            list(ex.map(rt.delete, many))
        rt.delete(sid)

        py = rt.create(image="ray-sandbox/python", memory="256Mi", cpu=1)
        if hasattr(rt, "run_python"):
            rows.append(measure("run_python print(1) warm (ours)",
                                lambda: rt.run_python(py, "print(1)"), n * 2, warmup=2))
        rows.append(measure("python3 -c print(1) per call (baseline, agent exec)",
                            lambda: rt.exec(py, ["python3", "-c", "print(1)"]), n))
        rt.delete(py)
    emit("runtime", rows)


if __name__ == "__main__":
    main()
