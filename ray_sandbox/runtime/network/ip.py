"""The ``ip`` (iproute2) wrapper: named network namespaces, veth pairs, addresses, routes."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .. import _proc
from ..errors import NetworkError, SandboxError
from .netns import NETNS_DIR

_TIMEOUT = 10.0
_GONE = ("Cannot find device", "No such file or directory", "Invalid argument")


def _classify(rc: int, stderr: str) -> type[SandboxError]:
    return NetworkError


def _ip(netns: str | None, *args: str, input: bytes | None = None,
        check: bool = True) -> _proc.Completed:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    return _proc.run(argv, timeout=_TIMEOUT, input=input, check=check, classify=_classify)


def netns_add(name: str) -> None:
    _ip(None, "netns", "add", name)


def netns_delete(name: str) -> None:
    """Remove the named netns (idempotent)."""
    if (NETNS_DIR / name).exists():
        done = _ip(None, "netns", "delete", name, check=False)
        if done.returncode != 0 and (NETNS_DIR / name).exists():
            raise NetworkError(f"cannot delete netns {name}", stderr=done.stderr)


def netns_exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


def netns_list() -> list[str]:
    try:
        return sorted(p.name for p in NETNS_DIR.iterdir())
    except FileNotFoundError:
        return []


def batch(netns: str | None, commands: Sequence[str]) -> None:
    """Run several ``ip`` commands in one process (each line is an ``ip`` command line)."""
    _ip(netns, "-batch", "-", input=("\n".join(commands) + "\n").encode())


def veth_commands(host: str, peer_netns: str, peer: str, gateway: str) -> list[str]:
    """Batch lines creating a veth whose host end has ``gateway`` and whose other end, named
    ``peer``, sits in ``peer_netns``."""
    return [
        f"link add {host} type veth peer name {peer} netns {peer_netns}",
        f"addr add {gateway} dev {host}",
        f"link set {host} up",
    ]


def sandbox_side_commands(dev: str, address: str, gateway: str) -> list[str]:
    """Batch lines configuring the sandbox end of a veth (address, default route, loopback)."""
    return [
        "link set lo up",
        f"addr add {address} dev {dev}",
        f"link set {dev} up",
        f"route add default via {gateway}",
    ]


def link_up(netns: str | None, dev: str) -> None:
    _ip(netns, "link", "set", dev, "up")


def link_delete(netns: str | None, dev: str) -> None:
    """Delete a link (and its veth peer); idempotent."""
    done = _ip(netns, "link", "delete", dev, check=False)
    if done.returncode != 0 and not any(g in done.stderr for g in _GONE):
        raise NetworkError(f"cannot delete link {dev}", stderr=done.stderr)


def links(netns: str | None) -> list[str]:
    return [link["ifname"] for link in _json(netns, "link", "show")]


def addresses(netns: str | None) -> list[str]:
    """Every IP address configured in the namespace."""
    return [a["local"] for link in _json(netns, "addr", "show") for a in link.get("addr_info", [])]


def routes(netns: str | None) -> list[tuple[str, str]]:
    """(destination, device) of every IPv4 route in the main table."""
    return [(r["dst"], r.get("dev", "")) for r in _json(netns, "-4", "route", "show")]


def _json(netns: str | None, *args: str) -> list[dict[str, Any]]:
    out = _ip(netns, "-j", *args).stdout
    return json.loads(out) if out.strip() else []
