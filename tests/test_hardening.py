"""``directfs=False``: the sentry runs without gVisor's directfs and reaches the sandbox's
files only through the gofer; with network "none" or "sandbox" it runs as host uid 65534 with
no capabilities (with "host"/"public" runsc keeps it root: in the node's user namespace for
"host", in an identity-mapped one of its own for "public").
Checked on the host (``/proc/<sentry>/status``) and end to end: exec, files, archives, a
size-capped writable root and workdir, snapshot/restore/fork, every network mode; delete and
the reaper leave nothing."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest

from ray_sandbox.runtime import SandboxRuntime
from ray_sandbox.runtime.config import EgressPolicy
from ray_sandbox.runtime.network import netns as _netns
from tests.fx_hostile import runsc_pid
from tests.fx_network import WEB, WEB2, free_port
from tests.fx_runtime import leftovers, leftovers_after_teardown

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
    assert leftovers_after_teardown(runtime.home, {sid}) == {}


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
            runtime.snapshots.delete(snap)
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
    assert leftovers_after_teardown(runtime.home, {sid, *made}) == {}
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
                # runsc --network=host keeps the sentry root; without directfs it loses what
                # directfs adds (CAP_DAC_READ_SEARCH). "public" runs it in a user namespace of
                # its own (build_spec), "host" in the node's.
                assert not int(st["CapEff"], 16) & 1 << 2, st
                assert (_user_namespace(sid)[0] == NODE_USERNS) == (mode == "host"), mode
    finally:
        rt.close()
    assert leftovers(net_home, set(ids)) == {}


def _user_namespace(sandbox_id: str) -> tuple[str, list[str]]:
    pid = runsc_pid(b"runsc-sandbox", sandbox_id)
    return os.readlink(f"/proc/{pid}/ns/user"), Path(f"/proc/{pid}/uid_map").read_text().split()


NODE_USERNS = os.readlink("/proc/self/ns/user")


@pytest.mark.parametrize("hardened", [False, True], ids=["directfs", "no-directfs"])
@pytest.mark.usefixtures("clean_network")
def test_public_sandbox_sentry_is_not_in_the_node_user_namespace(net_home, image_store, upstream,
                                                                  busybox_image, hardened):
    """runsc --network=host (network "public") starts the sentry in the spec's user namespace,
    else in the node's; build_spec gives public sandboxes an identity-mapped one. "host" keeps
    the node's (trusted code only: its netns is the node's, owned by the node's namespace)."""
    rt = SandboxRuntime(net_home, images=image_store)
    try:
        opts = HARDENED if hardened else {}
        sid = rt.create(image="ray-sandbox/busybox", memory="64Mi", network="public", **opts)
        userns, uid_map = _user_namespace(sid)
        st = _sentry(sid)
        print(f"\npublic {opts}: sentry {userns} (node {NODE_USERNS}), uid_map {uid_map}, {st}")
        assert userns != NODE_USERNS
        assert uid_map == ["0", "0", str(2**32 - 1)]
        assert st["NoNewPrivs"] == "1" and st["Seccomp"] == "2", st
        got = rt.exec(sid, f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {WEB} 80")
        assert got.stdout.endswith(f"inet {WEB}\n"), got
        host = rt.create(image="ray-sandbox/busybox", memory="64Mi", network="host", **opts)
        assert _user_namespace(host)[0] == NODE_USERNS
    finally:
        rt.close()


def _get(netns: str, port: int) -> bytes:
    def get() -> bytes:
        for _ in range(100):
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", port), timeout=2) as s:
                if data := s.recv(100):
                    return data
            time.sleep(0.05)
        return b""

    return _netns.run_in(netns, get)


@pytest.mark.usefixtures("clean_network")
def test_public_sandbox_in_its_user_namespace_works_end_to_end(net_home, image_store, upstream,
                                                                busybox_image):
    """Exec, files, disk=, low ports (the sentry no longer owns the netns' user namespace),
    a published port, the egress policy; delete leaves nothing. (runsc cannot checkpoint a
    --network=host sandbox: "checkpoint not supported when using hostinet", with or without
    the user namespace.)"""
    rt = SandboxRuntime(net_home, images=image_store)
    port = free_port()
    made: list[str] = []
    try:
        sid = rt.create(image="ray-sandbox/busybox", memory="64Mi", network="public",
                        readonly=False, workdir="/w", disk="16Mi", expose_ports=(port,),
                        egress=EgressPolicy(deny_cidrs=[f"{WEB2}/32"]), **HARDENED)
        made.append(sid)
        assert _user_namespace(sid)[0] != NODE_USERNS
        rt.write_file(sid, "/w/a", b"work\n")
        rt.exec(sid, "echo root > /root/f")
        assert rt.read_file(sid, "/root/f") == b"root\n"
        res = rt.exec(sid, "dd if=/dev/zero of=/w/fill bs=1M count=32", timeout=120)
        assert res.exit_code != 0 and "No space left" in res.stderr
        rt.remove(sid, "/w/fill")
        for p, text in ((80, "low"), (port, "published")):
            rt.exec(sid, f"nc -ll -p {p} -e echo {text} </dev/null >/dev/null 2>&1 &")
        assert _get(upstream.node, port) == b"published\n"
        low = rt.exec(sid, "printf x | nc -w 2 127.0.0.1 80")
        assert low.stdout == "low\n", low
        assert rt.exec(sid, f"nc -w 3 {WEB2} 80 </dev/null").exit_code != 0
        got = rt.exec(sid, f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {WEB} 80")
        assert got.stdout.endswith(f"inet {WEB}\n"), got
    finally:
        for i in made:
            rt.delete(i)
        rt.close()
    assert leftovers(net_home, set(made)) == {}


OWNER = textwrap.dedent(
    """
    import sys, time
    from ray_sandbox.runtime import SandboxRuntime
    rt = SandboxRuntime(sys.argv[1])
    ids = [rt.create(image="ray-sandbox/busybox", memory="64Mi", directfs=False,
                     readonly=ro, workdir="/w", network=sys.argv[2]) for ro in (True, False)]
    print(" ".join(ids), flush=True)
    time.sleep(600)
    """
)


def _reaped(home: Path, image_store, network: str) -> None:
    env = {**os.environ, "RAY_SANDBOX_IMAGES": str(image_store.root)}
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(home), network],
                            stdout=subprocess.PIPE, text=True, env=env)
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


def test_reaper_removes_a_dead_owners_hardened_sandboxes(tmp_path, image_store, busybox_image):
    _reaped(tmp_path / "home", image_store, "none")


@pytest.mark.usefixtures("clean_network")
def test_reaper_removes_a_dead_owners_public_sandboxes(net_home, image_store, upstream,
                                                       busybox_image):
    """Public sandboxes run their sentry in a user namespace of their own: the reaper still
    finds and removes them, and their network."""
    _reaped(net_home, image_store, "public")
