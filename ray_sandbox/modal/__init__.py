"""Modal's Sandbox API on ray_sandbox: ``import ray_sandbox.modal as modal`` and code
written for ``modal.Sandbox`` runs on sandboxes placed by Ray (the process must be
connected to a Ray cluster, as for :func:`ray_sandbox.create`). Every name of Modal's
sandbox guide and sandbox examples either works or raises NotImplementedError naming
itself and why; Modal's platform names (Functions, Queues, web endpoints, …) are refused
the same way. What differs and what is refused: docs/compat.md (checked against these
names by tests/unit/test_compat_modal_names.py)."""

from typing import Any

from . import (
    container_process,
    exception,
    experimental,
    file_io,
    image,
    io_streams,
    output,
    snapshot,
    stream_type,
    types,
)
from ._probe import Probe
from ._refuse import refusal
from .app import App, Secret
from .exception import Error
from .image import Image
from .io import ContainerProcess, FileIO, StreamReader, StreamType, StreamWriter
from .output import enable_output
from .sandbox import Sandbox, SandboxSnapshot
from .sandbox_fs import SandboxFilesystem
from .tunnel import Tunnel
from .volume import Volume

# Modal's names outside its sandboxes (Functions, classes, web endpoints, queues, …): each
# refused by name when used, not an AttributeError (``modal.<name>``).
PLATFORM = frozenset({
    "Client", "Cls", "CloudBucketMount", "Cluster", "Cron", "Dict", "Environment",
    "FilePatternMatcher", "Function", "FunctionCall", "NetworkFileSystem", "Period", "Proxy",
    "Queue", "Retries", "SchedulerPlacement", "Server", "Workspace", "asgi_app", "batched",
    "billing", "clustered", "concurrent", "current_function_call_id", "current_input_id",
    "enter", "exit", "fastapi_endpoint", "forward", "interact", "is_local",
    "method", "parameter", "sessioned", "web_endpoint", "web_server", "wsgi_app",
})


def __getattr__(name: str) -> Any:
    if name == "OutboundPolicy":
        raise refusal("modal.OutboundPolicy", "no egress proxy that rewrites requests here; "
                      "egress is allowed or denied by destination (outbound_domain_allowlist, "
                      "outbound_cidr_allowlist)")
    if name in PLATFORM:
        raise refusal(f"modal.{name}", "a Modal platform name (Functions, apps, queues, web "
                      "endpoints); ray_sandbox.modal has Modal's sandboxes")
    raise AttributeError(f"module 'ray_sandbox.modal' has no attribute {name!r}")


__all__ = ["App", "ContainerProcess", "Error", "FileIO", "Image", "Probe", "Sandbox",
           "SandboxFilesystem", "SandboxSnapshot", "Secret", "StreamReader", "StreamType",
           "StreamWriter", "Tunnel", "Volume", "container_process", "enable_output",
           "exception", "experimental", "file_io", "image", "io_streams", "output",
           "snapshot", "stream_type", "types"]
