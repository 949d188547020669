"""MCPServerConfig: what the MCP server serves (the sandbox every session gets, limits) and how
(transport, address, token). Validated once, before anything starts."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from ..runtime.config import SandboxConfig, parse_size
from ..runtime.images import is_loopback

Transport = Literal["stdio", "http"]


def default_sandbox() -> SandboxConfig:
    """A private, writable Python sandbox without network, working in /workspace, that may
    write at most 1 GiB to the node's disk (model code fills whatever it is given)."""
    return SandboxConfig(image="ray-sandbox/python", readonly=False, workdir="/workspace",
                         disk="1Gi")


class MCPServerConfig(BaseModel):
    """Server settings. Image, network mode, egress policy and limits of every session's
    sandbox come from ``sandbox``; clients cannot change them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sandbox: SandboxConfig = Field(default_factory=default_sandbox)
    default_timeout: float = Field(60.0, gt=0, description="seconds, when a call gives none")
    max_timeout: float = Field(600.0, gt=0, description="longer requested timeouts are cut")
    max_output_bytes: int = Field(64 * 1024, gt=0, description="per stream, per call")
    max_file_bytes: int = Field(1 << 20, gt=0, description="read_file returns at most this")
    max_dir_entries: int = Field(1000, gt=0, description="list_dir returns at most this many")
    idle_timeout: float = Field(1800.0, gt=0, description="seconds before an idle session ends")
    max_sessions: int = Field(32, gt=0, description="sessions (sandboxes) alive at once")
    workspace_volume: str | None = Field(
        None, description="size of a workspace volume (e.g. '256Mi') each client connection "
        "gets at the sandbox's working directory: its files survive reset_sandbox and idle "
        "ends, and it is deleted when the connection ends; None = files live and die with "
        "the session's sandbox")
    transport: Transport = "stdio"
    host: str = "127.0.0.1"
    port: int = Field(8765, ge=0, le=65535)
    path: str = "/mcp"
    token: SecretStr | None = Field(None, description="bearer token HTTP clients must send")
    require_token: bool = Field(True, description="False only on a loopback address")

    @model_validator(mode="after")
    def _checks(self) -> MCPServerConfig:
        if self.default_timeout > self.max_timeout:
            raise ValueError("default_timeout exceeds max_timeout")
        if self.workspace_volume is not None:
            parse_size(self.workspace_volume)  # a bad size fails here, not at the first call
            if self.sandbox.volumes:
                raise ValueError("workspace_volume and sandbox volumes= cannot be combined")
        if self.transport != "http":
            return self
        if self.require_token and not (self.token and self.token.get_secret_value()):
            raise ValueError(
                "the HTTP transport needs a bearer token: set RAY_SANDBOX_MCP_TOKEN (e.g. "
                "$(openssl rand -hex 32)) or pass --token; --no-auth only on loopback"
            )
        if not self.require_token and not is_loopback(self.host):
            raise ValueError(
                f"refusing to serve without a token on {self.host}: disabling the token is "
                "allowed only when bound to a loopback address (127.0.0.1, ::1, localhost)"
            )
        return self

    def clamp_timeout(self, timeout: float | None) -> float:
        """The timeout a call runs with: the default when None, never above the maximum."""
        if timeout is None:
            return self.default_timeout
        return min(max(timeout, 0.001), self.max_timeout)
