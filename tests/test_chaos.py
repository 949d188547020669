"""Chaos: SIGKILL each moving part while a call is in flight — the runsc sandbox process (the
sentry), the gofer, the agent's connection handler and PID 1 inside the sandbox, the process
owning a runtime mid-create, the Ray host actor, a Ray worker node of a multi-node cluster and
a Ray driver. Callers must get typed (or Ray) errors within seconds, nothing may hang, and the
reaper must leave zero containers, cgroups, mounts, processes and files.
(Issue 10: hostile code, faults and load.)
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ray_sandbox.runtime import SandboxRuntime, SandboxState, procfs
from ray_sandbox.runtime.errors import SandboxDiedError, SandboxError, SandboxNotFoundError
from tests.fx_hostile import answers, heavy, runsc_pid, settle_state, wait_until
from tests.fx_ray import host_pid
from tests.fx_runtime import leftovers, leftovers_after_teardown

FAST = 15.0  # seconds a caller may wait for the error after a kill ("within seconds")


class InFlight:
    """Run one call in a thread; remember its outcome and how long after ``mark`` it ended."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.outcome: object = None
        self.ended: float | None = None
        self.mark = 0.0
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], object]) -> None:
        try:
            self.outcome = fn()
        except BaseException as exc:  # noqa: BLE001 - the outcome is what the test inspects
            self.outcome = exc
        self.ended = time.monotonic()

    def kill_now(self) -> None:
        self.mark = time.monotonic()

    def wait(self, timeout: float = FAST) -> float:
        """Seconds from the kill to the outcome; fails the test if the call still hangs."""
        self._thread.join(timeout)
        assert self.ended is not None, f"call still hanging {timeout:g}s after the kill"
        return self.ended - self.mark


def _assert_gone(runtime: SandboxRuntime, rt_home: Path, sid: str) -> None:
    """No runsc container, process, cgroup, mount, state or directory of ``sid`` is left."""
    left = leftovers_after_teardown(rt_home, {sid})  # delete's teardown is in the background
    assert sid not in {c.id for c in runtime.runsc.list()}
    mine = {kind: [x for x in items if kind == "cgroups" or sid in x]
            for kind, items in left.items()}
    assert not any(mine.values()), mine


# --- the runtime's moving parts --------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", ["sentry", "gofer"])
def test_sigkill_of_runsc_process_fails_inflight_exec_fast(runtime, rt_home, victim):
    sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi", cpu=0.5)
    try:
        pid = runsc_pid(b"runsc-sandbox" if victim == "sentry" else b"runsc-gofer", sid)
        call = InFlight(lambda: runtime.exec(sid, ["sleep", "60"], timeout=120))
        time.sleep(0.5)
        call.kill_now()
        os.kill(pid, signal.SIGKILL)
        assert call.wait() < FAST
        assert isinstance(call.outcome, SandboxDiedError), call.outcome
        assert settle_state(runtime, sid) == SandboxState.ERROR
        with pytest.raises(SandboxDiedError):  # later calls fail at once as well
            runtime.exec(sid, ["true"], timeout=5)
    finally:
        runtime.delete(sid)
    _assert_gone(runtime, rt_home, sid)


@pytest.mark.timeout(120)
def test_sigkill_of_agent_handler_fails_only_that_call(runtime, rt_home):
    sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi", cpu=0.5)
    try:
        call = InFlight(lambda: runtime.exec(sid, ["sleep", "61"], timeout=120))
        assert wait_until(lambda: "sleep 61" in runtime.exec(sid, ["ps", "-o", "args"]).stdout,
                          10)
        # the handler serving that connection is the parent of the command
        find = "ps -o pid,ppid,args | awk '$3 == \"sleep\" && $4 == \"61\" {print $2}'"
        handler = runtime.exec(sid, ["/bin/sh", "-c", find]).stdout.strip()
        assert handler.isdigit() and handler != "1"
        call.kill_now()
        runtime.exec(sid, ["kill", "-9", handler])
        assert call.wait() < FAST
        assert isinstance(call.outcome, SandboxDiedError), call.outcome
        # PID 1 reaped the handler and the sandbox serves new calls; the orphaned command was
        # re-parented to PID 1 and can be killed from a new call
        assert runtime.get_status(sid).state == SandboxState.RUNNING and answers(runtime, sid)
    finally:
        runtime.delete(sid)
    _assert_gone(runtime, rt_home, sid)


