"""Fixtures and probes for the hostile-code tests (issue 10): escape attempts, resource abuse,
fuzzing, chaos and soak.

Everything measures the real host: host task counts come from the kernel (``/proc/loadavg``
and the sandbox's pids cgroup), listeners are real sockets on 127.0.0.1 or in a private
directory. Abuse tests run under a watchdog that SIGKILLs *their own* sandbox (by the PID runsc
reports for it) before it can take the shared machine's PID space.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest

from ray_sandbox.runtime import SandboxRuntime, SandboxState, procfs

HEAVY = bool(os.environ.get("RAY_SANDBOX_HEAVY"))
F = TypeVar("F", bound=Callable[..., object])

_CGROUP = Path("/sys/fs/cgroup")
# A sandbox that grows past this many host tasks is killed by the watchdog: the kernel's default
# pid_max, 32768, is shared by the whole machine (docs/platform.md, "Host task limits"), so no
# test may take more than a quarter of it.
TASK_CAP = 8000


def heavy(fn: F) -> F:
    """Mark a test heavy: it runs only with RAY_SANDBOX_HEAVY=1."""
    fn = pytest.mark.skipif(not HEAVY, reason="heavy: set RAY_SANDBOX_HEAVY=1")(fn)
    return pytest.mark.heavy(fn)


def skip_module_unless_heavy() -> None:
    """Call at module level in a module that is heavy as a whole."""
    if not HEAVY:
        pytest.skip("heavy module: set RAY_SANDBOX_HEAVY=1", allow_module_level=True)


# --- host measurements -------------------------------------------------------------------------


def host_tasks() -> int:
    """Threads on the whole host (each one uses a PID out of kernel.pid_max)."""
    return int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def sandbox_tasks(sandbox_id: str) -> int:
    """Host tasks (threads) charged to a sandbox: its pids cgroup holds the sentry, the gofer
    and, on ptrace, one stub thread per (address space, sentry thread) pair."""
    try:
        return int((_CGROUP / "pids" / sandbox_id / "pids.current").read_text())
    except (OSError, ValueError):
        return 0


def cgroup_value(controller: str, sandbox_id: str, name: str) -> str:
    return (_CGROUP / controller / sandbox_id / name).read_text().strip()


def sentry_pid(runtime: SandboxRuntime, sandbox_id: str) -> int:
    return runtime.runsc.state(sandbox_id).pid


def runsc_pid(argv0: bytes, sandbox_id: str) -> int:
    """PID of the sandbox's ``runsc-sandbox`` (sentry) or ``runsc-gofer`` host process."""
    for pid, argv in procfs.cmdlines():
        if argv[0] == argv0 and any(sandbox_id.encode() in a for a in argv):
            return pid
    raise AssertionError(f"no {argv0!r} process for {sandbox_id}")


