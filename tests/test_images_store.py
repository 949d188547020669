"""ImageStore against real skopeo, umoci and a real local registry: transports, caching,
exactly-once unpacking under concurrency, moved tags, pins, eviction, crash leftovers."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ray_sandbox.runtime.errors import ImageNotFoundError
from ray_sandbox.runtime.image_builders import export_layout
from ray_sandbox.runtime.images import (
    Image,
    ImageInUseError,
    ImageStore,
    PullPolicy,
    Transport,
    parse_reference,
)
from tests.fx_images import assert_store_clean, busybox_variant, scratch_dir

REPO = Path(__file__).resolve().parents[1]


def layout_digest(layout: Path, tag: str) -> str:
    index = json.loads((layout / "index.json").read_text())
    (entry,) = [m for m in index["manifests"]
                if m["annotations"]["org.opencontainers.image.ref.name"] == tag]
    return entry["digest"]


def assert_busybox(image: Image) -> None:
    assert (image.rootfs / "bin" / "busybox").is_file()
    assert os.readlink(image.rootfs / "bin" / "sh") == "/bin/busybox"
    assert "localhost" in (image.rootfs / "etc" / "hosts").read_text()
    assert image.config.cmd == ["/bin/sh"] and image.config.architecture == "amd64"
    assert sorted(p.name for p in image.rootfs.parent.iterdir()) == [
        "image.json", "oci", "pins", "rootfs", "used"]


@pytest.fixture
def traced_tools(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Put logging wrappers for skopeo and umoci first on PATH (the real tools still run);
    yields the log, one line per invocation, shared by threads and child processes."""
    with scratch_dir("rsb-trace-") as root:
        log = root / "calls.log"
        log.touch()
        for tool in ("skopeo", "umoci"):
            wrapper = root / tool
            wrapper.write_text(f'#!/bin/sh\necho "{tool} $$ $*" >> {log}\n'
                               f'exec /usr/bin/{tool} "$@"\n')
            wrapper.chmod(0o755)
        monkeypatch.setenv("PATH", f"{root}:{os.environ['PATH']}")
        yield log


def calls(log: Path, tool: str, verb: str) -> list[str]:
    """Logged invocations of ``tool`` with ``verb`` among its arguments."""
    return [line for line in log.read_text().splitlines()
            if line.split()[0] == tool and verb in line.split()[2:]]


