"""The node hosts' stock of booted, never-used sandboxes (issue 20), on a real one-node Ray
cluster with real sandboxes: a miss asks for stock, a matching create() gets a stocked
sandbox made its own, which shows nothing a fresh one would not; no caller's state reaches
another; a stocked sandbox whose host died is never handed out; the stock keeps to its bounds
and holds its sandboxes' block slots, and gives them back when idle."""

from __future__ import annotations

import os
import signal

import pytest

import ray_sandbox as sandbox
from tests.fx_hostile import wait_until
from tests.fx_ray import homes_cluster, host_pid

PER_SHAPE = 2
IDLE_S = 4  # RAY_SANDBOX_STOCK_IDLE_S here, so that the drain is seen within seconds
OPTS = {"image": "ray-sandbox/busybox", "memory": "32Mi", "cpu": 0.1}
FILL_S = 60  # a hang guard for a refill (one boot), not a speed claim


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, default_image, busybox_image):
    import ray

    home = tmp_path_factory.mktemp("rsb-stock")
    env = {"RAY_SANDBOX_STOCK_MAX": "3", "RAY_SANDBOX_STOCK_PER_SHAPE": str(PER_SHAPE),
           "RAY_SANDBOX_STOCK_IDLE_S": str(IDLE_S), "RAY_SANDBOX_BLOCK_IDLE_S": "2"}
    with homes_cluster([home], env, [{"object_store_memory": 100 * 2**20}]) as c:
        yield ray, home, c


def _stock(ray, sb) -> dict[str, int]:
    return ray.get(sb._host.stock.remote(), timeout=30)


def _stocked_ids(ray, sb) -> set[str]:
    return ray.get(sb._host.__ray_call__.remote(lambda self: self._stock.ids()), timeout=30)


def _filled(ray, sb, n: int = 1) -> None:
    assert wait_until(lambda: _stock(ray, sb)["stocked"] >= n, FILL_S, interval=0.1), \
        _stock(ray, sb)


def _out(ray, sb, cmd: str) -> str:
    r = ray.get(sb.exec.remote(cmd), timeout=60)
    assert r.exit_code == 0, r.stderr
    return r.stdout


def _view(ray, sb) -> dict[str, object]:
    """What a caller can see of its sandbox, with its own name taken out."""
    name = _out(ray, sb, "hostname").strip()
    return {
        "hostname is its own": name == "sandbox-" + sb.sandbox_id[:8],
        "env": sorted(_out(ray, sb, "env").replace(name, "NAME").splitlines()),
        "tmp": _out(ray, sb, "ls -A /tmp"),
        "processes": sorted(_out(ray, sb, "ps -o comm").splitlines()),
        "network": _out(ray, sb, "cat /proc/net/dev | cut -d: -f1; cat /etc/hosts")
        .replace(name, "NAME"),
        "cwd": _out(ray, sb, "pwd"),
        # a restored copy gets a fresh seed there; a booted sandbox, stocked or not, none
        "seed file": _out(ray, sb, "ls -A /.rsb/run"),
    }


def test_a_stocked_sandbox_is_handed_out_and_looks_fresh(cluster):
    ray, _, _ = cluster
    fresh = sandbox.create(**OPTS)  # a miss: the host starts stocking this boot
    _filled(ray, fresh)
    before = _stock(ray, fresh)
    stocked = _stocked_ids(ray, fresh)
    mine = sandbox.create(**OPTS, env={"MINE": "1"}, labels={"who": "me"}, name="stocked-1")
    try:
        after = _stock(ray, mine)
        assert after["hits"] == before["hits"] + 1
        assert mine.sandbox_id in stocked
        # not listed while stocked; listed, named and labelled once handed out
        assert {s.sandbox_id for s in sandbox.list()} == {fresh.sandbox_id, mine.sandbox_id}
        assert sandbox.get("stocked-1").sandbox_id == mine.sandbox_id
        assert _out(ray, mine, "echo $MINE") == "1\n"
        # the first call of both has run: the views compare like for like
        a, b = _view(ray, fresh), _view(ray, mine)
        b["env"] = [e for e in b["env"] if e != "MINE=1"]
        assert a == b
        assert a["hostname is its own"] and a["tmp"] == ""
    finally:
        ray.get([s.terminate.remote() for s in (fresh, mine)], timeout=60)


def test_no_state_reaches_the_next_caller(cluster):
    ray, _, _ = cluster
    first = sandbox.create(**OPTS)
    _filled(ray, first)
    first_id = first.sandbox_id
    _out(ray, first, "echo secret > /tmp/secret; echo secret > /root/secret")
    ray.get(first.terminate.remote(), timeout=60)
    seen = {first_id}
    hits = _stock(ray, first)["hits"]
    for _ in range(3):
        sb = sandbox.create(**OPTS)
        try:
            assert sb.sandbox_id not in seen  # a used sandbox is never handed out again
            seen.add(sb.sandbox_id)
            r = ray.get(sb.exec.remote("cat /tmp/secret /root/secret"), timeout=60)
            assert r.exit_code != 0 and "secret" not in r.stdout
            _out(ray, sb, "echo mine > /tmp/secret")
        finally:
            ray.get(sb.terminate.remote(), timeout=60)
        _filled(ray, sb)
    assert _stock(ray, first)["hits"] == hits + 3


