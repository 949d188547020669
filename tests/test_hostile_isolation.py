"""Escape and isolation: what hostile code inside a real gVisor sandbox can see and touch of
the host and of other sandboxes. (Issue 10: hostile code, faults and load.)

Each test plays the attacker inside the sandbox and checks the outcome on the host. Holes in
code owned elsewhere are strict xfails whose reason names the bug; docs/security.md links each
claim to the test that proves it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from ray_sandbox.runtime import SandboxRuntime
from ray_sandbox.runtime.errors import SandboxError, UnsafePathError
from tests.fx_hostile import Listener, host_ipv4_addresses, rss_bytes, runsc_pid, wait_until

# A probe script run inside the Python sandbox: applies each named attempt and prints one JSON
# object {name: "ok" | errno name}. Keeps every test to one exec.
PROBE = r"""
import errno, json, os, socket, stat, sys
out = {}
def attempt(name, fn):
    try:
        fn()
        out[name] = "ok"
    except OSError as e:
        out[name] = errno.errorcode.get(e.errno, str(e.errno))
"""


def run_probe(runtime: SandboxRuntime, sid: str, body: str) -> dict[str, str]:
    res = runtime.exec(sid, ["python3", "-c", PROBE + body + "\nprint(json.dumps(out))"],
                       timeout=60)
    assert res.exit_code == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def names_inside(runtime: SandboxRuntime, sid: str) -> list[str]:
    """Every path in the sandbox's filesystem outside /proc, /sys and /dev (names only)."""
    code = (
        "import os\n"
        "for top in sorted(os.listdir('/')):\n"
        "    if top in ('proc', 'sys', 'dev'): continue\n"
        "    for d, dirs, files in os.walk('/' + top):\n"
        "        for n in dirs + files: print(os.path.join(d, n))\n"
    )
    res = runtime.exec(sid, ["python3", "-c", code], timeout=120)
    assert res.exit_code == 0, res.stderr
    return res.stdout.splitlines()


# --- host processes, files, devices, state ----------------------------------------------------


def test_proc_lists_only_the_sandbox_own_processes(runtime, probe):
    marker = f"{4000 + secrets.randbelow(1000)}.{secrets.randbelow(10**6)}"
    host = subprocess.Popen(["sleep", marker])  # a host process with a unique command line
    try:
        code = (
            "import os, json\n"
            "procs = {}\n"
            "for p in os.listdir('/proc'):\n"
            "    if p.isdigit():\n"
            "        with open(f'/proc/{p}/cmdline', 'rb') as f:\n"
            "            procs[p] = f.read().replace(b'\\0', b' ').decode(errors='replace')\n"
            "print(json.dumps(procs))\n"
        )
        res = runtime.exec(probe, ["python3", "-c", code])
        procs = json.loads(res.stdout)
    finally:
        host.kill()
        host.wait()
    assert not [c for c in procs.values() if marker in c]
    assert procs["1"].startswith("/.rsb/bin/rsb-agent init")
    # agent (PID 1), the connection handler, and the probe itself: nothing else exists
    others = [c for p, c in procs.items() if p != "1" and "python3 -c" not in c]
    assert all(c.startswith("/.rsb/bin/rsb-agent") for c in others), procs


def test_host_files_and_hostname_are_invisible(runtime, probe, tmp_path, rt_home):
    token = "rsb-marker-" + secrets.token_hex(8)
    (tmp_path / token).write_text(token)
    names = names_inside(runtime, probe)
    assert not [n for n in names if token in n]
    res = runtime.exec(probe, ["cat", str(tmp_path / token)])
    assert res.exit_code != 0 and token not in res.stdout
    for host_path in (tmp_path, rt_home, rt_home / "sandboxes" / probe):
        assert runtime.exec(probe, ["test", "-e", str(host_path)]).exit_code != 0
    inside = runtime.exec(probe, ["cat", "/etc/hostname"]).stdout.strip()
    assert inside == f"sandbox-{probe[:8]}" and inside != socket.gethostname()
    assert runtime.exec(probe, ["uname", "-n"]).stdout.strip() == inside


