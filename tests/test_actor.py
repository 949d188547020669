"""The Ray layer on a real local Ray cluster: create(), handles, files through Ray, names,
lifetimes, pools, placement. (Issue: Ray-native sandboxes.)"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import textwrap
import time

import pytest
from ray.util.placement_group import PlacementGroup, placement_group_table

import ray_sandbox as sandbox
from ray_sandbox.runtime.errors import SandboxNotFoundError
from tests.fx_hostile import wait_until
from tests.fx_ray import host_pid


def test_issue_snippet(ray_cluster, tmp_path):
    ray = ray_cluster
    sb = sandbox.create(cpu=1.0, memory="512Mi", image="ray-sandbox/python")
    result = ray.get(sb.exec.remote("python3 -c 'import sys; print(sys.version)'"))
    assert result.exit_code == 0 and result.stdout.startswith("3.")
    ray.get(sb.write_file.remote("/app/train.py", "print('Training complete')"))
    bundle = tmp_path / "bundle.tar.gz"
    src = tmp_path / "src"
    src.mkdir()
    (src / "data.txt").write_text("payload")
    with tarfile.open(bundle, "w:gz") as t:
        t.add(src / "data.txt", arcname="data.txt")
    ray.get(sb.upload_file.remote(str(bundle), "/tmp/bundle.tar.gz"))
    res = ray.get(sb.exec.remote("mkdir -p /app && tar -xzf /tmp/bundle.tar.gz -C /app"))
    assert res.exit_code == 0, res.stderr
    out = ray.get(sb.exec.remote("python3 /app/train.py && cat /app/data.txt"))
    assert out.stdout == "Training complete\npayload"
    ray.get(sb.terminate.remote())
    with pytest.raises(SandboxNotFoundError):
        ray.get(sb.exec.remote("true"))


def test_handle_is_serializable_and_usable_from_tasks(ray_cluster):
    ray = ray_cluster
    sb = sandbox.create(image="ray-sandbox/busybox", cpu=0.1, memory="64Mi")

    @ray.remote(num_cpus=0)
    def use(handle):
        return ray.get(handle.exec.remote("echo from-task")).stdout

    try:
        assert ray.get(use.remote(sb)) == "from-task\n"
    finally:
        ray.get(sb.terminate.remote())


def test_one_sandbox_reaches_a_linked_port_of_another(ray_cluster):
    ray = ray_cluster
    opts = {"image": "ray-sandbox/busybox", "cpu": 0.1, "memory": "64Mi", "network": "sandbox"}
    server = sandbox.create(**opts)
    client = sandbox.create(**opts, node_id=server.node_id)
    try:
        ray.get(server.exec.remote("nc -ll -p 8080 -e echo hello </dev/null >/dev/null 2>&1 &"))
        link = ray.get(client.link.remote(server, 8080))
        assert link.to == server.sandbox_id and link.port == 8080
        assert ray.get(client.links.remote()) == [link]
        got = ray.get(client.exec.remote(f"nc -w 3 {link.host} 8080 </dev/null"))
        assert got.stdout == "hello\n", got
        ray.get(client.unlink.remote(server.sandbox_id, 8080))
        got = ray.get(client.exec.remote(f"nc -w 3 {link.host} 8080 </dev/null"))
        assert got.stdout == "" and got.exit_code != 0
        with pytest.raises(SandboxNotFoundError, match="on the node of"):
            ray.get(client.link.remote("0" * 32, 8080))
        ray.get(client.link.remote(server, 8080))
        ray.get(server.terminate.remote())
        assert ray.get(client.links.remote()) == []  # a link to a sandbox that is gone
    finally:
        ray.get([server.terminate.remote(), client.terminate.remote()])


def test_exec_stream_is_a_ray_generator(ray_cluster):
    ray = ray_cluster
    sb = sandbox.create(image="ray-sandbox/busybox", cpu=0.1, memory="64Mi")
    try:
        items = [ray.get(r) for r in sb.exec_stream.remote("for i in 1 2 3; do echo $i; done")]
        text = "".join(i.text for i in items[:-1])
        assert text == "1\n2\n3\n" and items[-1].exit_code == 0
    finally:
        ray.get(sb.terminate.remote())


def test_reservation_is_in_ray_and_released(ray_cluster):
    ray = ray_cluster
    before = ray.cluster_resources()["CPU"]
    _wait_cpu(ray, before)
    sb = sandbox.create(image="ray-sandbox/busybox", cpu=1.5, memory="64Mi")
    deadline = time.time() + 5
    while ray.available_resources().get("CPU", 0) > before - 1.5 and time.time() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU", 0) == pytest.approx(before - 1.5)
    ray.get(sb.terminate.remote())
    _wait_cpu(ray, before)
    assert ray.available_resources().get("CPU", 0) == pytest.approx(before)


def _wait_cpu(ray, want: float, timeout: float = 10) -> None:
    """Resource views update asynchronously after a placement group is removed."""
    deadline = time.time() + timeout
    while ray.available_resources().get("CPU", 0) < want and time.time() < deadline:
        time.sleep(0.1)


def test_queues_when_full(ray_cluster):
    ray = ray_cluster
    from ray_sandbox.runtime.errors import SandboxCreationError

    big = sandbox.create(image="ray-sandbox/busybox", cpu=3.5, memory="64Mi")
    try:
        with pytest.raises(SandboxCreationError, match="full"):
            sandbox.create(image="ray-sandbox/busybox", cpu=1.0, memory="64Mi", timeout=1.0)
    finally:
        ray.get(big.terminate.remote())
    sb = sandbox.create(image="ray-sandbox/busybox", cpu=1.0, memory="64Mi", timeout=30)
    ray.get(sb.terminate.remote())


def test_named_get_list_and_get_if_exists(ray_cluster):
    ray = ray_cluster
    sb = sandbox.create(image="ray-sandbox/busybox", cpu=0.1, memory="64Mi", name="alpha",
                        labels={"team": "rl"})
    try:
        again = sandbox.get("alpha")
        assert again.sandbox_id == sb.sandbox_id
        assert sandbox.create(name="alpha", get_if_exists=True).sandbox_id == sb.sandbox_id
        assert [h.sandbox_id for h in sandbox.list(labels={"team": "rl"})] == [sb.sandbox_id]
        with pytest.raises(SandboxNotFoundError):
            sandbox.get("beta")
    finally:
        ray.get(sb.terminate.remote())


DRIVER = textwrap.dedent(
    """
    import ray, ray_sandbox as sandbox
    ray.init(namespace="x")  # RAY_ADDRESS: this test's cluster, not whichever ran last
    a = sandbox.create(image="ray-sandbox/busybox", cpu=0.1, memory="64Mi", name="owned")
    b = sandbox.create(image="ray-sandbox/busybox", cpu=0.1, memory="64Mi", name="kept",
                       lifetime="detached")
    # copies follow the same rule: tied to this job unless detached
    c = sandbox.fork(b, lifetime="detached")[0]
    d = sandbox.fork(b)[0]
    # a detached sandbox suspended and resumed here stays detached
    e = sandbox.create(image="ray-sandbox/busybox", cpu=0.1, memory="64Mi", name="resumed",
                       lifetime="detached")
    ray.get(e.suspend.remote())
    e = sandbox.resume("resumed")
    print(a.sandbox_id, b.sandbox_id, c.sandbox_id, d.sandbox_id, e.sandbox_id, flush=True)
    """
)


def test_owner_tied_and_detached_lifetimes(ray_cluster):
    ray = ray_cluster
    out = subprocess.run([sys.executable, "-c", DRIVER], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "RAY_ADDRESS":
                                           ray.get_runtime_context().gcs_address})
    assert out.returncode == 0, out.stderr[-2000:]
    owned, kept, kept_copy, owned_copy, resumed = out.stdout.split()
    deadline = time.time() + 20
    while time.time() < deadline:
        ids = {h.sandbox_id for h in sandbox.list()}
        if owned not in ids and owned_copy not in ids:
            break
        time.sleep(0.25)
    assert owned not in ids, "the driver's sandbox outlived its driver"
    assert owned_copy not in ids, "the driver's copy outlived its driver"
    assert {kept, kept_copy, resumed} <= ids, "a detached sandbox died with its driver"
    for h in sandbox.list():
        if h.sandbox_id in (kept, kept_copy, resumed):
            ray.get(h.terminate.remote())


def test_files_through_ray_byte_exact(ray_cluster, tmp_path):
    ray = ray_cluster

    sb = sandbox.create(image="ray-sandbox/busybox", cpu=0.1, memory="128Mi")
    try:
        blob = os.urandom(9 << 20)  # crosses the 4 MiB chunking
        (tmp_path / "in.bin").write_bytes(blob)
        ray.get(sb.upload_file.remote(tmp_path / "in.bin", "/tmp/in.bin"))
        ray.get(sb.download_file.remote("/tmp/in.bin", tmp_path / "out.bin"))
        assert (tmp_path / "out.bin").read_bytes() == blob
        (tmp_path / "d/e").mkdir(parents=True)
        (tmp_path / "d/e/f").write_text("x")
        ray.get(sb.upload_dir.remote(tmp_path / "d", "/tmp/d"))
        ray.get(sb.download_dir.remote("/tmp/d", tmp_path / "d2"))
        assert (tmp_path / "d2/e/f").read_text() == "x"
        assert ray.get(sb.read_file.remote("/tmp/d/e/f")) == b"x"
    finally:
        ray.get(sb.terminate.remote())


def test_pool_serves_warm_sandboxes(ray_cluster):
    ray = ray_cluster
    with sandbox.SandboxPool(image="ray-sandbox/busybox", cpu=0.1, memory="64Mi", size=2) as pool:
        pool.wait_warm(2, timeout=60)
        sb = pool.acquire()
        assert ray.get(sb.exec.remote("echo warm")).stdout == "warm\n"
        ray.get(sb.write_file.remote("/tmp/secret", "x"))
        pool.release(sb)
        results = list(pool.map(lambda s, i: ray.get(s.exec.remote(f"echo {i}")).stdout,
                                range(4), concurrency=2))
        assert results == [f"{i}\n" for i in range(4)]
        stats = pool.stats()
        assert stats["hits"] >= 1 and stats["out"] == 0


def test_metrics_are_exported(ray_cluster, ray_metrics_port):
    """create/exec latency and live sandboxes reach Ray's Prometheus endpoint."""
    import urllib.request

    ray = ray_cluster
    sb = sandbox.create(image="ray-sandbox/busybox", cpu=0.1, memory="64Mi")
    hog = sandbox.create(image="ray-sandbox/python", cpu=0.5, memory="64Mi")
    try:
        ray.get(sb.exec.remote("true"))
        with pytest.raises(Exception):  # noqa: B017 - the sandbox dies under the call
            ray.get(hog.exec.remote(["python3", "-c", "x = bytearray(400 << 20); "
                                     "x[::4096] = b'1' * len(x[::4096])"], timeout=30))
        ray.get(hog.terminate.remote())
        want = ("ray_sandbox_create_seconds", "ray_sandbox_exec_seconds", "ray_sandbox_live",
                "ray_sandbox_oom_kills_total")
        deadline = time.time() + 60  # metrics are pushed to the agent every few seconds
        text = ""
        while time.time() < deadline and not all(w in text for w in want):
            time.sleep(1)
            try:
                url = f"http://127.0.0.1:{ray_metrics_port}/metrics"
                text = urllib.request.urlopen(url, timeout=5).read().decode()
            except OSError:
                continue
        assert all(w in text for w in want), [w for w in want if w not in text]
    finally:
        ray.get(sb.terminate.remote())


