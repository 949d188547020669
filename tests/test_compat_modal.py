"""Modal's Sandbox API on ray_sandbox (issue 18), on real sandboxes and a real local Ray
cluster: the examples of Modal's sandbox guide (modal.com/docs/guide/sandbox,
sandbox-spawn, sandbox-files) with only the import and the image names changed, then
Modal's exit codes, from_id, list and tags, and the ``.aio`` forms."""

from __future__ import annotations

import asyncio
import socket
import time
import urllib.request

import pytest

import ray_sandbox.modal as modal  # was: import modal
from tests.fx_hostile import wait_until

PY = modal.Image.from_registry("ray-sandbox/python")  # was: python:3.12 / debian_slim()
BUSYBOX = modal.Image.from_registry("ray-sandbox/busybox")
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@pytest.fixture(scope="module")
def app(ray_cluster):
    return modal.App.lookup("my-app", create_if_missing=True)


@pytest.fixture(scope="module")
def sb(app):
    sb = modal.Sandbox.create(app=app, image=PY, tags={"suite": "compat"}, name="compat-sb")
    yield sb
    sb.terminate()


def test_guide_exec_with_streaming_stdout(sb):
    p = sb.exec("python3", "-c", "print('hello')", timeout=3)
    assert p.stdout.read() == "hello\n"

    p = sb.exec("bash", "-c", "for i in $(seq 1 10); do echo foo $i; sleep 0.1; done",
                timeout=5)
    got = [line for line in p.stdout]
    assert "".join(got) == "".join(f"foo {i}\n" for i in range(1, 11))
    assert len(got) > 1  # it came as it was written, not at the end
    assert p.wait() == 0 and p.returncode == 0

    p = sb.exec("bash", "-c", "echo out; echo err >&2; exit 3", bufsize=1)
    assert (p.stdout.read(), p.stderr.read(), p.wait()) == ("out\n", "err\n", 3)


def test_stderr_streams_while_the_command_runs_and_stdout_is_kept_for_its_reader(sb):
    p = sb.exec("sh", "-c", "echo o1; echo e1 >&2; while [ ! -e /run/go-err ]; do sleep 0.1; "
                "done; echo o2; echo e2 >&2", bufsize=1)
    lines = iter(p.stderr)
    assert next(lines) == "e1\n"  # before the exit: it is still waiting for the file
    assert p.poll() is None
    sb.exec("touch", "/run/go-err").wait()
    assert list(lines) == ["e2\n"]
    assert p.stdout.read() == "o1\no2\n"  # read along with stderr, kept for this reader
    assert p.wait() == 0


def test_guide_stdin_multi_turn(sb):
    p = sb.exec("bash", "-c", "while read line; do echo $line; done")
    p.stdin.write(b"foo bar\n")
    p.stdin.write_eof()
    p.stdin.drain()
    p.wait()
    assert p.stdout.read() == "foo bar\n"

    # a conversation: each answer read before the next question is written
    p = sb.exec("python3", "-u", "-c",
                "import sys\nfor l in sys.stdin: print(int(l) * 2, flush=True)", bufsize=1)
    answers = iter(p.stdout)
    for n in (1, 21):
        p.stdin.write(f"{n}\n")
        p.stdin.drain()
        assert next(answers) == f"{n * 2}\n"
    p.stdin.write_eof()
    p.stdin.drain()
    assert p.wait() == 0


def test_guide_files(sb):
    with sb.open("/tmp/test.txt", "w") as f:
        f.write("hello\n")
    with sb.open("/tmp/test.txt", "a") as f:
        f.write("world\n")
    with sb.open("/tmp/test.txt", "r") as f:
        assert f.readline() == "hello\n" and f.read() == "world\n"
    with sb.open("/tmp/bin.dat", "wb") as f:
        f.write(b"\x00\xff")
    assert sb.open("/tmp/bin.dat", "rb").read() == b"\x00\xff"
    sb.mkdir("/tmp/d/e", parents=True)
    assert sorted(sb.ls("/tmp")) == ["bin.dat", "d", "test.txt"]
    sb.rm("/tmp/d", recursive=True)
    assert "d" not in sb.ls("/tmp")
    with pytest.raises(FileNotFoundError):
        sb.open("/tmp/nope")


def test_exec_env_secrets_workdir_and_timeout(sb):
    p = sb.exec("sh", "-c", "echo $A $B; pwd", workdir="/tmp", env={"A": "1"},
                secrets=[modal.Secret.from_dict({"B": "2"})])
    assert p.stdout.read() == "1 2\n/tmp\n"
    p = sb.exec("sleep", "30", timeout=0.5)
    assert p.wait() == -1  # Modal's code for an exec whose timeout ran out
    with pytest.raises(modal.exception.InvalidError):
        _ = sb.exec("true").returncode  # before wait(), as on Modal


def test_from_id_list_and_tags(sb, app):
    same = modal.Sandbox.from_id(sb.object_id)
    assert same.exec("echo", "hi").stdout.read() == "hi\n"
    assert modal.Sandbox.from_id("ray-sandbox-" + sb.object_id).object_id == sb.object_id
    with pytest.raises(modal.exception.NotFoundError):
        modal.Sandbox.from_id("ab" * 16)
    assert [s.object_id for s in modal.Sandbox.list(app_id=app.app_id)] == [sb.object_id]
    assert [s.object_id for s in modal.Sandbox.list(tags={"suite": "compat"})] \
        == [sb.object_id]
    assert modal.Sandbox.list(tags={"suite": "other"}) == []
    assert sb.get_tags() == {"suite": "compat"}
    assert modal.Sandbox.from_name("my-app", "compat-sb").object_id == sb.object_id
    with pytest.raises(modal.exception.NotFoundError):
        modal.Sandbox.from_name("my-app", "no-such-sandbox")
    assert sb.poll() is None and sb.returncode is None


