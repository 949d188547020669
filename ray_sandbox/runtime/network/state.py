"""What a sandbox's network consists of, persisted as ``<state_dir>/network.json`` after every
step of attach, so detach (or gc in a fresh process) removes exactly what exists."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, Field

from ..config import EgressPolicy
from ..secrets import CA_FILE, CA_KEY_FILE
from .procs import ProcRef

FILE = "network.json"
POLICY_FILE = "egress.json"  # read by the DNS helper
CACHE_FILE = "dns-cache.json"  # written by the DNS helper: address -> (name, expiry)
# the egress proxy's (network/inject.py): its CA, and the leaf key and last certificate it wrote
INJECT_FILES = (CA_FILE, CA_KEY_FILE, "inject-leaf-key.pem", "inject-leaf.pem")


class NetworkState(BaseModel):
    sandbox_id: str
    mode: str
    tag: str
    upstream: str | None
    internal: tuple[str, ...]  # ranges no sandbox may reach (the veth pool)
    egress: EgressPolicy
    expose_addr: str
    ports: tuple[int, ...] = ()
    netns: str | None = None  # created
    link: str | None = None  # host end of the veth, in upstream
    subnet: str | None = None
    table_netns: str | None = None  # netns holding the nft table (None = the node's)
    table: bool = False
    api_socket: str | None = None
    procs: list[ProcRef] = Field(default_factory=list)
    peers: list[tuple[str, int]] = Field(default_factory=list)  # (sandbox id, port) it links to
    inject: bool = False  # created with EgressPolicy.inject: its CA exists, its proxy listens
    proxy_port: int | None = None  # where the proxy listens (sandbox mode: DNAT from 443)


def save(state_dir: Path, state: NetworkState) -> None:
    tmp = state_dir / (FILE + ".tmp")
    tmp.write_text(state.model_dump_json(indent=1))
    os.replace(tmp, state_dir / FILE)


def load(state_dir: Path) -> NetworkState | None:
    try:
        return NetworkState.model_validate_json((state_dir / FILE).read_text())
    except FileNotFoundError:
        return None


def remove(state_dir: Path) -> None:
    for name in (FILE, POLICY_FILE, CACHE_FILE, "dns.json", *INJECT_FILES):
        (state_dir / name).unlink(missing_ok=True)