def _host_gone(ray, host) -> bool:
    try:
        ray.get(host.ping.remote(), timeout=10)
    except ray.exceptions.RayActorError:
        return True
    return False


def test_idle_host_retires_and_a_stale_handle_gets_a_fresh_host(ray_cluster):
    """A host without sandboxes leaves (so an autoscaler can remove its node); this driver
    still caches its handle, and its next create starts a fresh host instead of failing."""
    ray = ray_cluster
    sb = sandbox.create(image="ray-sandbox/busybox", cpu=0.1, memory="64Mi")
    old_host, old_pid = sb._host, host_pid(ray, sb._host)
    ray.get(sb.terminate.remote())
    ray.get(old_host.__ray_call__.remote(lambda self: setattr(self, "_idle_limit", 0.0)))
    assert wait_until(lambda: _host_gone(ray, old_host), 30, 0.2)
    sb = sandbox.create(image="ray-sandbox/busybox", cpu=0.1, memory="64Mi")
    try:
        assert ray.get(sb.exec.remote("echo again")).stdout == "again\n"
        assert host_pid(ray, sb._host) != old_pid
    finally:
        ray.get(sb.terminate.remote())


def test_create_racing_a_retiring_host_keeps_its_reservation(ray_cluster):
    """A create that reaches a host between its decision to retire and its exit is refused
    with HostRetiringError, and the caller retries on a fresh host with the same
    reservation, which stays in Ray while the sandbox lives."""
    ray = ray_cluster
    sb = sandbox.create(image="ray-sandbox/busybox", cpu=0.1, memory="64Mi")
    host = sb._host
    ray.get(sb.terminate.remote())

    def retire_soon(self):
        import threading

        self._here.retiring = True
        threading.Timer(1.0, lambda: ray.get_runtime_context().current_actor
                        .__ray_terminate__.remote()).start()

    old_pid = host_pid(ray, host)
    ray.get(host.__ray_call__.remote(retire_soon))
    sb = sandbox.create(image="ray-sandbox/busybox", cpu=0.1, memory="64Mi", timeout=60)
    try:
        # it was refused by the retiring host and landed on a fresh one
        assert _host_gone(ray, host) and host_pid(ray, sb._host) != old_pid
        assert ray.get(sb.exec.remote("echo fresh")).stdout == "fresh\n"
        pg_hex = ray.get(sb._host.__ray_call__.remote(lambda self, i: self._here.pgs[i],
                                                      sb.sandbox_id))
        assert placement_group_table(PlacementGroup(ray.PlacementGroupID(
            bytes.fromhex(pg_hex))))["state"] == "CREATED"
    finally:
        ray.get(sb.terminate.remote())