@pytest.mark.timeout(120)
def test_sigkill_of_pid1_inside_stops_the_sandbox_with_typed_errors(runtime, rt_home):
    sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi", cpu=0.5)
    try:
        call = InFlight(lambda: runtime.exec(sid, ["sleep", "60"], timeout=120))
        time.sleep(0.5)
        call.kill_now()
        with contextlib.suppress(SandboxDiedError):  # this call dies with the sandbox too
            runtime.exec(sid, ["kill", "-9", "1"])
        assert call.wait() < FAST and isinstance(call.outcome, SandboxError), call.outcome
        assert settle_state(runtime, sid) == SandboxState.ERROR
    finally:
        runtime.delete(sid)
    _assert_gone(runtime, rt_home, sid)


OWNER = textwrap.dedent("""
    import sys
    from ray_sandbox.runtime import SandboxRuntime
    rt = SandboxRuntime(sys.argv[1])
    rt.create(image="ray-sandbox/busybox", memory="64Mi", cpu=0.2)
    print("created", flush=True)
    import time; time.sleep(600)
""")


def _runsc_cli_running(home: Path, verb: bytes = b"run") -> bool:
    """A ``runsc <verb>`` command (not the sandbox or gofer) of this home is running (the
    verb matters: a starting runtime's reaper runs ``runsc list`` first)."""
    marker = f"--root={home / 'runsc'}".encode()
    for _, argv in procfs.cmdlines():
        if argv[0].endswith(b"runsc") and marker in argv and verb in argv:
            return True
    return False


def _remove_cgroups(sid: str) -> None:
    for ctrl in Path("/sys/fs/cgroup").iterdir():
        d = ctrl / sid
        if d.is_dir() and not (d / "cgroup.procs").read_text().strip():
            d.rmdir()


@pytest.mark.timeout(180)
def test_sigkill_of_owner_mid_create_is_reaped(tmp_path, image_store, busybox_image):
    """The owner dies while ``runsc run`` is in flight (its record already says 'creating'):
    the next runtime's reaper must remove runsc's half-made container and every trace."""
    home = tmp_path / "home"
    env = {**os.environ, "RAY_SANDBOX_IMAGES": str(image_store.root)}
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(home)], stdout=subprocess.PIPE,
                            env=env)
    try:
        assert wait_until(lambda: _runsc_cli_running(home), 60, 0.001)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    sid = next((home / "sandboxes").iterdir()).name
    try:
        SandboxRuntime(home, images=image_store)  # the reaper runs at start
        wait_until(lambda: not _runsc_cli_running(home), 30)  # the orphaned runsc run ends
        left = leftovers(home, {sid})
    finally:
        _remove_cgroups(sid)  # leave the shared machine as it was, whatever the outcome
    assert left == {}, left


EXITING_OWNER = textwrap.dedent("""
    import os, sys
    from ray_sandbox.runtime import SandboxRuntime
    rt = SandboxRuntime(sys.argv[1])
    print(rt.create(image="ray-sandbox/busybox", memory="64Mi", cpu=0.2), flush=True)
    os._exit(0)  # dies without deleting; its parent does not collect it (a zombie)
""")


@pytest.mark.timeout(120)
def test_zombie_owner_counts_as_dead(tmp_path, image_store, busybox_image):
    home = tmp_path / "home"
    env = {**os.environ, "RAY_SANDBOX_IMAGES": str(image_store.root)}
    proc = subprocess.Popen([sys.executable, "-c", EXITING_OWNER, str(home)],
                            stdout=subprocess.PIPE, text=True, env=env)
    sid = proc.stdout.readline().strip()
    try:
        assert wait_until(lambda: Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1]
                          .split()[0] == "Z", 30)
        rt = SandboxRuntime(home, images=image_store)  # its reaper runs now
        reaped = not (home / "sandboxes" / sid).exists()
    finally:
        proc.wait()  # now collect it, and let a second reaper clean up for real
        SandboxRuntime(home, images=image_store)
    assert reaped and rt.gc() == []


