"""Named volumes (runtime/volumes.py) with real runsc sandboxes: data outlives the sandbox, a
read-only mount cannot be written from inside by any route, the size cap gives ENOSPC, one
cache serves 8 sandboxes at once, a read-write volume has one user at a time, and delete,
gc and a killed owner never remove a volume in use nor leave a mount or loop device behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ray_sandbox.runtime import SandboxRuntime, SandboxState
from ray_sandbox.runtime.errors import (
    ConfigError,
    SandboxCreationError,
    SandboxError,
    VolumeExistsError,
    VolumeInUseError,
    VolumeNotFoundError,
)
from tests.fx_runtime import leftovers_after_teardown, loops_backed_by

BUSYBOX = "ray-sandbox/busybox"


def _volume_mounts(rt_home: Path) -> list[str]:
    """Mounts of this home's volumes (their own and the sandboxes' binds) and their loops."""
    vols = rt_home / "volumes"
    lines = [line for line in Path("/proc/self/mountinfo").read_text().splitlines()
             if f"{vols}/" in line or "/volumes/" in line and str(rt_home) in line]
    return lines + loops_backed_by(vols)


@pytest.fixture
def volume(runtime, request):
    """A fresh 32 MiB volume, deleted afterwards (which also proves it is idle by then)."""
    name = request.node.name.split("[")[0].replace("_", "-")[-40:].strip("-")
    runtime.volumes.create(name, "32Mi")
    yield name
    runtime.volumes.delete(name)
    assert not (runtime.volumes.root / name).exists()
    assert _volume_mounts(runtime.home) == []


def test_a_deleted_users_teardown_is_waited_for(runtime, volume):
    """delete() returns before the teardown unbinds the volume: the next create with the
    same read-write volume waits for it instead of failing."""
    a = runtime.create(image=BUSYBOX, memory="64Mi", volumes={"/ws": volume})
    assert runtime.exec(a, "echo first > /ws/f").exit_code == 0
    runtime.delete(a)  # no wait: its teardown runs in the background
    b = runtime.create(image=BUSYBOX, memory="64Mi", volumes={"/ws": volume})
    try:
        assert runtime.exec(b, "cat /ws/f").stdout == "first\n"
        # a live user is not waited for: refused at once
        with pytest.raises(SandboxCreationError, match=f"by sandbox {b} .read-write.:"):
            runtime.create(image=BUSYBOX, memory="64Mi", volumes={"/ws": volume})
    finally:
        runtime.delete(b, wait=True)


def test_on_delete_delete_removes_the_volume_with_its_last_user(runtime):
    vols = runtime.volumes
    vols.create("scratch-a", "16Mi")
    mount = {"name": "scratch-a", "readonly": True, "on_delete": "delete"}
    a = runtime.create(image=BUSYBOX, memory="64Mi", volumes={"/s": mount})
    b = runtime.create(image=BUSYBOX, memory="64Mi", volumes={"/s": mount})
    runtime.delete(a, wait=True)
    assert [u.sandbox_id for u in vols.inspect("scratch-a").mounts] == [b]  # b still uses it
    runtime.delete(b, wait=True)
    with pytest.raises(VolumeNotFoundError):
        vols.inspect("scratch-a")
    assert not (vols.root / "scratch-a").exists()
    # the same through a TTL, and the default keeps a volume
    vols.create("scratch-b", "16Mi")
    vols.create("kept-c", "16Mi")
    try:
        c = runtime.create(image=BUSYBOX, memory="64Mi", ttl_seconds=1, volumes={
            "/s": {"name": "scratch-b", "on_delete": "delete"}, "/k": "kept-c"})
        deadline = time.time() + 30
        while time.time() < deadline and "scratch-b" in [v.name for v in vols.list()]:
            time.sleep(0.1)
        assert [v.name for v in vols.list()] == ["kept-c"]
        assert runtime.get_status(c).reason == "TTLExpired"
    finally:
        vols.delete("kept-c")


def test_a_tool_bundle_is_on_path_after_the_images_own_tools(runtime, volume):
    writer = runtime.create(image=BUSYBOX, memory="64Mi", volumes={"/t": volume})
    assert runtime.exec(writer, "mkdir -p /t/bin && printf '#!/bin/sh\\necho tool $1\\n' "
                                "> /t/bin/mytool && cp /t/bin/mytool /t/bin/ls && "
                                "chmod +x /t/bin/*").exit_code == 0
    runtime.delete(writer, wait=True)
    user = runtime.create(image=BUSYBOX, memory="64Mi", volumes={
        "/opt/tools": {"name": volume, "readonly": True, "tools": True}})
    try:
        assert runtime.exec(user, "mytool 1").stdout == "tool 1\n"
        # the bundle's own ls comes after the image's: it cannot shadow it
        assert runtime.exec(user, "command -v ls").stdout.strip() != "/opt/tools/bin/ls"
        assert runtime.exec(user, "echo $PATH").stdout.strip().endswith(":/opt/tools/bin")
    finally:
        runtime.delete(user, wait=True)


def test_fill_unpacks_in_a_sandbox_and_keeps_members_inside(runtime, volume, tmp_path):
    import io
    import tarfile

    from ray_sandbox.runtime import archive
    from ray_sandbox.runtime.volumes import fill

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("a")
    (tmp_path / "d" / "ln").symlink_to("a.txt")
    fill(runtime, volume, archive.tar_of(tmp_path / "d"), path="/data")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        info = tarfile.TarInfo("../../escaped")
        info.size = 1
        t.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(SandboxError):
        fill(runtime, volume, [buf.getvalue()])
    user = runtime.create(image=BUSYBOX, memory="64Mi", volumes={"/v": f"{volume}:ro"})
    try:
        assert runtime.exec(user, "cat /v/data/ln; echo; ls -a /v").stdout.split() == \
            ["a", ".", "..", "data", "lost+found"]
    finally:
        runtime.delete(user, wait=True)
    assert runtime.list() == []  # the fill sandboxes are gone, the failed one too


def test_data_survives_delete_and_recreate(runtime, volume):
    a = runtime.create(image=BUSYBOX, memory="64Mi", volumes={"/ws": volume})
    info = runtime.volumes.inspect(volume)
    assert [(u.sandbox_id, u.readonly) for u in info.mounts] == [(a, False)]
    assert info.size == 32 << 20 and info.node and info.used > 0
    assert runtime.exec(a, "echo kept > /ws/f && mkdir /ws/d").exit_code == 0
    with pytest.raises(VolumeInUseError, match="mounted by"):
        runtime.volumes.delete(volume)
    runtime.delete(a)
    assert leftovers_after_teardown(runtime.home, {a}) == {}
    assert runtime.volumes.inspect(volume).mounts == []
    # a fresh sandbox, another image path: the same data
    b = runtime.create(image=BUSYBOX, memory="64Mi", volumes={"/again": volume})
    try:
        assert runtime.read_file(b, "/again/f") == b"kept\n"
        assert runtime.exec(b, "test -d /again/d").exit_code == 0
    finally:
        runtime.delete(b)
    assert leftovers_after_teardown(runtime.home, {b}) == {}


def test_readonly_mount_refuses_every_write(runtime, volume):
    """Read-only holds against root with CAP_SYS_ADMIN inside: remounting rw succeeds in
    gVisor's view, but the host bind is read-only, so no write, link or rename gets through."""
    w = runtime.create(image=BUSYBOX, memory="64Mi", volumes={"/v": volume})
    assert runtime.exec(w, "echo data > /v/f && mkdir /v/d").exit_code == 0
    runtime.delete(w, wait=True)
    caps = ["CAP_SYS_ADMIN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_CHOWN"]
    r = runtime.create(image=BUSYBOX, memory="64Mi", capabilities=caps,
                       volumes={"/v": f"{volume}:ro"})
    try:
        bind = runtime.sandboxes_dir / r / "volumes" / "0"
        line = next(ln for ln in Path("/proc/self/mountinfo").read_text().splitlines()
                    if ln.split()[4] == str(bind))
        assert "ro" in line.split()[5].split(","), line  # read-only on the host itself
        attempts = {
            "create": "echo x > /v/new",
            "append": "echo x >> /v/f",
            "truncate": "truncate -s 0 /v/f",
            "hardlink": "ln /v/f /v/d/link",
            "rename": "mv /v/f /v/g",
            "unlink": "rm /v/f",
            "chmod": "chmod 777 /v/f",
            "mkdir": "mkdir /v/e",
            "remount-then-write": "mount -o remount,rw /v; echo x > /v/new2",
            "bind-then-write": "mkdir -p /tmp/m && mount --bind /v /tmp/m && "
                               "mount -o remount,rw,bind /tmp/m; echo x > /tmp/m/new3",
        }
        for what, cmd in attempts.items():
            res = runtime.exec(r, cmd)
            assert res.exit_code != 0, (what, res)
        assert runtime.read_file(r, "/v/f") == b"data\n"
        listing = runtime.exec(r, "ls -A /v /v/d").stdout.split()
        assert sorted(x for x in listing if not x.endswith(":")) == ["d", "f", "lost+found"]
    finally:
        runtime.delete(r)
    assert leftovers_after_teardown(runtime.home, {r}) == {}