def test_disk_limit_through_ray(ray_cluster):
    ray = ray_cluster
    sb = sandbox.create(image="ray-sandbox/busybox", cpu=0.1, memory="64Mi", disk="16Mi")
    try:
        res = ray.get(sb.exec.remote("dd if=/dev/zero of=/fill bs=1M count=48"))
        assert res.exit_code != 0 and "No space left" in res.stderr
        assert ray.get(sb.exec.remote("rm /fill && echo ok")).stdout == "ok\n"
    finally:
        ray.get(sb.terminate.remote())


def test_every_config_option_works_through_create(ray_cluster, ray_home):
    """Issue 16: create() re-listed 18 of SandboxConfig's fields, so directfs=False and
    pids_limit= (what the README recommends for hostile code) were TypeErrors through Ray,
    and memory=None silently meant 512Mi."""
    import json

    ray = ray_cluster
    sb = sandbox.create(image="ray-sandbox/busybox", cpu=0, memory=None, directfs=False,
                        pids_limit=256, capabilities=[])
    try:
        assert ray.get(sb.exec.remote("echo ok")).stdout == "ok\n"
        cfg = json.loads((ray_home / "sandboxes" / sb.sandbox_id / "record.json")
                         .read_text())["config"]
        assert (cfg["directfs"], cfg["pids_limit"], cfg["memory"], cfg["cpu"]) == (
            False, 256, None, None)
    finally:
        ray.get(sb.terminate.remote())
    with pytest.raises(sandbox.ConfigError, match="no_such_option"):
        sandbox.create(image="ray-sandbox/busybox", no_such_option=1)


