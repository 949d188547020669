"""The argv and environment of a command, derived from the sandbox's record and the call's
request (``verbs.CommandRequest.agent_args`` puts them together with the working directory,
user and timeout). Checks everything the agent would otherwise trip over (NUL bytes, bad
names, a missing shell) so that bad input is a typed error before anything runs."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from . import bundle
from .errors import ConfigError, ExecError
from .records import SandboxRecord


def argv_of(rec: SandboxRecord, command: str | list[str], shell: str | None) -> list[str]:
    """A string runs through ``shell`` (else the sandbox's ``shell``, else ``/bin/sh``) with
    ``-c``; a list runs as argv."""
    if isinstance(command, str):
        sh = shell or rec.config.get("shell") or "/bin/sh"
        if not os.path.lexists(Path(rec.image_rootfs) / sh.lstrip("/")):
            raise ExecError(f"image {rec.image} has no {sh}; pass the command as an argv list",
                            sandbox_id=rec.sandbox_id)
        argv = [sh, "-c", command]
    elif isinstance(command, list | tuple):
        argv = [str(a) for a in command]
        if not argv:
            raise ExecError("empty command", sandbox_id=rec.sandbox_id)
    else:
        raise ConfigError(f"command must be a string or a list of arguments, not "
                          f"{type(command).__name__}", sandbox_id=rec.sandbox_id)
    if any("\0" in a for a in argv):
        raise ExecError("command contains a NUL byte", sandbox_id=rec.sandbox_id)
    return argv


def env_of(rec: SandboxRecord, env: Mapping[str, str] | None) -> list[str]:
    """The image's environment, then the trust bundle's (a sandbox that injects), the
    sandbox's, the call's; tool bundles' bin/ directories end PATH."""
    if env is not None and not isinstance(env, Mapping):
        raise ConfigError("env must be a mapping of names to strings", sandbox_id=rec.sandbox_id)
    merged = {**bundle.ca_env(rec.config), **rec.config.get("env", {}), **(env or {})}
    for k, v in merged.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise ConfigError(f"environment variable {k!r}: names and values must be strings",
                              sandbox_id=rec.sandbox_id)
        if not k or "=" in k or "\0" in k or "\0" in v:
            raise ExecError(f"invalid environment variable {k!r}", sandbox_id=rec.sandbox_id)
    out = bundle.merge_env(rec.image_env, merged)
    tools = [f"{path}/bin" for path, mount in rec.config.get("volumes", {}).items()
             if mount.get("tools")]
    if tools:  # appended, never ahead: a bundle cannot shadow the image's own commands
        out = [f"{e}:{':'.join(tools)}" if e.startswith("PATH=") else e for e in out]
    return out


def stdin_bytes(stdin: bytes | str | None, sandbox_id: str) -> bytes | None:
    if not isinstance(stdin, str):
        return stdin
    try:
        return stdin.encode()
    except UnicodeEncodeError:
        raise ExecError("stdin text cannot be encoded as UTF-8", sandbox_id=sandbox_id) from None