def test_command_sandbox_timeout_and_terminate(app):
    done = modal.Sandbox.create("sh", "-c", "echo hi; exit 3", app=app, image=BUSYBOX,
                                block_network=True)
    done.wait()
    assert (done.returncode, done.stdout.read()) == (3, "hi\n")

    late = modal.Sandbox.create("sleep", "100", app=app, image=BUSYBOX, block_network=True,
                                timeout=1)
    late.wait(raise_on_termination=False)
    assert late.returncode == 124
    with pytest.raises(modal.exception.SandboxTimeoutError):
        late.wait()

    ended = modal.Sandbox.create(app=app, image=BUSYBOX, block_network=True)
    ended.terminate()
    ended.wait(raise_on_termination=False)
    assert ended.returncode == 137
    with pytest.raises(modal.exception.SandboxTerminatedError):
        ended.wait()


def test_aio(app):
    async def main():
        sb = await modal.Sandbox.create.aio(app=app, image=BUSYBOX, block_network=True)
        p = await sb.exec.aio("sh", "-c", "echo a; echo b", bufsize=1)
        lines = [line async for line in p.stdout]
        code = await p.wait.aio()
        f = await sb.open.aio("/tmp/f", "w")
        await f.write.aio("x")
        await f.close.aio()
        p = await sb.exec.aio("cat", "/tmp/f")
        assert await p.stdout.read.aio() == "x"
        listed = [s.object_id async for s in modal.Sandbox.list.aio(app_id=app.app_id)]
        await sb.terminate.aio()
        return lines, code, sb.object_id in listed

    assert asyncio.run(main()) == (["a\n", "b\n"], 0, True)


def test_unencrypted_port_through_a_node_local_tunnel(app, sb):
    with socket.socket() as s:  # a port free on this node now
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    web = modal.Sandbox.create("sh", "-c", f"echo hello > /tmp/index.html; "
                               f"exec httpd -f -p {port} -h /tmp", app=app, image=BUSYBOX,
                               unencrypted_ports=[port])
    try:
        tunnel = web.tunnels()[port]
        assert tunnel.tcp_socket == ("127.0.0.1", port)
        deadline = time.monotonic() + 30
        while True:
            try:
                with NO_PROXY.open(f"{tunnel.url}/index.html", timeout=5) as r:
                    assert r.read() == b"hello\n"
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert modal.Sandbox.from_id(web.object_id).tunnels() == {port: tunnel}
    finally:
        web.terminate()
    assert sb.tunnels() == {}


def test_volumes_keep_files_between_sandboxes(app):
    with pytest.raises(modal.exception.NotFoundError):
        modal.Volume.from_name("compat-vol")
    vol = modal.Volume.from_name("compat-vol", create_if_missing=True)
    try:
        writer = modal.Sandbox.create(app=app, image=BUSYBOX, volumes={"/data": vol})
        writer.exec("sh", "-c", "echo kept > /data/f").wait()
        vol.commit()
        with pytest.raises(modal.exception.Error):  # mounted: not deleted under it
            modal.Volume.delete("compat-vol")
        writer.terminate()
        vol.reload()
        reader = modal.Sandbox.create(app=app, image=BUSYBOX, volumes={"/data": vol})
        assert reader.exec("cat", "/data/f").stdout.read() == "kept\n"
        reader.terminate()
        with pytest.raises(NotImplementedError, match="listdir"):
            vol.listdir("/")
    finally:
        modal.Volume.delete("compat-vol")  # right after a terminate: its teardown is awaited
    with modal.Volume.ephemeral() as tmp:
        user = modal.Sandbox.create(app=app, image=BUSYBOX, volumes={"/t": tmp})
        assert user.exec("touch", "/t/x").wait() == 0
        user.terminate()  # the block's end deletes the volume this sandbox just let go
    with pytest.raises(modal.exception.NotFoundError):
        modal.Volume.from_name(tmp.name)


def test_snapshot_filesystem_gives_an_image_later_sandboxes_start_from(app):
    import ray_sandbox

    sb = modal.Sandbox.create(app=app, image=BUSYBOX)
    sb.exec("sh", "-c", "mkdir -p /repo && echo setup-done > /repo/state").wait()
    image = sb.snapshot_filesystem()
    sb.terminate()
    try:
        sb2 = modal.Sandbox.create(app=app, image=image)
        assert sb2.exec("cat", "/repo/state").stdout.read() == "setup-done\n"
        sb2.terminate()
    finally:  # Modal keeps such images; here they are deleted by name once unused
        assert wait_until(lambda: _deleted(ray_sandbox, image.ref), 30)


def _deleted(ray_sandbox, ref: str) -> bool:
    try:
        ray_sandbox.delete_filesystem_image(ref)
        return True
    except ray_sandbox.ImageInUseError:
        return False


def test_idle_timeout_ends_an_unused_sandbox(app):
    sb = modal.Sandbox.create(app=app, image=BUSYBOX, idle_timeout=1)
    assert sb.exec("sleep", "1.5").wait() == 0  # a running command is use
    assert sb.poll() is None
    assert wait_until(lambda: sb.poll() is not None, 15)  # then nothing: it ends


def test_unsupported_features_raise_naming_them(sb):
    with pytest.raises(NotImplementedError, match="encrypted_ports"):
        modal.Sandbox.create(image=BUSYBOX, encrypted_ports=[443])
    with pytest.raises(NotImplementedError, match="pty"):
        sb.exec("true", pty=True)