def test_a_name_is_held_by_one_live_sandbox_at_a_time(ray_cluster):
    """create(name=) twice made two sandboxes and get() returned the newer one; Ray's named
    actors refuse a taken name, and Modal raises AlreadyExistsError."""
    from ray.experimental import internal_kv

    from ray_sandbox.actor import names
    from ray_sandbox.runtime.errors import SandboxExistsError

    ray = ray_cluster
    opts = {"image": "ray-sandbox/busybox", "cpu": 0.1, "memory": "64Mi"}
    first = sandbox.create(name="dup", **opts)
    try:
        with pytest.raises(SandboxExistsError, match="'dup' already exists"):
            sandbox.create(name="dup", **opts)
        assert isinstance(SandboxExistsError("x"), ValueError)  # what Ray raises for names
        same = sandbox.create(name="dup", get_if_exists=True, **opts)
        assert same.sandbox_id == first.sandbox_id
        assert len(sandbox.list()) == 1
    finally:
        ray.get(first.terminate.remote())
    # given back when its sandbox ends, at once
    second = sandbox.create(name="dup", **opts)
    assert sandbox.get("dup").sandbox_id == second.sandbox_id
    ray.get(second.terminate.remote())
    # a claim whose sandbox is gone (a host that died with it) is taken over
    internal_kv._internal_kv_put(b"ghost", b"f" * 32, namespace=names._NS)
    third = sandbox.create(name="ghost", **opts)
    ray.get(third.terminate.remote())
    # and one the TTL ended is given back too
    short = sandbox.create(name="ttl", ttl_seconds=1, **opts)
    wait_until(lambda: not sandbox.list(), 30)
    ray.get(sandbox.create(name="ttl", **opts).terminate.remote())
    assert short.sandbox_id not in {h.sandbox_id for h in sandbox.list()}