def fd_count(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_bytes(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass
class TaskWatch:
    """Samples a sandbox's host task count and the host's; kills the sandbox (its sentry, by
    PID) if it passes ``cap``, so an abuse test cannot exhaust the shared PID space."""

    runtime: SandboxRuntime
    sandbox_id: str
    cap: int = TASK_CAP
    peak: int = 0
    host_peak: int = 0
    host_base: int = 0
    tripped: bool = False
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> TaskWatch:
        self.host_base = host_tasks()
        pid = sentry_pid(self.runtime, self.sandbox_id)
        self._thread = threading.Thread(target=self._loop, args=(pid,), daemon=True)
        self._thread.start()
        return self

    def _loop(self, pid: int) -> None:
        while not self._stop.is_set():
            n = sandbox_tasks(self.sandbox_id)
            self.peak = max(self.peak, n)
            self.host_peak = max(self.host_peak, host_tasks())
            if n > self.cap and not self.tripped:
                self.tripped = True
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
            self._stop.wait(0.02)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()


def wait_until(pred: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def settle_state(runtime: SandboxRuntime, sandbox_id: str, timeout: float = 15) -> SandboxState:
    """The state once runsc has noticed a death (a killed sandbox stops a moment later)."""
    wait_until(lambda: runtime.get_status(sandbox_id).state != SandboxState.RUNNING, timeout)
    return runtime.get_status(sandbox_id).state


# --- sandboxes ----------------------------------------------------------------------------------


def answers(runtime: SandboxRuntime, sandbox_id: str, timeout: float = 10) -> bool:
    """The sandbox runs a command and returns its output."""
    token = secrets.token_hex(4)
    res = runtime.exec(sandbox_id, ["/bin/echo", token], timeout=timeout)
    return res.exit_code == 0 and res.stdout.strip() == token


def exec_p50_ms(runtime: SandboxRuntime, sandbox_id: str, n: int = 30) -> float:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        runtime.exec(sandbox_id, ["/bin/true"], timeout=30)
        samples.append((time.perf_counter() - t0) * 1000)
    return statistics.median(samples)


@pytest.fixture
def neighbour(runtime: SandboxRuntime) -> Iterator[str]:
    """A well-behaved sandbox next to the abusive one; it must stay healthy."""
    sid = runtime.create(image="ray-sandbox/busybox", memory="128Mi", cpu=0.5)
    yield sid
    runtime.delete(sid)


@pytest.fixture(scope="module")
def probe(runtime: SandboxRuntime) -> Iterator[str]:
    """One Python sandbox (default capabilities, network none) shared by read-only probes."""
    sid = runtime.create(image="ray-sandbox/python", memory="256Mi", cpu=1)
    yield sid
    runtime.delete(sid)


# --- host-side listeners ------------------------------------------------------------------------


@dataclass
class Listener:
    """A real server socket on the host that counts who connected."""

    sock: socket.socket
    address: str | tuple[str, int]
    hits: list[bytes] = field(default_factory=list)

    def serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(1)
                try:
                    self.hits.append(conn.recv(256))
                except OSError:
                    self.hits.append(b"")


@contextlib.contextmanager
def _serving(sock: socket.socket, address: str | tuple[str, int]) -> Iterator[Listener]:
    sock.listen(16)
    lst = Listener(sock, address)
    t = threading.Thread(target=lst.serve, daemon=True)
    t.start()
    try:
        yield lst
    finally:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        t.join(timeout=5)


@pytest.fixture
def loopback_tcp() -> Iterator[Listener]:
    """A TCP server on the host's 127.0.0.1 (ephemeral port)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    with _serving(sock, sock.getsockname()) as lst:
        yield lst


@pytest.fixture
def host_unix(tmp_path: Path) -> Iterator[Listener]:
    """A unix socket server in a private host directory."""
    path = tmp_path / "host.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    with _serving(sock, str(path)) as lst:
        yield lst


@pytest.fixture
def host_abstract() -> Iterator[Listener]:
    """An abstract-namespace unix socket on the host (no file; namespaced by netns on Linux)."""
    name = "\0rsb-hostile-" + secrets.token_hex(6)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(name)
    with _serving(sock, name) as lst:
        yield lst


def host_ipv4_addresses() -> list[str]:
    """The host's non-loopback IPv4 addresses (from the kernel's routing decision)."""
    out = set()
    for target in ("10.255.255.255", "192.0.2.1"):
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            out.add(s.getsockname()[0])
    return sorted(a for a in out if not a.startswith("127."))


__all__ = [
    "HEAVY",
    "TASK_CAP",
    "Listener",
    "TaskWatch",
    "answers",
    "cgroup_value",
    "exec_p50_ms",
    "fd_count",
    "heavy",
    "host_ipv4_addresses",
    "host_tasks",
    "mem_available",
    "rss_bytes",
    "sandbox_tasks",
    "sentry_pid",
    "settle_state",
    "skip_module_unless_heavy",
    "wait_until",
]
