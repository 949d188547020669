"""One sandbox of one tenant as a replica sees it (:class:`Entry`), with the execs this
replica runs in it, and the service's labels on a sandbox, which say whose it is and what it
is charged, so a restarted replica adopts what its predecessor made (``_sandboxes``)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..runtime.results import ExecResult
from . import _streams
from ._quota import Charge

LABEL_PREFIX = "ray-sandbox/"  # the Ray layer's and this service's labels; callers' may not
TENANT_LABEL = "ray-sandbox/service-tenant"
CPU_LABEL = "ray-sandbox/service-cpu"
MEMORY_LABEL = "ray-sandbox/service-memory"
PORTS_LABEL = "ray-sandbox/service-ports"  # its published ports, for port URLs after adoption
IMAGE_LABEL = "ray-sandbox/service-image"  # the image as the tenant named it (not a host path)


@dataclass(eq=False)
class Exec:
    exec_id: str
    future: asyncio.Future[ExecResult]
    reported: asyncio.Task[Any] | None = None  # its result on its way to the books


@dataclass(eq=False)
class Entry:
    """One sandbox of one tenant: being created, running, or failed to create."""

    api_id: str
    tenant: str
    charge: Charge
    image: str
    labels: dict[str, str]
    created_at: float | None
    ports: tuple[int, ...] = ()
    handle: Any = None  # SandboxHandle once made
    creating: asyncio.Task[None] | None = None  # this replica's create of it
    error: str | None = None
    deleted: bool = False
    lost: bool = False  # the books made it, no node has it any more
    token_answer: bool = False  # returned for a create's client token, not made by it
    execs: OrderedDict[str, Exec] = field(default_factory=OrderedDict)  # run by this replica
    streams: dict[str, _streams.Stream] = field(default_factory=dict)  # read by this replica

    def source(self) -> dict[str, Any]:
        """What copies of it get: its charge, image and labels (a snapshot keeps these)."""
        return {"cpu": self.charge.cpu, "memory": self.charge.memory, "image": self.image,
                "labels": self.labels}

    def row(self) -> list[Any]:
        """What the books' ``reconcile`` takes of a sandbox the hosts list."""
        return [self.charge.cpu, self.charge.memory,
                {**self.source(), "created_at": self.created_at}]


def user_labels(labels: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in labels.items() if not k.startswith(LABEL_PREFIX)}