def test_a_filesystem_image_is_deleted_when_no_host_runs(ray_cluster, ray_home):
    """With no host actor running (a new driver, or hosts retired after idling) the delete
    asked nobody and silently kept the image on disk (~169 MB per Modal snapshot)."""
    from ray_sandbox.runtime import fs_image

    ray = ray_cluster
    sb = sandbox.create(image="ray-sandbox/busybox", cpu=0.1, memory="64Mi", readonly=False)
    ref = ray.get(sb.snapshot_filesystem.remote())
    ray.get(sb.terminate.remote())
    sandbox.shutdown()  # every host gone, as after their idle retirement
    node, image_id = fs_image.parse(ref)
    path = fs_image.layout(node, image_id, ray_home)
    assert path.is_dir()
    sandbox.delete_filesystem_image(ref)
    assert not path.exists()


def test_a_create_of_another_shape_does_not_wait_for_idle_blocks(ray_cluster):
    """After terminate(), a create of another CPU/memory shape waited for the empty block
    of the first shape to idle out (RAY_SANDBOX_BLOCK_IDLE_S, ~11 s by default) while
    nothing ran: when no host has room, hosts give their empty blocks back at once."""
    ray = ray_cluster
    first = sandbox.create(image="ray-sandbox/busybox", cpu=2, memory="64Mi")
    host = first._host
    ray.get(first.terminate.remote())
    assert [b.used for b in ray.get(host.blocks.remote())] == [0]  # empty, still held
    assert ray.get(host.blocks.remote(True)) == []  # what a create waiting for room asks
    # 3 of the cluster's 4 CPUs: fits only once the empty block is gone
    other = sandbox.create(image="ray-sandbox/busybox", cpu=3, memory="96Mi", timeout=60)
    ray.get(other.terminate.remote())
