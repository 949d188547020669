"""The runsc wrapper: the only place that builds runsc argv.

One method per runsc verb. Global flags are assembled in :meth:`Runsc._argv` only; every call
goes through :mod:`._proc` with a timeout; failures become typed errors carrying the command,
its stderr and the sandbox id. JSON output (``state``, ``list``, ``events``) is parsed into
pydantic models. Killing a sandbox by PID (:meth:`Runsc.kill_sandbox`) starts no runsc process
at all: the PIDs come from runsc's state file, checked against each process's command line.
"""

from __future__ import annotations

import builtins
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from functools import cached_property
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel, ConfigDict, Field

from . import _proc
from .errors import (
    CommandError,
    SandboxError,
    SandboxNotFoundError,
    SandboxStateError,
    ToolMissingError,
)

TARGET_VERSION = "0.0~20240729"
_DEFAULT_TIMEOUT = 30.0
# runsc's state file holds the spec (a few KiB); a sandbox's command line is about 1 KiB.
_STATE_FILE_MAX = 1 << 20
_CMDLINE_MAX = 1 << 16
_PROCESS_NAMES = ("runsc-sandbox", "runsc-gofer")  # argv[0] of a sandbox's own processes


class RunscFlags(BaseModel):
    """The global flags a sandbox runs with. ``run``, ``checkpoint`` and ``restore`` must be
    given the same ones (a restore with another ``--directfs`` fails); verbs on a running
    sandbox (exec, state, kill, delete …) act through its control socket and need none."""

    model_config = ConfigDict(frozen=True)

    network: str
    overlay: str
    rootless: bool = False
    platform: str | None = None
    directfs: bool = True
    oci_seccomp: bool = False


class ContainerState(BaseModel):
    """``runsc state`` / ``runsc list --format=json`` entry."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    id: str
    status: str  # creating | created | running | paused | stopped
    pid: int = -1
    bundle: str = ""
    created: str | None = None


class _StateSandbox(BaseModel):
    model_config = ConfigDict(extra="ignore")

    pid: int = 0


class _StateFile(BaseModel):
    """The part of runsc's own state file (``<root>/<id>_sandbox:<id>.state``) that names
    the sandbox's processes: the sentry (``sandbox.pid``) and the gofer."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    gofer_pid: int = Field(0, alias="goferPid")
    sandbox: _StateSandbox = Field(default_factory=_StateSandbox)


class RunscVersion(BaseModel):
    """runsc version and what that build can do."""

    version: str  # e.g. "0.0~20240729.0"
    date: int  # e.g. 20240729

    @property
    def has_systrap(self) -> bool:
        return self.date >= 20230101

    @property
    def has_file_control_socket(self) -> bool:
        # 20221219 binds an abstract socket per netns: ids collide across roots and a
        # container started in another netns looks "stopped" from the root netns.
        return self.date >= 20230101

    @property
    def has_nonblocking_leave_running(self) -> bool:
        return self.date >= 20230101

    @property
    def has_fast_checkpoint(self) -> bool:
        """``checkpoint --leave-running`` returns at once and ``--compression=none`` exists
        (both measured on 20240729; 20221219 has neither)."""
        return self.date >= 20240729

    @property
    def has_directfs(self) -> bool:
        """``--directfs`` exists (20240729 has it, default on; 20221219 always serves files
        through the gofer and rejects the flag)."""
        return self.date >= 20230101

    @property
    def overlay_dir_syntax(self) -> str:
        return "dir=" if self.date >= 20230101 else ""

    def limitations(self) -> list[str]:
        if self.date >= 20240729:
            return []
        return [
            "no systrap platform (ptrace only)",
            "abstract control socket: sandbox ids collide across --root dirs",
            "checkpoint --leave-running blocks until the container exits",
            "no uncompressed checkpoints",
        ]


