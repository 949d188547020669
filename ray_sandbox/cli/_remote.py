"""The sandbox commands over the HTTP service (docs/service.md) instead of this node's runtime:
``ray-sandbox --url URL --token TOKEN exec ID -- ls`` (or ``RAY_SANDBOX_URL`` and
``RAY_SANDBOX_API_TOKEN`` in the environment). Only what the service offers (``COMMANDS``);
the other commands concern one node and refuse a URL (the root command checks). The client
is imported only then: it needs httpx (the ``client`` extra), the rest of the CLI does not."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..runtime.config import SandboxConfig
from ..runtime.errors import ConfigError
from ..runtime.results import ExecResult

if TYPE_CHECKING:
    from ..client import SandboxClient

# what a service offers
COMMANDS = frozenset({"run", "create", "exec", "ps", "rm", "cp", "port-url"})
_target: dict[str, str | None] = {"url": None, "token": None}


def target(url: str | None, token: str | None) -> None:
    """Set by the root command's ``--url``/``--token`` (or their environment variables)."""
    _target.update(url=url, token=token)


def client() -> SandboxClient | None:
    """The service's client when a URL was given, else None (this node's runtime is used)."""
    if not _target["url"]:
        return None
    if not _target["token"]:
        raise ConfigError("a service URL needs a token: --token or RAY_SANDBOX_API_TOKEN")
    from ..client import SandboxClient

    return SandboxClient(_target["url"], _target["token"])


def _options(config: SandboxConfig) -> dict[str, Any]:
    """Only what the command line set: the service applies its own defaults and limits."""
    return config.model_dump(mode="json", exclude_unset=True)


def run(c: SandboxClient, config: SandboxConfig, command: str | list[str],
        timeout: float | None) -> ExecResult:
    with c:  # the sandbox is deleted when the block ends
        return c.create(**_options(config)).exec(command, timeout=timeout)


def create(c: SandboxClient, config: SandboxConfig) -> str:
    try:
        return c.create(detach=True, **_options(config)).sandbox_id
    finally:
        c.close()


def exec_(c: SandboxClient, sandbox_id: str, command: str | list[str],
          **options: Any) -> ExecResult:
    try:
        return c.get(sandbox_id).exec(command, **options)
    finally:
        c.close()


def port_url(c: SandboxClient, sandbox_id: str, port: int, ttl: float | None) -> str:
    try:
        return c.get(sandbox_id).port_url(port, ttl_seconds=ttl)
    finally:
        c.close()


def ps(c: SandboxClient) -> list[dict[str, Any]]:
    """The rows of the local ``ps``: the service's Unix times as ISO 8601 text in UTC."""
    try:
        return [{"sandbox_id": st["sandbox_id"], "state": st["status"],
                 "reason": st.get("reason"), "image": st.get("image"), "network": None,
                 "created_at": _iso(st.get("created_at")), "owner_pid": None,
                 "stock": False}
                for st in c.statuses()]
    finally:
        c.close()


def _iso(unix_time: float | None) -> str | None:
    return None if unix_time is None else datetime.fromtimestamp(unix_time, UTC).isoformat()


def rm(c: SandboxClient, sandbox_id: str) -> None:
    """Idempotent, as the service's DELETE is: no lookup first."""
    from ..client import Sandbox

    try:
        Sandbox(c, sandbox_id).terminate()
    finally:
        c.close()


def cp(c: SandboxClient, sandbox_id: str, remote: str, local: Path, *,
       upload: bool) -> None:
    """Directories as tars, files as bytes (a remote path that is a directory is asked for
    as one first)."""
    try:
        sb = c.get(sandbox_id)
        if upload:
            if local.is_dir():
                sb.upload_dir(local, remote)
            else:
                sb.write_file(remote, local.read_bytes())
            return
        ok = sb.exec(["test", "-d", remote]).exit_code == 0
        if ok:
            sb.download_dir(remote, local)
        else:
            local.write_bytes(sb.read_file(remote))
    finally:
        c.close()
