"""Modal's own client (``modal`` 1.6 from PyPI, unmodified, in a venv without Ray) against
``ray-sandbox serve --modal-port`` on a real local Ray cluster with real gVisor sandboxes
(docs/modal.md). Each script is written from Modal's documented sandbox behaviour, as a
user would, and run with only MODAL_SERVER_URL, MODAL_TOKEN_ID and MODAL_TOKEN_SECRET set."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests import fx_modal_wire
from tests.fx_hostile import heavy
from tests.fx_modal_wire import ModalService
from tests.fx_service import free_port
from tests.test_service_cli import CLI

SERVICE_SETTINGS = {"modal_port": free_port(), "port_host_suffix": "ports.test",
                    "modal_image_aliases": {"python:3.12-slim": "ray-sandbox/python:3.13"}}
SERVICE_QUOTAS = ("bob:sandboxes=2,cpu=2,memory=2Gi",)

pytestmark = pytest.mark.timeout(600)
modal_python = fx_modal_wire.modal_python  # the fixtures, for this module
modal_service = fx_modal_wire.modal_service


def test_create_exec_streams_stdin_and_wait(modal_service: ModalService, tmp_path):
    out = modal_service.ok("""
        import modal

        app = modal.App.lookup("wire-basics", create_if_missing=True)
        sb = modal.Sandbox.create(app=app, timeout=120)
        p = sb.exec("sh", "-c", "for i in 1 2 3; do echo line$i; sleep 0.2; done; echo err >&2")
        lines = [line for line in p.stdout]
        print("STDOUT", lines)
        print("STDERR", p.stderr.read())
        print("CODE", p.wait())

        p = sb.exec("sh", "-c", "read x; echo got:$x; exit 3")
        p.stdin.write(b"hello\\n")
        p.stdin.write_eof()
        p.stdin.drain()
        print("STDIN", p.stdout.read().strip(), p.wait())

        p = sb.exec("pwd", workdir="/tmp")
        print("PWD", p.stdout.read().strip())
        p = sb.exec("sh", "-c", "echo $A-$B", env={"A": "1"},
                    secrets=[modal.Secret.from_dict({"B": "2"})])
        print("ENV", p.stdout.read().strip())
        print("POLL", sb.poll())
        sb.terminate()
        print("RC", sb.wait(raise_on_termination=False), sb.returncode)
    """, tmp_path)
    assert "STDOUT ['line1\\n', 'line2\\n', 'line3\\n']" in out
    assert "STDERR err" in out
    assert "CODE 0" in out
    assert "STDIN got:hello 3" in out
    assert "PWD /tmp" in out
    assert "ENV 1-2" in out
    assert "POLL None" in out
    assert "RC None 137" in out  # wait() returns None; returncode 137 (terminated)


def test_stdin_eof_after_the_command_exited(modal_service: ModalService, tmp_path):
    """A command may exit between a stdin write and the EOF that follows it (under load the
    entrypoint test's did): the EOF then closes nothing, as on a closed pipe, and is no error;
    the same for an exec's stdin."""
    out = modal_service.ok("""
        import modal

        app = modal.App.lookup("wire-eof", create_if_missing=True)
        sb = modal.Sandbox.create("sh", "-c", "read x; echo got:$x; exit 7", app=app,
                                  timeout=60)
        sb.stdin.write(b"zz\\n")
        sb.stdin.drain()
        print("OUT", sb.stdout.read().split())  # to its end: the command has exited
        sb.stdin.write_eof()
        sb.stdin.drain()
        sb.wait()
        print("RC", sb.returncode)

        sb = modal.Sandbox.create(app=app, timeout=60)
        p = sb.exec("sh", "-c", "read x; echo exec:$x")
        p.stdin.write(b"yy\\n")
        p.stdin.drain()
        print("EXEC", p.stdout.read().split(), p.wait())
        p.stdin.write_eof()
        p.stdin.drain()
        print("AFTER", p.returncode)
        sb.terminate()
    """, tmp_path)
    assert "OUT ['got:zz']" in out and "RC 7" in out
    assert "EXEC ['exec:yy'] 0" in out and "AFTER 0" in out


def test_entrypoint_output_stdin_exit_code_and_timeouts(modal_service: ModalService,
                                                       tmp_path):
    out = modal_service.ok("""
        import time
        import modal

        app = modal.App.lookup("wire-entry", create_if_missing=True)
        sb = modal.Sandbox.create("sh", "-c", "echo started; read x; echo got:$x; exit 7",
                                  app=app, timeout=60)
        sb.stdin.write(b"zz\\n")
        sb.stdin.write_eof()
        sb.stdin.drain()
        print("OUT", sb.stdout.read().split())
        sb.wait()
        print("RC", sb.returncode)

        sb = modal.Sandbox.create(app=app, timeout=60)
        t0 = time.monotonic()
        p = sb.exec("sleep", "30", timeout=2)
        print("EXEC-TIMEOUT", p.wait() in (-1, 137), time.monotonic() - t0 < 20)
        time.sleep(1)
        ps = sb.exec("sh", "-c", "ps -o args | grep -c '^sleep 30' || true")
        print("LEFT", ps.stdout.read().strip())
        sb.terminate()

        sb = modal.Sandbox.create("sleep", "100", app=app, timeout=4)
        try:
            sb.wait()
            print("NO-TIMEOUT", sb.returncode)
        except modal.exception.SandboxTimeoutError:
            print("SANDBOX-TIMEOUT", sb.returncode)

        missing = modal.Sandbox.create("no-such-command", app=app, timeout=60)
        missing.wait()
        print("MISSING", missing.returncode)

        idle = modal.Sandbox.create(app=app, idle_timeout=3, timeout=120)
        t0 = time.monotonic()
        try:
            idle.wait()
        except modal.exception.SandboxTimeoutError:
            print("IDLE-TIMEOUT", idle.returncode, time.monotonic() - t0 < 60)
    """, tmp_path)
    assert "OUT ['started', 'got:zz']" in out
    assert "RC 7" in out
    # -1 when the client's own deadline ends its wait first (as with Modal), else 137
    assert "EXEC-TIMEOUT True True" in out
    assert "LEFT 0" in out  # ... and the service killed the command
    assert "SANDBOX-TIMEOUT 124" in out
    assert "MISSING 127" in out  # a command that cannot start ends its sandbox
    assert "IDLE-TIMEOUT 124 True" in out


def test_filesystem_calls(modal_service: ModalService, tmp_path):
    (tmp_path / "local.txt").write_text("from the laptop\n")
    out = modal_service.ok("""
        import modal

        app = modal.App.lookup("wire-fs", create_if_missing=True)
        sb = modal.Sandbox.create(app=app, timeout=120)
        fs = sb.filesystem
        fs.make_directory("/work/sub", create_parents=True)
        fs.write_text("hello files\\n", "/work/sub/a.txt")
        fs.write_bytes(bytes(range(256)) * 4096, "/work/b.bin")
        print("TEXT", fs.read_text("/work/sub/a.txt").strip())
        print("BYTES", fs.read_bytes("/work/b.bin") == bytes(range(256)) * 4096)
        names = sorted((e.name, e.type.value) for e in fs.list_files("/work"))
        print("LIST", names)
        st = fs.stat("/work/b.bin")
        print("STAT", st.size, st.type.value, st.permissions)
        fs.copy_from_local("local.txt", "/work/up/local.txt")
        fs.copy_to_local("/work/up/local.txt", "down.txt")
        print("ROUND", open("down.txt").read().strip())
        fs.remove("/work/sub", recursive=True)
        for call in (lambda: fs.read_text("/work/missing"), lambda: fs.read_text("/work"),
                     lambda: fs.list_files("/work/b.bin"),
                     lambda: fs.make_directory("/work/up", create_parents=False)):
            try:
                call()
                print("NOERROR")
            except Exception as exc:
                print("ERR", type(exc).__name__)
        p = sb.exec("cat", "/work/up/local.txt")
        print("CAT", p.stdout.read().strip())
        sb.terminate()
    """, tmp_path)
    assert "TEXT hello files" in out
    assert "BYTES True" in out
    assert "LIST [('b.bin', 'file'), ('sub', 'directory')]" in out
    assert "STAT 1048576 file -rw-r--r--" in out
    assert "ROUND from the laptop" in out
    assert out.count("ERR ") == 4, out
    assert "ERR SandboxFilesystemNotFoundError" in out
    assert "ERR SandboxFilesystemIsADirectoryError" in out
    assert "ERR SandboxFilesystemNotADirectoryError" in out
    assert "CAT from the laptop" in out


def test_names_tags_list_from_id_and_from_name(modal_service: ModalService, tmp_path):
    out = modal_service.ok("""
        import modal

        app = modal.App.lookup("wire-names", create_if_missing=True)
        other = modal.App.lookup("wire-names-other", create_if_missing=True)
        a = modal.Sandbox.create(app=app, name="first", timeout=120)
        a.set_tags({"team": "red"}) if False else None
        b = modal.Sandbox.create(app=app, timeout=120)
        c = modal.Sandbox.create(app=other, timeout=120)
        try:
            modal.Sandbox.create(app=app, name="first", timeout=120)
        except modal.exception.AlreadyExistsError:
            print("DUPLICATE refused")
        found = modal.Sandbox.from_name("wire-names", "first")
        print("FROM-NAME", found.object_id == a.object_id)
        again = modal.Sandbox.from_id(b.object_id)
        print("FROM-ID", again.exec("echo", "hi").stdout.read().strip(), again.poll())
        ids = {s.object_id for s in modal.Sandbox.list(app_id=app.app_id)}
        print("LIST", ids == {a.object_id, b.object_id})
        try:
            modal.Sandbox.from_name("wire-names", "nobody")
        except modal.exception.NotFoundError:
            print("NO-NAME not found")
        for s in (a, b, c):
            s.terminate()
        print("AFTER", [s.object_id for s in modal.Sandbox.list(app_id=app.app_id)])
    """, tmp_path)
    assert "DUPLICATE refused" in out
    assert "FROM-NAME True" in out
    assert "FROM-ID hi None" in out
    assert "LIST True" in out
    assert "NO-NAME not found" in out
    assert "AFTER []" in out


def test_tags_filter_the_listing(modal_service: ModalService, tmp_path):
    out = modal_service.ok("""
        import modal

        app = modal.App.lookup("wire-tags", create_if_missing=True)
        red = modal.Sandbox.create(app=app, tags={"team": "red"}, timeout=120)
        blue = modal.Sandbox.create(app=app, tags={"team": "blue"}, timeout=120)
        print("TAGS", red.get_tags())
        print("RED", [s.object_id == red.object_id
                      for s in modal.Sandbox.list(app_id=app.app_id, tags={"team": "red"})])
        try:
            red.set_tags({"team": "green"})
        except modal.exception.UnimplementedError as exc:
            print("SET", "SandboxTagsSet" in str(exc))
        red.terminate()
        blue.terminate()
    """, tmp_path)
    assert "TAGS {'team': 'red'}" in out
    assert "RED [True]" in out
    assert "SET True" in out


@heavy  # 13 s in CI, image builds
def test_images_registry_alias_debian_slim_dsl_and_dockerfile(modal_service: ModalService,
                                                              tmp_path):
    (tmp_path / "Dockerfile").write_text(
        "FROM ray-sandbox/busybox:latest\nRUN echo from-dockerfile > /marker\n")
    out = modal_service.ok("""
        import modal

        app = modal.App.lookup("wire-images", create_if_missing=True)

        def run(image, *cmd):
            sb = modal.Sandbox.create(app=app, image=image, timeout=120)
            try:
                return sb.exec(*cmd).stdout.read().strip()
            finally:
                sb.terminate()

        print("ALIAS", run(modal.Image.from_registry("python:3.12-slim"),
                           "python3", "-c", "import sys; print(sys.version_info[:2])"))
        print("SLIM", run(modal.Image.debian_slim(), "python3", "-c",
                          "import sys; print(sys.version_info[:2])"))
        meta = modal.Image.from_registry("ray-sandbox/busybox").env({"X": "1"}).workdir("/tmp")
        print("META", run(meta, "sh", "-c", "echo $X $(pwd)"))
        with modal.enable_output():
            built = modal.Image.from_registry("ray-sandbox/busybox").run_commands(
                "echo built-$((6*7)) > /built.txt")
            print("BUILT", run(built, "cat", "/built.txt"))
        print("DOCKERFILE", run(modal.Image.from_dockerfile("Dockerfile"), "cat", "/marker"))
        try:
            run(modal.Image.from_registry("ray-sandbox/busybox").run_commands("exit 3"), "true")
        except Exception as exc:
            print("FAILED-BUILD", type(exc).__name__)
        try:
            run(modal.Image.from_registry("ray-sandbox/busybox").add_local_file(
                "Dockerfile", "/Dockerfile", copy=True), "true")
        except Exception as exc:
            print("LOCAL-FILE", type(exc).__name__)
    """, tmp_path, timeout=900)
    assert "ALIAS (3, 13)" in out
    assert "SLIM (3, 11)" in out
    assert "META 1 /tmp" in out
    assert "BUILT built-42" in out
    assert "Step 2/2 : RUN echo built-$((6*7))" in out  # the build's log, under enable_output
    assert "DOCKERFILE from-dockerfile" in out
    assert "FAILED-BUILD ImageBuildError" in out
    assert "LOCAL-FILE" in out


def test_snapshot_filesystem_then_create_from_it(modal_service: ModalService, tmp_path):
    out = modal_service.ok("""
        import modal

        app = modal.App.lookup("wire-snap", create_if_missing=True)
        # a small root: the client waits 55 s by default for the snapshot
        sb = modal.Sandbox.create(app=app, image=modal.Image.from_registry("ray-sandbox/busybox"),
                                  timeout=120)
        sb.exec("sh", "-c", "echo kept > /root/state.txt").wait()
        image = sb.snapshot_filesystem()
        print("ID", image.object_id.startswith("im-"))
        sb.terminate()
        copy = modal.Sandbox.create(app=app, image=image, timeout=120)
        print("COPY", copy.exec("cat", "/root/state.txt").stdout.read().strip())
        copy.terminate()
    """, tmp_path)
    assert "ID True" in out
    assert "COPY kept" in out


def test_volumes_named_and_ephemeral(modal_service: ModalService, tmp_path):
    out = modal_service.ok("""
        import modal

        app = modal.App.lookup("wire-vol", create_if_missing=True)
        vol = modal.Volume.from_name("wire-data", create_if_missing=True)
        sb = modal.Sandbox.create(app=app, volumes={"/data": vol}, timeout=120)
        sb.exec("sh", "-c", "echo persisted > /data/f.txt").wait()
        sb.terminate()
        sb.wait(raise_on_termination=False)
        again = modal.Sandbox.create(app=app, volumes={"/data": vol}, timeout=120)
        print("READ", again.exec("cat", "/data/f.txt").stdout.read().strip())
        again.terminate()
        again.wait(raise_on_termination=False)
        with modal.Volume.ephemeral() as eph:
            sb = modal.Sandbox.create(app=app, volumes={"/scratch": eph}, timeout=120)
            print("EPH", sb.exec("sh", "-c", "touch /scratch/x && ls /scratch")
                  .stdout.read().split())
            sb.terminate()
        try:
            modal.Volume.from_name("wire-missing").hydrate()
            print("NOERROR")
        except modal.exception.NotFoundError:
            print("MISSING not found")
    """, tmp_path)
    assert "READ persisted" in out
    assert "EPH ['lost+found', 'x']" in out
    assert "MISSING not found" in out


def test_tunnels_are_the_services_signed_port_urls(modal_service: ModalService, tmp_path):
    http = modal_service.service.url.removesuffix("/api/v1")
    out = modal_service.ok("""
        import sys
        import time
        import urllib.request
        import modal

        app = modal.App.lookup("wire-tunnel", create_if_missing=True)
        sb = modal.Sandbox.create("python3", "-m", "http.server", "8000", app=app,
                                  encrypted_ports=[8000], timeout=120)
        tunnel = sb.tunnels()[8000]
        print("URL", tunnel.url.startswith("https://"), tunnel.host.endswith(".ports.test"))
        # no TLS ingress in a test: the same name, through the service's plain HTTP port
        req = urllib.request.Request(sys.argv[1] + "/", headers={"Host": tunnel.host})
        for _ in range(100):
            try:
                body = urllib.request.urlopen(req, timeout=10).read().decode()
                break
            except Exception as exc:
                time.sleep(0.3)
        print("BODY", "Directory listing" in body)
        forged = urllib.request.Request(sys.argv[1] + "/", headers={
            "Host": "x" + tunnel.host[1:]})
        try:
            urllib.request.urlopen(forged, timeout=10)
        except urllib.error.HTTPError as exc:
            print("FORGED", exc.code)
        print("ID", sb.object_id)
        sb.terminate()
    """, tmp_path, args=(http,))
    assert "URL True True" in out
    assert "BODY True" in out
    assert "FORGED 401" in out


def test_network_block_allowlists_and_changes_held_to_the_policy(
        modal_service: ModalService, tmp_path, ray_cluster):
    out = modal_service.ok("""
        import modal

        app = modal.App.lookup("wire-net", create_if_missing=True)
        blocked = modal.Sandbox.create(app=app, block_network=True, timeout=120)
        nics = blocked.exec("ls", "/sys/class/net").stdout.read().split()
        print("BLOCKED", [n for n in nics if n != "lo"])
        try:
            blocked._experimental_set_outbound_network_policy(
                outbound_cidr_allowlist=["1.1.1.1/32"])
        except modal.exception.ConflictError:
            print("BLOCKED-STAYS")
        blocked.terminate()
        listed = modal.Sandbox.create(app=app, cidr_allowlist=["1.1.1.1/32"], timeout=120)
        print("LISTED", listed.object_id)
        listed._experimental_set_outbound_network_policy(
            outbound_cidr_allowlist=["8.8.8.8/32"], outbound_domain_allowlist=["example.com"])
        try:
            listed._experimental_set_outbound_network_policy(
                outbound_cidr_allowlist=["10.0.0.0/8"])
        except modal.exception.InvalidError as exc:
            print("PRIVATE refused", "tenant policy" in str(exc))
        try:
            modal.Sandbox.create(app=app, cidr_allowlist=["127.0.0.0/8"], timeout=60)
        except modal.exception.InvalidError:
            print("CREATE refused")
    """, tmp_path)
    assert "BLOCKED []" in out
    assert "BLOCKED-STAYS" in out
    assert "PRIVATE refused True" in out
    assert "CREATE refused" in out
    import ray

    import ray_sandbox
    from ray_sandbox.runtime.network import state as network_state
    from ray_sandbox.service._sandboxes import TENANT_LABEL

    api_id = out.split("LISTED sb-")[1].split()[0]
    handle = next(h for h in ray_sandbox.list({TENANT_LABEL: "alice"}) if h.name == api_id)
    # the node's network state of the sandbox holds the policy now in force
    found = [p for p in Path(os.environ["RAY_SANDBOX_HOME"]).rglob(handle.sandbox_id)
             if p.is_dir()]
    egress = next(st.egress for st in map(network_state.load, found) if st is not None)
    assert egress.default == "deny"
    assert egress.allow_cidrs == ("8.8.8.8/32",)
    assert egress.allow_domains == ("example.com",)
    ray.get(handle.terminate.remote(), timeout=60)


def test_tenants_are_isolated_and_a_wrong_token_is_refused(modal_service: ModalService,
                                                           tmp_path):
    out = modal_service.ok("""
        import modal

        app = modal.App.lookup("wire-alice", create_if_missing=True)
        sb = modal.Sandbox.create("python3", "-m", "http.server", "8000", app=app,
                                  name="private", encrypted_ports=[8000], timeout=120)
        sb.filesystem.write_text("secret", "/root/secret.txt")
        print("ID", sb.object_id)
    """, tmp_path)
    alice_id = out.split("ID ")[1].split()[0]
    bob = modal_service.ok("""
        import asyncio
        import os
        import sys
        import modal
        from grpclib.client import Channel
        from modal_proto import api_grpc, api_pb2, task_command_router_grpc
        from modal_proto import task_command_router_pb2 as tcr

        alice = sys.argv[1]
        for what, call in [
            ("FROM-ID", lambda: modal.Sandbox.from_id(alice).exec("true").wait()),
            ("FROM-NAME", lambda: modal.Sandbox.from_name("wire-alice", "private")),
            ("READ", lambda: modal.Sandbox.from_id(alice).filesystem.read_text(
                "/root/secret.txt")),
            ("TUNNELS", lambda: modal.Sandbox.from_id(alice).tunnels()),
            ("TERMINATE", lambda: modal.Sandbox.from_id(alice).terminate()),
        ]:
            try:
                call()
                print(what, "REACHED")
            except modal.exception.NotFoundError:
                print(what, "not found")
        app = modal.App.lookup("wire-alice", create_if_missing=True)
        print("LIST", [s.object_id for s in modal.Sandbox.list(app_id=app.app_id)])
        # bob's own sandbox's router token, presented for alice's sandbox
        mine = modal.Sandbox.create(app=app, timeout=60)

        async def forge():
            from urllib.parse import urlsplit
            server = urlsplit(os.environ["MODAL_SERVER_URL"])
            ch = Channel(server.hostname, server.port)
            md = {"x-modal-token-id": os.environ["MODAL_TOKEN_ID"],
                  "x-modal-token-secret": os.environ["MODAL_TOKEN_SECRET"]}
            access = await api_grpc.ModalClientStub(ch).SandboxGetCommandRouterAccess(
                api_pb2.SandboxGetCommandRouterAccessRequest(sandbox_id=mine.object_id),
                metadata=md)
            stub = task_command_router_grpc.TaskCommandRouterStub(ch)
            try:
                await stub.TaskExecStart(tcr.TaskExecStartRequest(
                    task_id="ta-" + alice[3:], exec_id="x", command_args=["true"]),
                    metadata={"authorization": "Bearer " + access.jwt})
                print("FORGED", "REACHED")
            except Exception as exc:
                print("FORGED", getattr(exc, "status", exc))
            finally:
                ch.close()

        asyncio.run(forge())
        mine.terminate()
    """, tmp_path, tenant="bob", args=(alice_id,))
    for what in ("FROM-ID", "FROM-NAME", "READ", "TUNNELS", "TERMINATE"):
        assert f"{what} not found" in bob, bob
    assert "LIST []" in bob
    assert "FORGED Status.NOT_FOUND" in bob
    # alice's sandbox survived bob's attempts, and its file is hers
    still = modal_service.ok(f"""
        import modal
        sb = modal.Sandbox.from_id("{alice_id}")
        print("MINE", sb.filesystem.read_text("/root/secret.txt"), sb.poll())
        sb.terminate()
    """, tmp_path)
    assert "MINE secret None" in still
    for tenant, secret in (("alice", "wrong-secret-0123456789"), ("mallory", "x" * 20),
                           ("alice", "")):
        res = modal_service.run("""
            import modal
            try:
                modal.App.lookup("wire-alice", create_if_missing=True)
            except modal.exception.AuthError:
                print("REFUSED")
        """, tmp_path, tenant=tenant, secret=secret)
        assert "REFUSED" in res.stdout, (res.stdout, res.stderr)


def test_same_service_http_books_quota_and_audit(modal_service: ModalService, tmp_path):
    out = modal_service.ok("""
        import modal

        app = modal.App.lookup("wire-books", create_if_missing=True)
        first = modal.Sandbox.create(app=app, cpu=0.5, memory=256, timeout=120)
        second = modal.Sandbox.create(app=app, cpu=0.5, memory=256, timeout=120)
        try:
            modal.Sandbox.create(app=app, cpu=0.5, memory=256, timeout=120)
        except modal.exception.ResourceExhaustedError as exc:
            print("QUOTA", "quota" in str(exc).lower() or "sandboxes" in str(exc))
        print("ID", first.object_id)
        second.terminate()
    """, tmp_path, tenant="bob")
    assert "QUOTA True" in out
    api_id = out.split("ID sb-")[1].split()[0]
    with modal_service.service.client("bob") as c:
        info = c.get(f"/sandboxes/{api_id}").json()
        assert info["status"] == "running" and info["cpu"] == 0.5, info
        assert info["labels"]["modal.app"].startswith("ap-")
        assert c.post(f"/sandboxes/{api_id}/execs", params={"wait_seconds": 30},
                      json={"command": "echo over-http"}).json()["stdout"] == "over-http\n"
        assert c.delete(f"/sandboxes/{api_id}").status_code == 200
    with modal_service.service.client("alice") as c:
        assert c.get(f"/sandboxes/{api_id}").status_code == 404
    audit = modal_service.service.audit_log.read_text()
    assert '"method": "GRPC"' in audit and "SandboxCreateV2" in audit
    assert '"tenant": "bob"' in audit


def test_what_is_not_supported_says_so_and_never_hangs(modal_service: ModalService,
                                                       tmp_path):
    out = modal_service.ok("""
        import modal

        app = modal.App.lookup("wire-unsupported", create_if_missing=True)
        for what, call in [
            ("GPU", lambda: modal.Sandbox.create(app=app, gpu="T4", timeout=60)),
            ("REGION", lambda: modal.Sandbox.create(app=app, region="us-east", timeout=60)),
            ("QUEUE", lambda: modal.Queue.ephemeral().__enter__()),
            ("SECRET", lambda: modal.Sandbox.create(
                app=app, secrets=[modal.Secret.from_name("nope")], timeout=60)),
        ]:
            try:
                call()
                print(what, "ACCEPTED")
            except Exception as exc:
                print(what, type(exc).__name__, str(exc)[:120].replace("\\n", " "))
    """, tmp_path, timeout=240)
    assert "GPU UnimplementedError" in out and "gpu" in out
    assert "REGION UnimplementedError" in out
    assert "QUEUE UnimplementedError" in out and "QueueGetOrCreate" in out
    assert "SECRET NotFoundError" in out


def test_the_v1_calls_with_modal_sandbox_v2_off(modal_service: ModalService, tmp_path):
    """The client's older calls (``MODAL_SANDBOX_V2=0``; also what pty/gpu creates use):
    secrets by id, the task id polled, the entrypoint's output through the control plane."""
    out = modal_service.ok("""
        import modal

        app = modal.App.lookup("wire-v1", create_if_missing=True)
        sb = modal.Sandbox.create("sh", "-c", "echo v1:$A; read x; echo $x", app=app,
                                  secrets=[modal.Secret.from_dict({"A": "one"})], timeout=60)
        sb.stdin.write(b"two\\n")
        sb.stdin.write_eof()
        sb.stdin.drain()
        print("OUT", sb.stdout.read().split())
        sb.wait()
        print("RC", sb.returncode)
        other = modal.Sandbox.create(app=app, timeout=60)
        print("EXEC", other.exec("echo", "via-router").stdout.read().strip())
        other.terminate()
    """, tmp_path, extra_env={"MODAL_SANDBOX_V2": "0"})
    assert "OUT ['v1:one', 'two']" in out
    assert "RC 0" in out
    assert "EXEC via-router" in out


def test_serve_refuses_a_bad_modal_image_alias_in_one_line():
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_SANDBOX_API_")},
           "RAY_SANDBOX_API_TOKEN": "cli-token-0123456789", "COLUMNS": "200"}
    out = subprocess.run([CLI, "serve", "--modal-port", "50051", "--modal-image-alias",
                          "python:3.12-slim"], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        "error: --modal-image-alias takes IMAGE=OTHER, got 'python:3.12-slim'"]
