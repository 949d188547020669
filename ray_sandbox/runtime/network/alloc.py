"""Node-wide allocations shared by every process and every home on the node: veth subnets,
published ports, the state directory of each attached sandbox (so gc can find it) and the
``ip_forward`` value we changed. One JSON file, read and written under an exclusive flock.

Every lease names its owner, the sandboxes dir its state dir is in: a runtime's gc judges only
the sandboxes of its own dir, since it cannot know which sandboxes of another home are alive."""

from __future__ import annotations

import fcntl
import ipaddress
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic import BaseModel, Field

from ..errors import NetworkError
from .settings import node_dir


class Lease(BaseModel):
    sandbox_id: str
    owner: str  # see owner()
    upstream: str | None = None


def owner(sandboxes_dir: Path) -> str:
    """How leases name the sandboxes dir that owns them (symlinks resolved, so two spellings of
    one home agree)."""
    return str(sandboxes_dir.resolve())


class Alloc(BaseModel):
    subnets: dict[str, Lease] = Field(default_factory=dict)  # "10.213.0.4/30" -> lease
    ports: dict[str, Lease] = Field(default_factory=dict)  # "<upstream>:<port>" -> lease
    forwarding: dict[str, str] = Field(default_factory=dict)  # upstream -> ip_forward before us
    state_dirs: dict[str, str] = Field(default_factory=dict)  # sandbox id -> state dir (resolved)

    def release(self, sandbox_id: str) -> None:
        for table in (self.subnets, self.ports):
            for key in [k for k, v in table.items() if v.sandbox_id == sandbox_id]:
                del table[key]
        self.state_dirs.pop(sandbox_id, None)

    def sandbox_ids(self, owned_by: str | None = None) -> set[str]:
        """Every sandbox holding something, or only those of owner ``owned_by``."""
        leases = (*self.subnets.values(), *self.ports.values())
        return {
            *(s for s, d in self.state_dirs.items() if owned_by in (None, str(Path(d).parent))),
            *(lease.sandbox_id for lease in leases if owned_by in (None, lease.owner)),
        }

    def subnet_users(self, upstream: str | None) -> int:
        return sum(1 for v in self.subnets.values() if v.upstream == upstream)


def port_key(upstream: str | None, port: int) -> str:
    return f"{upstream or ''}:{port}"


def free_subnet(alloc: Alloc, pool: str, routes: Iterable[str]) -> str:
    """The first /30 of ``pool`` neither leased nor overlapping a route of the namespace."""
    taken = [ipaddress.ip_network(r) for r in routes if r != "default"]
    taken += [ipaddress.ip_network(s) for s in alloc.subnets]
    for net in ipaddress.IPv4Network(pool).subnets(new_prefix=30):
        if not any(net.overlaps(t) for t in taken if t.version == 4):
            return str(net)
    raise NetworkError(f"no free /30 left in the veth pool {pool}")


def read() -> Alloc:
    """The table as it is now, without the lock (it is replaced whole, never rewritten)."""
    path = node_dir() / "alloc.json"
    return Alloc.model_validate_json(path.read_text()) if path.exists() else Alloc()


@contextmanager
def locked() -> Iterator[Alloc]:
    """The allocation table, locked against other processes; saved when the block succeeds."""
    d = node_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / "alloc.json"
    with open(d / "alloc.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        alloc = read()
        yield alloc
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(alloc.model_dump_json(indent=1))
        os.replace(tmp, path)
