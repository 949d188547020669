"""Modal's ``modal.container_process``: where ``ContainerProcess`` (what ``exec`` returns)
is imported from."""

from .io import ContainerProcess

__all__ = ["ContainerProcess"]
