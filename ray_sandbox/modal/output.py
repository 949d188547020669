"""Modal's ``enable_output()``: within it, what the facade does slowly is shown as it happens
on this process's stderr: an image build's steps and every line of their output (Docker's
``Step N/M`` lines, apt, pip), whether the build came from the cache, and how long it took.
Outside it nothing is printed. Process-wide, as Modal's is, and nestable."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0


@contextlib.contextmanager
def enable_output(show_progress: bool = True) -> Iterator[None]:
    """Show image builds on stderr while the block runs (``show_progress=False``, an older
    Modal's argument, shows nothing)."""
    global _depth
    if not show_progress:
        yield
        return
    with _lock:
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1


def enabled() -> bool:
    return _depth > 0


def show(line: str) -> None:
    """Print ``line`` on stderr if output is enabled."""
    if _depth > 0:
        print(line, file=sys.stderr, flush=True)


__all__ = ["enable_output"]
