"""Fixtures for the agent tests: a native agent (a plain child process on the host) and
hand-made gVisor sandboxes running the agent as PID 1.

The gVisor bundle is built by hand here on purpose (busybox rootfs as in docs/platform.md,
"A busybox rootfs", a minimal OCI config); the runtime's spec builder will replace it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ray_sandbox.runtime import _proc
from ray_sandbox.runtime.agent import (
    INIT_ARGS,
    SANDBOX_BIN_DIR,
    SANDBOX_RUN_DIR,
    SOURCE_DIR,
    AgentClient,
    binary_path,
)
from ray_sandbox.runtime.config import DOCKER_DEFAULT_CAPABILITIES

AGENT_DIR = SOURCE_DIR
PASSWD = (
    "root:x:0:0:root:/root:/bin/sh\n"
    "tester:x:1000:1000:tester:/home/tester:/bin/sh\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
)
GROUP = "root:x:0:\ntester:x:1000:\nextra:x:2000:tester\nnogroup:x:65534:\n"
HELLO_C = '#include <stdio.h>\nint main(int c, char **v) { printf("hello %d\\n", c); return 7; }\n'


def proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, cmdline) of every process on the host."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        table[int(entry)] = (int(stat.rsplit(")", 1)[1].split()[1]), cmd.decode(errors="replace"))
    return table


def descendants(pid: int) -> list[int]:
    table = proc_table()
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [p for p, (pp, _) in table.items() if pp == parent]
        found += kids
        frontier += kids
    return found


def wait_gone(pids: list[int], timeout: float = 5.0) -> list[int]:
    """PIDs still alive (not zombies) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(pid)
            except OSError:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.02)


@pytest.fixture(scope="session")
def agent_binary() -> Path:
    _proc.run(["make", "-s", "-C", AGENT_DIR], timeout=180)
    return binary_path()


@dataclass
class NativeAgent:
    """``rsb-agent init`` running as a plain host process."""

    dir: Path
    proc: subprocess.Popen
    client: AgentClient

    @property
    def socket(self) -> Path:
        return self.dir / "agent.sock"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def new_client(self, **kw) -> AgentClient:
        return AgentClient(self.socket, sandbox_id="native", **kw)


@pytest.fixture
def native_agent(agent_binary: Path) -> Iterator[NativeAgent]:
    work = Path(tempfile.mkdtemp(prefix="rsba"))  # short: unix socket paths max 107 bytes
    proc = _proc.spawn([agent_binary, "init", work / "agent.sock"], stdout=None, stderr=None)
    client = AgentClient(work / "agent.sock", sandbox_id="native")
    agent = NativeAgent(work, proc, client)
    try:
        client.wait_ready(10)
        yield agent
    finally:
        client.close()
        # Whatever the tests left running (background commands) dies with the agent.
        left = descendants(proc.pid)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
        _proc.forget(proc)
        assert not wait_gone(left + [proc.pid])
        shutil.rmtree(work, ignore_errors=True)


# -- gVisor ------------------------------------------------------------------------------


def runsc_usable() -> bool:
    return shutil.which("runsc") is not None and os.geteuid() == 0


def _busybox_rootfs(root: Path) -> None:
    for d in ("bin", "etc", "tmp", "proc", "dev", "sys", "root", "home/tester"):
        (root / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2("/bin/busybox", root / "bin" / "busybox")
    applets = subprocess.run(["/bin/busybox", "--list"], capture_output=True, text=True).stdout
    for name in applets.split():
        if name != "busybox":
            os.symlink("busybox", root / "bin" / name)
    (root / "etc" / "passwd").write_text(PASSWD)
    (root / "etc" / "group").write_text(GROUP)
    (root / "tmp").chmod(0o1777)


def _static_rootfs(root: Path, work: Path) -> None:
    """No shell, no libc: a single static binary (plus the mount points)."""
    for d in ("proc", "tmp", "dev", "etc"):
        (root / d).mkdir(parents=True, exist_ok=True)
    src = work / "hello.c"
    src.write_text(HELLO_C)
    _proc.run(["gcc", "-static", "-O2", "-o", root / "hello", src], timeout=120)


def _python_rootfs(root: Path) -> None:
    """busybox plus the host's /usr (read-only bind) for python3."""
    _busybox_rootfs(root)
    (root / "usr").mkdir()
    for link in ("lib", "lib64"):
        os.symlink(f"usr/{link}", root / link)


@dataclass
class GvisorSandbox:
    """One hand-made runsc container whose PID 1 is the agent."""

    id: str
    work: Path
    client: AgentClient

    @property
    def root(self) -> Path:
        return self.work / "state"

    @property
    def run_dir(self) -> Path:
        return self.work / "run"

    def runsc(self, *args: str, timeout: float = 30, check: bool = True) -> _proc.Completed:
        return _proc.run(["runsc", "--root", self.root, *args], timeout=timeout, check=check)

    def runsc_exec(self, *argv: str) -> str:
        return self.runsc("exec", self.id, *argv).stdout.decode()


def _config(rootfs: Path, run_dir: Path, mounts: list[dict]) -> dict:
    caps = list(DOCKER_DEFAULT_CAPABILITIES)
    bind = ["rbind"]
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": INIT_ARGS,
            "env": ["PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8"],
            "cwd": "/",
            "capabilities": {k: caps for k in ("bounding", "effective", "permitted")},
        },
        "root": {"path": str(rootfs), "readonly": True},
        "hostname": "rsb",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {
                "destination": "/tmp",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "nodev", "mode=1777"],
            },
            {
                "destination": SANDBOX_BIN_DIR,
                "type": "bind",
                "source": str(AGENT_DIR),
                "options": [*bind, "ro"],
            },
            {
                "destination": SANDBOX_RUN_DIR,
                "type": "bind",
                "source": str(run_dir),
                "options": [*bind, "rw"],
            },
            *mounts,
        ],
        "linux": {"namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount", "network")]},
    }


