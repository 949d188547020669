"""The only place that builds ``umoci`` command lines: create OCI layouts, add layers, set the
image config, garbage-collect and unpack. Failures are classified from umoci's stderr."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from . import _proc
from .errors import ImageCorruptError, ImageError, ImageNotFoundError, StoreFullError

_RULES: tuple[tuple[re.Pattern[str], type[ImageError]], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), cls)
    for pattern, cls in (
        (r"no space left on device|disk quota exceeded", StoreFullError),
        (
            r"digest mismatch|verified digest|unexpected EOF|invalid tar header"
            r"|gzip: invalid header|invalid checksum|invalid character",
            ImageCorruptError,
        ),
        (r"not found|no such file or directory", ImageNotFoundError),
    )
)

# Long enough for a multi-GB rootfs on a slow disk; callers pass less when they have a deadline.
DEFAULT_TIMEOUT = 1800.0


def classify(returncode: int, stderr: str) -> type[ImageError]:
    """Map a failed umoci run to the ImageError subclass its stderr describes."""
    return next((cls for pattern, cls in _RULES if pattern.search(stderr)), ImageError)


def _repeat(flag: str, values: Sequence[str]) -> list[str]:
    return [arg for v in values for arg in (flag, v)]


@dataclass(frozen=True)
class Umoci:
    """umoci; ``rootless`` (default: not running as root) makes unpack keep files ours."""

    rootless: bool = field(default_factory=lambda: os.geteuid() != 0)

    def _run(self, verb: Sequence[str], *args: str, timeout: float) -> None:
        _proc.run(["umoci", *verb, *args], timeout=timeout, classify=classify,
                  what=f"umoci {' '.join(verb)}")

    def init(self, layout: Path, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self._run(["init"], "--layout", str(layout), timeout=timeout)

    def new(self, image: str, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Create an empty image ``LAYOUT:TAG``."""
        self._run(["new"], "--image", image, timeout=timeout)

    def raw_add_layer(
        self, image: str, layer_tar: Path, *, created: str, timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        """Append an uncompressed tar as a new layer (umoci gzips it)."""
        self._run(["raw", "add-layer"], "--image", image, "--history.created", created,
                  str(layer_tar), timeout=timeout)

    def config(
        self,
        image: str,
        *,
        created: str,
        architecture: str,
        os_name: str = "linux",
        env: Sequence[str] = (),
        cmd: Sequence[str] = (),
        working_dir: str = "/",
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        """Set the image config (``env`` items are ``KEY=VALUE``, ``cmd`` is an argv)."""
        args = ["--image", image, "--created", created, "--history.created", created,
                "--architecture", architecture, "--os", os_name, "--config.workingdir", working_dir]
        args += _repeat("--config.env", env) + _repeat("--config.cmd", cmd)
        self._run(["config"], *args, timeout=timeout)

    def gc(self, layout: Path, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Drop blobs no tag reaches (``config``/``add-layer`` leave the old manifests)."""
        self._run(["gc"], "--layout", str(layout), timeout=timeout)

    def unpack(self, image: str, bundle: Path, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Unpack ``LAYOUT:TAG`` into ``bundle`` (creates ``bundle/rootfs`` and metadata files)."""
        rootless = ["--rootless"] if self.rootless else []
        self._run(["unpack"], *rootless, "--image", image, str(bundle), timeout=timeout)
