"""Filesystem images as diffs (runtime/fs_image.py, "Diffs"), with real gVisor and the real
image store: the image holds exactly what changed since the sandbox started, as a layer on
its source image, and a hostile sandbox can neither make the host read its own files nor
exceed the bound."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tarfile
from pathlib import Path

import pytest

from ray_sandbox.runtime import fs_image
from ray_sandbox.runtime.errors import ImageError, ImageNotFoundError

# busybox has /bin/*, /sbin/*, /etc/{group,hosts,passwd}, /root (empty), no /opt
CHANGES = """set -e
mkdir -p /opt/app/sub && echo one > /opt/app/sub/f && chmod 0750 /opt/app
echo secret > /opt/app/suid && chown 1234:4321 /opt/app/suid && chmod 4711 /opt/app/suid
echo data > /opt/app/h1 && ln /opt/app/h1 /opt/app/h2
ln -s ../../etc/passwd /opt/app/rel && ln -s /etc/shadow /opt/app/abs
echo more >> /etc/passwd
chmod 0600 /etc/group
rm /bin/ls
rm -rf /root
rm -f /sbin/* && echo new > /sbin/new
echo scratch > /tmp/scratch
"""

# the changes above as the diff directory holds them: type, mode, owner
EXPECTED_DIFF = {
    "bin": "d 755 0:0", "bin/ls": "whiteout",
    "etc": "d 755 0:0", "etc/group": "f 600 0:0", "etc/passwd": "f 644 0:0",
    "opt": "d 755 0:0", "opt/app": "d 750 0:0", "opt/app/sub": "d 755 0:0",
    "opt/app/sub/f": "f 644 0:0", "opt/app/suid": "f 4711 1234:4321",
    "opt/app/h1": "f 644 0:0", "opt/app/h2": "f 644 0:0",
    "opt/app/rel": "l 777 0:0", "opt/app/abs": "l 777 0:0",
    "root": "whiteout",
    "sbin": "d 755 0:0 opaque", "sbin/new": "f 644 0:0",
}  # fmt: skip
EXPECTED_LAYER = {
    "bin/", "bin/.wh.ls", "etc/", "etc/group", "etc/passwd", "opt/", "opt/app/",
    "opt/app/sub/", "opt/app/sub/f", "opt/app/suid", "opt/app/h1", "opt/app/h2 -> opt/app/h1",
    "opt/app/rel", "opt/app/abs", ".wh.root", "sbin/", "sbin/.wh..wh..opq", "sbin/new",
}  # fmt: skip


def diff_of(image) -> dict[str, str]:
    """The image's diff directory as ``path -> "type mode uid:gid"`` (whiteouts named)."""
    root = Path(image.rootfs).parent / "diff"
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        rel = str(path.relative_to(root))
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
            out[rel] = "whiteout"
            continue
        kind = "d" if path.is_dir() and not path.is_symlink() else "l" if path.is_symlink() \
            else "f"
        desc = f"{kind} {stat.S_IMODE(st.st_mode):o} {st.st_uid}:{st.st_gid}"
        if kind == "d" and "trusted.overlay.opaque" in os.listxattr(path):
            desc += " opaque"
        out[rel] = desc
    return out


def layer_of(ref: str) -> list[tarfile.TarInfo]:
    """The members of the layout's last layer (the changes)."""
    layout = Path(ref.removeprefix("oci:").rsplit(":", 1)[0])
    blobs = layout / "blobs" / "sha256"
    index = json.loads((layout / "index.json").read_text())
    manifest = json.loads((blobs / index["manifests"][0]["digest"][7:]).read_text())
    with tarfile.open(blobs / manifest["layers"][-1]["digest"][7:]) as tar:
        return tar.getmembers()


def names(members: list[tarfile.TarInfo]) -> set[str]:
    return {m.name + ("/" if m.isdir() else "") + (f" -> {m.linkname}" if m.islnk() else "")
            for m in members}


@pytest.fixture
def fs_rt(runtime, rt_home):
    """The module runtime; no filesystem image, mount or staging directory may be left."""
    tmp_before = set(os.listdir(runtime.images.root / "tmp"))
    yield runtime
    layouts = rt_home / fs_image.DIR
    assert not layouts.exists() or not [p for p in layouts.glob("*/*")]
    # work directories nobody works in (the store is the node's: others' pulls run there)
    left = set(os.listdir(runtime.images.root / "tmp")) - tmp_before
    assert not [d for d in left if _unowned(runtime.images.root, d)]
    mounted = Path("/proc/self/mountinfo").read_text()
    assert f"{runtime.images.root}/tmp" not in mounted


