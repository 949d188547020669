"""``directfs=False``: the sentry runs without gVisor's directfs and reaches the sandbox's
files only through the gofer; with network "none" or "sandbox" it runs as host uid 65534 with
no capabilities (with "host"/"public" runsc keeps it root in the node's user namespace).
Checked on the host (``/proc/<sentry>/status``) and end to end: exec, files, archives, a
size-capped writable root and workdir, snapshot/restore/fork, every network mode; delete and
the reaper leave nothing."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

from ray_sandbox.runtime import SandboxRuntime
from tests.fx_hostile import runsc_pid
from tests.fx_network import WEB
from tests.fx_runtime import leftovers

HARDENED = {"directfs": False}


def _sentry(sandbox_id: str) -> dict[str, str]:
    """The sentry's host identity: real/effective/saved/fs uids and capability sets."""
    lines = Path(f"/proc/{runsc_pid(b'runsc-sandbox', sandbox_id)}/status").read_text()
    st = {k: v.strip() for k, _, v in (line.partition(":") for line in lines.splitlines())}
    return {"uids": st["Uid"].split(), "CapEff": st["CapEff"], "CapPrm": st["CapPrm"],
            "NoNewPrivs": st["NoNewPrivs"], "Seccomp": st["Seccomp"]}


def test_sentry_without_directfs_has_no_root_and_no_capabilities(runtime):
    default = runtime.create(image="ray-sandbox/busybox", memory="64Mi")
    hardened = runtime.create(image="ray-sandbox/busybox", memory="64Mi", **HARDENED)
    try:
        d, h = _sentry(default), _sentry(hardened)
        # Today's default (directfs): host uid 0 in its user namespace, with capabilities.
        assert d["uids"] == ["0"] * 4 and int(d["CapEff"], 16) != 0, d
        assert h["uids"] == ["65534"] * 4, h
        assert int(h["CapEff"], 16) == 0 and int(h["CapPrm"], 16) == 0, h
        for st in (d, h):
            assert st["NoNewPrivs"] == "1" and st["Seccomp"] == "2", st
        assert runtime.record(hardened).directfs is False
        assert runtime.exec(hardened, "echo ok").stdout == "ok\n"
    finally:
        runtime.delete(default)
        runtime.delete(hardened)


def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def _members(stream) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}


@pytest.mark.parametrize("readonly", [True, False])
def test_files_archives_and_a_capped_disk_work_without_directfs(runtime, tmp_path, readonly):
    """The workdir (a host bind, read-only root) and the writable root (runsc's filestore)
    both live on the disk= filesystem; the gofer now does every file operation there."""
    sid = runtime.create(image="ray-sandbox/python", memory="256Mi", readonly=readonly,
                         workdir="/w", disk="16Mi", **HARDENED)
    try:
        assert runtime.exec(sid, ["python3", "-c", "print(6 * 7)"]).stdout == "42\n"
        for path in ("/w/a.txt", "/tmp/t.txt") + (() if readonly else ("/root/r.txt",)):
            runtime.write_file(sid, path, b"data " + path.encode())
            assert runtime.read_file(sid, path) == b"data " + path.encode()
        local = tmp_path / "up.bin"
        local.write_bytes(os.urandom(1 << 20))
        runtime.upload_file(sid, local, "/w/up.bin")
        runtime.download_file(sid, "/w/up.bin", tmp_path / "down.bin")
        assert (tmp_path / "down.bin").read_bytes() == local.read_bytes()
        runtime.put_archive(sid, "/w/tree", [_tar({"x/y.txt": b"y", "z.txt": b"z"})])
        assert _members(runtime.get_archive(sid, "/w/tree")) == {"x/y.txt": b"y", "z.txt": b"z"}
        assert sorted(i.name for i in runtime.list_dir(sid, "/w/tree")) == ["x", "z.txt"]
        res = runtime.exec(sid, "dd if=/dev/zero of=/w/fill bs=1M count=32", timeout=120)
        assert res.exit_code != 0 and "No space left" in res.stderr
        runtime.remove(sid, "/w/fill")
        runtime.write_file(sid, "/w/after", b"space again")
    finally:
        runtime.delete(sid)
    assert leftovers(runtime.home, {sid}) == {}


