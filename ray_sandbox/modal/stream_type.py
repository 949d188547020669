"""Modal's ``modal.stream_type``: ``StreamType`` (``PIPE``, ``DEVNULL``, ``STDOUT``)."""

from .io import StreamType

__all__ = ["StreamType"]
