"""attach/detach/gc without sandboxes: bad input, failures half-way, crashes, concurrency."""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ray_sandbox.runtime import network
from ray_sandbox.runtime.config import EgressPolicy, SandboxConfig, make_config
from ray_sandbox.runtime.errors import ConfigError, NetworkError
from ray_sandbox.runtime.network import _lifecycle, alloc, procs, slirp4netns
from tests.fx_network import free_port

pytestmark = pytest.mark.usefixtures("clean_network")


def _sid() -> str:
    return secrets.token_hex(16)


def _dir(tmp_path: Path, sid: str) -> Path:
    d = tmp_path / sid
    d.mkdir()
    return d


@pytest.mark.parametrize(
    "fields",
    [
        {"network": "bogus"},
        {"network": "sandbox", "rootless": True},
        {"network": "host", "dns": ("198.18.1.53",)},
        {"network": "none", "expose_ports": (8080,)},
    ],
)
def test_bad_input_is_rejected_before_anything_exists(tmp_path: Path, fields: dict) -> None:
    # model_construct skips SandboxConfig's own checks: attach must not rely on them
    config = SandboxConfig.model_construct(**{**SandboxConfig().model_dump(), **fields})
    with pytest.raises(ConfigError):
        network.attach(_sid(), config, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_bad_sandbox_id(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        network.attach("../../x", make_config(network="public"), tmp_path)


def test_port_in_use_is_a_config_error(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match="in use"):
            network.attach(_sid(), make_config(network="public", expose_ports=(port,)),
                           _dir(tmp_path, "a"))


def test_port_leased_by_another_sandbox_is_a_config_error(tmp_path: Path, upstream) -> None:
    port = free_port()
    first = _sid()
    network.attach(first, make_config(network="sandbox", expose_ports=(port,)),
                   _dir(tmp_path, first))
    try:
        # nothing listens (DNAT), so only the lease can tell
        with pytest.raises(ConfigError, match="in use"):
            network.attach(_sid(), make_config(network="public", expose_ports=(port,)),
                           _dir(tmp_path, "b"))
    finally:
        network.detach(first, tmp_path / first)


@pytest.mark.parametrize("mode", ["none", "host"])
def test_trivial_modes_create_nothing(tmp_path: Path, mode: str) -> None:
    att = network.attach(_sid(), make_config(network=mode), tmp_path)
    assert att.runsc_network == mode and att.run_prefix == [] and att.netns_path is None
    assert "localhost" in att.hosts
    assert list(tmp_path.iterdir()) == []
    network.detach(_sid(), tmp_path)


def test_public_resolver_is_generated_not_inherited(tmp_path: Path, upstream) -> None:
    sid = _sid()
    att = network.attach(sid, make_config(network="public"), _dir(tmp_path, sid))
    try:
        assert att.resolv_conf.startswith("nameserver 127.0.0.53\n")
        cfg = json.loads((tmp_path / sid / "dns.json").read_text())
        assert cfg["upstreams"] == ["1.1.1.1", "8.8.8.8"]  # public resolvers by default
    finally:
        network.detach(sid, tmp_path / sid)


def test_failed_attach_leaves_nothing(tmp_path: Path, upstream, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise NetworkError("slirp4netns did not come up (injected)")

    monkeypatch.setattr(slirp4netns, "wait_ready", broken)
    sid = _sid()
    with pytest.raises(NetworkError, match="injected"):
        network.attach(sid, make_config(network="public", expose_ports=(free_port(),)),
                       _dir(tmp_path, sid))
    assert not (tmp_path / sid / "network.json").exists()


def test_detach_is_idempotent(tmp_path: Path, upstream) -> None:
    sid = _sid()
    network.attach(sid, make_config(network="sandbox"), _dir(tmp_path, sid))
    network.detach(sid, tmp_path / sid)
    network.detach(sid, tmp_path / sid)
    network.detach(_sid(), tmp_path)  # never attached
    left = network.leftovers()  # the first detach removed everything; the others add nothing
    tag = _lifecycle.tag(sid)
    assert tag not in left["netns"] and sid not in left["leases"]
    assert not [p for p in left["processes"] if tag in p]
    assert not (tmp_path / sid / "network.json").exists()


def _crash(sid: str, config: SandboxConfig, state_dir: Path) -> None:
    """Attach in a separate process that then dies without detaching."""
    code = (
        "import sys; from pathlib import Path; from ray_sandbox.runtime import network; "
        "from ray_sandbox.runtime.config import SandboxConfig; "
        "c = SandboxConfig.model_validate_json(sys.argv[3]); "
        "print(network.attach(sys.argv[1], c, Path(sys.argv[2])).model_dump_json())"
    )
    subprocess.run([sys.executable, "-c", code, sid, str(state_dir), config.model_dump_json()],
                   check=True, capture_output=True, timeout=60)


def test_gc_after_a_crash(tmp_path: Path, upstream) -> None:
    live, dead, lost = _sid(), _sid(), _sid()
    for sid, mode in ((live, "public"), (dead, "sandbox"), (lost, "public")):
        _crash(sid, make_config(network=mode, expose_ports=(free_port(),)), _dir(tmp_path, sid))
    (tmp_path / lost / "network.json").unlink()  # its state dir is gone too: sweep by name
    removed = network.gc({live}, tmp_path)
    assert f"sandbox {dead}" in removed
    assert any(lost in r or _lifecycle.tag(lost) in r for r in removed)
    left = network.leftovers()  # node-wide: keep only this test's objects
    tags = {_lifecycle.tag(s) for s in (live, dead, lost)}
    assert [n for n in left["netns"] if n in tags] == [_lifecycle.tag(live)]
    mine = [p for p in left["processes"] if any(t in p for t in tags)]
    assert mine and all(_lifecycle.tag(live) in p for p in mine)
    assert [s for s in left["leases"] if s in (live, dead, lost)] == [live]
    network.gc(set(), tmp_path)
    assert not (tmp_path / live / "network.json").exists()


def test_detach_without_state_removes_by_name_what_is_recorded(tmp_path: Path, upstream) -> None:
    """A teardown cut short can leave the lease with its state file gone (seen: a netns
    left on the node after a Ray host was killed mid-teardown). Detach must not only drop
    the lease then, or nothing would ever find the netns again."""
    sid = _sid()
    _crash(sid, make_config(network="sandbox"), _dir(tmp_path, sid))
    (tmp_path / sid / "network.json").unlink()
    network.detach(sid, tmp_path / sid)
    left = network.leftovers()
    tag = _lifecycle.tag(sid)
    assert tag not in left["netns"] and sid not in left["leases"]
    assert not [p for p in left["processes"] if tag in p]
    assert not [x for x in left["links"] + left["nft_tables"] if tag in x]


def test_concurrent_attaches_get_distinct_subnets(tmp_path: Path, upstream) -> None:
    sids = [_sid() for _ in range(8)]
    config = make_config(network="sandbox")
    dirs = [_dir(tmp_path, s) for s in sids]
    with ThreadPoolExecutor(4) as pool:
        # half in other processes, half in this one, all at once
        futures = [pool.submit(_crash if i < 4 else network.attach, sids[i], config, dirs[i])
                   for i in range(8)]
        for f in futures:
            f.result()
    try:
        with alloc.locked() as a:
            subnets = [k for k, v in a.subnets.items() if v.sandbox_id in sids]
        assert len(subnets) == 8
        nets = [ipaddress.ip_network(s) for s in subnets]
        assert all(not a.overlaps(b) for i, a in enumerate(nets) for b in nets[i + 1 :])
    finally:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(network.detach, sids, dirs))


def test_set_egress_validates_and_needs_an_attachment(tmp_path: Path, upstream) -> None:
    with pytest.raises(NetworkError):
        network.set_egress(_sid(), tmp_path, EgressPolicy())
    sid = _sid()
    network.attach(sid, make_config(network="public"), _dir(tmp_path, sid))
    try:
        with pytest.raises(ConfigError):
            network.set_egress(sid, tmp_path / sid, {"allow_cidrs": ["300.1.1.1/8"]})
        network.set_egress(sid, tmp_path / sid, EgressPolicy(default="deny"))
        rules = json.loads((tmp_path / sid / "egress.json").read_text())
        assert (rules["allow_domains"], rules["default"], rules["inject"]) == ([], "deny", [])
        assert "10.213.0.0/16" in rules["sets"]["cidrs"]["deny4"]  # what the proxy checks
    finally:
        network.detach(sid, tmp_path / sid)


def test_stop_never_signals_a_recycled_pid() -> None:
    ref = procs.ProcRef(pid=os.getpid(), start=1, what="stale")  # wrong start time
    procs.stop(ref)  # must not kill the test process
    assert not procs.alive(ref)


def test_gc_leaves_other_homes_alone(tmp_path: Path, upstream, net_home: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    sid = _sid()
    network.attach(sid, make_config(network="public"), _dir(tmp_path, sid))
    try:
        monkeypatch.setenv("RAY_SANDBOX_HOME", str(tmp_path / "another-home"))
        assert network.gc(set(), tmp_path / "another-home" / "sandboxes") == []
        assert _lifecycle.tag(sid) in network.leftovers()["netns"]
    finally:
        monkeypatch.setenv("RAY_SANDBOX_HOME", str(net_home))
        network.detach(sid, tmp_path / sid)


def test_dns_helper_survives_a_reload_signal_sent_at_once(tmp_path):
    """A SIGHUP (policy change) that arrives before the helper installed its handler must
    not kill it: set_egress right after attach used to leave the sandbox without DNS."""
    import contextlib
    import json
    import signal
    import socket
    import time

    from ray_sandbox.runtime import _proc
    from ray_sandbox.runtime.network import dns

    (tmp_path / "policy.json").write_text(json.dumps({"allow_domains": [], "default": "allow"}))
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    udp.bind(("127.0.0.1", 0))
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    cfg = {"table": "rsb-000000000000", "nft_netns": None, "upstreams": [],
           "policy_path": str(tmp_path / "policy.json"), "cache_path": str(tmp_path / "c.json"),
           "udp_fd": udp.fileno(), "tcp_fd": tcp.fileno()}
    udp_addr = udp.getsockname()
    with udp, tcp:
        proc = dns.start(tag="rsb-000000000000", config=cfg, state_dir=tmp_path,
                         upstream=None, fds=[udp.fileno(), tcp.fileno()])
    try:
        proc.send_signal(signal.SIGHUP)  # at once: the interpreter is still starting
        # It must still answer a query afterwards (any reply: it has no upstreams).
        query = bytes.fromhex("abcd0100000100000000000003777777076578616d706c6503636f6d0000010001")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as client:
            client.settimeout(0.5)
            reply = b""
            deadline = time.monotonic() + 15
            while not reply and time.monotonic() < deadline and proc.poll() is None:
                client.sendto(query, udp_addr)
                with contextlib.suppress(TimeoutError):
                    reply = client.recv(512)
        assert reply[:2] == b"\xab\xcd", (tmp_path / "dns.log").read_text()
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
        _proc.forget(proc)