def test_pull_from_registry_then_cached_without_processes(
    temp_store: ImageStore, pushed_busybox: str, busybox_layout: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    image = temp_store.get(pushed_busybox)
    assert image.digest == layout_digest(busybox_layout, "latest")  # OCI digests are kept
    assert image.ref == f"docker://{pushed_busybox}"
    assert_busybox(image)
    assert image.size_bytes > 2_000_000
    monkeypatch.setenv("PATH", "/nonexistent")  # any process start would now fail
    again = temp_store.get(pushed_busybox)
    assert (again.digest, again.rootfs) == (image.digest, image.rootfs)
    assert again.last_used >= image.last_used
    assert ImageStore(temp_store.root).get(f"docker://{pushed_busybox}").digest == image.digest


@pytest.mark.parametrize("transport", ["oci", "oci-archive", "docker-archive", "dir"])
def test_pull_from_file_transports(
    temp_store: ImageStore, busybox_sources: dict[str, str], busybox_layout: Path, transport: str
) -> None:
    image = temp_store.get(busybox_sources[transport])
    assert_busybox(image)
    assert image.ref == str(parse_reference(busybox_sources[transport]))
    if transport != "docker-archive":  # docker-archive holds a Docker manifest, re-encoded
        assert image.digest == layout_digest(busybox_layout, "latest")
    assert list((temp_store.root / "tmp").iterdir()) == []


def test_same_image_under_two_names_is_stored_once(
    temp_store: ImageStore, pushed_busybox: str, busybox_sources: dict[str, str],
    traced_tools: Path,
) -> None:
    a = temp_store.get(pushed_busybox)
    b = temp_store.get(busybox_sources["oci"])
    assert a.digest == b.digest and a.rootfs == b.rootfs
    assert len(calls(traced_tools, "umoci", "unpack")) == 1
    assert {i.ref for i in temp_store.list()} == {a.ref, b.ref}


def test_blobs_are_shared_and_reused(
    temp_store: ImageStore, registry: str, busybox_layout: Path, traced_tools: Path
) -> None:
    export_layout(busybox_layout, "latest", f"docker://{registry}/lab/reuse:v1", tls_verify=False)
    first = temp_store.get(f"{registry}/lab/reuse:v1")
    pool = temp_store.root / "blobs" / "sha256"
    layer = next(p for p in pool.iterdir() if p.stat().st_size > 1_000_000)
    assert layer.stat().st_nlink == 2  # pool + the image's own layout
    temp_store.remove(first.digest)
    assert list(pool.iterdir()) == []  # unreferenced blobs go with the image


def test_concurrent_creators_pull_and_unpack_once(
    registry: str, traced_tools: Path
) -> None:
    """10 threads and 6 processes ask for one new image at the same moment."""
    with scratch_dir("rsb-concurrent-") as root:
        layout = root / "src"
        busybox_variant(layout, "c", marker="concurrent")
        ref = f"{registry}/lab/concurrent:v1"
        export_layout(layout, "c", f"docker://{ref}", tls_verify=False)
        traced_tools.write_text("")  # count only what the store runs
        store_root, go = root / "store", root / "go"
        ImageStore(store_root)  # create the directories once, like a node does at boot
        ready = root / "ready"
        ready.mkdir()
        code = ("import os, time\nfrom ray_sandbox.runtime.images import ImageStore\n"
                f"open(os.path.join({str(ready)!r}, str(os.getpid())), 'w').close()\n"
                f"while not os.path.exists({str(go)!r}): time.sleep(0.002)\n"
                f"print(ImageStore({str(store_root)!r}).get({ref!r}).rootfs)")
        procs = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for _ in range(6)]
        results: list[Path] = []
        errors: list[BaseException] = []

        def worker() -> None:
            while not go.exists():
                time.sleep(0.002)
            try:
                results.append(ImageStore(store_root).get(ref).rootfs)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker) for _ in range(10)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while len(list(ready.iterdir())) < len(procs):  # all imported, all waiting
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.01)
        go.touch()
        for t in threads:
            t.join(60)
        outputs = [p.communicate(timeout=60) for p in procs]
        assert not errors, errors
        assert all(p.returncode == 0 for p in procs), outputs
        results += [Path(out.strip()) for out, _ in outputs]
        assert len(results) == 16 and len(set(results)) == 1
        assert len(calls(traced_tools, "umoci", "unpack")) == 1
        assert len(calls(traced_tools, "skopeo", "copy")) == 1
        assert list((store_root / "tmp").iterdir()) == []


def test_moved_tag_is_reresolved_only_with_always(
    temp_store: ImageStore, registry: str, traced_tools: Path
) -> None:
    with scratch_dir("rsb-moving-") as root:
        busybox_variant(root / "oci", "one", marker="one")
        busybox_variant(root / "oci", "two", marker="two")
        ref = f"{registry}/lab/moving:latest"
        export_layout(root / "oci", "one", f"docker://{ref}", tls_verify=False)
        traced_tools.write_text("")  # count only what the store runs
        first = temp_store.get(ref)
        assert (first.rootfs / "etc" / "variant").read_text() == "one"
        assert temp_store.get(ref, policy=PullPolicy.ALWAYS).digest == first.digest
        assert len(calls(traced_tools, "skopeo", "copy")) == 1  # unchanged tag: nothing copied

        export_layout(root / "oci", "two", f"docker://{ref}", tls_verify=False)
        assert temp_store.get(ref).digest == first.digest  # if-not-present keeps the old one
        assert temp_store.get(ref, policy=PullPolicy.NEVER).digest == first.digest
        moved = temp_store.get(ref, policy=PullPolicy.ALWAYS)
        assert moved.digest == layout_digest(root / "oci", "two") != first.digest
        assert (moved.rootfs / "etc" / "variant").read_text() == "two"
        assert temp_store.get(ref).digest == moved.digest
        # The old image is now dangling: prune takes it, the current one stays.
        assert temp_store.prune() == [first.digest]
        assert [i.digest for i in temp_store.list()] == [moved.digest]


