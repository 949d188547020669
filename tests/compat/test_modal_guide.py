"""The snippets of Modal's sandbox guide (modal.com/docs/guide: sandboxes, sandbox-spawn,
sandbox-files, sandbox-networking, sandbox-snapshots) that need nothing of Modal's cloud (no
GPU, no ``Secret.from_name``), written anew from what each does, with only ``import modal``
changed. Each test names its page. The snippets that build an image of their own are heavy
(tests/compat/test_modal_examples.py builds the default run's one DSL image)."""

from __future__ import annotations

import asyncio
import io
import time

import pytest

import ray_sandbox
import ray_sandbox.modal as modal  # was: import modal
from tests.fx_hostile import heavy, wait_until

pytestmark = pytest.mark.usefixtures("built_images")

FETCH = ("import sys, urllib.request\n"
         "print(urllib.request.urlopen(sys.argv[1], timeout=5).status)")
CONNECT = ("import socket, sys\n"
           "try:\n"
           "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).close()\n"
           "    print('open')\n"
           "except OSError as e:\n"
           "    print('closed', type(e).__name__)")


@pytest.fixture(scope="module")
def sb(app):
    sb = modal.Sandbox.create(app=app)
    yield sb
    sb.terminate()


# --- sandboxes -------------------------------------------------------------------------------


def test_sandboxes_quick_start(app):
    sb = modal.Sandbox.create(app=app)
    p = sb.exec("python", "-c", "print('hello')", timeout=3)
    assert p.stdout.read() == "hello\n"
    p = sb.exec("bash", "-c", "for i in {1..10}; do date +%T; sleep 0.1; done", timeout=10)
    lines = [line for line in p.stdout]
    assert len("".join(lines).splitlines()) == 10 and all(len(t) == 8 for t in
                                                           "".join(lines).split())
    sb.terminate()
    sb.detach()


def test_sandboxes_quick_start_async():
    async def main():
        app = await modal.App.lookup.aio("compat", create_if_missing=True)
        sb = await modal.Sandbox.create.aio(app=app)
        p = await sb.exec.aio("python", "-c", "print('hello')", timeout=3)
        first = await p.stdout.read.aio()
        p = await sb.exec.aio("bash", "-c", "for i in {1..3}; do echo $i; sleep 0.1; done")
        lines = [line async for line in p.stdout]
        await sb.terminate.aio()
        await sb.detach.aio()
        return first, "".join(lines)

    assert asyncio.run(main()) == ("hello\n", "1\n2\n3\n")


def test_sandboxes_entrypoint_and_from_id(app):
    sb = modal.Sandbox.create("echo", "hello world", app=app)
    assert sb.stdout.read() == "hello world\n"
    sb.wait()
    assert sb.returncode == 0
    other = modal.Sandbox.create(app=app)
    try:
        same = modal.Sandbox.from_id(other.object_id)
        assert same.exec("echo", "from id").stdout.read() == "from id\n"
    finally:
        other.terminate()


def test_sandboxes_names_and_tags(app):
    sb = modal.Sandbox.create(app=app, name="compat-named", tags={"team": "compat"})
    try:
        with pytest.raises(modal.exception.AlreadyExistsError, match="compat-named"):
            modal.Sandbox.create(app=app, name="compat-named")
        assert modal.Sandbox.from_name("compat", "compat-named").object_id == sb.object_id
        assert sb.get_tags() == {"team": "compat"}
        assert [s.object_id for s in modal.Sandbox.list(tags={"team": "compat"})] \
            == [sb.object_id]
    finally:
        assert sb.terminate(wait=True) == 137
    again = modal.Sandbox.create(app=app, name="compat-named")  # the name is free again
    again.terminate()


