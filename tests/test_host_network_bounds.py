"""Host-side bounds of the network layer under hostile sandboxes (issue 15): the DNS helper's
threads and memory stay capped whatever the sandbox sends it, and node-wide network state
(leases, ``ip_forward``) is shared by every home on the node, so one home's gc or delete never
cuts off another home's live sandboxes.

Everything runs real gVisor sandboxes against the fake internet of tests/fx_network.py; the
"slow upstream" is a UDP socket in the fake internet that is never read.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from ray_sandbox.runtime import SandboxRuntime
from ray_sandbox.runtime.config import make_config
from ray_sandbox.runtime.network import dns, procs
from ray_sandbox.runtime.network import netns as _netns
from ray_sandbox.runtime.network import state as _state
from ray_sandbox.runtime.network.procs import ProcRef
from tests.fx_hostile import heavy
from tests.fx_network import DNS_SERVER, INET, WEB, WEB2, Sandboxes
from tests.fx_runtime import leftovers

pytestmark = pytest.mark.usefixtures("clean_network")
TEST_DNS = (DNS_SERVER,)
BLACK_HOLE = WEB2  # its UDP port 53 gets a socket that is never read: queries just wait

# Opens N TCP connections to the sandbox's resolver and holds them until /tmp/stop exists.
HOLD = r"""
import os, resource, socket, sys, time
n = int(sys.argv[1])
server = [l.split()[1] for l in open("/etc/resolv.conf") if l.startswith("nameserver")][0]
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
held, deadline = [], time.monotonic() + 60
while len(held) < min(n, hard - 64) and time.monotonic() < deadline:
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect((server, 53))
    except OSError:
        s.close()
        continue
    held.append(s)
print(len(held), flush=True)
deadline = time.monotonic() + 120
while not os.path.exists("/tmp/stop") and time.monotonic() < deadline:
    time.sleep(0.05)
"""

# Sends up to N distinct UDP queries to the sandbox's resolver, as fast as it can, for at most
# LIMIT seconds; prints how many it sent.
FLOOD = r"""
import socket, struct, sys, time
n, limit = int(sys.argv[1]), float(sys.argv[2])
server = [l.split()[1] for l in open("/etc/resolv.conf") if l.startswith("nameserver")][0]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setblocking(False)
sent, deadline = 0, time.monotonic() + limit
while sent < n and time.monotonic() < deadline:
    q = struct.pack("!HHHHHH", sent & 0xFFFF, 0x0100, 1, 0, 0, 0)
    q += b"\x0bflood%06d\x04test\x00\x00\x01\x00\x01" % (sent % 1000000)
    try:
        s.sendto(q, (server, 53))
        sent += 1
    except BlockingIOError:
        pass
print(sent)
"""

RESOLVE = "import socket; print(socket.gethostbyname('web.test'))"


def _helper(state_dir: Path) -> ProcRef:
    st = _state.load(state_dir)
    assert st is not None
    return next(p for p in st.procs if p.what == "dns")


def _status(pid: int) -> dict[str, int]:
    """Threads and memory (KiB) of a host process, from /proc/PID/status."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Threads", "VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


@contextmanager
def _peak_threads(pid: int) -> Iterator[list[int]]:
    """Samples the thread count of ``pid`` while the block runs; yields [peak]."""
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], _status(pid)["Threads"])

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        yield peak
    finally:
        done.set()
        t.join()


@contextmanager
def _black_hole() -> Iterator[None]:
    """A DNS "server" in the fake internet that takes queries and never answers."""

    def bind() -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((BLACK_HOLE, 53))
        return s

    with _netns.run_in(INET, bind):
        yield


@contextmanager
def _runtime(home: Path, image_store) -> Iterator[SandboxRuntime]:
    rt = SandboxRuntime(home, images=image_store)
    try:
        yield rt
    finally:
        rt.close()