def test_no_host_devices_even_with_mknod(runtime, probe):
    root_dev = os.stat("/").st_dev
    out = run_probe(runtime, probe, f"""
out['dev'] = sorted(os.listdir('/dev'))
for name, kind, major, minor in [
        ('disk', stat.S_IFBLK, {os.major(root_dev)}, {os.minor(root_dev)}),
        ('mem', stat.S_IFCHR, 1, 1), ('kvm', stat.S_IFCHR, 10, 232)]:
    attempt('mknod-' + name, lambda: os.mknod('/tmp/' + name, kind | 0o600,
                                              os.makedev(major, minor)))
    attempt('read-' + name, lambda: open('/tmp/' + name, 'rb').read(512))
""")
    # Only gVisor's own emulated devices exist; nodes made for host devices are inert.
    assert set(out.pop("dev")) <= {"fd", "full", "fuse", "net", "null", "ptmx", "pts", "random",
                                   "shm", "stderr", "stdin", "stdout", "tty", "urandom", "zero"}
    for name in ("disk", "mem", "kvm"):
        assert out[f"read-{name}"] in ("ENXIO", "ENODEV", "EPERM", "EACCES", "ENOENT"), out


def test_runsc_state_and_home_are_invisible(runtime, probe, rt_home):
    names = names_inside(runtime, probe)
    assert not [n for n in names if probe in n or "runsc" in n or ".gvisor" in n]
    for path in (rt_home / "runsc", "/var/lib/ray_sandbox", "/run/runsc"):
        assert runtime.exec(probe, ["test", "-e", str(path)]).exit_code != 0
    # The only host directories mounted in are the agent's (ro) and its socket dir.
    mounts = runtime.exec(probe, ["cat", "/proc/mounts"]).stdout
    points = {line.split()[1] for line in mounts.splitlines()}
    assert points <= {"/", "/dev", "/dev/pts", "/dev/shm", "/sys", "/tmp", "/proc", "/.rsb/bin",
                      "/.rsb/run", "/etc/hosts", "/etc/hostname", "/etc/resolv.conf"}, points


def test_other_sandbox_files_and_processes_are_invisible(runtime, probe):
    token = "rsb-secret-" + secrets.token_hex(8)
    other = runtime.create(image="ray-sandbox/busybox", memory="64Mi", readonly=False,
                           workdir="/work")
    try:
        script = (f"for d in /root /tmp /work /dev/shm /etc; do echo {token} > $d/{token}; done;"
                  f" sleep 300 &")
        runtime.exec(other, ["/bin/sh", "-c", script])
        names = names_inside(runtime, probe)
        assert not [n for n in names if token in n]
        ps = runtime.exec(probe, ["sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"]).stdout
        assert "sleep 300" not in ps
        # nor through the host path of the other's socket directory
        res = runtime.exec(probe, ["ls", f"{runtime.sandboxes_dir}/{other}/run"])
        assert res.exit_code != 0
    finally:
        runtime.delete(other)