def _unowned(store: Path, work: str) -> bool:
    """Whether the store's work directory ``work`` is left over: its owner's lock is free."""
    import fcntl

    if not (store / "tmp" / work).exists():
        return False
    fd = os.open(store / "locks" / f"{work.split('.', 1)[0]}.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return (store / "tmp" / work).exists()


def test_a_diff_image_holds_exactly_the_changes(fs_rt):
    rt = fs_rt
    src = rt.create(image="ray-sandbox/busybox", memory="64Mi", readonly=False)
    image = kid = None
    try:
        done = rt.exec(src, CHANGES)
        assert done.exit_code == 0, done.stderr
        base = rt.images.inspect(rt.records.get(src).image_digest)
        image = rt.snapshot_filesystem(src)
        assert image.parent == base.digest  # a layer on the source image, not a copy
        assert diff_of(image) == EXPECTED_DIFF
        diff = Path(image.rootfs).parent / "diff"
        assert (diff / "opt/app/h1").stat().st_ino == (diff / "opt/app/h2").stat().st_ino
        assert os.readlink(diff / "opt/app/abs") == "/etc/shadow"  # a link, never followed
        assert (diff / "etc/passwd").read_text().endswith("more\n")

        members = layer_of(image.ref)
        assert names(members) == EXPECTED_LAYER
        order = [m.name for m in members]
        assert order.index("sbin/.wh..wh..opq") < order.index("sbin/new")
        suid = next(m for m in members if m.name == "opt/app/suid")
        assert (suid.mode, suid.uid, suid.gid) == (0o4711, 1234, 4321)
        # the source image's layers are referenced, by digest, before the new one
        layout = Path(image.ref.removeprefix("oci:").rsplit(":", 1)[0])
        blobs = layout / "blobs" / "sha256"
        manifest = json.loads((blobs / json.loads((layout / "index.json").read_text())[
            "manifests"][0]["digest"][7:]).read_text())
        base_oci = Path(base.rootfs).parent / "oci" / "blobs" / "sha256"
        for item in manifest["layers"][:-1]:
            assert (blobs / item["digest"][7:]).stat().st_ino == \
                (base_oci / item["digest"][7:]).stat().st_ino
        last = manifest["layers"][-1]["digest"]
        assert "sha256:" + hashlib.sha256((blobs / last[7:]).read_bytes()).hexdigest() == last

        kid = rt.create(image=image.ref, memory="64Mi", readonly=False)
        check = rt.exec(kid, "cat /opt/app/sub/f; tail -1 /opt/app/rel; "
                             "stat -c '%u:%g %a %h %n' /opt/app/suid /opt/app/h2 /opt/app "
                             "/etc/group; readlink /opt/app/abs; ls /sbin; ls /bin/ls || "
                             "echo no-ls; ls -d /root || echo no-root; cat /tmp/scratch || "
                             "echo no-tmp; ls /bin | wc -l")
        assert check.stdout.splitlines() == [
            "one", "more", "1234:4321 4711 1 /opt/app/suid", "0:0 644 2 /opt/app/h2",
            "0:0 750 2 /opt/app", "0:0 600 1 /etc/group", "/etc/shadow", "new", "no-ls",
            "no-root", "no-tmp", str(len(os.listdir(Path(base.rootfs) / "bin")) - 1),
        ], check.stderr
    finally:
        for sid in (src, kid):
            if sid is not None:
                rt.delete(sid, wait=True)
        if image is not None:
            rt.delete_filesystem_image(image.ref)


def test_files_changed_in_place_deep_down_are_found(fs_rt):
    """What lets the diff skip every directory whose mtime is the image's: gVisor's overlay
    creates an entry in each directory above a file it copies up (changed in place, or only
    its mode), so each of those directories' mtime changes. If a runsc stops doing so, this
    test fails rather than images losing such changes."""
    rt = fs_rt
    src = rt.create(image="ray-sandbox/python", memory="256Mi", readonly=False)
    image = None
    try:
        found = rt.exec(src, "set -e; f=$(ls /usr/lib/python3*/json/__init__.py); "
                             "echo '# changed' >> $f; g=$(ls /usr/lib/python3*/json/decoder.py);"
                             " chmod 0600 $g; echo $f; echo $g")
        assert found.exit_code == 0, found.stderr
        changed, chmodded = (p.lstrip("/") for p in found.stdout.split())
        image = rt.snapshot_filesystem(src)
        diff = diff_of(image)
        assert diff[changed] == "f 644 0:0" and diff[chmodded] == "f 600 0:0"
        assert set(diff) == {changed, chmodded} | {str(p) for p in Path(changed).parents
                                                   if str(p) != "."}
        kid = rt.create(image=image.ref, memory="256Mi")
        try:
            assert rt.exec(kid, f"tail -1 /{changed}").stdout == "# changed\n"
        finally:
            rt.delete(kid, wait=True)
    finally:
        rt.delete(src, wait=True)
        if image is not None:
            rt.delete_filesystem_image(image.ref)


def test_images_layer_on_images_and_a_parent_stays_while_its_child_needs_it(fs_rt):
    rt = fs_rt
    src = rt.create(image="ray-sandbox/busybox", memory="64Mi", readonly=False)
    first = second = None
    made: list[str] = []
    try:
        assert rt.exec(src, "mkdir /opt && echo 1 > /opt/one && echo x > /opt/gone").ok
        first = rt.snapshot_filesystem(src)
        made.append(kid := rt.create(image=first.ref, memory="64Mi", readonly=False))
        assert rt.exec(kid, "echo 2 > /opt/two && rm /opt/gone").ok
        second = rt.snapshot_filesystem(kid)
        assert second.parent == first.digest
        assert diff_of(second) == {"opt": "d 755 0:0", "opt/two": "f 644 0:0",
                                   "opt/gone": "whiteout"}
        made.append(grandkid := rt.create(image=second.ref, memory="64Mi"))
        assert rt.exec(grandkid, "cat /opt/*; ls /opt").stdout == "1\n2\none\ntwo\n"

        # the parent's name goes; its files stay while the child is stored
        for sid in made[:1]:
            rt.delete(sid, wait=True)
        rt.delete_filesystem_image(first.ref)
        with pytest.raises(ImageNotFoundError):
            rt.images.inspect(first.ref)
        assert rt.images.inspect(first.digest).digest == first.digest
        assert rt.exec(grandkid, "cat /opt/one").stdout == "1\n"
        rt.delete(grandkid, wait=True)
        rt.delete_filesystem_image(second.ref)
        for gone in (first, second):  # the child took its parent along
            with pytest.raises(ImageNotFoundError):
                rt.images.inspect(gone.digest)
            assert not Path(gone.rootfs).parent.exists()
        assert str(first.digest[7:]) not in Path("/proc/self/mountinfo").read_text()
    finally:
        for sid in [src, *made]:
            rt.delete(sid, wait=True)
        for image in (second, first):
            if image is not None:
                rt.delete_filesystem_image(image.ref)


def test_links_to_host_paths_and_host_binds_are_never_read(fs_rt):
    """Symlinks pointing at the host's files stay symlinks; the host's binds inside the
    sandbox (/etc/hosts, the agent's /.rsb) are not part of the image; nothing of the host
    lands in the diff."""
    rt = fs_rt
    src = rt.create(image="ray-sandbox/busybox", memory="64Mi", readonly=False)
    image = None
    try:
        assert rt.exec(src, "mkdir -p /opt/d && ln -s /etc/shadow /opt/shadow && "
                            "ln -s / /opt/root && ln -s ../../../../../../../etc /opt/d/up && "
                            "ln -s /opt/root/etc/passwd /opt/chain && echo x >> /etc/passwd").ok
        image = rt.snapshot_filesystem(src)
        diff = diff_of(image)
        assert {k for k, v in diff.items() if v.startswith("l")} == {
            "opt/shadow", "opt/root", "opt/d/up", "opt/chain"}
        assert "etc/hosts" not in diff and ".rsb" not in diff
        host_shadow = Path("/etc/shadow").read_bytes()
        root = Path(image.rootfs).parent / "diff"
        for path in root.rglob("*"):
            if path.is_file() and not path.is_symlink():
                assert host_shadow not in path.read_bytes()
    finally:
        rt.delete(src, wait=True)
        if image is not None:
            rt.delete_filesystem_image(image.ref)


def test_changes_over_the_bound_are_refused_before_anything_is_read(fs_rt):
    rt = fs_rt
    sid = rt.create(image="ray-sandbox/busybox", memory="64Mi", readonly=False, disk="64Mi")
    try:
        # sparse: costs the sandbox nothing, would cost the host 1 GiB
        assert rt.exec(sid, "mkdir -p /opt/a && dd if=/dev/zero of=/opt/a/big bs=1 count=0 "
                            "seek=1G").exit_code == 0
        with pytest.raises(ImageError, match="at /opt/a/big"):  # image size + disk=
            rt.snapshot_filesystem(sid)
        with pytest.raises(ImageError, match="at /opt/a/big"):
            rt.snapshot_filesystem(sid, max_bytes=512 << 20)
        client = rt._client(sid)
        base = rt.images.inspect(rt.records.get(sid).image_digest)
        diff = rt.home / "diff-bound"
        diff.mkdir()
        try:
            with pytest.raises(ImageError, match="over 3 files"):
                fs_image.capture_diff(client, sid, base, diff, rt.home / "x", max_entries=3)
            assert not (rt.home / "x").exists()
        finally:
            import shutil
            shutil.rmtree(diff)
    finally:
        rt.delete(sid, wait=True)


# Runs as root in a python sandbox and takes the agent's socket (as in
# tests/test_agent_untrusted.py): each listing of "/" answers the next scenario of SCENARIOS.
FAKE_AGENT = r"""
import os, socket, struct, threading, time
RUN = "/.rsb/run"
SOCK = RUN + "/agent.sock"
HDR = struct.Struct(">IB")
SCENARIOS = ["names", "twice", "huge"]

def frame(ftype, payload=b""):
    return HDR.pack(len(payload), ftype) + payload

def tlv(tag, value):
    if isinstance(value, int):
        return struct.pack(">BIq", tag, 8, value)
    return struct.pack(">BI", tag, len(value)) + value

def entry(path, kind, size=5, link=None, mode=0o644):
    out = (tlv(10, path) + tlv(40, kind) + tlv(41, size) + tlv(12, mode) + tlv(42, 0)
           + tlv(43, 0) + tlv(44, 1_000_000_000) + tlv(46, 7) + tlv(47, 1) + tlv(48, 1))
    return frame(0x46, out + (tlv(45, link) if link else b""))

def tlvs(payload):
    out, pos = [], 0
    while pos < len(payload):
        tag, n = struct.unpack(">BI", payload[pos:pos + 5])
        out.append((tag, payload[pos + 5:pos + 5 + n]))
        pos += 5 + n
    return out

def reads(items):
    out = b""
    for tag, value in items:
        if tag == 18:  # one LENGTH per file: its data, then END
            data = b"data!"[:struct.unpack(">q", value)[0]]
            out += (frame(0x20, data) if data else b"") + frame(0x47, tlv(41, len(data)))
    return out + frame(0x40)

ROOT = {
    "names": [entry(b"..", 2), entry(b".", 2), entry(b"a/b", 1), entry(b"x\0y", 1),
              entry(b".wh.etc", 1), entry(b"esc", 3, link=b"/etc/shadow"), entry(b"new", 2)],
    "twice": [entry(b"twice", 3, link=b"/"), entry(b"twice", 2)],
    "huge": [entry(b"big", 1, size=1 << 40)],
}
WALK = [entry(b"../../out-1", 1), entry(b"sub/../../out-2", 1), entry(b"ok", 1),
        entry(b"missing/out-3", 1), entry(b"ok/../../out-4", 1), entry(b"d", 2),
        entry(b"d/inner", 1), entry(b"/out-5", 1), entry(b"d/../../out-6", 1)]
state = {"n": 0}

def recv_exact(c, n):
    buf = b""
    while len(buf) < n:
        got = c.recv(n - len(buf))
        if not got:
            raise OSError("hung up")
        buf += got
    return buf

def serve(c):
    try:
        while True:
            length, ftype = HDR.unpack(recv_exact(c, 5))
            items = tlvs(recv_exact(c, length))
            path = dict(items).get(10, b"")
            if ftype == 0x01:
                c.sendall(frame(0x40, tlv(39, b"fake")))
            elif ftype == 0x03 and path == b"/proc/mounts":
                c.sendall(frame(0x20, b"none / overlay rw 0 0\n") + frame(0x40))
            elif ftype == 0x0D:
                c.sendall(reads(items))
            elif ftype == 0x06 and path == b"/":
                scenario = SCENARIOS[min(state["n"], len(SCENARIOS) - 1)]
                state["n"] += 1
                c.sendall(b"".join(ROOT[scenario]) + frame(0x40))
            elif ftype == 0x0C:
                c.sendall(b"".join(WALK) + frame(0x40))
            elif ftype not in (0x20, 0x21):
                c.sendall(frame(0x40))
    except OSError:
        pass
    finally:
        c.close()

open(RUN + "/checkpoint.hold", "w").close()
while os.path.exists(SOCK):
    time.sleep(0.01)
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(SOCK)
srv.listen(64)
for pid in os.listdir("/proc"):
    if pid.isdigit() and int(pid) not in (1, os.getpid()):
        try:
            if b"rsb-agent" in open(f"/proc/{pid}/cmdline", "rb").read():
                os.kill(int(pid), 9)
        except OSError:
            pass
open(RUN + "/fake.ready", "w").close()
while True:
    threading.Thread(target=serve, args=(srv.accept()[0],), daemon=True).start()
"""


@pytest.mark.timeout(300)
def test_a_hostile_agents_names_never_leave_the_diff(fs_rt, rt_home):
    """An agent replaced by root in the sandbox lists names with "/", "..", NUL, a name
    listed as a link and then as a directory, paths that climb out of a walked directory,
    children before their parents and a file of 1 TiB: the host writes only inside the
    diff, refuses what it cannot place, and keeps to its bound."""
    import time

    rt = fs_rt
    sid = rt.create(image="ray-sandbox/python", memory="256Mi", readonly=False)
    image = None
    try:
        rt.write_file(sid, "/tmp/fake_agent.py", FAKE_AGENT)
        rt.exec(sid, "python3 /tmp/fake_agent.py </dev/null >/dev/null 2>&1 &")
        ready = rt.sandboxes_dir / sid / "run" / "fake.ready"
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert time.monotonic() < deadline
            time.sleep(0.02)

        image = rt.snapshot_filesystem(sid)  # "names"
        diff = diff_of(image)
        assert {k: v for k, v in diff.items() if v != "whiteout"} == {
            "esc": "l 777 0:0", "new": "d 644 0:0", "new/ok": "f 644 0:0",
            "new/d": "d 644 0:0", "new/d/inner": "f 644 0:0"}
        assert os.readlink(Path(image.rootfs).parent / "diff" / "esc") == "/etc/shadow"
        assert (Path(image.rootfs).parent / "diff" / "new/ok").read_bytes() == b"data!"
        places = [rt.images.root / "tmp", Path(image.rootfs).parent, rt_home / fs_image.DIR]
        assert not [p for place in places for p in place.rglob("out-*")
                    if "rootfs" not in p.parts]
        assert not [*rt.images.root.glob("out-*"), *rt.images.root.glob("*/out-*")]

        with pytest.raises(ImageError, match="listed both"):  # "twice"
            rt.snapshot_filesystem(sid)
        with pytest.raises(ImageError, match="at /big"):  # "huge"
            rt.snapshot_filesystem(sid)
    finally:
        rt.delete(sid, wait=True)
        if image is not None:
            rt.delete_filesystem_image(image.ref)


def test_without_a_layout_to_layer_on_the_whole_root_is_copied(tmp_path):
    """The fallback: a source image whose OCI layout is gone cannot be referenced, so the
    whole root is copied into an image of one layer (unpacked by the store)."""
    from ray_sandbox.runtime import ImageStore, SandboxRuntime
    from tests.fx_runtime import leftovers

    store = ImageStore(tmp_path / "store")
    rt = SandboxRuntime(tmp_path / "home", images=store)
    image = None
    try:
        sid = rt.create(image="ray-sandbox/busybox", memory="64Mi", readonly=False)
        base = rt.images.inspect(rt.records.get(sid).image_digest)
        index = Path(base.rootfs).parent / "oci" / "index.json"
        index.rename(index.with_name("hidden"))
        assert fs_image.refused(base, store) is not None
        assert rt.exec(sid, "mkdir /opt && echo copied > /opt/f && rm /bin/ls").ok
        image = rt.snapshot_filesystem(sid)
        index.with_name("hidden").rename(index)
        assert image.parent is None and not (Path(image.rootfs).parent / "diff").exists()
        kid = rt.create(image=image.ref, memory="64Mi")
        assert rt.exec(kid, "cat /opt/f; ls /bin/ls || echo no-ls").stdout == "copied\nno-ls\n"
        rt.delete(kid, wait=True)
        rt.delete(sid, wait=True)
        rt.delete_filesystem_image(image.ref)
    finally:
        rt.close()
        rt.gc()
    assert leftovers(tmp_path / "home", store=tmp_path / "store") == {}


def test_the_agent_reads_many_regular_files_in_one_request(runtime, sandbox):
    """READS, what the diff reads changed files with: each item at most its length; a
    link, a FIFO, a device or a missing path ends at once, empty, and the rest go on."""
    assert runtime.exec(sandbox, "echo hello > /tmp/a && ln -s /tmp/a /tmp/link && "
                                 "mkfifo /tmp/fifo && head -c 300000 /dev/zero > /tmp/big").ok
    items = [("/tmp/a", 100), ("/tmp/link", 100), ("/tmp/fifo", 10), ("/dev/zero", 10),
             ("/tmp/missing", 5), ("/tmp/big", 262145), ("/tmp/a", 3)]
    got: dict[int, bytes] = {}
    ended = []
    for i, data in runtime._client(sandbox).read_files(items, chunk_size=65536):
        if data is None:
            ended.append(i)
        else:
            got[i] = got.get(i, b"") + data
    assert ended == list(range(len(items)))
    assert got == {0: b"hello\n", 5: b"\0" * 262145, 6: b"hel"}
