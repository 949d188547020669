"""Modal's Sandbox API on ray_sandbox: ``import ray_sandbox.modal as modal`` and code
written for ``modal.Sandbox`` runs on sandboxes placed by Ray (the process must be
connected to a Ray cluster, as for :func:`ray_sandbox.create`). What differs and what is
refused: docs/compat.md."""

from . import exception
from .app import App, Image, Secret
from .io import ContainerProcess, FileIO, StreamReader, StreamType, StreamWriter
from .sandbox import Sandbox
from .tunnel import Tunnel
from .volume import Volume

__all__ = ["App", "ContainerProcess", "FileIO", "Image", "Sandbox", "Secret", "StreamReader",
           "StreamType", "StreamWriter", "Tunnel", "Volume", "exception"]