def test_sandboxes_readiness_probes(app):
    web = modal.Sandbox.create("python3", "-m", "http.server", "8080", app=app,
                               readiness_probe=modal.Probe.with_tcp(8080))
    try:
        web.wait_until_ready()
        p = web.exec("python3", "-c", FETCH, "http://127.0.0.1:8080/")
        assert p.stdout.read() == "200\n"
        # any handle of it knows its probe
        modal.Sandbox.from_id(web.object_id).wait_until_ready(timeout=10)
    finally:
        web.terminate()

    probe = modal.Probe.with_exec("sh", "-c", "test -f /tmp/ready", interval_ms=50)
    slow = modal.Sandbox.create("sh", "-c", "sleep 1; touch /tmp/ready; sleep 300", app=app,
                                readiness_probe=probe)
    try:
        assert slow.exec("test", "-f", "/tmp/ready").wait() != 0  # not ready yet
        slow.wait_until_ready(timeout=60)
        assert slow.exec("test", "-f", "/tmp/ready").wait() == 0
    finally:
        slow.terminate()

    never = modal.Sandbox.create(app=app, readiness_probe=modal.Probe.with_exec("false"))
    try:
        with pytest.raises(modal.exception.TimeoutError):
            never.wait_until_ready(timeout=1)
        with pytest.raises(modal.exception.InvalidError):
            never.wait_until_ready(timeout=0)
    finally:
        never.terminate()
    with pytest.raises(modal.exception.ConflictError, match="ended"):
        never.wait_until_ready(timeout=5)


def test_sandboxes_without_a_probe_cannot_wait_for_one(sb):
    with pytest.raises(modal.exception.ConflictError, match="readiness_probe"):
        sb.wait_until_ready(timeout=5)


def test_sandboxes_terminate_and_wait():
    done = modal.Sandbox.create("sh", "-c", "exit 3", app=modal.App.lookup("compat"))
    done.wait()
    assert done.terminate(wait=True) == 3  # ended already: it keeps its command's code
    running = modal.Sandbox.create("sleep", "300", app=modal.App.lookup("compat"))
    assert running.terminate() is None
    assert running.poll() == 137


# --- running commands (sandbox-spawn) ----------------------------------------------------------


def test_spawn_three_commands(sb):
    p = sb.exec("echo", "hello", timeout=3)
    assert p.stdout.read() == "hello\n"
    p = sb.exec("python", "-c", "print(1 + 1)", timeout=3)
    assert p.stdout.read() == "2\n"
    p = sb.exec("bash", "-c", "for i in $(seq 1 3); do echo line $i; sleep 0.2; done",
                timeout=5)
    arrived = []
    for line in p.stdout:
        arrived.append((line, time.monotonic()))
    assert [line for line, _ in arrived] == ["line 1\n", "line 2\n", "line 3\n"]
    assert arrived[-1][1] - arrived[0][1] > 0.2  # as they came


def test_spawn_stdin(sb):
    p = sb.exec("bash", "-c", "while read line; do echo $line; done")
    p.stdin.write(b"foo bar\n")
    p.stdin.write_eof()
    p.stdin.drain()
    p.wait()
    assert p.stdout.read() == "foo bar\n"

    async def main():
        s = await modal.Sandbox.create.aio(app=modal.App.lookup("compat"))
        q = await s.exec.aio("bash", "-c", "while read line; do echo $line; done")
        q.stdin.write(b"baz\n")
        q.stdin.write_eof()
        await q.stdin.drain.aio()
        await q.wait.aio()
        out = await q.stdout.read.aio()
        await s.terminate.aio()
        await s.detach.aio()
        return out

    assert asyncio.run(main()) == "baz\n"


def test_spawn_output_and_stream_types(sb, capsys):
    p = sb.exec("bash", "-c", "echo out; echo err >&2")
    p.wait()
    assert (p.stdout.read(), p.stderr.read()) == ("out\n", "err\n")  # kept after the exit
    p = sb.exec("bash", "-c", "echo dropped", stdout=modal.stream_type.StreamType.DEVNULL)
    assert (p.wait(), p.stdout.read()) == (0, "")
    capsys.readouterr()
    p = sb.exec("bash", "-c", "echo shown-here", stdout=modal.stream_type.StreamType.STDOUT)
    assert p.wait() == 0 and p.stdout.read() == ""
    assert wait_until(lambda: "shown-here" in capsys.readouterr().out, 10)


# --- files (sandbox-files) ---------------------------------------------------------------------