def test_the_stock_keeps_its_bounds_holds_its_slots_and_drains_when_idle(cluster):
    ray, _, _ = cluster
    made = [sandbox.create(**OPTS) for _ in range(PER_SHAPE + 2)]  # misses beyond the cap
    try:
        host = made[0]._host
        _filled(ray, made[0], PER_SHAPE)
        assert _stock(ray, made[0])["target"] <= PER_SHAPE
        used = sum(b.used for b in ray.get(host.blocks.remote(), timeout=30))
        # Ray accounts the stock: every stocked sandbox holds a block slot of its shape
        assert used == len(made) + _stock(ray, made[0])["stocked"]
    finally:
        ray.get([s.terminate.remote() for s in made], timeout=60)
    # idle: one fewer per idle period, then nothing stocked and no slot held for it (a
    # refill still booting when its shelf went is deleted when it is up)
    def drained() -> bool:
        return (_stock(ray, made[0])["stocked"] == 0
                and sum(b.used for b in ray.get(host.blocks.remote(), timeout=30)) == 0)

    assert wait_until(drained, IDLE_S * (PER_SHAPE + 3) + FILL_S, interval=0.5)


def test_the_stock_takes_no_more_than_its_share_of_the_node(cluster):
    """RAY_SANDBOX_STOCK_SHARE (0.25) of the node's 2 CPUs is 0.5: a cpu=1 boot is asked
    for but never stocked, so the stock cannot keep other Ray work off the node."""
    ray, _, _ = cluster
    big = sandbox.create(**{**OPTS, "cpu": 1})
    try:
        assert _stock(ray, big)["target"] >= 1  # asked for (it shrinks after IDLE_S)
        assert not wait_until(lambda: _stock(ray, big)["stocked"] > 0, IDLE_S - 1,
                              interval=0.25)
    finally:
        ray.get(big.terminate.remote(), timeout=60)


def test_a_stocked_sandbox_of_a_dead_host_is_never_handed_out(cluster):
    ray, home, _ = cluster
    sb = sandbox.create(**OPTS)
    _filled(ray, sb)
    old = _stocked_ids(ray, sb)
    os.kill(host_pid(ray, sb._host), signal.SIGKILL)  # Ray restarts the host at once
    # the new incarnation reaps its predecessor's sandboxes, the stocked ones with them
    assert wait_until(lambda: not any((home / "sandboxes" / s).exists() for s in old | {
        sb.sandbox_id}), 60, interval=0.5)
    again = sandbox.create(**OPTS)
    try:
        assert again.sandbox_id not in old
        assert _out(ray, again, "echo ok") == "ok\n"
    finally:
        ray.get(again.terminate.remote(), timeout=60)


def test_a_config_the_stock_cannot_serve_always_boots(cluster):
    """A config no stocked sandbox can serve (a spec transform is code) always boots."""
    ray, _, _ = cluster
    sb = sandbox.create(**OPTS, spec_transform=_identity)
    try:
        before = _stock(ray, sb)
        again = sandbox.create(**OPTS, spec_transform=_identity)
        assert _stock(ray, again)["hits"] == before["hits"]
        ray.get(again.terminate.remote(), timeout=60)
    finally:
        ray.get(sb.terminate.remote(), timeout=60)


def _identity(spec: dict) -> dict:
    return spec


def test_a_config_that_publishes_ports_is_never_stocked(cluster):
    """A stocked copy of a config publishing a port held that port on the node, so the next
    create publishing it (another shape) failed 'port already in use'."""
    ray, _, _ = cluster
    ports = {"network": "sandbox", "expose_ports": [18080]}
    plain = sandbox.create(**OPTS)
    before = _stock(ray, plain)["target"]
    sb = sandbox.create(**OPTS, **ports)
    try:
        assert _stock(ray, sb)["target"] == before  # no shelf for it: nothing boots ahead
    finally:
        ray.get([sb.terminate.remote(), plain.terminate.remote()], timeout=60)
    # ...and the port is published again at once: the deleted one's teardown is finished
    # first (it ran in the background and held the port for a while)
    other = sandbox.create(**{**OPTS, "memory": "48Mi"}, **ports)
    ray.get(other.terminate.remote(), timeout=60)


def test_a_filesystem_image_only_the_stock_uses_is_deleted_at_once(cluster):
    """The stock booted copies from a filesystem image its callers had used; deleting the
    image then answered 'in use' for ~30 s, though none of them was anyone's."""
    ray, _, _ = cluster
    src = sandbox.create(**{**OPTS, "readonly": False})
    try:
        ray.get(src.exec.remote("echo kept > /marker"), timeout=60)
        ref = ray.get(src.snapshot_filesystem.remote(), timeout=120)
    finally:
        ray.get(src.terminate.remote(), timeout=60)
    made = [sandbox.create(**{**OPTS, "image": ref}) for _ in range(2)]
    assert _out(ray, made[0], "cat /marker") == "kept\n"
    _filled(ray, made[0])  # a copy booted from it that no caller asked for
    for sb in made:
        ray.get(sb.terminate.remote(), timeout=60)
    sandbox.delete_filesystem_image(ref)  # raised ImageInUseError