def test_size_cap_is_enospc_inside(runtime, volume):
    sid = runtime.create(image=BUSYBOX, memory="64Mi", volumes={"/v": volume})
    image = runtime.volumes.root / volume / "volume.img"
    try:
        res = runtime.exec(sid, "dd if=/dev/zero of=/v/fill bs=1M count=64", timeout=120)
        assert res.exit_code != 0 and "No space left" in res.stderr
        assert runtime.get_status(sid).state == SandboxState.RUNNING
        assert os.stat(image).st_blocks * 512 <= (32 << 20) + (64 << 10)
        assert runtime.exec(sid, "rm /v/fill && echo ok > /v/ok").exit_code == 0
    finally:
        runtime.delete(sid)
    assert leftovers_after_teardown(runtime.home, {sid}) == {}


def test_one_cache_read_only_in_8_sandboxes(runtime, volume):
    """Filled once by a writer, then mounted read-only by 8 sandboxes at once; meanwhile
    nobody may mount it read-write, and a read-write volume has one user at a time."""
    w = runtime.create(image=BUSYBOX, memory="64Mi", volumes={"/cache": volume})
    assert runtime.exec(w, "seq 1 1000 > /cache/data").exit_code == 0
    with pytest.raises(SandboxCreationError, match="one sandbox at a time"):
        runtime.create(image=BUSYBOX, memory="64Mi", volumes={"/cache": f"{volume}:ro"})
    runtime.delete(w, wait=True)
    with ThreadPoolExecutor(4) as pool:  # concurrent creates: the store's lock orders them
        readers = list(pool.map(lambda _: runtime.create(
            image=BUSYBOX, memory="64Mi", volumes={"/cache": f"{volume}:ro"}), range(8)))
    try:
        info = runtime.volumes.inspect(volume)
        assert sorted(u.sandbox_id for u in info.mounts) == sorted(readers)
        assert all(u.readonly for u in info.mounts)
        for sid in readers:
            assert runtime.exec(sid, "wc -l < /cache/data").stdout.strip() == "1000"
        with pytest.raises(SandboxCreationError, match="one sandbox at a time"):
            runtime.create(image=BUSYBOX, memory="64Mi", volumes={"/cache": volume})
    finally:
        for sid in readers:
            runtime.delete(sid)
    assert leftovers_after_teardown(runtime.home, set(readers)) == {}