def test_never_policy_does_not_fetch(temp_store: ImageStore, pushed_busybox: str) -> None:
    with pytest.raises(ImageNotFoundError):
        temp_store.get(pushed_busybox, policy=PullPolicy.NEVER)
    with pytest.raises(ImageNotFoundError):
        temp_store.get("ray-sandbox/busybox", policy=PullPolicy.NEVER)
    assert_store_clean(temp_store)


def test_local_images_are_built_on_demand_once(temp_store: ImageStore, traced_tools: Path) -> None:
    image = temp_store.get("ray-sandbox/busybox")
    assert image.ref == "ray-sandbox/busybox:latest"
    assert_busybox(image)
    assert temp_store.pull("ray-sandbox/busybox").digest == image.digest  # no rebuild
    rebuilt = temp_store.build("ray-sandbox/busybox:latest", force=True)
    assert rebuilt.digest == image.digest  # the busybox build is reproducible
    assert len(calls(traced_tools, "umoci", "unpack")) == 1
    with pytest.raises(ImageNotFoundError):
        temp_store.get("ray-sandbox/nope")


def test_a_live_store_survives_its_directory_being_wiped(temp_store: ImageStore) -> None:
    first = temp_store.get("ray-sandbox/busybox")
    shutil.rmtree(temp_store.root)  # an operator's rm -rf under a running runtime
    again = temp_store.get("ray-sandbox/busybox")
    assert again.digest == first.digest and again.rootfs.is_dir()


def test_pins_block_removal_and_survive_restarts(
    temp_store: ImageStore, pushed_busybox: str
) -> None:
    image = temp_store.get(pushed_busybox)
    temp_store.pin(image.digest, "sandbox-a")
    temp_store.pin(image.digest, "sandbox-b")
    reopened = ImageStore(temp_store.root)
    assert reopened.pins(image.digest) == {"sandbox-a", "sandbox-b"}
    with pytest.raises(ImageInUseError):
        reopened.remove(image.digest)
    with pytest.raises(ImageInUseError):
        reopened.remove(pushed_busybox)
    assert reopened.prune(all_images=True) == []
    reopened.unpin(image.digest, "sandbox-a")
    reopened.unpin(image.digest, "sandbox-a")  # idempotent
    reopened.unpin(image.digest, "sandbox-b")
    assert reopened.pins(image.digest) == set()
    assert reopened.remove(pushed_busybox) == [image.digest]
    assert_store_clean(reopened)
    with pytest.raises(ImageNotFoundError):
        reopened.pin(image.digest, "late")


def test_remove_untags_before_deleting(
    temp_store: ImageStore, pushed_busybox: str, busybox_sources: dict[str, str]
) -> None:
    image = temp_store.get(pushed_busybox)
    temp_store.get(busybox_sources["oci"])
    assert temp_store.remove(busybox_sources["oci"]) == []  # still named by the registry ref
    assert temp_store.inspect(pushed_busybox).digest == image.digest
    assert temp_store.inspect(image.digest).ref == image.digest
    assert temp_store.remove(pushed_busybox) == [image.digest]
    with pytest.raises(ImageNotFoundError):
        temp_store.remove(pushed_busybox)
    assert_store_clean(temp_store)


