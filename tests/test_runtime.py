"""SandboxRuntime on real gVisor sandboxes: lifecycle, filesystem semantics, limits, status,
bad input. (Issue: SandboxRuntime.)"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ray_sandbox.runtime import SandboxState
from ray_sandbox.runtime.errors import (
    ConfigError,
    ExecError,
    ImageError,
    SandboxCreationError,
    SandboxNotFoundError,
)
from tests.fx_runtime import pids_inside


def harden_spec(spec):
    spec["process"]["rlimits"] = [{"type": "RLIMIT_NPROC", "hard": 64, "soft": 64}]
    if "capabilities" in spec["process"]:
        for cap_type in spec["process"]["capabilities"]:
            spec["process"]["capabilities"][cap_type] = []
    return spec


def test_issue_example_with_spec_transform(runtime):
    sb_id = runtime.create(image="ray-sandbox/python", memory="512Mi",
                           _oci_spec_transform_fn=harden_spec)
    try:
        assert runtime.exec(sb_id, "python3 -c 'print(1)'").stdout == "1\n"
        # the hook really reached runsc: no capabilities inside, NPROC limit applied
        status = runtime.exec(sb_id, "grep -E '^Cap(Eff|Bnd)' /proc/self/status").stdout
        assert status.split() == ["CapEff:", "0000000000000000", "CapBnd:", "0000000000000000"]
        limits = runtime.exec(sb_id, "grep 'Max processes' /proc/self/limits").stdout
        assert limits.split()[2:4] == ["64", "64"]
    finally:
        runtime.delete(sb_id)


def test_status_transitions_and_idempotent_delete(runtime):
    sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi")
    assert runtime.get_status(sid).state == SandboxState.RUNNING
    assert sid in runtime.list()
    runtime.runsc.pause(sid)
    assert runtime.get_status(sid).state == SandboxState.PAUSED
    runtime.runsc.resume(sid)
    assert runtime.get_status(sid).state == SandboxState.RUNNING
    runtime.delete(sid)
    st = runtime.get_status(sid)
    assert (st.state, st.reason) == (SandboxState.TERMINATED, "Deleted")
    runtime.delete(sid)  # idempotent
    with pytest.raises(SandboxNotFoundError):
        runtime.exec(sid, "true")
    assert sid not in runtime.list()


def test_readonly_root_writable_tmp_and_workdir(runtime, image_store):
    sid = runtime.create(image="ray-sandbox/busybox", workdir="/work/space", memory="64Mi")
    try:
        res = runtime.exec(sid, "touch /etc/evil")
        assert res.exit_code != 0 and "Read-only file system" in res.stderr
        assert runtime.exec(sid, "echo hi > /tmp/t && cat /tmp/t").stdout == "hi\n"
        res = runtime.exec(sid, "pwd && echo data > f && cat f")
        assert res.stdout == "/work/space\ndata\n"
        assert runtime.exec(sid, "touch /work/evil").exit_code != 0  # only the workdir
    finally:
        runtime.delete(sid)
    rootfs = Path(image_store.get("ray-sandbox/busybox").rootfs)
    assert not (rootfs / "etc/evil").exists() and not (rootfs / "work/space/f").exists()


def test_copy_on_write_is_private_per_sandbox(runtime, image_store):
    a = runtime.create(image="ray-sandbox/busybox", readonly=False, memory="64Mi")
    b = runtime.create(image="ray-sandbox/busybox", readonly=False, memory="64Mi")
    try:
        assert runtime.exec(a, "echo A > /etc/marker && rm /bin/ls").exit_code == 0
        assert runtime.exec(a, "cat /etc/marker").stdout == "A\n"
        assert runtime.exec(b, "cat /etc/marker").exit_code != 0
        assert runtime.exec(b, "ls /").exit_code == 0
    finally:
        runtime.delete(a)
        runtime.delete(b)
    rootfs = Path(image_store.get("ray-sandbox/busybox").rootfs)
    assert not (rootfs / "etc/marker").exists() and (rootfs / "bin/ls").is_symlink()


def test_generated_hosts_and_hostname(sandbox, runtime):
    hosts = runtime.exec(sandbox, "cat /etc/hosts").stdout
    assert "localhost" in hosts and sandbox[:8] in runtime.exec(sandbox, "hostname").stdout


def test_user_env_and_cwd(runtime, sandbox):
    res = runtime.exec(sandbox, "id -u; echo $FOO; pwd", user="65534", env={"FOO": "bar"},
                       cwd="/tmp")
    assert res.stdout.split() == ["65534", "bar", "/tmp"]
    sid = runtime.create(image="ray-sandbox/busybox", user="65534", env={"X": "1"},
                         memory="64Mi")
    try:
        assert runtime.exec(sid, "id -u; echo $X").stdout.split() == ["65534", "1"]
    finally:
        runtime.delete(sid)


def test_memory_limit_visible_and_cpu_quota_applied(runtime):
    sid = runtime.create(image="ray-sandbox/busybox", memory="96Mi", cpu=0.5)
    try:
        meminfo = runtime.exec(sid, "head -1 /proc/meminfo").stdout
        assert meminfo.split()[1] == str(96 * 1024)
        quota = Path(f"/sys/fs/cgroup/cpu/{sid}/cpu.cfs_quota_us").read_text().strip()
        assert quota == "250000"  # 0.5 x the 500 ms period
        # Throttling is real: a busy loop is throttled by the CFS quota.
        runtime.exec(sid, "timeout 1 sh -c 'while :; do :; done'", timeout=5)
        stat = Path(f"/sys/fs/cgroup/cpu/{sid}/cpu.stat").read_text()
        throttled = dict(line.split() for line in stat.splitlines())["nr_throttled"]
        assert int(throttled) > 0
    finally:
        runtime.delete(sid)


def test_oom_kill_reported(runtime):
    sid = runtime.create(image="ray-sandbox/python", memory="64Mi")
    try:
        with pytest.raises(Exception):  # noqa: B017 - the sandbox dies under the call
            runtime.exec(sid, ["python3", "-c", "x = bytearray(400 << 20); x[::4096] = b'1' * "
                                                "len(x[::4096]); import time; time.sleep(5)"],
                         timeout=30)
        deadline = time.time() + 10
        while runtime.get_status(sid).state == SandboxState.RUNNING and time.time() < deadline:
            time.sleep(0.1)
        st = runtime.get_status(sid)
        assert (st.state, st.reason) == (SandboxState.ERROR, "OOMKilled")
    finally:
        runtime.delete(sid)


def test_ttl_deletes_and_reports(runtime):
    sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi", ttl_seconds=1)
    deadline = time.time() + 15
    while time.time() < deadline and runtime.get_status(sid).state != SandboxState.TERMINATED:
        time.sleep(0.1)
    st = runtime.get_status(sid)
    assert (st.state, st.reason) == (SandboxState.TERMINATED, "TTLExpired")
    while time.time() < deadline and (runtime.sandboxes_dir / sid).exists():
        time.sleep(0.05)
    assert not (runtime.sandboxes_dir / sid).exists()


def test_idle_timeout_counts_from_the_last_use_and_spares_running_work(runtime):
    idle = 1.5
    sid = runtime.create(image="ray-sandbox/python", memory="128Mi", idle_timeout_seconds=idle)
    # a running exec and a running spawned process are use, however long they take
    assert runtime.exec(sid, "sleep 2.5").exit_code == 0
    proc = runtime.spawn(sid, ["sleep", "2.5"])
    assert proc.wait(timeout=10).exit_code == 0
    # a warm interpreter between calls is not; code running in it is
    assert runtime.run_python(sid, "import time; time.sleep(2.5); x = 1").ok
    time.sleep(idle * 0.6)
    assert runtime.exec(sid, "true").exit_code == 0  # used again: its idle time restarts
    time.sleep(idle * 0.6)
    assert runtime.get_status(sid).state == SandboxState.RUNNING
    deadline = time.time() + idle + 10
    while time.time() < deadline and runtime.get_status(sid).state != SandboxState.TERMINATED:
        time.sleep(0.1)
    st = runtime.get_status(sid)
    assert (st.state, st.reason) == (SandboxState.TERMINATED, "IdleTimeout")


def test_bad_input(runtime, sandbox):
    with pytest.raises(SandboxNotFoundError):
        runtime.exec("0" * 32, "true")
    with pytest.raises(SandboxNotFoundError):
        runtime.exec("not-an-id", "true")
    assert runtime.exec(sandbox, "no-such-command").exit_code == 127
    assert runtime.exec(sandbox, ["/no/such/binary"]).exit_code == 127
    with pytest.raises(ExecError):
        runtime.exec(sandbox, "pwd", cwd="/does/not/exist")
    with pytest.raises(ExecError):
        runtime.exec(sandbox, "id", user="nosuchuser")
    with pytest.raises(ExecError):
        runtime.exec(sandbox, "true", env={"BAD=NAME": "x"})
    with pytest.raises(ExecError):
        runtime.exec(sandbox, "true", shell="/bin/bash")  # busybox has no bash
    with pytest.raises(ConfigError):
        runtime.create(image="ray-sandbox/busybox", memory="lots")
    before = set(runtime.sandboxes_dir.iterdir())
    with pytest.raises(ImageError):
        runtime.create(image="ray-sandbox/does-not-exist")
    with pytest.raises(SandboxCreationError) as failed:
        runtime.create(image="ray-sandbox/busybox", spec_transform=lambda s: 1 / 0)
    assert set(runtime.sandboxes_dir.iterdir()) == before
    digest = runtime.images.get("ray-sandbox/busybox").digest
    assert failed.value.sandbox_id not in runtime.images.pins(digest)  # no pin leaked


def test_crashed_sandbox_gives_typed_error_not_hang(runtime):
    sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi")
    try:
        pid = runtime.runsc.state(sid).pid
        import os

        os.kill(pid, 9)
        t0 = time.monotonic()
        with pytest.raises(Exception) as info:  # noqa: B017
            runtime.exec(sid, "true", timeout=10)
        assert time.monotonic() - t0 < 10
        assert "sandbox" in str(info.value).lower()
        assert runtime.get_status(sid).state == SandboxState.ERROR
    finally:
        runtime.delete(sid)


def test_exec_timeout_kills_inside(runtime, sandbox):
    t0 = time.monotonic()
    res = runtime.exec(sandbox, "sleep 30", timeout=2)
    assert res.timed_out and time.monotonic() - t0 < 10
    assert not [p for p in pids_inside(runtime, sandbox) if p.startswith("sleep")]


def test_binary_output_keeps_bytes(runtime, sandbox):
    res = runtime.exec(sandbox, "printf '\\377\\376abc\\000'; exit 3")
    assert res.exit_code == 3 and res.stdout_bytes == b"\xff\xfeabc\x00"
    assert res.stdout == "\ufffd\ufffdabc\x00"


def test_files_round_trip(runtime, sandbox, tmp_path):
    runtime.write_file(sandbox, "/tmp/d/e/f.txt", "hello")
    assert runtime.read_file(sandbox, "/tmp/d/e/f.txt") == b"hello"
    runtime.write_file(sandbox, "/tmp/d/e/f.txt", b" world", append=True)
    assert runtime.exec(sandbox, "cat /tmp/d/e/f.txt").stdout == "hello world"
    src = tmp_path / "blob"
    src.write_bytes(bytes(range(256)) * 4096)
    runtime.upload_file(sandbox, src, "/tmp/blob")
    runtime.download_file(sandbox, "/tmp/blob", tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == src.read_bytes()
    runtime.exec(sandbox, "chmod 750 /tmp/blob")
    runtime.download_file(sandbox, "/tmp/blob", tmp_path / "back")
    assert (tmp_path / "back").stat().st_mode & 0o777 == 0o750  # mode kept
    assert runtime.exists(sandbox, "/tmp/blob") and not runtime.exists(sandbox, "/tmp/nope")
    with pytest.raises(FileNotFoundError):
        runtime.read_file(sandbox, "/tmp/nope")
    with pytest.raises(IsADirectoryError):
        runtime.read_file(sandbox, "/tmp/d")


def test_dir_transfer_keeps_modes_symlinks_empty_dirs(runtime, sandbox, tmp_path):
    import os

    src = tmp_path / "src"
    (src / "a/b").mkdir(parents=True)
    (src / "empty").mkdir()
    (src / "a/b/run.sh").write_text("#!/bin/sh\necho ok\n")
    os.chmod(src / "a/b/run.sh", 0o750)
    os.symlink("a/b/run.sh", src / "link")
    runtime.upload_dir(sandbox, src, "/tmp/up")
    assert runtime.exec(sandbox, "/tmp/up/link").stdout == "ok\n"
    runtime.download_dir(sandbox, "/tmp/up", tmp_path / "dst")
    dst = tmp_path / "dst"
    assert (dst / "empty").is_dir() and os.readlink(dst / "link") == "a/b/run.sh"
    assert os.stat(dst / "a/b/run.sh").st_mode & 0o777 == 0o750


def test_shell_less_image_exec_argv(runtime, static_image_ref):
    sid = runtime.create(image=static_image_ref, memory="64Mi")
    try:
        with pytest.raises(ExecError):
            runtime.exec(sid, "echo hi")  # no /bin/sh in the image
        res = runtime.exec(sid, ["/hello"])
        assert res.exit_code == 0 and res.stdout == "hello\n"
        runtime.write_file(sid, "/tmp/x", b"123")
        assert runtime.read_file(sid, "/tmp/x") == b"123"
    finally:
        runtime.delete(sid)


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    import os

    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_mode, st.st_size)
    return out


def test_shared_image_rootfs_is_never_written(runtime, image_store, tmp_path):
    rootfs = Path(image_store.get("ray-sandbox/busybox").rootfs)
    before = _tree(rootfs)
    extra = tmp_path / "extra"
    extra.mkdir()

    def add_mount(spec):
        spec["mounts"].append({"destination": "/brand/new/mnt", "type": "bind",
                               "source": str(extra), "options": ["rbind", "ro"]})

    for readonly in (True, False):
        sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi", readonly=readonly,
                             workdir="/not/in/image", spec_transform=add_mount)
        try:
            assert runtime.exec(sid, "ls -d /brand/new/mnt /not/in/image").exit_code == 0
        finally:
            runtime.delete(sid)
    assert _tree(rootfs) == before