def classify(returncode: int, stderr: str) -> type[SandboxError]:
    """Map a runsc failure to an error class."""
    s = stderr.lower()
    if ("file does not exist" in s or "no such container" in s or "not found" in s
            or ("loading container" in s and "no such file or directory" in s)):
        return SandboxNotFoundError
    if "in state" in s or "is not running" in s or "cannot" in s and "state" in s:
        return SandboxStateError
    return CommandError


class Runsc:
    """runsc bound to one state directory (``--root``) and one platform."""

    def __init__(self, root: Path, *, binary: str | None = None, platform: str = "ptrace") -> None:
        self.root = Path(root)
        self.binary = binary or shutil.which("runsc") or "runsc"
        self.platform = platform

    @cached_property
    def version(self) -> RunscVersion:
        out = _proc.run([self.binary, "--version"], timeout=10, what="runsc --version")
        text = out.stdout.decode()
        m = re.search(r"runsc version (\S+)", text)
        if not m:
            raise ToolMissingError(f"cannot parse runsc version from {text!r}")
        d = re.search(r"(\d{8})", m.group(1))
        return RunscVersion(version=m.group(1), date=int(d.group(1)) if d else 0)

    def _argv(self, verb: str, *args: str, flags: RunscFlags | None = None) -> list[str]:
        """Global flags come before the verb; a sandbox's own (``flags``) only for the verbs
        that start or save it."""
        argv = [self.binary, f"--root={self.root}"]
        if flags is not None:
            argv += [f"--network={flags.network}", f"--overlay2={flags.overlay}",
                     f"--platform={flags.platform or self.platform}", "--host-uds=create"]
            if flags.rootless:
                argv += ["--rootless", "--ignore-cgroups"]
            if not flags.directfs and self.version.has_directfs:
                argv.append("--directfs=false")
            if flags.oci_seccomp:
                argv.append("--oci-seccomp")
            if flags.network == "sandbox" and self.version.has_fast_checkpoint:
                # a checkpoint (snapshot, suspend) resets the sandbox's open TCP connections
                # to the outside instead of failing on them ("endpoint cannot be saved in
                # connected state"): no save could be made while a client stays connected
                argv.append("--net-disconnect-ok")
        return [*argv, verb, *args]

    def _run(self, argv: list[str], sandbox_id: str | None, timeout: float) -> _proc.Completed:
        verb = next(a for a in argv[1:] if not a.startswith("-"))
        return _proc.run(
            argv, timeout=timeout, classify=classify, sandbox_id=sandbox_id, what=f"runsc {verb}"
        )

    # --- lifecycle -------------------------------------------------------------------------

    def run_detached(
        self,
        sandbox_id: str,
        bundle: Path,
        flags: RunscFlags,
        *,
        prefix: Sequence[str] = (),
        log_dir: Path,
        timeout: float = 60.0,
    ) -> None:
        """``runsc run --detach``. stdio go to files: the sandbox keeps them open forever, so
        pipes would never reach EOF (docs/platform.md, "Detached stdio")."""
        argv = [
            *prefix,
            *self._argv(
                "run", f"--bundle={bundle}", "--detach", sandbox_id, flags=flags,
            ),
        ]
        self._run_logged(argv, sandbox_id, log_dir, timeout, "runsc run")

    @staticmethod
    def _run_logged(
        argv: list[str], sandbox_id: str, log_dir: Path, timeout: float, what: str
    ) -> None:
        with open(log_dir / "runsc.out", "ab") as out, open(log_dir / "runsc.err", "ab") as err:
            start = err.tell()
            res = _proc.run(
                argv, timeout=timeout, stdout=out, stderr=err, check=False,
                sandbox_id=sandbox_id, what=what,
            )
        if res.returncode != 0:
            stderr = (log_dir / "runsc.err").read_bytes()[start:].decode(errors="replace")
            raise CommandError(
                f"{what} failed", sandbox_id=sandbox_id, argv=argv,
                returncode=res.returncode, stderr=stderr,
            )

    def checkpoint(
        self,
        sandbox_id: str,
        image_path: Path,
        flags: RunscFlags,
        *,
        timeout: float = 120.0,
    ) -> None:
        """``runsc checkpoint --leave-running --compression=none``: the container keeps
        running. Global flags must match the ones it was started with (docs/platform.md,
        "Checkpoint and restore flags")."""
        argv = self._argv(
            "checkpoint", f"--image-path={image_path}", "--leave-running",
            "--compression=none", sandbox_id, flags=flags,
        )
        self._run(argv, sandbox_id, timeout)

    def restore_detached(
        self,
        sandbox_id: str,
        bundle: Path,
        image_path: Path,
        flags: RunscFlags,
        *,
        prefix: Sequence[str] = (),
        log_dir: Path,
        direct: bool = False,
        timeout: float = 120.0,
    ) -> None:
        """``runsc restore --detach``: a new container ``sandbox_id`` from a checkpoint,
        with the same global flags as ``run`` and stdio in files (docs/platform.md,
        "Detached stdio"). ``direct`` reads the pages file with O_DIRECT (past the page
        cache)."""
        argv = [
            *prefix,
            *self._argv(
                "restore", f"--image-path={image_path}", f"--bundle={bundle}", "--detach",
                *(["--direct"] if direct else []), sandbox_id, flags=flags,
            ),
        ]  # fmt: skip
        self._run_logged(argv, sandbox_id, log_dir, timeout, "runsc restore")

    def state(self, sandbox_id: str, *, timeout: float = _DEFAULT_TIMEOUT) -> ContainerState:
        out = self._run(self._argv("state", sandbox_id), sandbox_id, timeout)
        return ContainerState.model_validate_json(out.stdout)

    def list(self, *, timeout: float = _DEFAULT_TIMEOUT) -> list[ContainerState]:
        if not self.root.exists():
            return []
        out = self._run(self._argv("list", "--format=json"), None, timeout)
        data = json.loads(out.stdout or b"null") or []
        return [ContainerState.model_validate(d) for d in data]

    def kill(
        self, sandbox_id: str, signal: str = "KILL", *, all: bool = False, pid: int | None = None
    ) -> None:
        args = (["--all"] if all else []) + ([f"--pid={pid}"] if pid is not None else [])
        self._run(self._argv("kill", *args, sandbox_id, signal), sandbox_id, _DEFAULT_TIMEOUT)

    def kill_sandbox(self, sandbox_id: str) -> builtins.list[int]:
        """SIGKILL the sandbox's sentry and gofer (their ptrace stubs die with the sentry);
        returns the PIDs signalled. Starts no runsc process (``runsc state``/``kill`` cost
        ~20 ms of CPU each): the PIDs come from runsc's state file, or from a scan of /proc
        if it has none (a ``runsc run`` killed half-way: docs/platform.md,
        "Leftovers of a killed runsc run"). Only a process whose command line names this root
        and the id is signalled, never one found by name."""
        def names_it(args: list[str]) -> bool:
            return args[0] in _PROCESS_NAMES and any(sandbox_id in a for a in args)

        pids = self._state_pids(sandbox_id) or list(self.processes())
        return [pid for pid in pids if self.kill_if(pid, names_it)]

    def has_container(self, sandbox_id: str) -> bool:
        """Whether runsc keeps a container ``sandbox_id`` (its state file: no runsc process,
        which would cost ~20 ms of CPU)."""
        return (self.root / f"{sandbox_id}_sandbox:{sandbox_id}.state").exists()

    def _state_pids(self, sandbox_id: str) -> builtins.list[int]:
        try:
            with open(self.root / f"{sandbox_id}_sandbox:{sandbox_id}.state", "rb") as f:
                state = _StateFile.model_validate_json(f.read(_STATE_FILE_MAX))
        except (OSError, ValueError):
            return []
        return [p for p in (state.sandbox.pid, state.gofer_pid) if p > 0]

    def processes(self) -> dict[int, builtins.list[str]]:
        """argv of every process of this root: sandboxes, gofers and runsc commands."""
        found: dict[int, list[str]] = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and (args := self._argv_of(int(entry.name))) is not None:
                found[int(entry.name)] = args
        return found

    def _argv_of(self, pid: int) -> builtins.list[str] | None:
        """``pid``'s argv if it is a runsc process of this root, else None."""
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read(_CMDLINE_MAX).decode(errors="replace").split("\0")
        except OSError:
            return None
        if (args[0] not in _PROCESS_NAMES and os.path.basename(args[0]) != "runsc"
                or f"--root={self.root}" not in args):
            return None
        return args

    def kill_if(self, pid: int, check: Callable[[builtins.list[str]], bool]) -> bool:
        """SIGKILL ``pid`` if it is a runsc process of this root whose argv passes ``check``.
        Through a pidfd opened before the check: a PID reused meanwhile is never signalled."""
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return False
        try:
            args = self._argv_of(pid)
            if args is None or not check(args):
                return False
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            return True
        except ProcessLookupError:
            return False
        finally:
            os.close(fd)

    def delete(
        self, sandbox_id: str, *, timeout: float = _DEFAULT_TIMEOUT, retries: int = 2
    ) -> None:
        """``runsc delete --force``; idempotent. Retried: it can fail transiently right after a
        restore (``context deadline exceeded``, docs/platform.md, "Delete retries")."""
        argv = self._argv("delete", "--force", sandbox_id)
        for attempt in range(retries + 1):
            try:
                self._run(argv, sandbox_id, timeout)
                return
            except SandboxNotFoundError:
                return
            except CommandError:
                if attempt == retries:
                    raise
                time.sleep(0.2 * (attempt + 1))

    def pause(self, sandbox_id: str) -> None:
        self._run(self._argv("pause", sandbox_id), sandbox_id, _DEFAULT_TIMEOUT)

    def resume(self, sandbox_id: str) -> None:
        self._run(self._argv("resume", sandbox_id), sandbox_id, _DEFAULT_TIMEOUT)

    def events_stats(self, sandbox_id: str) -> dict[str, Any]:
        out = self._run(self._argv("events", "--stats", sandbox_id), sandbox_id, _DEFAULT_TIMEOUT)
        stats: dict[str, Any] = json.loads(out.stdout or b"{}")
        return stats

    # --- exec (the fallback and baseline path; the agent is the fast path) ------------------

    def exec_argv(
        self,
        sandbox_id: str,
        argv: Sequence[str],
        *,
        cwd: str | None = None,
        env: Sequence[str] = (),
        user: str | None = None,
    ) -> builtins.list[str]:
        """argv for ``runsc exec`` with stdio on pipes (never regular files: docs/platform.md,
        "runsc exec output into a file")."""
        args: list[str] = []
        if cwd:
            args.append(f"--cwd={cwd}")
        for e in env:
            args.append(f"--env={e}")
        if user:
            args.append(f"--user={user}")
        return self._argv("exec", *args, sandbox_id, *argv)

    def exec(
        self,
        sandbox_id: str,
        argv: Sequence[str],
        *,
        cwd: str | None = None,
        env: Sequence[str] = (),
        user: str | None = None,
        stdin: bytes | None = None,
        timeout: float,
    ) -> _proc.Completed:
        """Run one command with ``runsc exec`` and wait for it (non-zero exit is returned)."""
        return _proc.run(
            self.exec_argv(sandbox_id, argv, cwd=cwd, env=env, user=user),
            timeout=timeout,
            input=stdin,
            check=False,
            sandbox_id=sandbox_id,
            what="runsc exec",
        )

    def spawn_exec(
        self,
        sandbox_id: str,
        argv: Sequence[str],
        *,
        stdin: int | IO[bytes] | None = subprocess.PIPE,
        cwd: str | None = None,
        env: Sequence[str] = (),
        user: str | None = None,
    ) -> subprocess.Popen[bytes]:
        return _proc.spawn(self.exec_argv(sandbox_id, argv, cwd=cwd, env=env, user=user),
                           stdin=stdin)
