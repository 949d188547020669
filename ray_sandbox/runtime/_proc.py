"""The one place where ray_sandbox starts external programs.

Every wrapper (runsc, umoci, skopeo, slirp4netns, nft) calls :func:`run` or :func:`spawn`, which
apply a timeout that kills the whole process group, translate a missing binary into
:class:`ToolMissingError` and a failure into a typed error carrying argv and stderr. PIDs of the
processes started here are recorded so the subreaper thread never steals their exit status.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from .errors import CommandError, CommandTimeoutError, SandboxError, ToolMissingError

# Maps (returncode, stderr) to the error class to raise; each wrapper supplies its own.
Classifier = Callable[[int, str], type[SandboxError]]

_own_pids: set[int] = set()
_own_lock = threading.Lock()


def is_own_child(pid: int) -> bool:
    """True if ``pid`` was started through this module and is not yet waited for."""
    with _own_lock:
        return pid in _own_pids


@dataclass(frozen=True)
class Completed:
    argv: list[str]
    returncode: int
    stdout: bytes
    stderr: str


def spawn(
    argv: Sequence[str],
    *,
    stdin: int | IO[bytes] | None = subprocess.DEVNULL,
    stdout: int | IO[bytes] | None = subprocess.PIPE,
    stderr: int | IO[bytes] | None = subprocess.PIPE,
    env: Mapping[str, str] | None = None,
    pass_fds: Sequence[int] = (),
    new_session: bool = True,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` and return the Popen; the caller must wait for it (see :func:`wait`)."""
    argv = [str(a) for a in argv]
    try:
        with _own_lock:
            proc = subprocess.Popen(
                argv,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                env=dict(env) if env is not None else None,
                pass_fds=tuple(pass_fds),
                start_new_session=new_session,
                close_fds=True,
            )
            _own_pids.add(proc.pid)
    except FileNotFoundError as exc:
        raise ToolMissingError(
            f"{argv[0]} is not installed (run scripts/setup.sh)", argv=argv
        ) from exc
    return proc


def forget(proc: subprocess.Popen[bytes]) -> None:
    """Drop ``proc`` from the own-children set once its exit status has been collected."""
    with _own_lock:
        _own_pids.discard(proc.pid)


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process group started for ``proc`` (it leads its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass


def run(
    argv: Sequence[str],
    *,
    timeout: float,
    input: bytes | None = None,
    env: Mapping[str, str] | None = None,
    stdout: int | IO[bytes] | None = subprocess.PIPE,
    stderr: int | IO[bytes] | None = subprocess.PIPE,
    check: bool = True,
    classify: Classifier | None = None,
    sandbox_id: str | None = None,
    what: str | None = None,
) -> Completed:
    """Run ``argv`` to completion within ``timeout`` seconds.

    On timeout the process group is killed and :class:`CommandTimeoutError` raised. With
    ``check`` a non-zero exit raises ``classify(rc, stderr)`` (default :class:`CommandError`).
    """
    argv = [str(a) for a in argv]
    proc = spawn(
        argv,
        stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        env=env,
    )
    try:
        out, err = proc.communicate(input=input, timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        forget(proc)
        raise CommandTimeoutError(
            f"{what or argv[0]} did not finish within {timeout:g}s and was killed",
            sandbox_id=sandbox_id,
            argv=argv,
            stderr=(err or b"").decode(errors="replace"),
        ) from None
    except BaseException:
        kill_group(proc)
        proc.wait()
        forget(proc)
        raise
    forget(proc)
    result = Completed(argv, proc.returncode, out or b"", (err or b"").decode(errors="replace"))
    if check and result.returncode != 0:
        cls = classify(result.returncode, result.stderr) if classify else CommandError
        raise cls(
            f"{what or argv[0]} failed",
            sandbox_id=sandbox_id,
            argv=argv,
            returncode=result.returncode,
            stderr=result.stderr,
        )
    return result