def test_concurrent_writers_get_the_volume_one_at_a_time(runtime, volume):
    def create():
        try:
            return runtime.create(image=BUSYBOX, memory="64Mi", volumes={"/w": volume})
        except SandboxCreationError as exc:
            assert "one sandbox at a time" in str(exc)
            return None

    with ThreadPoolExecutor(3) as pool:
        made = [sid for sid in pool.map(lambda _: create(), range(3)) if sid]
    try:
        assert len(made) == 1
        assert [u.sandbox_id for u in runtime.volumes.inspect(volume).mounts] == made
    finally:
        for sid in made:
            runtime.delete(sid)
    assert leftovers_after_teardown(runtime.home, set(made)) == {}


def test_ttl_expiry_releases_and_keeps_the_volume(runtime, volume):
    sid = runtime.create(image=BUSYBOX, memory="64Mi", ttl_seconds=1, volumes={"/w": volume})
    assert runtime.exec(sid, "echo ttl > /w/f").exit_code == 0
    assert leftovers_after_teardown(runtime.home, {sid}) == {}  # expired and torn down
    assert runtime.volumes.inspect(volume).mounts == []
    again = runtime.create(image=BUSYBOX, memory="64Mi", volumes={"/w": f"{volume}:ro"})
    try:
        assert runtime.read_file(again, "/w/f") == b"ttl\n"
    finally:
        runtime.delete(again)
    assert leftovers_after_teardown(runtime.home, {again}) == {}