# --- the Ray layer ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chaos_cluster(ray_home) -> Iterator[tuple[object, object]]:
    """A real two-node Ray cluster on this machine: a head and a killable worker node that
    alone offers the ``chaos_worker`` resource."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 2, "include_dashboard": False})
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield ray, cluster
    finally:
        import ray_sandbox

        try:
            ray_sandbox.shutdown()
        except Exception:  # noqa: BLE001 - a host on a removed node cannot answer
            pass
        ray.shutdown()
        cluster.shutdown()
        _collect_ray_zombies()
        SandboxRuntime(ray_home)  # the reaper: what killed hosts and nodes left behind
        assert leftovers(ray_home) == {}, leftovers(ray_home)


def _collect_ray_zombies() -> None:
    """Collect Ray workers that died as our adopted orphans (see _wait_dead), so the reaper
    sees their sandboxes' owners as dead even after a failed test."""
    for task in Path("/proc/self/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for pid in map(int, children):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            comm, state = stat[stat.index("(") + 1 : stat.rindex(")")], stat.rsplit(")", 1)[1]
            if comm.startswith("ray::") and state.split()[0] == "Z":
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)


def _worker(cluster) -> object:
    node = cluster.add_node(num_cpus=2, resources={"chaos_worker": 100})
    cluster.wait_for_nodes()
    return node


def _wait_dead(pid: int, timeout: float = 60) -> bool:
    """Wait until ``pid`` exits. This pytest process is a child subreaper (SandboxRuntime
    makes it one), so Ray workers orphaned by a killed raylet re-parent *here* and stay
    zombies (see test_zombie_owner_counts_as_dead): collect them like init would."""

    def dead() -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        return not Path(f"/proc/{pid}").exists()

    return wait_until(dead, timeout, 0.2)


@pytest.mark.timeout(240)
def test_sigkill_of_host_actor_gives_ray_error_and_restart_reaps(chaos_cluster, ray_home):
    ray, cluster = chaos_cluster
    import ray_sandbox as sandbox

    sb = sandbox.create(image="ray-sandbox/busybox", cpu=0.1, memory="64Mi")
    ref = sb.exec.remote("sleep 60")
    time.sleep(1)
    t0 = time.monotonic()
    os.kill(host_pid(ray, sb._host), signal.SIGKILL)
    with pytest.raises(ray.exceptions.RayError):
        ray.get(ref, timeout=60)
    assert time.monotonic() - t0 < FAST
    # The host restarts (max_restarts=-1) and reaps what its dead incarnation created.
    assert wait_until(lambda: not (ray_home / "sandboxes" / sb.sandbox_id).exists(), 60, 0.5)
    with pytest.raises((SandboxNotFoundError, ray.exceptions.RayError)):
        ray.get(sb.exec.remote("true"), timeout=60)
    fresh = sandbox.create(image="ray-sandbox/busybox", cpu=0.1, memory="64Mi")
    assert ray.get(fresh.exec.remote("echo ok"), timeout=60).stdout == "ok\n"
    ray.get(fresh.terminate.remote(), timeout=60)


@pytest.mark.timeout(300)
def test_worker_node_death_gives_ray_errors_and_reaper_cleans(chaos_cluster, ray_home):
    ray, cluster = chaos_cluster
    import ray_sandbox as sandbox

    node = _worker(cluster)
    sb = sandbox.create(image="ray-sandbox/busybox", cpu=0.1, memory="64Mi",
                        resources={"chaos_worker": 1})
    assert ray.get(sb.exec.remote("echo hi"), timeout=60).stdout == "hi\n"
    host = host_pid(ray, sb._host)
    ref = sb.exec.remote("sleep 60")
    time.sleep(1)
    t0 = time.monotonic()
    cluster.remove_node(node, allow_graceful=False)
    with pytest.raises(ray.exceptions.RayError):
        ray.get(ref, timeout=60)
    with pytest.raises(ray.exceptions.RayError):
        ray.get(sb.exec.remote("true"), timeout=60)
    assert time.monotonic() - t0 < 2 * FAST
    # Nothing on this machine deletes the dead node's sandboxes until a runtime starts here
    # (in production: the node's next host actor). Its reaper removes every trace once the
    # old host process (the sandbox's owner) has noticed its raylet is gone and exited.
    assert (ray_home / "sandboxes" / sb.sandbox_id).exists()
    assert _wait_dead(host)
    SandboxRuntime(ray_home)
    assert not (ray_home / "sandboxes" / sb.sandbox_id).exists()
    assert not leftovers(ray_home, {sb.sandbox_id}).get("cgroups")


