"""Fixtures for runtime tests: a runtime in a private home using the node's image cache, and
leak accounting that every runtime test module must pass."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ray_sandbox.runtime import ImageStore, SandboxRuntime, disk, procfs
from ray_sandbox.runtime.images import pins
from ray_sandbox.runtime.images.storedir import StoreDir
from ray_sandbox.runtime.paths import home
from ray_sandbox.runtime.records import present

_ID = re.compile(r"^[0-9a-f]{32}$")
# The node's image store, which every test's runtime shares; fixed when the run starts, since
# Ray fixtures point RAY_SANDBOX_HOME at their own homes meanwhile.
NODE_IMAGES = home() / "images"


def leftovers(rt_home: Path, ids: set[str] = frozenset(),
              store: Path | None = None) -> dict[str, list[str]]:
    """Everything a sandbox could leave behind on the host, for the given runtime home and
    (for cgroups, which are global) the given sandbox ids: also the home's image pins in
    ``store`` (default: the node's image store, which tests share)."""
    out: dict[str, list[str]] = {"processes": [], "cgroups": [], "sandbox_dirs": [],
                                 "runsc_state": [], "mounts": [], "loops": [], "pins": []}
    marker = f"--root={rt_home / 'runsc'}".encode()
    for pid, argv in procfs.cmdlines():
        if marker in argv:
            out["processes"].append(f"{pid}: {b' '.join(argv)[:120]!r}")
    cg = Path("/sys/fs/cgroup")
    for ctrl in cg.iterdir() if cg.is_dir() else []:
        for d in ctrl.iterdir() if ctrl.is_dir() else []:
            if d.name in ids and d.is_dir():
                out["cgroups"].append(str(d))
    sdir = rt_home / "sandboxes"
    out["sandbox_dirs"] = sorted(p.name for p in sdir.iterdir()) if sdir.is_dir() else []
    rdir = rt_home / "runsc"
    out["runsc_state"] = sorted(p.name for p in rdir.iterdir()) if rdir.is_dir() else []
    out["mounts"] = [line for line in Path("/proc/self/mountinfo").read_text().splitlines()
                     if str(rt_home) in line]
    out["loops"] = loops_backed_by(rt_home)
    key = pins.home_key(rt_home)
    out["pins"] = [f"{p.digest} {p.owner}" for p in store_pins(store or NODE_IMAGES)
                   if p.key == key]
    return {k: v for k, v in out.items() if v}


def store_pins(root: Path) -> list[pins.Pin]:
    """Every pin in the image store at ``root`` (none if there is no store), read only."""
    try:
        return list(pins.listing(StoreDir(root)))
    except FileNotFoundError:
        return []


def leftovers_after_teardown(rt_home: Path, ids: set[str] = frozenset(),
                             timeout: float = 60.0) -> dict[str, list[str]]:
    """:func:`leftovers` once a delete's background teardown had its chance: polled until
    nothing is left, else what is still there after ``timeout`` seconds (a hang guard, not a
    speed claim)."""
    deadline = time.monotonic() + timeout
    while (left := leftovers(rt_home, ids)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


def loops_backed_by(prefix: Path) -> list[str]:
    """Loop devices whose backing file is under ``prefix`` (a deleted one reads
    "<path> (deleted)"), e.g. a disk= image whose filesystem was never released."""
    return sorted(f"{dev}: {path}" for dev, path in disk.loop_backings()
                  if path.startswith(f"{prefix}/"))


@pytest.fixture(scope="session")
def image_store() -> ImageStore:
    return ImageStore(NODE_IMAGES)


@pytest.fixture(scope="session", autouse=True)
def no_stale_pins_at_the_end(tmp_path_factory) -> Iterator[None]:
    """Fails the run if the node's shared image store ends with a pin made during the run
    (new since its start) that names one of the run's homes (every sandbox the run made is
    gone by its end), or any home that no longer has the sandbox (stale: nothing would ever
    remove it but a gc)."""
    root = NODE_IMAGES
    before = {(p.digest, p.owner) for p in store_pins(root)}
    yield
    ours = tmp_path_factory.getbasetemp().resolve()
    left = []
    for p in store_pins(root):
        if (p.digest, p.owner) in before or p.home is None or p.sandbox_id is None:
            continue
        if p.home.is_relative_to(ours):
            left.append(f"{p.digest} {p.owner}: home {p.home} of this run, sandbox "
                        + ("still there" if present(p.home / "sandboxes", p.sandbox_id)
                           else "gone"))
        elif pins.stale(p, lambda h, sid: present(h / "sandboxes", sid)):
            left.append(f"{p.digest} {p.owner}: home {p.home}, sandbox gone")
    assert not left, f"pins left in {root} by this run: {left}"


@pytest.fixture(scope="module")
def rt_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("rsb-home")


@pytest.fixture(scope="module")
def runtime(rt_home, image_store, default_image, busybox_image):
    rt = SandboxRuntime(rt_home, images=image_store)
    yield rt
    rt.close()
    rt.gc()
    ids = rt.records.tombstoned()
    assert leftovers(rt_home, ids) == {}, leftovers(rt_home, ids)


@pytest.fixture(scope="session")
def static_image_ref(tmp_path_factory, image_store) -> Iterator[str]:
    """An OCI layout holding one static binary, /hello, and nothing else (no shell, no libc)."""
    import tarfile

    from ray_sandbox.runtime import _proc
    from ray_sandbox.runtime.umoci import Umoci

    work = tmp_path_factory.mktemp("static-image")
    src = work / "hello.c"
    src.write_text('#include <stdio.h>\nint main(void){puts("hello");return 0;}\n')
    _proc.run(["gcc", "-static", "-O2", "-o", work / "hello", src], timeout=120)
    layer = work / "layer.tar"
    with tarfile.open(layer, "w") as tar:
        tar.add(work / "hello", arcname="hello")
    layout = work / "oci"
    image = f"{layout}:static"
    umoci = Umoci()
    umoci.init(layout, timeout=60)
    umoci.new(image, timeout=60)
    umoci.raw_add_layer(image, layer, created="2024-01-01T00:00:00Z", timeout=60)
    umoci.config(image, created="2024-01-01T00:00:00Z", architecture="amd64", env=[],
                 cmd=["/hello"], timeout=60)
    ref = f"oci:{image}"
    yield ref
    image_store.remove(image_store.get(ref).digest)  # not part of the node's image cache


@pytest.fixture
def sandbox(runtime):
    """A fresh busybox sandbox, deleted afterwards."""
    sid = runtime.create(image="ray-sandbox/busybox", memory="128Mi", cpu=0.5)
    yield sid
    runtime.delete(sid)


@pytest.fixture
def py_sandbox(runtime):
    sid = runtime.create(image="ray-sandbox/python", memory="256Mi", cpu=1)
    yield sid
    runtime.delete(sid)


def pids_inside(runtime: SandboxRuntime, sid: str) -> list[str]:
    """Command lines of the processes inside a sandbox, read through the agent."""
    res = runtime.exec(sid, ["/bin/sh", "-c", "for p in /proc/[0-9]*; do "
                             "tr '\\0' ' ' < $p/cmdline; echo; done"])
    return [line for line in res.stdout.splitlines() if line.strip()]


__all__ = ["NODE_IMAGES", "leftovers", "leftovers_after_teardown", "loops_backed_by", "pids_inside",
           "os"]