def test_fork_of_a_read_write_volume_fails_clearly(runtime, volume):
    sid = runtime.create(image=BUSYBOX, memory="64Mi", volumes={"/ws": volume})
    try:
        with pytest.raises(SandboxCreationError, match="read-write volume is mounted by one"):
            runtime.fork(sid)
        assert runtime.exec(sid, "echo still > /ws/x").exit_code == 0
    finally:
        runtime.delete(sid)
    assert leftovers_after_teardown(runtime.home, {sid}) == {}


def test_copies_remount_volumes(runtime, volume):
    """A snapshot holds no volume data: a copy made once its source is gone (resume) gets
    the read-write volume as it is now; a second copy meanwhile is refused; read-only
    volumes go to every copy of a fork, still read-only."""
    runtime.volumes.create("copies-ro", "16Mi")
    sid = runtime.create(image=BUSYBOX, memory="64Mi",
                         volumes={"/ws": volume, "/ro": "copies-ro:ro"})
    assert runtime.exec(sid, "echo before > /ws/f").exit_code == 0
    snap = runtime.snapshot(sid)
    runtime.delete(sid, wait=True)
    made = []
    try:
        made += runtime.restore(snap)
        assert runtime.exec(made[0], "echo after >> /ws/f").exit_code == 0
        with pytest.raises(SandboxCreationError, match="one sandbox at a time"):
            runtime.restore(snap)
        runtime.delete(made.pop(), wait=True)
        ro = runtime.create(image=BUSYBOX, memory="64Mi", volumes={"/ro": "copies-ro:ro"})
        made += [ro, *runtime.fork(ro, 2)]
        for copy in made:
            res = runtime.exec(copy, "echo x > /ro/x")
            assert res.exit_code != 0 and "Read-only" in res.stderr
    finally:
        for copy in made:
            runtime.delete(copy)
        runtime.snapshots.delete(snap)
    assert leftovers_after_teardown(runtime.home, set(made)) == {}
    assert runtime.volumes.inspect(volume).mounts == []
    runtime.volumes.delete("copies-ro")
    b = runtime.create(image=BUSYBOX, memory="64Mi", volumes={"/ws": f"{volume}:ro"})
    try:
        assert runtime.read_file(b, "/ws/f") == b"before\nafter\n"
    finally:
        runtime.delete(b)
    assert leftovers_after_teardown(runtime.home, {b}) == {}


def test_export_and_import_copy_a_volume(runtime, volume):
    """The stream another node imports from (Ray's copy): only data extents travel, the
    copy is a new volume with the same bytes, and an export refuses a volume in use."""
    sid = runtime.create(image=BUSYBOX, memory="64Mi", volumes={"/v": volume})
    res = runtime.exec(sid, "dd if=/dev/urandom of=/v/blob bs=1M count=3 2>/dev/null && "
                            "echo tiny > /v/tiny && md5sum /v/blob | cut -d' ' -f1")
    assert res.exit_code == 0, res.stderr
    with pytest.raises(VolumeInUseError, match="only when idle"):
        runtime.volumes.export_stream(volume)
    runtime.delete(sid, wait=True)
    data = b"".join(runtime.volumes.export_stream(volume))
    assert (3 << 20) < len(data) < (8 << 20)  # sparse: not the 32 MiB of the image
    pieces = [data[i:i + 65536] for i in range(0, len(data), 65536)]
    info = runtime.volumes.import_stream("copy-of-it", pieces)
    assert info.size == runtime.volumes.inspect(volume).size
    with pytest.raises(VolumeExistsError, match="already exists"):
        runtime.volumes.import_stream("copy-of-it", pieces)
    with pytest.raises(ConfigError, match="ended in the middle"):
        runtime.volumes.import_stream("copy-cut", [data[:-5]])
    assert not (runtime.volumes.root / "copy-cut").exists()
    c = runtime.create(image=BUSYBOX, memory="64Mi", volumes={"/c": "copy-of-it:ro"})
    try:
        out = runtime.exec(c, "md5sum /c/blob | cut -d' ' -f1; cat /c/tiny").stdout.split()
        assert out == [res.stdout.strip(), "tiny"]
    finally:
        runtime.delete(c, wait=True)
    runtime.volumes.delete("copy-of-it")
    assert leftovers_after_teardown(runtime.home, {sid, c}) == {}
    assert list(runtime.volumes.root.glob(".*-*")) == []