def test_snapshot_restore_and_fork_keep_the_hardened_sentry(runtime):
    """A restore needs the source's --directfs: with the other value runsc fails (ENOMEM)."""
    sid = runtime.create(image="ray-sandbox/python", memory="256Mi", readonly=False,
                         workdir="/w", **HARDENED)
    made: list[str] = []
    try:
        runtime.exec(sid, "echo root > /root/f && echo work > /w/f && echo tmp > /tmp/f")
        snap = runtime.snapshot(sid)
        try:
            made += runtime.restore(snap, 2)
        finally:
            runtime.delete_snapshot(snap)
        made += runtime.fork(sid)
        for copy in made:
            assert runtime.exec(copy, "cat /root/f /w/f /tmp/f").stdout == "root\nwork\ntmp\n"
            assert runtime.record(copy).directfs is False
            assert _sentry(copy)["uids"] == ["65534"] * 4
        runtime.write_file(made[0], "/root/f", b"changed\n")
        assert runtime.read_file(made[1], "/root/f") == b"root\n"
    finally:
        for i in [sid, *made]:
            runtime.delete(i)
    assert leftovers(runtime.home, {sid, *made}) == {}
    assert list((runtime.home / "snapshots").iterdir()) == []


@pytest.mark.usefixtures("clean_network")
def test_every_network_mode_works_without_directfs(net_home, image_store, upstream, busybox_image):
    rt = SandboxRuntime(net_home, images=image_store)
    ids: list[str] = []
    try:
        for mode in ("none", "host", "public", "sandbox"):
            sid = rt.create(image="ray-sandbox/busybox", memory="64Mi", network=mode,
                            **HARDENED)
            ids.append(sid)
            ifaces = {line.split()[1] for line in rt.exec(sid, "ip -o addr").stdout.splitlines()}
            assert (ifaces == {"lo"}) == (mode == "none"), (mode, ifaces)
            if mode in ("public", "sandbox"):
                got = rt.exec(sid, f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {WEB} 80")
                assert got.stdout.endswith(f"inet {WEB}\n"), (mode, got)
            st = _sentry(sid)
            if mode in ("none", "sandbox"):
                assert st["uids"] == ["65534"] * 4 and int(st["CapEff"], 16) == 0, (mode, st)
            else:
                # runsc --network=host keeps the sentry root (the xfail below); without
                # directfs it loses what directfs adds (CAP_DAC_READ_SEARCH).
                assert not int(st["CapEff"], 16) & 1 << 2, st
    finally:
        rt.close()
    assert leftovers(net_home, set(ids)) == {}


@pytest.mark.xfail(strict=True, reason=(
    "runsc 20240729 starts the sentry of a --network=host sandbox (network 'public' and "
    "'host') in the caller's user namespace: host uid 0 with the container's capabilities + "
    "CAP_SYS_PTRACE, directfs or not, where 'none'/'sandbox' get their own user namespace "
    "(and uid 65534 without directfs). Fix: give such sandboxes a user namespace in the spec; "
    "an identity mapping (0->0, size 2^32-1) added by spec_transform put the sentry in its own "
    "user namespace with public networking working (measured once); a non-identity mapping "
    "failed to start ('cannot read client sync file')"))
@pytest.mark.usefixtures("clean_network")
def test_public_sandbox_sentry_is_not_in_the_node_user_namespace(net_home, image_store, upstream,
                                                                  busybox_image):
    rt = SandboxRuntime(net_home, images=image_store)
    try:
        sid = rt.create(image="ray-sandbox/busybox", memory="64Mi", network="public", **HARDENED)
        sentry = runsc_pid(b"runsc-sandbox", sid)
        assert os.readlink(f"/proc/{sentry}/ns/user") != os.readlink("/proc/self/ns/user")
    finally:
        rt.close()


OWNER = textwrap.dedent(
    """
    import sys, time
    from ray_sandbox.runtime import SandboxRuntime
    rt = SandboxRuntime(sys.argv[1])
    ids = [rt.create(image="ray-sandbox/busybox", memory="64Mi", directfs=False,
                     readonly=ro, workdir="/w") for ro in (True, False)]
    print(" ".join(ids), flush=True)
    time.sleep(600)
    """
)


def test_reaper_removes_a_dead_owners_hardened_sandboxes(tmp_path, image_store, busybox_image):
    home = tmp_path / "home"
    env = {**os.environ, "RAY_SANDBOX_IMAGES": str(image_store.root)}
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(home)], stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        ids = proc.stdout.readline().split()
        assert len(ids) == 2
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert set(ids) <= set(leftovers(home, set(ids))["sandbox_dirs"])
    rt = SandboxRuntime(home, images=image_store)  # the reaper runs at start
    assert leftovers(home, set(ids)) == {}
    assert rt.gc() == []