def test_files_filesystem_api(sb, tmp_path):
    sb.filesystem.write_text("Hello, world!\n", "/tmp/hello.txt")
    assert sb.filesystem.read_text("/tmp/hello.txt") == "Hello, world!\n"
    local = tmp_path / "local.txt"
    local.write_text("from this machine\n")
    sb.filesystem.copy_from_local(local, "/tmp/copies/local.txt")  # parents are made
    sb.filesystem.copy_to_local("/tmp/copies/local.txt", tmp_path / "back" / "local.txt")
    assert (tmp_path / "back" / "local.txt").read_text() == "from this machine\n"
    info = sb.filesystem.stat("/tmp/hello.txt")
    assert (info.size, info.is_file(), info.owner, info.permissions) == (14, True, "root",
                                                                          "-rw-r--r--")
    sb.filesystem.make_directory("/tmp/a/b/c")
    assert [f.name for f in sb.filesystem.list_files("/tmp/a")] == ["b"]
    with pytest.raises(modal.exception.SandboxFilesystemDirectoryNotEmptyError):
        sb.filesystem.remove("/tmp/a")
    sb.filesystem.remove("/tmp/a", recursive=True)
    with pytest.raises(modal.exception.SandboxFilesystemNotFoundError):
        sb.filesystem.read_bytes("/tmp/a")
    with pytest.raises(FileNotFoundError):  # also Python's own
        sb.filesystem.stat("/tmp/a")


def test_files_relative_paths_start_at_the_workdir(app):
    sb = modal.Sandbox.create(app=app, workdir="/work")
    try:
        with sb.open("test.txt", "w") as f:  # the guide's first file snippet
            f.write("hello\n")
        assert sb.open("/work/test.txt", "rb").read() == b"hello\n"
        sb.filesystem.write_bytes(b"\x00\x01", "sub/data.bin")
        assert sb.exec("cat", "/work/sub/data.bin").stdout.read() == "\x00\x01"
        assert sorted(sb.ls(".")) == ["sub", "test.txt"]
    finally:
        sb.terminate()


def test_files_named_volume(app):
    vol = modal.Volume.from_name("compat-guide-vol", create_if_missing=True)
    try:
        writer = modal.Sandbox.create(app=app, volumes={"/cache": vol})
        writer.exec("bash", "-c", "echo cached > /cache/a.txt").wait()
        writer.terminate()
        reader = modal.Sandbox.create(app=app, volumes={"/cache": vol})
        assert reader.exec("cat", "/cache/a.txt").stdout.read() == "cached\n"
        reader.terminate()
    finally:
        modal.Volume.delete("compat-guide-vol")


def test_files_ephemeral_volume_and_batch_upload(app, tmp_path):
    (tmp_path / "local.txt").write_text("local file\n")
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "inner.txt").write_text("inner\n")
    with modal.Volume.ephemeral() as vol:
        sb = modal.Sandbox.create(app=app, volumes={"/cache": vol})
        sb.exec("bash", "-c", "echo foo > /cache/a.txt").wait()
        sb.terminate()
        sb.wait(raise_on_termination=False)
        assert b"".join(vol.read_file("a.txt")) == b"foo\n"
        with pytest.raises(modal.exception.NotFoundError):
            list(vol.read_file("missing.txt"))

        with vol.batch_upload() as batch:
            batch.put_file(tmp_path / "local.txt", "/remote/local.txt")
            batch.put_directory(tmp_path / "dir", "/remote/dir")
            batch.put_file(io.BytesIO(b"in memory\n"), "/remote/bytes.txt")
        sb = modal.Sandbox.create(app=app, volumes={"/cache": vol})
        p = sb.exec("cat", "/cache/remote/local.txt", "/cache/remote/dir/inner.txt",
                    "/cache/remote/bytes.txt")
        assert p.stdout.read() == "local file\ninner\nin memory\n"
        sb.terminate()


@heavy
@pytest.mark.timeout(900)
def test_files_image_with_a_local_directory(app, tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "one.txt").write_text("1")
    (tmp_path / "data" / "two.txt").write_text("2")
    image = modal.Image.debian_slim().add_local_dir(tmp_path / "data", remote_path="/app")
    with modal.enable_output():
        sb = modal.Sandbox.create(app=app, image=image)
    try:
        assert sb.exec("ls", "/app").stdout.read().split() == ["one.txt", "two.txt"]
    finally:
        sb.terminate()


# --- networking (sandbox-networking) -----------------------------------------------------------


