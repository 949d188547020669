"""Safe defaults and bounded background work on the host (issue 15, findings 11, 12, 17):
a sandbox's limits cannot be set so that they break the runtime, and the defaults leave the
node room for its other sandboxes. Real runsc."""

from __future__ import annotations

import pytest

from ray_sandbox.runtime import SandboxState
from ray_sandbox.runtime.config import PLANNED_DENSITY, node_pid_max, node_pids_limit
from ray_sandbox.runtime.errors import ConfigError
from tests.fx_hostile import cgroup_value, wait_until


def test_a_huge_ttl_is_refused_and_other_ttls_still_fire(runtime):
    """ttl_seconds=1e10 used to pass validation and kill the TTL thread (OverflowError), so
    no other TTL of that runtime ever fired again."""
    try:
        sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi", ttl_seconds=1e10)
    except ConfigError:
        pass
    else:
        runtime.delete(sid)
    sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi", ttl_seconds=1)
    try:
        wait_until(lambda: runtime.get_status(sid).state == SandboxState.TERMINATED, 15)
        st = runtime.get_status(sid)
        assert (st.state, st.reason) == (SandboxState.TERMINATED, "TTLExpired")
    finally:
        runtime.delete(sid)


@pytest.mark.parametrize("bad", [dict(timeout_seconds=1e10), dict(ttl_seconds=1e10),
                                 dict(workdir="/.rsb/run"), dict(workdir="/.rsb")])
def test_unusable_configs_are_refused_before_any_work(runtime, bad):
    with pytest.raises(ConfigError, match=next(iter(bad))):
        runtime.create(image="ray-sandbox/busybox", memory="64Mi", **bad)


def test_default_pids_limit_leaves_the_node_room(runtime):
    """A default sandbox could hold ~4,070 host tasks: nine exhausted pid_max 32768. The
    default is now sized from pid_max: PLANNED_DENSITY sandboxes at their limit use half."""
    sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi")
    try:
        limit = int(cgroup_value("pids", sid, "pids.max"))
    finally:
        runtime.delete(sid)
    assert limit == node_pids_limit()
    assert limit * PLANNED_DENSITY <= max(node_pid_max() // 2, 1024 * PLANNED_DENSITY)


def test_a_second_home_on_a_shared_store_keeps_the_first_homes_pins(temp_store,
                                                                       busybox_sources,
                                                                       tmp_path):
    """#7: a runtime starting in a second home ran gc over the shared image store and
    unpinned the first home's live images; a later remove deleted a running root fs."""
    from ray_sandbox.runtime import SandboxRuntime
    from ray_sandbox.runtime.images import ImageInUseError

    image = temp_store.get(busybox_sources["oci"])
    first = SandboxRuntime(tmp_path / "a", images=temp_store)
    try:
        sid = first.create(image=busybox_sources["oci"], memory="64Mi")
        SandboxRuntime(tmp_path / "b", images=temp_store).close()  # its gc runs at start
        with pytest.raises(ImageInUseError):
            temp_store.remove(image.digest)
        assert first.exec(sid, ["cat", "/bin/busybox"]).exit_code == 0
    finally:
        first.close()
    assert temp_store.pins(image.digest) == set()


@pytest.mark.parametrize("call", [
    lambda rt, sid: rt.exec(sid, "true", timeout=1e10),
    lambda rt, sid: rt.exec(sid, "true", timeout=1e17),
    lambda rt, sid: rt.exec(sid, "true", timeout="5"),
    lambda rt, sid: rt.exec(sid, "true", max_output_bytes=2**63),
    lambda rt, sid: rt.exec(sid, None),
    lambda rt, sid: rt.exec(sid, "true", env={"A": 1}),
    lambda rt, sid: rt.exec(sid, "cat", stdin=5),
    lambda rt, sid: rt.spawn(sid, ["sh"], pty="big"),
    lambda rt, sid: rt.write_file(sid, "/tmp/x", 5),
], ids=["timeout-1e10", "timeout-1e17", "timeout-str", "max-output-2**63", "command-None",
        "env-int", "stdin-int", "pty-str", "write-int"])
def test_bad_call_arguments_are_config_errors(runtime, call):
    """#16: each of these raised OverflowError, struct.error or TypeError from deep inside."""
    sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi")
    try:
        with pytest.raises(ConfigError):
            call(runtime, sid)
        assert runtime.exec(sid, ["echo", "still"]).stdout == "still\n"
    finally:
        runtime.delete(sid)


@pytest.mark.parametrize("bad", ["soon", "0", "-1", "nan", "1e10"])
def test_a_bad_agent_io_timeout_is_a_config_error(tmp_path, monkeypatch, bad):
    """A mistyped RAY_SANDBOX_AGENT_IO_TIMEOUT used to be a bare ValueError at startup (in Ray:
    every create on the node failed with it)."""
    from ray_sandbox.runtime import SandboxRuntime

    monkeypatch.setenv("RAY_SANDBOX_AGENT_IO_TIMEOUT", bad)
    with pytest.raises(ConfigError, match="RAY_SANDBOX_AGENT_IO_TIMEOUT"):
        SandboxRuntime(tmp_path, reap=False)