def _until(check, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


# --- finding 4: TCP connections to the DNS helper -----------------------------------------


def test_dns_helper_threads_stay_bounded_under_held_tcp_connections(
    image_store, net_home, upstream, default_image
) -> None:
    with _runtime(net_home, image_store) as rt:
        sid = rt.create(image="ray-sandbox/python", memory="256Mi", cpu=1, network="sandbox",
                        dns=TEST_DNS)
        try:
            ref = _helper(rt.sandboxes_dir / sid)
            before = _status(ref.pid)["Threads"]
            rt.write_file(sid, "/tmp/hold.py", HOLD.encode())
            rt.exec(sid, "python3 /tmp/hold.py 1500 >/tmp/held 2>&1 </dev/null &")
            with _peak_threads(ref.pid) as peak:
                _until(lambda: rt.exec(sid, "cat /tmp/held").stdout.strip().isdigit(),
                       "the client never finished connecting")
                held = int(rt.exec(sid, "cat /tmp/held").stdout)
                # the helper still answers while every connection slot may be taken
                resolved = rt.exec(sid, ["python3", "-c", RESOLVE]).stdout.strip()
            rt.exec(sid, "touch /tmp/stop")
            print(f"\nhelper threads: {before} idle, peak {peak[0]} with {held} TCP "
                  f"connections held (bound {dns.MAX_THREADS})")
            assert held >= 1000, held
            assert peak[0] <= dns.MAX_THREADS, peak[0]
            assert resolved == WEB
            assert procs.alive(ref)
        finally:
            rt.delete(sid)
    assert leftovers(net_home, {sid}) == {}


# --- finding 5: a UDP flood against a slow upstream ---------------------------------------


@heavy  # 11 s in CI, a flood
def test_dns_helper_memory_stays_bounded_under_a_udp_flood(
    image_store, net_home, upstream, default_image
) -> None:
    with _black_hole(), _runtime(net_home, image_store) as rt:
        sid = rt.create(image="ray-sandbox/python", memory="256Mi", cpu=1, network="sandbox",
                        dns=(BLACK_HOLE,))
        try:
            ref = _helper(rt.sandboxes_dir / sid)
            before = _status(ref.pid)
            rt.write_file(sid, "/tmp/flood.py", FLOOD.encode())
            with _peak_threads(ref.pid) as peak:
                out = rt.exec(sid, "python3 /tmp/flood.py 300000 10", timeout=60)
            after = _status(ref.pid)
            sent = int(out.stdout)
            growth = after["VmHWM"] - before["VmRSS"]
            print(f"\n{sent} queries: helper RSS {before['VmRSS']} KiB before, peak "
                  f"{after['VmHWM']} KiB (+{growth} KiB), threads {before['Threads']} -> "
                  f"peak {peak[0]}")
            assert sent >= 20000, out
            assert growth < 16 * 1024, growth
            assert peak[0] <= dns.MAX_THREADS, peak[0]
            assert procs.alive(ref)
        finally:
            rt.delete(sid)
    assert leftovers(net_home, {sid}) == {}


# --- finding 6: gc of one home and the live sandboxes of another ----------------------------


def test_gc_of_another_home_leaves_live_sandboxes_running(
    image_store, net_home, upstream, busybox_image, tmp_path_factory
) -> None:
    """Both runtimes run with the same RAY_SANDBOX_HOME in the environment (net_home), as a
    process hosting several runtimes does; their homes differ."""
    home_a, home_b = tmp_path_factory.mktemp("home-a"), tmp_path_factory.mktemp("home-b")
    with _runtime(home_a, image_store) as rt_a:
        sid = rt_a.create(image="ray-sandbox/busybox", memory="64Mi", network="sandbox",
                          dns=TEST_DNS)
        try:
            st = _state.load(rt_a.sandboxes_dir / sid)
            ref = _helper(rt_a.sandboxes_dir / sid)
            with _runtime(home_b, image_store):  # its gc runs now
                pass
            assert procs.alive(ref), "home B's gc killed home A's DNS helper"
            assert st is not None and _netns.NETNS_DIR.joinpath(st.netns).exists()
            assert rt_a.exec(sid, "nslookup web.test").stdout.count(WEB) >= 1
            got = rt_a.exec(sid, f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {WEB} 80")
            assert got.stdout.endswith(f"inet {WEB}\n"), got
        finally:
            rt_a.delete(sid)
    assert leftovers(home_a, {sid}) == {}
    assert leftovers(home_b) == {}


# --- finding 9: ip_forward across homes -------------------------------------------------------


def _forwarding(netns: str) -> str:
    return _netns.run_in(netns, lambda: Path("/proc/sys/net/ipv4/ip_forward").read_text().strip())


@contextmanager
def _in_home(monkeypatch: pytest.MonkeyPatch, home: Path, cm):
    """Enter and leave ``cm`` with RAY_SANDBOX_HOME set to ``home``, as that home's process
    would."""
    monkeypatch.setenv("RAY_SANDBOX_HOME", str(home))
    value = cm.__enter__()
    try:
        yield value
    except BaseException as exc:
        monkeypatch.setenv("RAY_SANDBOX_HOME", str(home))
        if not cm.__exit__(type(exc), exc, exc.__traceback__):
            raise
    else:
        monkeypatch.setenv("RAY_SANDBOX_HOME", str(home))
        cm.__exit__(None, None, None)


def test_last_delete_of_one_home_keeps_forwarding_for_another(
    sandboxes: Sandboxes, busybox_rootfs: Path, upstream, tmp_path_factory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    home_a = sandboxes.base.parent
    home_b = tmp_path_factory.mktemp("home-b")
    other = Sandboxes(home_b / "sandboxes", busybox_rootfs)
    original = _forwarding(upstream.node)
    config = make_config(network="sandbox", dns=TEST_DNS)
    with ExitStack() as stack_b:
        with ExitStack() as stack_a:
            box_a = stack_a.enter_context(_in_home(monkeypatch, home_a, sandboxes.run(config)))
            box_b = stack_b.enter_context(_in_home(monkeypatch, home_b, other.run(config)))
            assert box_a.http(WEB) == box_b.http(WEB) == f"inet {WEB}\n"
        # home A's last network="sandbox" sandbox is gone; home B's still runs
        assert _forwarding(upstream.node) == "1"
        assert box_b.http(WEB) == f"inet {WEB}\n", "home B lost its egress"
    assert _forwarding(upstream.node) == original