def test_networking_block_network(app):
    sb = modal.Sandbox.create(app=app, block_network=True)
    try:
        p = sb.exec("python", "-c", CONNECT, "deb.debian.org", "80")
        assert p.stdout.read().startswith("closed")
    finally:
        sb.terminate()


def test_networking_allowlists(app):
    sb = modal.Sandbox.create("sleep", "infinity", app=app,
                              outbound_cidr_allowlist=["203.0.113.0/24", "192.168.1.0/24"])
    try:
        assert sb.poll() is None  # runs, with nothing else reachable
        p = sb.exec("python", "-c", CONNECT, "deb.debian.org", "80")
        assert p.stdout.read().startswith("closed")
    finally:
        sb.terminate()
    sb = modal.Sandbox.create(app=app, outbound_domain_allowlist=["pypi.org"])
    try:
        p = sb.exec("python", "-c", CONNECT, "pypi.org", "443")
        assert p.stdout.read() == "open\n"
        p = sb.exec("python", "-c", CONNECT, "deb.debian.org", "80")
        assert p.stdout.read().startswith("closed")
    finally:
        sb.terminate()


def test_networking_connect_tokens_are_refused(sb):
    with pytest.raises(NotImplementedError, match="create_connect_token"):
        sb.create_connect_token(user_metadata={"user_id": "u1"})


# --- snapshots (sandbox-snapshots) ---------------------------------------------------------------


def test_snapshots_filesystem(app):
    sb = modal.Sandbox.create(app=app)
    p = sb.exec("bash", "-c", "echo 'test' > /test")
    p.wait()
    assert p.returncode == 0
    image = sb.snapshot_filesystem()
    sb.terminate()
    sb2 = modal.Sandbox.create(image=image, app=app)
    try:
        assert sb2.exec("cat", "/test").stdout.read() == "test\n"
    finally:
        sb2.terminate()
    assert wait_until(lambda: _deleted(image), 30)


def _deleted(image: modal.Image) -> bool:
    try:
        modal.experimental.image_delete(image.object_id)
        return True
    except ray_sandbox.ImageInUseError:
        return False


def test_snapshots_directory_snapshots_are_refused(sb):
    with pytest.raises(NotImplementedError, match="snapshot_directory"):
        sb.snapshot_directory("/tmp")
    with pytest.raises(NotImplementedError, match="mount_image"):
        sb.mount_image("/mnt", modal.Image.debian_slim())


def test_snapshots_memory(app):
    sb = modal.Sandbox.create("python3", "-m", "http.server", "8000", app=app,
                              _experimental_enable_snapshot=True,
                              readiness_probe=modal.Probe.with_tcp(8000))
    sb.wait_until_ready(timeout=60)
    snapshot = sb._experimental_snapshot()
    sb.terminate()
    restored = []
    try:
        restored.append(modal.Sandbox._experimental_from_snapshot(snapshot))
        again = modal.SandboxSnapshot.from_id(snapshot.object_id)  # as another process would
        restored.append(modal.Sandbox._experimental_from_snapshot(again))
        for copy in restored:  # the server runs on in each copy, never started again there
            p = copy.exec("python3", "-c", FETCH, "http://127.0.0.1:8000/")
            assert p.stdout.read() == "200\n"
    finally:
        for copy in restored:
            copy.terminate()
        ray_sandbox.delete_snapshot(snapshot._snapshot)


@heavy
@pytest.mark.timeout(900)
def test_snapshots_memory_as_written(app):
    image = modal.Image.debian_slim().apt_install("curl", "procps")
    with modal.enable_output():
        sb = modal.Sandbox.create("python3", "-m", "http.server", "8000", app=app,
                                  image=image, _experimental_enable_snapshot=True)
    try:
        time.sleep(2)
        snapshot = sb._experimental_snapshot()
    finally:
        sb.terminate()
    sb2 = modal.Sandbox._experimental_from_snapshot(snapshot)
    try:
        assert "http.server" in sb2.exec("ps", "aux").stdout.read()
        p = sb2.exec("curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                     "http://localhost:8000")
        assert p.stdout.read() == "200"
    finally:
        sb2.terminate()
        ray_sandbox.delete_snapshot(snapshot._snapshot)