@pytest.mark.timeout(300)
@heavy  # 13 s in CI
def test_shutdown_after_a_node_death_does_not_hang(chaos_cluster):
    """``ray_sandbox.shutdown()`` right after a node died returns within a minute, skipping
    the dead node's host (dead, or still RESTARTING) instead of raising its Ray error."""
    ray, cluster = chaos_cluster
    import ray_sandbox as sandbox

    node = _worker(cluster)
    sb = sandbox.create(image="ray-sandbox/busybox", cpu=0.1, memory="64Mi",
                        resources={"chaos_worker": 1})
    ray.get(sb.exec.remote("true"), timeout=60)
    host = host_pid(ray, sb._host)
    cluster.remove_node(node, allow_graceful=False)
    call = InFlight(sandbox.shutdown)
    call.kill_now()
    try:
        assert call.wait(75) < 75
        assert not isinstance(call.outcome, BaseException), call.outcome
    finally:  # reap the dead node's sandbox once its owner has exited
        _wait_dead(host)
        SandboxRuntime(os.environ["RAY_SANDBOX_HOME"])


@pytest.mark.timeout(240)
def test_pool_replaces_warm_sandboxes_lost_with_their_host(chaos_cluster, ray_home):
    """SIGKILL the host that runs a pool's warm stock: the restarted host reaps those
    sandboxes, the pool drops them and warms new ones, and acquire serves working ones."""
    ray, _ = chaos_cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    import ray_sandbox as sandbox

    head = ray.get_runtime_context().get_node_id()  # not a worker node an earlier test removed
    with sandbox.SandboxPool(
        image="ray-sandbox/busybox", cpu=0.1, memory="64Mi", size=2, node_id=head,
        actor_options={"scheduling_strategy": NodeAffinitySchedulingStrategy(head, soft=False)},
    ) as pool:
        pool.wait_warm(2, timeout=90)
        stock = ray.get(pool._actor.__ray_call__.remote(lambda self: list(self._warm)))
        warm = [sb.sandbox_id for sb in stock]
        os.kill(host_pid(ray, stock[0]._host), signal.SIGKILL)  # both are on the head's host

        def replaced() -> bool:
            now = ray.get(pool._actor.__ray_call__.remote(
                lambda self: [sb.sandbox_id for sb in self._warm]))
            return len(now) == 2 and not set(now) & set(warm)

        assert wait_until(replaced, 90, 0.5)
        for _ in range(2):
            sb = pool.acquire()
            assert ray.get(sb.exec.remote("echo ok"), timeout=60).stdout == "ok\n"
            pool.release(sb)
    for sid in warm:
        assert not (ray_home / "sandboxes" / sid).exists()


DRIVER = textwrap.dedent("""
    import sys, ray, ray_sandbox as sandbox
    ray.init(address=sys.argv[1], log_to_driver=False)
    sb = sandbox.create(image="ray-sandbox/busybox", cpu=0.1, memory="64Mi")
    ref = sb.exec.remote("sleep 300")
    print(sb.sandbox_id, flush=True)
    ray.get(ref)
""")


@pytest.mark.timeout(240)
def test_sigkill_of_driver_deletes_its_sandboxes(chaos_cluster, ray_home):
    ray, cluster = chaos_cluster
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, cluster.address],
                            stdout=subprocess.PIPE, text=True)
    try:
        # Ray may print its own messages first (e.g. the death of an earlier test's node)
        sid = next((line.strip() for line in proc.stdout
                    if re.fullmatch(r"[0-9a-f]{32}", line.strip())), "")
        assert len(sid) == 32, sid
        assert (ray_home / "sandboxes" / sid).exists()
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    # the job ends, its placement group goes, the host's watcher deletes the sandbox
    assert wait_until(lambda: not (ray_home / "sandboxes" / sid).exists(), 60, 0.5), sid
    assert not leftovers(ray_home, {sid}).get("cgroups")