def _start_sandbox(kind: str, agent_binary: Path) -> GvisorSandbox:
    work = Path(tempfile.mkdtemp(prefix=f"rsbg-{kind}-"))
    rootfs = work / "rootfs"
    mounts: list[dict] = []
    if kind == "busybox":
        _busybox_rootfs(rootfs)
    elif kind == "static":
        _static_rootfs(rootfs, work)
    else:
        _python_rootfs(rootfs)
        mounts.append(
            {"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro"]}
        )
    for d in (".rsb/bin", ".rsb/run"):
        (rootfs / d).mkdir(parents=True)
    (work / "run").mkdir()
    (work / "state").mkdir()
    (work / "config.json").write_text(json.dumps(_config(rootfs, work / "run", mounts)))
    cid = secrets.token_hex(16)
    client = AgentClient(work / "run" / "agent.sock", sandbox_id=cid)
    box = GvisorSandbox(cid, work, client)
    argv = ["runsc", "--root", box.root, "--network=none", "--host-uds=create",
            "--platform=ptrace", "run", "--bundle", work, "--detach", cid]  # fmt: skip
    # A detached sandbox keeps its stdio open (docs/platform.md, "Detached stdio"): files, never
    # pipes.
    with open(work / "runsc.out", "wb") as out, open(work / "runsc.err", "wb") as err:
        proc = _proc.spawn(argv, stdout=out, stderr=err)
    try:
        rc = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        _proc.kill_group(proc)
        rc = proc.wait()
    finally:
        _proc.forget(proc)
    if rc != 0:
        _stop_sandbox(box)
        raise RuntimeError(f"runsc run failed ({rc}): {(work / 'runsc.err').read_text()[-2000:]}")
    client.wait_ready(20)
    return box


def _stop_sandbox(box: GvisorSandbox) -> None:
    box.client.close()
    for _ in range(3):  # a delete may need a retry (docs/platform.md, "Delete retries")
        if box.runsc("delete", "-force", box.id, timeout=60, check=False).returncode == 0:
            break
    leftovers = [p for p in Path("/sys/fs/cgroup").glob(f"*/{box.id}") if p.is_dir()]
    for cg in leftovers:
        if not (cg / "cgroup.procs").read_text().strip():
            cg.rmdir()
    shutil.rmtree(box.work, ignore_errors=True)
    assert not [p for p in Path("/sys/fs/cgroup").glob(f"*/{box.id}") if p.exists()]


@pytest.fixture(scope="session")
def gvisor_factory(agent_binary: Path) -> Iterator:
    """Starts sandboxes of a kind ("busybox", "static", "python"), one per kind per session."""
    if not runsc_usable():
        pytest.skip("runsc needs root")
    boxes: dict[str, GvisorSandbox] = {}

    def get(kind: str) -> GvisorSandbox:
        if kind not in boxes:
            boxes[kind] = _start_sandbox(kind, agent_binary)
        return boxes[kind]

    try:
        yield get
    finally:
        for box in boxes.values():
            _stop_sandbox(box)


@pytest.fixture
def busybox_box(gvisor_factory) -> GvisorSandbox:
    return gvisor_factory("busybox")


@pytest.fixture
def static_box(gvisor_factory) -> GvisorSandbox:
    return gvisor_factory("static")


@pytest.fixture
def python_box(gvisor_factory) -> GvisorSandbox:
    return gvisor_factory("python")


def read_until(proc, needle: bytes, timeout: float = 10) -> bytes:
    """Output of a spawned process (a PTY session) until ``needle`` shows up."""
    got = b""
    deadline = time.monotonic() + timeout
    while needle not in got and time.monotonic() < deadline:
        got += proc.read(timeout=0.5)
    assert needle in got, got
    return got
