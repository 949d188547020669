"""Node-wide network settings and the names every network object of a sandbox gets.

Everything this package creates on the node is named from the sandbox id with the ``rsb``
prefix, so it never touches the host's own namespaces, links or nft tables and a fresh
process can find leftovers by name alone.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, field_validator

from ..errors import ConfigError
from .netns import NETNS_DIR

PREFIX = "rsb"
_ID_RE = re.compile(r"^[0-9a-f]{12,64}$")
_TAG_RE = re.compile(rf"^{PREFIX}-([0-9a-f]{{12}})$")


class NodeSettings(BaseModel):
    """Per-node knobs, read from the environment (``RAY_SANDBOX_NET_*``).

    ``upstream_netns`` names the namespace (in /run/netns) where egress leaves the node: the
    slirp4netns process and the host end of the veth live there. Empty means the node's own
    namespace; tests point it at a fake internet.
    """

    model_config = ConfigDict(frozen=True)

    upstream_netns: str | None = None
    expose_addr: str = "127.0.0.1"
    veth_pool: str = "10.213.0.0/16"
    pull_dns: tuple[str, ...] = ()  # resolvers of isolated pulls; () = the node's own
    inject_ca: str | None = None  # what the egress proxy trusts upstream; None = the node's store

    @field_validator("inject_ca")
    @classmethod
    def _ca_file(cls, v: str | None) -> str | None:
        if v and not Path(v).is_file():
            raise ValueError(f"RAY_SANDBOX_NET_INJECT_CA {v!r} is not a file")
        return v or None

    @field_validator("pull_dns")
    @classmethod
    def _resolvers(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(str(ipaddress.ip_address(a)) for a in v)

    @field_validator("expose_addr")
    @classmethod
    def _addr(cls, v: str) -> str:
        return str(ipaddress.IPv4Address(v))

    @field_validator("veth_pool")
    @classmethod
    def _pool(cls, v: str) -> str:
        net = ipaddress.IPv4Network(v)
        if net.prefixlen > 28:
            raise ValueError("veth pool must be /28 or larger")
        return str(net)

    @field_validator("upstream_netns")
    @classmethod
    def _netns(cls, v: str | None) -> str | None:
        if v and not (NETNS_DIR / v).exists():
            raise ValueError(f"upstream netns {v!r} does not exist in {NETNS_DIR}")
        return v or None


def settings() -> NodeSettings:
    env = os.environ
    try:
        return NodeSettings(
            upstream_netns=env.get("RAY_SANDBOX_NET_UPSTREAM") or None,
            expose_addr=env.get("RAY_SANDBOX_NET_EXPOSE_ADDR", "127.0.0.1"),
            veth_pool=env.get("RAY_SANDBOX_NET_POOL", "10.213.0.0/16"),
            pull_dns=tuple(a.strip() for a in env.get("RAY_SANDBOX_NET_PULL_DNS", "").split(",")
                           if a.strip()),
            inject_ca=env.get("RAY_SANDBOX_NET_INJECT_CA") or None,
        )
    except ValueError as exc:
        raise ConfigError(f"invalid RAY_SANDBOX_NET_* setting: {exc}") from None


NODE_DIR = Path("/run/ray_sandbox/network")


def node_dir() -> Path:
    """Node-wide network state (allocations, API sockets). One place per node, whatever
    ``RAY_SANDBOX_HOME`` a runtime uses: subnets, ports and ``ip_forward`` belong to the node,
    and a table per home let one home's gc and deletes undo another's. It lives in /run beside
    /run/netns because both describe kernel objects that a reboot removes."""
    return NODE_DIR


def metrics_file(tag_: str) -> Path:
    """The Prometheus textfile of a sandbox's egress proxy (node_exporter's textfile
    collector reads the directory)."""
    return NODE_DIR / "metrics" / f"{tag_}.prom"


def is_sandbox_id(value: str) -> bool:
    return bool(_ID_RE.match(value))


def tag(sandbox_id: str) -> str:
    """``rsb-<first 12 hex>``: the name of the sandbox's netns and nft table."""
    if not _ID_RE.match(sandbox_id):
        raise ConfigError(f"sandbox id must be 12-64 lowercase hex characters, got {sandbox_id!r}")
    return f"{PREFIX}-{sandbox_id[:12]}"


def tag_of(name: str) -> str | None:
    """The tag a netns/table/link name belongs to, or None if it is not ours."""
    if _TAG_RE.match(name):
        return name
    if len(name) == 15 and name.startswith(PREFIX) and _TAG_RE.match(f"{PREFIX}-{name[3:]}"):
        return f"{PREFIX}-{name[3:]}"
    return None


def host_link(tag_: str) -> str:
    """The host end of a sandbox's veth: ``rsb<12 hex>`` fits IFNAMSIZ (15 characters)."""
    return PREFIX + tag_[len(PREFIX) + 1 :]