def _tree_digest(root: Path) -> dict[str, tuple[int, int, str]]:
    """path -> (mode, uid, content sha256 or link target), without following symlinks."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if os.path.islink(p):
                what = "->" + os.readlink(p)
            elif os.path.isfile(p):
                what = hashlib.sha256(Path(p).read_bytes()).hexdigest()
            else:
                what = ""
            out[os.path.relpath(p, root)] = (st.st_mode, st.st_uid, what)
    return out


@pytest.mark.parametrize("readonly", [False, True])
def test_shared_image_rootfs_unwritable_and_unchanged(runtime, image_store, readonly):
    rootfs = Path(image_store.get("ray-sandbox/busybox").rootfs)
    before = _tree_digest(rootfs)
    sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi", readonly=readonly)
    try:
        vandal = ("echo pwned > /etc/passwd; chmod 777 /etc /bin/busybox; chown 1:1 /bin;"
                  " touch /new; ln -sf /etc/passwd /bin/ls; mkdir -p /x/y;"
                  " echo x >> /bin/busybox; mv /bin/sh /bin/sh2; rm -rf /usr /sbin;"
                  " mount -o remount,rw / ; true")
        runtime.exec(sid, ["/bin/busybox", "sh", "-c", vandal])
    finally:
        runtime.delete(sid)
    after = _tree_digest(rootfs)
    assert after == before, sorted(set(after.items()) ^ set(before.items()))[:10]


def _status(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def test_sentry_and_gofer_are_confined_on_the_host(runtime, probe):
    """What a sentry compromise would hold (measured; docs/security.md): both processes have
    NoNewPrivs and a seccomp filter; the sentry lives in its own user namespace, chrooted to
    an empty directory. With directfs (runsc's default) that namespace maps uid 0 to host
    root and keeps the container's capabilities, so the seccomp filter and the chroot are
    what confine it; directfs=False runs it as 65534 with no capabilities
    (tests/test_hardening.py)."""
    sentry = runsc_pid(b"runsc-sandbox", probe)
    gofer = runsc_pid(b"runsc-gofer", probe)
    for pid in (sentry, gofer):
        st = _status(pid)
        assert st["NoNewPrivs"] == "1" and st["Seccomp"] == "2", st
    assert os.readlink(f"/proc/{sentry}/ns/user") != os.readlink("/proc/self/ns/user")
    assert set(os.listdir(f"/proc/{sentry}/root")) <= {"proc", "etc", "dev", "tmp"}
    assert int(_status(gofer)["CapEff"], 16) & ~0x4001F == 0  # only file-serving capabilities


def test_run_dir_sockets_are_create_only(runtime, probe):
    """--host-uds=create: the sandbox may bind sockets that appear on the host (that is how
    the agent's socket gets out), but cannot connect to a host socket put in the same dir."""
    host_sock = runtime.sandboxes_dir / probe / "run" / "host.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(host_sock))
    srv.listen(1)
    srv.settimeout(0.5)
    try:
        out = run_probe(runtime, probe, """
attempt('connect-host-socket', lambda: socket.socket(socket.AF_UNIX).connect(
    '/.rsb/run/host.sock'))
""")
        assert out["connect-host-socket"] == "ECONNREFUSED"
        with pytest.raises(TimeoutError):
            srv.accept()
    finally:
        srv.close()
        host_sock.unlink()


# --- capabilities and network -----------------------------------------------------------------

CAP_ATTEMPTS = """
attempt('chown', lambda: os.chown('/tmp', 1000, 1000))
attempt('raw-socket', lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP))
attempt('packet-socket', lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0))
attempt('setuid-file', lambda: os.chmod('/tmp', 0o4777))
attempt('mknod-char', lambda: os.mknod('/tmp/null2', stat.S_IFCHR | 0o666, os.makedev(1, 3)))
attempt('mknod-fifo', lambda: os.mknod('/tmp/fifo', stat.S_IFIFO | 0o600))
out['capeff'] = [l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')][0]
"""
MKNOD_ATTEMPTS = """
attempt('mknod-char', lambda: os.mknod('/tmp/null3', stat.S_IFCHR | 0o666, os.makedev(1, 3)))
attempt('mknod-block', lambda: os.mknod('/tmp/loop9', stat.S_IFBLK | 0o600, os.makedev(7, 9)))
attempt('mknodat-char', lambda: os.mknod('null4', stat.S_IFCHR | 0o666, os.makedev(1, 3),
                                         dir_fd=os.open('/tmp', os.O_RDONLY)))
attempt('mknod-fifo', lambda: os.mknod('/tmp/fifo2', stat.S_IFIFO | 0o600))
attempt('mknod-socket', lambda: os.mknod('/tmp/sock2', stat.S_IFSOCK | 0o600))
attempt('mknod-regular', lambda: os.mknod('/tmp/reg2', 0o600))
"""


def test_no_capabilities_blocks_chown_and_raw_sockets(runtime, probe):
    sid = runtime.create(image="ray-sandbox/python", memory="256Mi", capabilities=[])
    try:
        out = run_probe(runtime, sid, CAP_ATTEMPTS)
    finally:
        runtime.delete(sid)
    default = run_probe(runtime, probe, CAP_ATTEMPTS.replace("/tmp/", "/tmp/d-"))
    assert out["capeff"] == "0000000000000000"
    assert out["chown"] == "EPERM" and default["chown"] == "ok"  # the capability matters
    assert out["raw-socket"] == "EPERM" and out["packet-socket"] == "EPERM"
    assert out["mknod-fifo"] == "ok"  # no capability needed, as on Linux


def test_no_capabilities_blocks_mknod(runtime, probe):
    """gVisor does not check CAP_MKNOD; without it the spec carries a seccomp filter the
    sentry enforces (runsc --oci-seccomp): device nodes are refused like on Linux, FIFOs,
    sockets and regular files are not, and a restored copy keeps the filter."""
    sid = runtime.create(image="ray-sandbox/python", memory="256Mi", capabilities=[])
    try:
        out = run_probe(runtime, sid, MKNOD_ATTEMPTS)
        copy = runtime.fork(sid)[0]
        try:
            forked = run_probe(runtime, copy, MKNOD_ATTEMPTS.replace("/tmp/", "/tmp/f-"))
        finally:
            runtime.delete(copy)
    finally:
        runtime.delete(sid)
    default = run_probe(runtime, probe, MKNOD_ATTEMPTS.replace("/tmp/", "/tmp/m-"))
    for got in (out, forked):
        assert got["mknod-char"] == got["mknod-block"] == got["mknodat-char"] == "EPERM", got
        assert got["mknod-fifo"] == got["mknod-socket"] == got["mknod-regular"] == "ok", got
    assert default["mknod-char"] == default["mknod-block"] == "ok"  # CAP_MKNOD grants it


def test_network_none_reaches_nothing(runtime, probe, loopback_tcp, host_abstract):
    host_ips = host_ipv4_addresses()
    port = loopback_tcp.address[1]
    out = run_probe(runtime, probe, f"""
out['ifaces'] = [n for _, n in socket.if_nameindex()]
def connect(addr, family=socket.AF_INET):
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(3)
        s.connect(addr)
attempt('tcp-loopback', lambda: connect(('127.0.0.1', {port})))
attempt('tcp-localhost6', lambda: connect(('::1', {port}), socket.AF_INET6))
for ip in {host_ips!r}:
    attempt('tcp-host-' + ip, lambda: connect((ip, {port})))
attempt('abstract', lambda: connect({host_abstract.address!r}, socket.AF_UNIX))
attempt('udp-out', lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(
    b'x', ('1.1.1.1', 53)))
attempt('dns', lambda: socket.getaddrinfo('example.com', 80))
""")
    assert out.pop("ifaces") == ["lo"]
    assert out.pop("dns") != "ok"
    assert all(v != "ok" for v in out.values()), out
    assert loopback_tcp.hits == [] and host_abstract.hits == []


# --- transfers: host files in, sandbox files out ----------------------------------------------


def test_upload_sends_only_what_was_asked(runtime, sandbox, tmp_path):
    token = "rsb-hostsecret-" + secrets.token_hex(8)
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "key").write_text(token)
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("a")
    (src / "sub" / "b.txt").write_text("b")
    os.symlink("a.txt", src / "inside-link")
    clean = {"a.txt", "sub", "sub/b.txt", "inside-link"}
    runtime.upload_dir(sandbox, src, "/tmp/clean")
    walked = runtime.exec(sandbox, ["/bin/sh", "-c", "cd /tmp/clean && find . | cut -c3-"])
    assert set(walked.stdout.split()) - {""} == clean
    # links that lead out of the uploaded directory: their targets must never be read
    os.symlink(secret / "key", src / "abs-link")
    os.symlink("../secret/key", src / "rel-link")
    os.symlink(secret, src / "dir-link")
    with contextlib.suppress(UnsafePathError):
        runtime.upload_dir(sandbox, src, "/tmp/up")
    grep = runtime.exec(sandbox, ["/bin/sh", "-c", f"grep -r {token} /tmp /root; find / -name key"
                                  " 2>/dev/null | grep -v ^/proc"])
    assert token not in grep.stdout and "/key" not in grep.stdout
    runtime.upload_file(sandbox, src / "a.txt", "/tmp/one")
    assert runtime.read_file(sandbox, "/tmp/one") == b"a"


def test_planted_symlinks_cannot_redirect_downloads(runtime, sandbox, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "dest"
    plant = (f"mkdir -p /tmp/o/d && echo data > /tmp/o/d/f && ln -s {outside} /tmp/o/abs &&"
             f" ln -s ../../.. /tmp/o/d/up && ln -s /etc/passwd /tmp/o/passwd &&"
             f" ln -s {outside}/file /tmp/file")
    assert runtime.exec(sandbox, ["/bin/sh", "-c", plant]).exit_code == 0
    with pytest.raises(UnsafePathError):
        runtime.download_dir(sandbox, "/tmp/o", dest)
    # download_file reads through a symlink *inside* the sandbox only: a dangling link to a
    # host path is just a missing file there
    with pytest.raises(SandboxError):
        runtime.download_file(sandbox, "/tmp/file", tmp_path / "got")
    runtime.download_file(sandbox, "/tmp/o/passwd", tmp_path / "passwd")
    assert (tmp_path / "passwd").read_text().startswith("root:")  # the sandbox's own file
    assert list(outside.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest", "outside", "passwd"]


def _chain_scripts(dest: Path) -> list[str]:
    """Sandbox-side steps of the tarfile ``data`` filter bypass (CVE-2025-4517): a symlink
    whose real target passes PATH_MAX is not resolved by os.path.realpath, so a later link
    through it is judged to stay inside. Each step is one download into the same host dir."""
    steps = "abcdefghijklmnop"
    comp = "d" * ((4096 - len(str(dest)) - 1) // (len(steps) + 1))
    deep = "/".join(steps)
    ups = "/".join([".."] * len(steps))
    return [
        # host gets real dirs d/d/..., with short symlinks a, d/b, d/d/c ... into them
        f"rm -rf /tmp/o; mkdir /tmp/o; cd /tmp/o; ln -s {comp} a;"
        f" for s in {' '.join(steps[1:])}; do mkdir {comp}; cd {comp}; ln -s {comp} $s; done;"
        f" mkdir {comp}",
        # through them: a link back to dest (legit) and one whose check overflows PATH_MAX
        f"rm -rf /tmp/o; mkdir -p /tmp/o/{deep}; cd /tmp/o; ln -s {ups} {deep}/{'l' * 254};"
        f" ln -s {deep}/{'l' * 254}/.. escape",
        # a plain file under 'escape' lands in dest's parent on the host
        "rm -rf /tmp/o; mkdir -p /tmp/o/escape; echo pwned > /tmp/o/escape/newfile",
    ]


def test_download_dir_symlink_chain_cannot_write_outside_target(runtime, sandbox, tmp_path):
    dest = tmp_path / "dest"
    for script in _chain_scripts(dest):
        assert runtime.exec(sandbox, ["/bin/sh", "-c", script]).exit_code == 0
        with contextlib.suppress(SandboxError):
            runtime.download_dir(sandbox, "/tmp/o", dest)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dest"], "wrote outside local_dir"


def test_read_of_planted_device_is_bounded(runtime):
    sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi")
    outcome: dict[str, object] = {}

    def read() -> None:
        try:
            outcome["len"] = len(runtime.read_file(sid, "/tmp/result.txt"))
        except SandboxError as exc:
            outcome["error"] = exc

    try:
        runtime.exec(sid, ["ln", "-s", "/dev/zero", "/tmp/result.txt"])
        base = rss_bytes()
        threading.Thread(target=read, daemon=True).start()
        # Give up (by deleting the sandbox) long before the read can hurt the shared host.
        wait_until(lambda: bool(outcome) or rss_bytes() - base > LIMIT, 15)
        growth = rss_bytes() - base
        refused = isinstance(outcome.get("error"), SandboxError)
    finally:
        runtime.delete(sid)
    assert refused and growth < LIMIT, f"host RSS grew {growth >> 20} MiB"


LIMIT = 256 << 20


def test_download_of_planted_fifo_does_not_hang(runtime, tmp_path):
    sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi")
    outcome: dict[str, object] = {}

    def download() -> None:
        try:
            runtime.download_file(sid, "/tmp/pipe", tmp_path / "out")
            outcome["done"] = True
        except SandboxError as exc:
            outcome["error"] = exc

    try:
        runtime.exec(sid, ["mkfifo", "/tmp/pipe"])
        t = threading.Thread(target=download, daemon=True)
        t.start()
        finished = wait_until(lambda: bool(outcome), 10)
    finally:
        runtime.delete(sid)  # unblocks the call if it hung
    assert finished and isinstance(outcome.get("error"), SandboxError)


# --- the agent's socket directory -------------------------------------------------------------


def test_deleted_or_hijacked_agent_socket_gives_nothing_on_host(runtime, tmp_path):
    sid = runtime.create(image="ray-sandbox/python", memory="256Mi")
    run_dir = runtime.sandboxes_dir / sid / "run"
    try:
        # Deleted: the agent re-creates it (checked every 0.5 s) and the host carries on.
        runtime.exec(sid, ["rm", "-f", "/.rsb/run/agent.sock"])
        assert wait_until(lambda: (run_dir / "agent.sock").exists(), 5)
        runtime._connections.close(sid)  # force fresh connections
        assert wait_until(lambda: _answers_quietly(runtime, sid), 10)
        # Replaced by a fake agent that answers garbage and huge frame lengths: every call
        # fails fast with a typed error, the host does not allocate what the fake claims.
        runtime.write_file(sid, "/tmp/fake.py", FAKE_AGENT)
        runtime.exec(sid, ["/bin/sh", "-c", "python3 /tmp/fake.py >/dev/null 2>&1 &"])
        time.sleep(1)
        base = rss_bytes()
        t0 = time.monotonic()
        for call in (lambda: runtime.exec(sid, ["true"], timeout=5),
                     lambda: runtime.read_file(sid, "/etc/passwd"),
                     lambda: runtime.write_file(sid, "/tmp/x", b"x")):
            with pytest.raises(SandboxError):
                call()
        assert time.monotonic() - t0 < 30
        assert rss_bytes() - base < 64 << 20
        assert sorted(p.name for p in run_dir.iterdir()) == ["agent.sock"]
    finally:
        runtime.delete(sid)


FAKE_AGENT = """
import os, socket, struct
os.kill(1, 19)  # SIGSTOP the real agent so it cannot take its socket back
path = "/.rsb/run/agent.sock"
s = socket.socket(socket.AF_UNIX)
os.unlink(path)
s.bind(path)
s.listen(8)
while True:
    c, _ = s.accept()
    c.sendall(struct.pack(">IB", 0xFFFFFFF0, 0x45) + os.urandom(64))
    c.close()
"""


def _answers_quietly(runtime: SandboxRuntime, sid: str) -> bool:
    try:
        return runtime.exec(sid, ["true"], timeout=5).exit_code == 0
    except SandboxError:
        return False


def test_agent_socket_symlink_is_not_followed(runtime, host_unix: Listener):
    sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi")
    try:
        # A background process retires this connection, so the next call connects anew.
        hijack = f"kill -STOP 1; ln -sf {host_unix.address} /.rsb/run/agent.sock; sleep 60 &"
        runtime.exec(sid, ["/bin/sh", "-c", hijack])
        with contextlib.suppress(SandboxError):
            runtime.exec(sid, ["echo", "for-the-sandbox"], timeout=5)
    finally:
        runtime.delete(sid)
    assert host_unix.hits == [], f"host connected to a host socket: {host_unix.hits[:1]}"


def test_host_binds_cannot_fill_host_disk(runtime):
    sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi")
    sdir = runtime.sandboxes_dir / sid
    try:
        runtime.exec(sid, ["/bin/sh", "-c",
                           "dd if=/dev/zero of=/.rsb/run/junk bs=1M count=16;"
                           " dd if=/dev/zero of=/etc/hosts bs=1M count=16"], timeout=60)
        used = sum(f.stat().st_size for f in (sdir / "run").iterdir() if f.is_file())
        used += (sdir / "etc" / "hosts").stat().st_size
    finally:
        runtime.delete(sid)
    assert used < 1 << 20, f"{used >> 20} MiB written to the host disk"