def test_lru_eviction_never_takes_pinned_images(registry: str) -> None:
    with scratch_dir("rsb-evict-") as root:
        refs = []
        for name in ("a", "b", "c", "d"):
            busybox_variant(root / "oci", name, marker=name)
            refs.append(f"{registry}/lab/evict-{name}:v1")
            export_layout(root / "oci", name, f"docker://{refs[-1]}", tls_verify=False)
        probe = ImageStore(root / "probe").get(refs[0])
        cap = int(probe.size_bytes * 2.5)  # room for two images
        store = ImageStore(root / "store", max_bytes=cap)
        a = store.get(refs[0])
        store.pin(a.digest, "sandbox-1")
        b = store.get(refs[1])
        time.sleep(0.01)
        c = store.get(refs[2])  # over the cap: b is the LRU unpinned image
        assert {i.digest for i in store.list()} == {a.digest, c.digest}
        assert store.usage() <= cap
        # Pins live on disk: a fresh store (another process, after a restart) honours them.
        restarted = ImageStore(root / "store", max_bytes=cap)
        restarted.get(refs[2])  # touch c so it is the most recently used
        d = restarted.get(refs[3])
        assert {i.digest for i in restarted.list()} == {a.digest, d.digest}
        assert restarted.pins(a.digest) == {"sandbox-1"}
        assert b.digest not in {i.digest for i in restarted.list()}
        with pytest.raises(ImageNotFoundError):
            restarted.get(refs[1], policy=PullPolicy.NEVER)  # evicted refs are dropped too


def test_crashed_pull_leaves_only_a_work_dir_that_the_next_open_removes(
    registry: str, busybox_layout: Path
) -> None:
    """SIGKILL a process in the middle of its unpack; nothing half-done becomes visible."""
    ref = f"{registry}/lab/crash:v1"
    export_layout(busybox_layout, "latest", f"docker://{ref}", tls_verify=False)
    with scratch_dir("rsb-crash-") as root:
        bin_dir, started = root / "bin", root / "unpack.pid"
        bin_dir.mkdir()
        slow = bin_dir / "umoci"  # a umoci that stalls before unpacking
        slow.write_text(f'#!/bin/sh\n[ "$1" = unpack ] && echo $$ > {started} && exec sleep 30\n'
                        'exec /usr/bin/umoci "$@"\n')
        slow.chmod(0o755)
        code = ("from ray_sandbox.runtime.images import ImageStore\n"
                f"ImageStore({str(root / 'store')!r}).get({ref!r})")
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env)
        try:
            deadline = time.monotonic() + 30
            while not started.exists() or not started.read_text().strip():
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.01)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            os.kill(int(started.read_text()), signal.SIGKILL)  # the stalled child we started
            store_root = root / "store"
            assert len(list((store_root / "tmp").iterdir())) == 1
            assert list((store_root / "sha256").iterdir()) == []
            store = ImageStore(store_root)
            assert list((store_root / "tmp").iterdir()) == []
            with pytest.raises(ImageNotFoundError):
                store.get(ref, policy=PullPolicy.NEVER)
            assert_busybox(store.get(ref))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_default_image_fixtures(default_image: Image, busybox_image: Image) -> None:
    assert default_image.ref == "ray-sandbox/python:latest"
    assert (default_image.rootfs / "usr" / "bin" / "python3").exists()
    assert (default_image.rootfs / "bin" / "bash").exists()
    assert (default_image.rootfs / "etc" / "ssl" / "certs").is_dir()
    share = default_image.rootfs / "usr" / "share"
    assert not [p for d in ("man", "locale") for p in (share / d).rglob("*") if p.is_file()]
    assert "LANG=C.UTF-8" in default_image.config.env
    assert default_image.config.cmd == ["/usr/bin/python3"]
    assert "localhost" in (default_image.rootfs / "etc" / "hosts").read_text()
    assert busybox_image.ref == "ray-sandbox/busybox:latest"
    assert parse_reference(busybox_image.ref).transport is Transport.LOCAL
    assert (busybox_image.rootfs / "bin" / "busybox").is_file()
