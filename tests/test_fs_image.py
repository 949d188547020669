"""Filesystem images (Modal's snapshot_filesystem) on the runtime, with real gVisor and the
real image store: a sandbox's files become an image that new sandboxes start from."""

from __future__ import annotations

import pytest

from ray_sandbox.runtime import fs_image
from ray_sandbox.runtime.errors import ConfigError, ImageError, ImageNotFoundError

SETUP = """set -e
mkdir -p /opt/made/deep && echo kept > /opt/made/deep/f && chmod 0750 /opt/made
echo owned > /opt/owned && chown 1234:4321 /opt/owned && chmod 4711 /opt/owned
ln -s /opt/made/deep/f /opt/link
rm /bin/ls
echo in-tmp > /tmp/scratch
"""


@pytest.fixture
def fs_rt(runtime, rt_home):
    """The module runtime; no filesystem image may be left afterwards."""
    yield runtime
    left = [p for p in (rt_home / fs_image.DIR).rglob("*") if p.is_dir() and p.parent.parent
            == rt_home / fs_image.DIR] if (rt_home / fs_image.DIR).exists() else []
    assert left == []


def test_a_sandboxs_files_become_an_image_new_sandboxes_start_from(fs_rt):
    rt = fs_rt
    src = rt.create(image="ray-sandbox/busybox", memory="64Mi", readonly=False,
                    env={"FROM_CONFIG": "1"})
    made: list[str] = []
    image = None
    try:
        done = rt.exec(src, SETUP)
        assert done.exit_code == 0, done.stderr
        image = rt.snapshot_filesystem(src)
        assert fs_image.parse(image.ref) is not None
        made.append(kid := rt.create(image=image.ref, memory="64Mi", readonly=False))
        check = rt.exec(kid, "cat /opt/made/deep/f /opt/link; stat -c '%u:%g %a' /opt/owned "
                             "/opt/made; ls /bin/ls || echo no-ls; cat /tmp/scratch || "
                             "echo no-tmp; echo $FROM_CONFIG; cat /proc/1/cmdline | tr '\\0' ' '")
        lines = check.stdout.splitlines()
        assert lines[:2] == ["kept", "kept"]
        assert lines[2:4] == ["1234:4321 4711", "0:0 750"]
        assert "no-ls" in lines  # a file deleted stays deleted
        assert "no-tmp" in lines  # /tmp is a mount of its own
        assert lines[-2] == ""  # the source's create-time env is its own, not the image's
        assert "rsb-agent" in lines[-1]  # the sandbox runs as any other
        assert rt.exec(kid, "echo again > /opt/made/deep/f").exit_code == 0
        assert rt.exec(src, "cat /opt/made/deep/f").stdout == "kept\n"  # copies diverge
    finally:
        for sid in [src, *made]:
            rt.delete(sid, wait=True)
        if image is not None:
            rt.delete_filesystem_image(image.ref)
    with pytest.raises(ImageNotFoundError):
        rt.images.inspect(image.ref)
    rt.delete_filesystem_image(image.ref)  # idempotent


def test_a_root_over_the_bound_is_refused_and_leaves_nothing(fs_rt, rt_home):
    rt = fs_rt
    sid = rt.create(image="ray-sandbox/busybox", memory="64Mi", readonly=False, disk="64Mi")
    try:
        # sparse: costs the sandbox nothing, would cost the host 1 GiB
        assert rt.exec(sid, "dd if=/dev/zero of=/big bs=1 count=0 seek=1G").exit_code == 0
        with pytest.raises(ImageError, match="at /big"):  # the bound: image size + disk=
            rt.snapshot_filesystem(sid)
        with pytest.raises(ImageError, match="at /big"):
            rt.snapshot_filesystem(sid, max_bytes=512 << 20)
        assert [p.name for p in (rt_home / fs_image.DIR / "local").iterdir()] == []
    finally:
        rt.delete(sid, wait=True)


def test_only_filesystem_images_can_be_deleted_that_way(fs_rt):
    with pytest.raises(ConfigError):
        fs_rt.delete_filesystem_image("ray-sandbox/busybox")
    with pytest.raises(ConfigError):  # not "in use" by the sandboxes of any other image
        fs_rt.filesystem_image_in_use("ray-sandbox/busybox")


def test_refs_and_mount_points_parse(tmp_path):
    ref = fs_image.reference(fs_image.layout("abc", "0" * 32, tmp_path / "a"))
    assert fs_image.parse(ref) == ("abc", "0" * 32)
    # another node's home: the same image in this one's
    assert fs_image.local_ref(ref, tmp_path / "b") == ref.replace("/a/", "/b/")
    assert fs_image.local_ref("ray-sandbox/busybox", tmp_path) == "ray-sandbox/busybox"
    for bad in (ref.replace("0" * 32, "../x"), "oci:/elsewhere/x:image", ref + "x",
                ref.replace("/abc/", "/a/b/"), "oci:fs-images/abc/" + "0" * 32 + ":image"):
        assert fs_image.parse(bad) is None
    with pytest.raises(ImageError):
        fs_image.layout("../..", "0" * 32, tmp_path)
    mounts = "none / 9p rw 0 0\nproc /proc proc rw 0 0\nnone /data\\040dir 9p rw 0 0\n"
    assert fs_image.mount_points(mounts) == {"/proc", "/data dir"}


def test_an_image_is_deleted_right_after_the_last_sandbox_using_it(fs_rt):
    """delete() returns before its teardown drops the image's pin: deleting the image next
    finishes that teardown first instead of finding the image in use."""
    rt = fs_rt
    src = rt.create(image="ray-sandbox/busybox", memory="64Mi", readonly=False)
    image = None
    try:
        image = rt.snapshot_filesystem(src)
        kid = rt.create(image=image.ref, memory="64Mi", readonly=False)
        rt.delete(kid)  # not wait=True: the pin goes in the background
        rt.delete_filesystem_image(image.ref)
        with pytest.raises(ImageNotFoundError):
            rt.images.inspect(image.ref)
    finally:
        rt.delete(src, wait=True)
        if image is not None:
            rt.delete_filesystem_image(image.ref)
