"""Modal's ``modal.io_streams``: ``StreamReader`` (an exec's stdout/stderr) and
``StreamWriter`` (its stdin)."""

from .io import StreamReader, StreamWriter

__all__ = ["StreamReader", "StreamWriter"]
