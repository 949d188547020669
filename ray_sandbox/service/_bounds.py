"""What the service's books (``_state``) are held to: the per-tenant limits of the service's
config (:class:`Bounds`, all that crosses to the state actor: no tokens), the grace a create
or exec gets past its own bound, and the kinds of things a tenant keeps."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from ._config import ServiceConfig

GRACE = 60.0  # a create or exec past its own bound by this much lost its replica
SNAPSHOT, FS_IMAGE = "snapshot", "filesystem image"  # the kinds of things a tenant keeps


class Bounds(BaseModel):
    """What the books are held to (from ServiceConfig; no tokens cross to the actor)."""

    model_config = ConfigDict(frozen=True)

    max_execs_per_sandbox: int
    max_errored: int
    max_snapshots: int
    max_fs_images: int
    create_timeout: float
    max_running_execs_per_tenant: int
    max_result_bytes_per_tenant: int
    max_exec_timeout: float = 3600.0
    max_exec_result_age: float = 86400.0
    max_client_tokens: int = 4096
    client_token_seconds: float = 86400.0

    @classmethod
    def of(cls, config: ServiceConfig) -> Bounds:
        return cls(**{k: getattr(config, k) for k in cls.model_fields})

    def limit(self, kind: str) -> int:
        """How many of ``kind`` (SNAPSHOT, FS_IMAGE) one tenant keeps."""
        return self.max_snapshots if kind == SNAPSHOT else self.max_fs_images
