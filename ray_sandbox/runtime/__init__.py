"""The Ray-free sandbox runtime: images, OCI bundles, runsc lifecycle, exec and files."""

from .config import DOCKER_DEFAULT_CAPABILITIES, EgressPolicy, SandboxConfig, make_config
from .images import (
    Image,
    ImageBusyError,
    ImageConfig,
    ImageInUseError,
    ImageStore,
    PullPolicy,
    parse_reference,
)
from .results import (
    ExecResult,
    FileInfo,
    FileType,
    OutputChunk,
    SandboxState,
    SandboxStatus,
)
from .sandbox import LimitNotEnforcedWarning, SandboxRuntime

__all__ = [
    "DOCKER_DEFAULT_CAPABILITIES",
    "EgressPolicy",
    "ExecResult",
    "FileInfo",
    "FileType",
    "Image",
    "ImageBusyError",
    "ImageConfig",
    "ImageInUseError",
    "ImageStore",
    "PullPolicy",
    "parse_reference",
    "LimitNotEnforcedWarning",
    "OutputChunk",
    "SandboxConfig",
    "SandboxRuntime",
    "SandboxState",
    "SandboxStatus",
    "make_config",
]
