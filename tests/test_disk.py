"""disk=: what a sandbox writes to the node's disk (a writable root, a workdir) is capped by a
loop-mounted ext4 of that size. Beyond it writes fail inside with ENOSPC, the sandbox keeps
running and can free space and write again, and nothing of it — mount, loop device, image
file — outlives delete, a failed create, or an owner killed at any point of the setup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from ray_sandbox.runtime import SandboxRuntime, SandboxState
from ray_sandbox.runtime.config import DEFAULT_DISK
from ray_sandbox.runtime.errors import SandboxCreationError, SandboxFileError
from tests.fx_runtime import leftovers, leftovers_after_teardown, loops_backed_by

DISK = 16 << 20
# config, and the directory (as a prefix) the sandbox writes to
WHERE = {"root": ({"readonly": False}, ""), "workdir": ({"readonly": True, "workdir": "/w"}, "/w")}


def _allocated(path) -> int:
    return os.stat(path).st_blocks * 512


@pytest.mark.parametrize("where", ["root", "workdir"])
def test_full_disk_is_enospc_and_the_sandbox_recovers(runtime, where):
    cfg, base = WHERE[where]
    sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi", disk="16Mi", **cfg)
    image = runtime.sandboxes_dir / sid / "disk.img"
    fill = f"{base}/fill"
    try:
        res = runtime.exec(sid, f"dd if=/dev/zero of={fill} bs=1M count=48", timeout=120)
        assert res.exit_code != 0 and "No space left" in res.stderr
        assert runtime.get_status(sid).state == SandboxState.RUNNING
        # The node paid at most the cap (plus its own extent blocks for the image file).
        assert _allocated(image) <= DISK + (64 << 10)
        with pytest.raises(SandboxFileError, match="No space left"):
            runtime.write_file(sid, f"{base}/more", b"x" * DISK)
        res = runtime.exec(sid, f"rm -f {fill} {base}/more && "
                                f"dd if=/dev/zero of={fill} bs=1M count=8 && wc -c < {fill}")
        assert res.exit_code == 0, res.stderr
        assert res.stdout.strip() == str(8 << 20)
    finally:
        runtime.delete(sid)
    assert leftovers_after_teardown(runtime.home, {sid}) == {}


def test_disks_are_private_copies_of_one_template(runtime):
    """Every disk of a size is copied from one formatted template: what one sandbox writes
    reaches neither the template nor its neighbour, and each disk stays sparse."""
    a, b = (runtime.create(image="ray-sandbox/busybox", memory="64Mi", disk="16Mi",
                           readonly=False) for _ in range(2))
    template = runtime.home / "disks" / f"ext4-{DISK}.img"
    try:
        before = template.read_bytes()
        assert runtime.exec(a, "echo mine > /mine && sync").exit_code == 0
        assert runtime.exec(b, "cat /mine").exit_code != 0
        assert template.read_bytes() == before
        assert _allocated(runtime.sandboxes_dir / b / "disk.img") < DISK // 2
    finally:
        for sid in (a, b):
            runtime.delete(sid)
    assert leftovers_after_teardown(runtime.home, {a, b}) == {}


def test_only_sandboxes_that_write_to_the_node_disk_get_an_image(runtime):
    """A read-only sandbox without a workdir writes only to tmpfs (bounded by memory): disk=
    sets nothing up for it; one that asks for no cap (disk="unlimited") gets none."""
    ro = runtime.create(image="ray-sandbox/busybox", memory="64Mi", disk="16Mi")
    rw = runtime.create(image="ray-sandbox/busybox", memory="64Mi", readonly=False,
                        disk="unlimited")
    try:
        for sid in (ro, rw):
            assert not (runtime.sandboxes_dir / sid / "disk.img").exists()
        assert loops_backed_by(runtime.home) == []
        assert runtime.exec(rw, "echo x > /f && cat /f").stdout == "x\n"
    finally:
        runtime.delete(ro)
        runtime.delete(rw)


@pytest.mark.parametrize("where", ["root", "workdir"])
def test_a_sandbox_that_writes_to_the_node_disk_is_capped_unless_it_asks_not_to_be(runtime,
                                                                                    where):
    """Without disk= the runtime caps what a sandbox writes to the node's disk at
    DEFAULT_DISK, as create() through Ray does: a writable root without disk= wrote 2 GiB
    in 1.6 s to the node's disk before."""
    cfg, base = WHERE[where]
    sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi", **cfg)
    try:
        image = runtime.sandboxes_dir / sid / "disk.img"
        assert image.stat().st_size == DEFAULT_DISK
        st = os.statvfs(runtime.sandboxes_dir / sid / "disk")
        assert st.f_blocks * st.f_frsize <= DEFAULT_DISK
        res = runtime.exec(sid, f"echo x > {base}/f && cat {base}/f")
        assert res.stdout == "x\n", res.stderr
    finally:
        runtime.delete(sid)
    assert leftovers_after_teardown(runtime.home, {sid}) == {}


