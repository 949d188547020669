"""One hostile sandbox cannot take down its node (issue 15's outage test), on a real local Ray
cluster: it floods its DNS helper, plants huge files, freezes its agent's handlers, then
replaces the agent with its own server. Its calls fail with typed errors; the node's host
actor stays the same process, and two neighbour sandboxes on the node answer throughout."""

from __future__ import annotations

import os
import threading
import time

import pytest

from ray_sandbox.runtime import errors
from ray_sandbox.runtime.paths import images
from tests.fx_hostile import heavy, wait_until
from tests.fx_ray import host_pid
from tests.fx_runtime import leftovers
from tests.test_agent_untrusted import FAKE_AGENT
from tests.test_host_network_bounds import FLOOD, HOLD, TEST_DNS

MiB = 1 << 20

# Runs as root in the sandbox for 8 s: SIGSTOPs every handler of its agent as soon as it
# appears (not init, so it can go on accepting), then SIGCONTs them and writes how many it
# froze to /.rsb/run (the host sees that directory: waiting on it needs no agent call).
FREEZE = r"""
import os, signal, time
me, stopped, deadline = os.getpid(), set(), time.monotonic() + 8
open("/.rsb/run/freezing", "w").close()
while time.monotonic() < deadline:
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) not in (1, me) and int(pid) not in stopped:
            try:
                if b"rsb-agent" in open(f"/proc/{pid}/cmdline", "rb").read():
                    os.kill(int(pid), signal.SIGSTOP)
                    stopped.add(int(pid))
            except OSError:
                pass
    time.sleep(0.01)
for pid in stopped:
    try:
        os.kill(pid, signal.SIGCONT)
    except OSError:
        pass
open("/.rsb/run/frozen", "w").write(str(len(stopped)))
"""


@pytest.fixture(scope="module")
def outage_cluster(tmp_path_factory, fake_internet, default_image, busybox_image):
    """A Ray cluster whose hosts attach sandbox networks to the fake internet and give up
    on a frozen agent after 3 s (the env is read by the host actor's runtime)."""
    import ray

    import ray_sandbox

    home = tmp_path_factory.mktemp("rsb-outage")
    env = {"RAY_SANDBOX_HOME": str(home), "RAY_SANDBOX_IMAGES": str(images()),
           "RAY_SANDBOX_NET_UPSTREAM": fake_internet.node,
           "RAY_SANDBOX_AGENT_IO_TIMEOUT": "3"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             object_store_memory=300 * MiB)
    try:
        yield ray, home
    finally:
        ray_sandbox.shutdown()
        ray.shutdown()
        from ray_sandbox.runtime import SandboxRuntime

        SandboxRuntime(home, reap=True)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert leftovers(home) == {}, leftovers(home)


class Watch:
    """Neighbours exec ``echo`` in a loop while the hostile sandbox does its worst."""

    def __init__(self, ray, neighbours) -> None:
        self.ray, self.neighbours = ray, neighbours
        self.calls, self.failures = 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for sb in self.neighbours:
                try:
                    out = self.ray.get(sb.exec.remote(["echo", "ok"]), timeout=60).stdout
                    if out != "ok\n":
                        self.failures.append(repr(out))
                except Exception as exc:  # noqa: BLE001 - every failure is the finding
                    self.failures.append(repr(exc))
                self.calls += 1
            time.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=120)


@pytest.mark.timeout(600)
@heavy  # 17 s in CI
def test_one_hostile_sandbox_cannot_take_down_its_node(outage_cluster, tmp_path):
    ray, home = outage_cluster
    import ray_sandbox as sandbox

    neighbours = [sandbox.create(image="ray-sandbox/busybox", cpu=0.1, memory="64Mi")
                  for _ in range(2)]
    bad = sandbox.create(image="ray-sandbox/python", cpu=1, memory="512Mi",
                         network="sandbox", dns=list(TEST_DNS))
    host = host_pid(ray, bad._host)
    watch = Watch(ray, neighbours)
    try:
        run = lambda cmd, **kw: ray.get(bad.exec.remote(cmd, **kw), timeout=120)  # noqa: E731

        # 1. DNS: 1,500 TCP connections held to its helper, and a UDP flood
        ray.get(bad.write_file.remote("/tmp/hold.py", HOLD))
        ray.get(bad.write_file.remote("/tmp/flood.py", FLOOD))
        run("python3 /tmp/hold.py 1500 >/tmp/held 2>&1 </dev/null &")
        wait_until(lambda: run("cat /tmp/held").stdout.strip().isdigit(), 90)
        assert int(run("python3 /tmp/flood.py 100000 5").stdout) > 0
        run("touch /tmp/stop")

        # 2. huge files: bounded reads, nothing left on the caller's disk
        run("truncate -s 8G /tmp/huge")
        with pytest.raises(errors.FileTooLargeError):
            ray.get(bad.read_file.remote("/tmp/huge"))
        with pytest.raises(errors.FileTooLargeError):
            ray.get(bad.download_file.remote("/tmp/huge", tmp_path / "h", max_bytes=32 * MiB))
        assert list(tmp_path.iterdir()) == []

        # 3. every handler of its agent frozen for 8 s while an upload is under way: the call
        #    ends (tests/test_agent_untrusted.py has the handler frozen for good, which is an
        #    AgentTimeoutError) and the neighbours keep answering meanwhile
        ray.get(bad.write_file.remote("/tmp/freeze.py", FREEZE))
        run_dir = home / "sandboxes" / bad.sandbox_id / "run"
        run("python3 /tmp/freeze.py </dev/null >/dev/null 2>&1 &")
        wait_until((run_dir / "freezing").exists, 30)
        try:  # an error (a frame missed its deadline) or done once thawed; never stuck
            ray.get(bad.write_file.remote("/tmp/big", b"\0" * (64 * MiB)), timeout=120)
        except errors.SandboxError:
            pass
        wait_until(lambda: (run_dir / "frozen").exists(), 60)
        assert int((run_dir / "frozen").read_text()) >= 1

        # 4. a planted agent answering every request with a flood
        ray.get(bad.write_file.remote("/tmp/fake_agent.py", FAKE_AGENT))
        run("python3 /tmp/fake_agent.py </dev/null >/dev/null 2>&1 &")
        wait_until(lambda: (home / "sandboxes" / bad.sandbox_id / "run" / "fake.ready")
                   .exists(), 60)
        res = ray.get(bad.exec.remote(["true"], max_output_bytes=MiB), timeout=120)
        assert len(res.stdout_bytes) == MiB and res.truncated
        with pytest.raises(errors.SandboxError):
            ray.get(bad.read_file.remote("/etc/hostname", max_bytes=4 * MiB), timeout=120)
        assert host_pid(ray, bad._host) == host, "the node's host actor was restarted"
    finally:
        watch.stop()
        try:
            ray.get(bad.terminate.remote(), timeout=120)
        finally:
            for sb in neighbours:
                ray.get(sb.terminate.remote(), timeout=120)
    assert watch.calls >= 4 and watch.failures == [], watch.failures