def test_bad_volumes_fail_create_and_leave_nothing(runtime, volume):
    with pytest.raises(SandboxCreationError, match="does not exist"):
        runtime.create(image=BUSYBOX, memory="64Mi", volumes={"/v": "no-such-volume"})
    with pytest.raises(SandboxCreationError, match="mounted twice"):
        runtime.create(image=BUSYBOX, memory="64Mi", volumes={"/a": volume, "/b": volume})
    assert leftovers_after_teardown(runtime.home) == {}
    assert _volume_mounts(runtime.home) == []


def test_store_verbs(runtime):
    vols = runtime.volumes
    vols.create("verbs-a", "16Mi")
    try:
        with pytest.raises(VolumeExistsError, match="already exists"):
            vols.create("verbs-a", "16Mi")
        with pytest.raises(ConfigError, match="at least"):
            vols.create("verbs-b", "1Mi")
        with pytest.raises(ConfigError):
            vols.create("Bad/Name", "16Mi")
        assert "verbs-a" in [v.name for v in vols.list()]
        # idle: nothing mounted, and the image is sparse
        assert vols.inspect("verbs-a").used < (2 << 20)
    finally:
        vols.delete("verbs-a")
    with pytest.raises(VolumeNotFoundError):
        vols.inspect("verbs-a")
    assert "verbs-a" not in [v.name for v in vols.list()]


# Creates a sandbox with the volume in the given home, prints its id, and waits to be killed.
OWNER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from ray_sandbox.runtime import SandboxRuntime
    rt = SandboxRuntime(Path(sys.argv[1]), reap=False)
    print(rt.create(image="ray-sandbox/busybox", memory="64Mi",
                    volumes={"/ws": sys.argv[2]}), flush=True)
    time.sleep(600)
""")


def test_killed_owner_is_reaped_and_the_volume_kept(rt_home, runtime, volume):
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(rt_home), volume],
                            stdout=subprocess.PIPE, text=True)
    try:
        sid = proc.stdout.readline().strip()
        assert [u.sandbox_id for u in runtime.volumes.inspect(volume).mounts] == [sid]
        assert runtime.exec(sid, "echo survived > /ws/f").exit_code == 0
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert sid in runtime.gc()
    assert leftovers_after_teardown(runtime.home, {sid}) == {}
    assert _volume_mounts(rt_home) == []
    again = runtime.create(image=BUSYBOX, memory="64Mi", volumes={"/ws": f"{volume}:ro"})
    try:
        assert runtime.read_file(again, "/ws/f") == b"survived\n"
    finally:
        runtime.delete(again)
    assert leftovers_after_teardown(runtime.home, {again}) == {}


def test_gc_unmounts_an_idle_volume_and_keeps_it(rt_home, image_store, volume):
    """A creator that died between mounting a volume and binding it left only the volume's
    own mount: gc (run by every new runtime) unmounts it and keeps the data."""
    from ray_sandbox.runtime import disk

    vol_dir = rt_home / "volumes" / volume
    disk.mount_image(vol_dir / "volume.img", vol_dir / "mnt", sandbox_id=None)
    assert _volume_mounts(rt_home) != []
    SandboxRuntime(rt_home, images=image_store)  # reap=True runs gc
    assert _volume_mounts(rt_home) == []
    assert (vol_dir / "volume.img").is_file()