def test_image_workdir_larger_than_disk_fails_create_cleanly(runtime):
    # busybox's /bin (1.9 MiB) is seeded into the workdir, which lives on the 1 MiB disk.
    with pytest.raises(SandboxCreationError, match="No space left"):
        runtime.create(image="ray-sandbox/busybox", memory="64Mi", disk="1Mi", workdir="/bin")
    assert leftovers_after_teardown(runtime.home) == {}  # the last test's deletes included


def test_ttl_expiry_releases_the_disk(runtime):
    sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi", disk="16Mi",
                         readonly=False, ttl_seconds=1)
    assert loops_backed_by(runtime.sandboxes_dir / sid)
    assert leftovers_after_teardown(runtime.home, {sid}) == {}


@pytest.mark.parametrize("where", ["root", "workdir"])
def test_restored_copies_keep_their_own_cap(runtime, where):
    cfg, base = WHERE[where]
    sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi", disk="16Mi", **cfg)
    runtime.write_file(sid, f"{base}/kept", b"kept\n")
    snap = runtime.snapshot(sid)
    copies = []
    try:
        copies = runtime.restore(snap, 2)
        for c in copies:
            assert runtime.read_file(c, f"{base}/kept") == b"kept\n"
            res = runtime.exec(c, f"dd if=/dev/zero of={base}/fill bs=1M count=48",
                               timeout=120)
            assert res.exit_code != 0 and "No space left" in res.stderr
            assert runtime.get_status(c).state == SandboxState.RUNNING
        assert len(loops_backed_by(runtime.home)) == 3
    finally:
        for c in [*copies, sid]:
            runtime.delete(c)
        runtime.snapshots.delete(snap)
    assert leftovers_after_teardown(runtime.home, {sid, *copies}) == {}


# Dies (SIGKILL, from itself) right after one real step of the disk setup.
CRASHING_OWNER = textwrap.dedent("""
    import os, sys
    from ray_sandbox.runtime import SandboxRuntime, _mount, disk
    module, name = {"loop bound": (disk, "_bind_loop"),
                    "mounted": (_mount, "mount_block")}[sys.argv[2]]
    real = getattr(module, name)

    def then_die(*args, **kwargs):
        real(*args, **kwargs)
        os.kill(os.getpid(), 9)

    setattr(module, name, then_die)
    SandboxRuntime(sys.argv[1]).create(image="ray-sandbox/busybox", memory="64Mi",
                                       disk="16Mi", readonly=False)
""")


@pytest.mark.parametrize("point", ["loop bound", "mounted"])
def test_owner_killed_during_disk_setup_leaves_nothing(tmp_path, image_store, busybox_image,
                                                       point):
    home = tmp_path / "home"
    env = {**os.environ, "RAY_SANDBOX_IMAGES": str(image_store.root)}
    proc = subprocess.run([sys.executable, "-c", CRASHING_OWNER, str(home), point], env=env,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL
    (sdir,) = (home / "sandboxes").iterdir()
    assert (sdir / "disk.img").exists()
    if point == "loop bound":
        # The dead process's fd was the device's only holder: autoclear freed it.
        assert loops_backed_by(home) == []
    else:
        assert loops_backed_by(home) != []
    # No record yet: the reaper leaves the directory to a creator that may still be working
    # for a minute. Age it past that instead of waiting.
    os.utime(sdir, (sdir.stat().st_atime - 120, sdir.stat().st_mtime - 120))
    SandboxRuntime(home, images=image_store)  # the reaper runs at start
    assert leftovers(home) == {}


NO_LOOP_OWNER = textwrap.dedent("""
    import ctypes, os, stat, sys
    libc = ctypes.CDLL(None, use_errno=True)
    # Its own mount namespace (made private first, so nothing reaches the host's) with a
    # /dev holding only null: a node without loop devices, for this process only.
    assert libc.unshare(0x00020000) == 0  # CLONE_NEWNS
    assert libc.mount(None, b"/", None, 0x4000 | 0x40000, None) == 0  # MS_REC | MS_PRIVATE
    assert libc.mount(b"tmpfs", b"/dev", b"tmpfs", 0, None) == 0
    os.mknod("/dev/null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    from ray_sandbox.runtime import SandboxRuntime
    from ray_sandbox.runtime.errors import SandboxCreationError
    try:
        SandboxRuntime(sys.argv[1]).create(image="ray-sandbox/busybox", memory="64Mi",
                                           disk="16Mi", readonly=False)
    except SandboxCreationError as exc:
        print(exc.message)
""")


def test_no_loop_devices_is_a_creation_error_not_an_unbounded_sandbox(tmp_path, image_store,
                                                                        busybox_image):
    home = tmp_path / "home"
    env = {**os.environ, "RAY_SANDBOX_IMAGES": str(image_store.root)}
    proc = subprocess.run([sys.executable, "-c", NO_LOOP_OWNER, str(home)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "disk= cannot be enforced here: no loop devices" in proc.stdout
    assert leftovers(home) == {}
