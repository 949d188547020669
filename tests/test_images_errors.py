"""Every bad input gives its typed error with the tool's stderr, leaves nothing in the store and
does not disturb other pulls. Real skopeo, umoci, registries and a real full tmpfs."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ray_sandbox.runtime.errors import (
    CommandTimeoutError,
    ImageCorruptError,
    ImageError,
    ImageNotFoundError,
    ImageReferenceError,
    PlatformNotFoundError,
    RegistryAuthError,
    RegistryUnreachableError,
    StoreFullError,
    ToolMissingError,
)
from ray_sandbox.runtime.image_builders import export_layout, write_busybox_layout
from ray_sandbox.runtime.images import ImageStore, is_loopback
from ray_sandbox.runtime.skopeo import Skopeo
from tests.fx_images import assert_store_clean, busybox_variant, scratch_dir, write_authfile

INDEX = "application/vnd.oci.image.index.v1+json"


def expect(store: ImageStore, ref: str, error: type[ImageError] | type[ToolMissingError],
           **kwargs) -> ImageError:
    with pytest.raises(error) as info:
        store.get(ref, **kwargs)
    assert_store_clean(store)
    return info.value


@pytest.fixture(scope="module")
def foreign_layout() -> Iterator[Path]:
    """Tags: ``arm`` (a single arm64 manifest) and ``multi`` (an index offering only arm64)."""
    with scratch_dir("rsb-foreign-") as root:
        layout = root / "oci"
        write_busybox_layout(layout, "arm", architecture="arm64")
        index = json.loads((layout / "index.json").read_text())
        arm = index["manifests"][0]
        blob = json.dumps({"schemaVersion": 2, "mediaType": INDEX, "manifests": [
            {"mediaType": arm["mediaType"], "digest": arm["digest"], "size": arm["size"],
             "platform": {"architecture": "arm64", "os": "linux"}}]}).encode()
        digest = hashlib.sha256(blob).hexdigest()
        (layout / "blobs" / "sha256" / digest).write_bytes(blob)
        index["manifests"].append({"mediaType": INDEX, "digest": f"sha256:{digest}",
                                   "size": len(blob),
                                   "annotations": {"org.opencontainers.image.ref.name": "multi"}})
        (layout / "index.json").write_text(json.dumps(index))
        yield layout


@contextmanager
def tiny_store(size: str) -> Iterator[ImageStore]:
    """An ImageStore on a tmpfs of ``size`` (unmounted and removed afterwards)."""
    with scratch_dir("rsb-tmpfs-") as mountpoint:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mountpoint)],
                       check=True)
        try:
            yield ImageStore(mountpoint / "images")
        finally:
            subprocess.run(["umount", str(mountpoint)], check=True)


def test_bad_reference_syntax(temp_store: ImageStore) -> None:
    for ref in ("Bad:Name", "python:", "oci:", "x@sha256:123", ""):
        expect(temp_store, ref, ImageReferenceError)


def test_unknown_images(temp_store: ImageStore, registry: str, pushed_busybox: str,
                        busybox_layout: Path) -> None:
    repo = pushed_busybox.rsplit(":", 1)[0]
    for ref in (f"{registry}/lab/absent:v1", f"{repo}:no-such-tag", "oci:/nonexistent/x:t",
                f"oci:{busybox_layout}:no-such-tag", "oci-archive:/nonexistent.tar",
                "docker-archive:/nonexistent.tar", "dir:/nonexistent", "ray-sandbox/nope"):
        err = expect(temp_store, ref, ImageNotFoundError)
        assert ref.split(":")[0] in str(err)


def test_not_found_carries_the_tool_stderr(temp_store: ImageStore, registry: str) -> None:
    err = expect(temp_store, f"{registry}/lab/absent:v1", ImageNotFoundError)
    assert err.argv[0] == "skopeo" and "manifest unknown" in err.stderr


def test_unreachable_registry(temp_store: ImageStore) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connection refused
        err = expect(temp_store, f"127.0.0.1:{port}/lab/x:v1", RegistryUnreachableError)
    assert "connection refused" in err.stderr


def test_pull_timeout_kills_a_hung_transfer(temp_store: ImageStore) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()  # connections complete, nothing ever answers
        port = server.getsockname()[1]
        expect(temp_store, f"127.0.0.1:{port}/lab/x:v1", CommandTimeoutError, timeout=2)


def test_tls_is_required_unless_insecure_or_loopback(
    temp_store: ImageStore, pushed_busybox: str
) -> None:
    name = socket.gethostname()
    if not is_loopback(socket.gethostbyname(name)) or name != name.lower() or "." in name:
        pytest.skip("needs a plain host name that resolves to loopback via /etc/hosts")
    port = pushed_busybox.split("/")[0].split(":")[1]
    ref = f"{name}:{port}/lab/busybox:latest"
    err = expect(temp_store, ref, RegistryUnreachableError)
    assert "HTTP response to HTTPS client" in err.stderr
    insecure = ImageStore(temp_store.root, insecure_registries=[f"{name}:{port}"])
    assert (insecure.get(ref).rootfs / "bin" / "busybox").is_file()


def test_registry_credentials(
    temp_store: ImageStore, auth_registry: tuple[str, str, str], busybox_layout: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    addr, user, password = auth_registry
    with scratch_dir("rsb-auth-") as home:
        for var in ("REGISTRY_AUTH_FILE", "XDG_RUNTIME_DIR"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("HOME", str(home))
        good = write_authfile(home / "good.json", addr, user, password)
        bad = write_authfile(home / "bad.json", addr, user, "wrong")
        Skopeo(authfile=good).copy(f"oci:{busybox_layout}:latest",
                                   f"docker://{addr}/lab/private:v1", dest_tls_verify=False,
                                   timeout=120)
        ref = f"{addr}/lab/private:v1"
        err = expect(ImageStore(temp_store.root), ref, RegistryAuthError)  # no credentials
        assert "authentication required" in err.stderr
        expect(ImageStore(temp_store.root, authfile=bad), ref, RegistryAuthError)
        monkeypatch.setenv("REGISTRY_AUTH_FILE", str(bad))
        expect(ImageStore(temp_store.root), ref, RegistryAuthError)
        monkeypatch.setenv("REGISTRY_AUTH_FILE", str(good))
        assert ImageStore(temp_store.root).get(ref).digest
        monkeypatch.delenv("REGISTRY_AUTH_FILE")
        (home / ".docker").mkdir()
        good.rename(home / ".docker" / "config.json")
        assert ImageStore(temp_store.root).pull(ref).digest  # ~/.docker/config.json is used


def test_missing_platform_never_gives_a_wrong_arch_image(
    temp_store: ImageStore, foreign_layout: Path, registry: str
) -> None:
    expect(temp_store, f"oci:{foreign_layout}:multi", PlatformNotFoundError)
    err = expect(temp_store, f"oci:{foreign_layout}:arm", PlatformNotFoundError)
    assert "arm64" in str(err)
    for tag in ("multi", "arm"):
        export_layout(foreign_layout, tag, f"docker://{registry}/lab/foreign:{tag}",
                      tls_verify=False, all_images=True)
        expect(temp_store, f"{registry}/lab/foreign:{tag}", PlatformNotFoundError)
    arm = ImageStore(temp_store.root, platform="linux/arm64")
    for ref in (f"oci:{foreign_layout}:multi", f"{registry}/lab/foreign:multi"):
        assert arm.get(ref).config.architecture == "arm64"


def test_corrupt_archives(temp_store: ImageStore, busybox_sources: dict[str, str]) -> None:
    with scratch_dir("rsb-corrupt-") as root:
        garbage = root / "garbage.tar"
        garbage.write_bytes(os.urandom(3000))
        refs = [f"oci-archive:{garbage}", f"docker-archive:{garbage}"]
        for name in ("oci-archive", "docker-archive"):
            whole = Path(busybox_sources[name].split(":", 1)[1]).read_bytes()
            half = root / f"half-{name}.tar"
            half.write_bytes(whole[: len(whole) // 2])
            refs.append(f"{name}:{half}")
        damaged = root / "damaged.dir"
        subprocess.run(["cp", "-a", busybox_sources["dir"].split(":", 1)[1], str(damaged)],
                       check=True)
        layer = max(damaged.iterdir(), key=lambda p: p.stat().st_size)
        data = bytearray(layer.read_bytes())
        data[len(data) // 2] ^= 0xFF
        layer.write_bytes(bytes(data))
        refs.append(f"dir:{damaged}")
        for ref in refs:
            expect(temp_store, ref, ImageCorruptError)


@pytest.mark.parametrize("size", ["600k", "2m"], ids=["blob-copy", "unpack"])
def test_full_disk(pushed_busybox: str, size: str) -> None:
    with tiny_store(size) as store:
        err = expect(store, pushed_busybox, StoreFullError)
        # the tool's own words are kept: ENOSPC, or (umoci, sometimes) a crash of its hashing
        # reader after the failed write, which the store tells from the disk it left full
        assert "no space left on device" in err.stderr or (
            size == "2m" and "panic: d.nx != 0" in err.stderr), err.stderr[:300]
        assert err.argv[0] == ("skopeo" if size == "600k" else "umoci")


def test_missing_binaries(temp_store: ImageStore, pushed_busybox: str,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    expect(temp_store, pushed_busybox, ToolMissingError)
    expect(temp_store, "ray-sandbox/busybox", ToolMissingError)


def test_failures_do_not_disturb_a_concurrent_pull(
    temp_store: ImageStore, registry: str
) -> None:
    with scratch_dir("rsb-mixed-") as root:
        busybox_variant(root / "oci", "good", marker="good")
        good = f"{registry}/lab/mixed:v1"
        export_layout(root / "oci", "good", f"docker://{good}", tls_verify=False)
        garbage = root / "garbage.tar"
        garbage.write_bytes(b"not a tar" * 100)
        bad = [f"{registry}/lab/absent:v1", f"oci-archive:{garbage}", "127.0.0.1:1/x:y",
               f"oci:{root / 'oci'}:missing"]
        outcome: dict[str, object] = {}

        def pull(ref: str) -> None:
            try:
                outcome[ref] = temp_store.get(ref)
            except ImageError as exc:
                outcome[ref] = exc

        threads = [threading.Thread(target=pull, args=(ref,)) for ref in [good, *bad]]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not isinstance(outcome[good], Exception), outcome[good]
        assert all(isinstance(outcome[ref], ImageError) for ref in bad), outcome
        assert [i.ref for i in temp_store.list()] == [f"docker://{good}"]
        assert list((temp_store.root / "tmp").iterdir()) == []
