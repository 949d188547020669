"""Every network mode end to end with real gVisor sandboxes: what each can reach and what not.

The fake internet (tests/fx_network.py) answers on 198.18.1.1 (web.test), 198.18.1.2
(web2.test), a metadata stand-in 169.254.169.254 and a private-range server 10.99.0.1; the
fake node has a server on its loopback and on its own address 198.18.0.1.
"""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ray_sandbox.runtime import network
from ray_sandbox.runtime.config import EgressPolicy, make_config
from ray_sandbox.runtime.errors import ConfigError
from ray_sandbox.runtime.network import netns as _netns
from tests.fx_network import (
    METADATA,
    NODE_ADDR,
    NODE_PORT,
    PRIVATE,
    WEB,
    WEB2,
    Box,
    Sandboxes,
    free_port,
)

pytestmark = pytest.mark.usefixtures("clean_network")
TEST_DNS = ("198.18.1.53",)
GATEWAY = "10.0.2.2"  # slirp4netns' alias for the upstream's loopback


def _until(check, timeout: float = 10.0) -> None:
    """Wait until ``check()`` holds. ``timeout`` only keeps a broken policy update from
    hanging the test; how fast an update applies is measured in benchmarks/, not here."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout, "the policy change never took effect"


def _reach(box: Box) -> dict[str, bool]:
    return {
        "web by ip": box.http(WEB) == f"inet {WEB}\n",
        "web by name": box.http("web.test") == f"inet {WEB}\n",
        "metadata": bool(box.http(METADATA)),
        "private": bool(box.http(PRIVATE)),
        "node address": bool(box.http(NODE_ADDR, NODE_PORT)),
    }


def test_none_reaches_nothing(sandboxes: Sandboxes, host_server: int) -> None:
    with sandboxes.run(make_config(network="none")) as box:
        assert box.attachment.runsc_network == "none" and box.attachment.netns_path is None
        assert box.sh("ip -o addr").stdout.decode().split()[1] == "lo"
        assert box.http("127.0.0.1", host_server) == ""
        err = box.sh(f"nc -w 2 {WEB} 80 </dev/null").stderr.lower()
        assert "no route" in err or "unreachable" in err


def test_host_shares_the_node_namespace(sandboxes: Sandboxes, host_server: int) -> None:
    with sandboxes.run(make_config(network="host")) as box:
        assert box.attachment.runsc_network == "host"
        assert box.http("127.0.0.1", host_server) == "host 127.0.0.1\n"


@pytest.mark.parametrize("mode", ["public", "sandbox"])
def test_default_policy(sandboxes: Sandboxes, upstream, mode: str) -> None:
    with sandboxes.run(make_config(network=mode, dns=TEST_DNS)) as box:
        assert box.lookup("web.test") == WEB
        assert _reach(box) == {"web by ip": True, "web by name": True, "metadata": False,
                               "private": False, "node address": False}
        # the node's loopback: slirp4netns refuses it, the veth path has no route to it
        assert box.http(GATEWAY if mode == "public" else "10.213.0.1", NODE_PORT) == ""


@pytest.mark.parametrize("mode", ["public", "sandbox"])
def test_allow_cidrs_open_private_but_not_the_node_loopback(
    sandboxes: Sandboxes, upstream, mode: str
) -> None:
    egress = EgressPolicy(allow_cidrs=(f"{PRIVATE}/32", "10.0.2.0/24"), deny_cidrs=(WEB2,))
    with sandboxes.run(make_config(network=mode, dns=TEST_DNS, egress=egress)) as box:
        assert box.http(PRIVATE) == f"inet {PRIVATE}\n"
        assert box.http(WEB2) == ""  # deny wins
        assert box.http(METADATA) == ""
        if mode == "public":  # allowed by nft, still refused by --disable-host-loopback
            assert box.http(GATEWAY, NODE_PORT) == ""


def test_public_never_reaches_the_hosts_loopback(sandboxes: Sandboxes, host_server: int) -> None:
    """Upstream = the real node namespace; only loopback is ever addressed here."""
    egress = EgressPolicy(allow_cidrs=(f"{GATEWAY}/32",))
    with sandboxes.run(make_config(network="public", egress=egress)) as box:
        assert box.http(GATEWAY, host_server) == ""
        assert box.http("127.0.0.1", host_server) == ""  # its own loopback: nothing there


@pytest.mark.parametrize("mode", ["public", "sandbox"])
def test_domain_allowlist_and_live_changes(sandboxes: Sandboxes, upstream, mode: str) -> None:
    only_web = EgressPolicy(default="deny", allow_domains=("web.test", "private.test",
                                                           "meta.test"))
    with sandboxes.run(make_config(network=mode, dns=TEST_DNS, egress=only_web)) as box:
        assert box.http(WEB) == ""  # not resolved yet: unknown addresses are denied
        assert box.lookup("web.test") == WEB
        assert box.http("web.test") == f"inet {WEB}\n"
        assert box.lookup("web2.test") is None  # not allowlisted: the resolver refuses
        assert box.http(WEB2) == ""
        assert box.lookup("private.test") == PRIVATE  # a domain may open a private address
        assert box.http(PRIVATE) == f"inet {PRIVATE}\n"
        assert box.lookup("meta.test") == METADATA  # ... but never link-local (rebinding)
        assert box.http(METADATA) == ""

        state_dir = box.state_dir
        network.set_egress(box.sandbox_id, state_dir,
                           EgressPolicy(default="deny", allow_domains=("web2.test",)))
        _until(lambda: box.http(WEB) == "")  # web.test's addresses are gone at once
        assert box.lookup("web2.test") == WEB2
        assert box.http(WEB2) == f"inet {WEB2}\n"

        network.set_egress(box.sandbox_id, state_dir, EgressPolicy(deny_cidrs=(WEB2,)))
        _until(lambda: box.http(WEB) == f"inet {WEB}\n" and box.http(WEB2) == "")


def test_set_egress_cuts_open_connections(sandboxes: Sandboxes, upstream) -> None:
    # connect at once, send the request a second later
    slow_get = f"(sleep 1; printf 'GET / HTTP/1.0\\r\\n\\r\\n') | nc {WEB} 80"
    with sandboxes.run(make_config(network="public", dns=TEST_DNS)) as box:
        assert "200 OK" in box.sh(slow_get).stdout.decode()
        with ThreadPoolExecutor(1) as pool:
            slow = pool.submit(box.sh, slow_get)
            time.sleep(0.4)
            network.set_egress(box.sandbox_id, box.state_dir, EgressPolicy(deny_cidrs=(WEB,)))
            assert "200 OK" not in slow.result().stdout.decode()


def _listen_in_sandbox(box: Box, port: int) -> None:
    box.sh(f"nc -ll -p {port} -e echo hello-from-sandbox </dev/null >/dev/null 2>&1 &")


def _get(netns: str | None, addr: str, port: int) -> bytes:
    def get() -> bytes:
        for _ in range(50):
            try:
                with socket.create_connection((addr, port), timeout=2) as s:
                    data = s.recv(100)
                    if data:
                        return data
            except OSError:
                pass
            time.sleep(0.05)
        return b""

    return _netns.run_in(netns, get)


def test_public_exposed_port_answers_on_the_host(sandboxes: Sandboxes) -> None:
    port = free_port()
    with sandboxes.run(make_config(network="public", expose_ports=(port,))) as box:
        assert box.attachment.endpoints == {port: ("127.0.0.1", port)}
        _listen_in_sandbox(box, port)
        assert _get(None, "127.0.0.1", port) == b"hello-from-sandbox\n"


def test_sandbox_mode_exposed_port_answers_on_the_node(sandboxes: Sandboxes, upstream) -> None:
    with sandboxes.run(make_config(network="sandbox", dns=TEST_DNS, expose_ports=(8080,))) as box:
        assert box.attachment.endpoints == {8080: ("127.0.0.1", 8080)}
        assert box.attachment.run_prefix[0] == "unshare"
        _listen_in_sandbox(box, 8080)
        assert _get(upstream.node, "127.0.0.1", 8080) == b"hello-from-sandbox\n"


@pytest.mark.parametrize("mode", ["public", "sandbox"])
def test_a_published_port_cannot_be_taken_by_a_node_service(sandboxes: Sandboxes, upstream,
                                                             mode: str) -> None:
    """sandbox mode publishes by DNAT, which binds nothing: a node service bound the port
    afterwards without error, and its local clients reached the sandbox instead."""
    port = free_port()

    def bind() -> str:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
                s.listen(1)
            except OSError as exc:
                return exc.strerror or str(exc)
            return "bound"

    netns = upstream.node  # both publish in the upstream (the stand-in node)
    extra = {"dns": TEST_DNS} if mode == "sandbox" else {}
    with sandboxes.run(make_config(network=mode, expose_ports=(port,), **extra)) as box:
        _listen_in_sandbox(box, port)
        assert _netns.run_in(netns, bind) == "Address already in use"
        assert _get(netns, "127.0.0.1", port) == b"hello-from-sandbox\n"
    _until(lambda: _netns.run_in(netns, bind) == "bound")  # freed with the sandbox


def test_sandbox_cannot_touch_its_network(sandboxes: Sandboxes, upstream) -> None:
    """In public mode the sentry uses host sockets in the sandbox's netns; it still cannot
    reconfigure that netns: the sentry holds no capability over it."""
    with sandboxes.run(make_config(network="public", dns=TEST_DNS)) as box:
        for cmd in ("ip route del default", "ip link set tap0 down",
                    "ip addr add 169.254.169.1/16 dev tap0",
                    "ip route add 169.254.0.0/16 dev tap0"):
            assert box.sh(cmd).returncode != 0, cmd
        assert box.http(METADATA) == "" and box.http(WEB) == f"inet {WEB}\n"
        pid = box.runsc.state(box.sandbox_id).pid
        status = Path(f"/proc/{pid}/status").read_text()
        cap_eff = int(next(line for line in status.splitlines()
                           if line.startswith("CapEff:")).split()[1], 16)
        userns = Path(f"/proc/{pid}/ns/user").readlink()
        own_userns = userns != Path("/proc/self/ns/user").readlink()
        assert not cap_eff & (1 << 12) or own_userns, (hex(cap_eff), userns)  # CAP_NET_ADMIN


def test_a_link_opens_one_port_of_another_sandbox_and_unlink_closes_it(
    sandboxes: Sandboxes, upstream
) -> None:
    config = make_config(network="sandbox", dns=TEST_DNS)
    with sandboxes.run(config) as server, sandboxes.run(config) as client:
        for port in (8080, 8081):
            _listen_in_sandbox(server, port)
        addr = server.sh("ip -4 -o addr show eth0").stdout.decode().split()[3].split("/")[0]

        def hello(box: Box, host: str, port: int) -> bool:
            done = box.sh(f"nc -w 3 {host} {port} </dev/null")
            return "hello-from-sandbox" in done.stdout.decode()

        assert not hello(client, addr, 8080)  # the veth pool is closed by default
        got = network.link(client.sandbox_id, client.state_dir, server.sandbox_id,
                           server.state_dir, 8080)
        assert got == (addr, 8080)
        assert network.links(client.state_dir) == [(server.sandbox_id, 8080)]
        assert hello(client, addr, 8080)
        assert not hello(client, addr, 8081)  # only the linked port
        _listen_in_sandbox(client, 9090)
        client_addr = client.sh("ip -4 -o addr show eth0").stdout.decode().split()[3]
        assert not hello(server, client_addr.split("/")[0], 9090)  # and only that way
        network.unlink(client.sandbox_id, client.state_dir, server.sandbox_id, 8080)
        network.unlink(client.sandbox_id, client.state_dir, server.sandbox_id, 8080)
        assert network.links(client.state_dir) == []
        assert not hello(client, addr, 8080)


def test_links_join_only_sandbox_mode_sandboxes(sandboxes: Sandboxes, upstream) -> None:
    with sandboxes.run(make_config(network="sandbox", dns=TEST_DNS)) as server, \
            sandboxes.run(make_config(network="public", dns=TEST_DNS)) as client:
        for a, b in ((client, server), (server, client)):
            with pytest.raises(ConfigError, match="network='sandbox'"):
                network.link(a.sandbox_id, a.state_dir, b.sandbox_id, b.state_dir, 80)
        with pytest.raises(ConfigError, match="1-65535"):
            network.link(server.sandbox_id, server.state_dir, client.sandbox_id,
                         client.state_dir, 0)


def test_links_to_deleted_sandboxes_make_room(sandboxes: Sandboxes, upstream, monkeypatch) -> None:
    from ray_sandbox.runtime.network import _lifecycle

    monkeypatch.setattr(_lifecycle, "MAX_LINKS", 1)
    config = make_config(network="sandbox", dns=TEST_DNS)
    with sandboxes.run(config) as client:
        with sandboxes.run(config) as first, sandboxes.run(config) as second:
            network.link(client.sandbox_id, client.state_dir, first.sandbox_id,
                         first.state_dir, 80)
            with pytest.raises(ConfigError, match="at most 1 links"):
                network.link(client.sandbox_id, client.state_dir, second.sandbox_id,
                             second.state_dir, 80)
        with sandboxes.run(config) as third:  # first is gone now
            network.link(client.sandbox_id, client.state_dir, third.sandbox_id,
                         third.state_dir, 80)
            assert network.links(client.state_dir) == [(third.sandbox_id, 80)]
