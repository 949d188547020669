"""open-instruct's ``SandboxBackend`` on a ray_sandbox sandbox.

open-instruct (github.com/allenai/open-instruct, not on PyPI) builds an environment's
backend with ``open_instruct.environments.backends.create_backend(backend_type, **kw)``,
which knows only ``"docker"``. :func:`install` adds ``"ray_sandbox"`` to it (and registers
:class:`RaySandboxBackend` as a ``SandboxBackend``), after which the generic sandbox
environment selects it by its config: ``GenericSandboxEnvConfig(backend="ray_sandbox")``.
The backend also works alone: ``RaySandboxBackend(image=...).start()``.

What maps, following ``DockerBackend`` (``environments/backends.py``): ``image``;
``timeout`` (seconds per command; a command past it is killed, ``exit_code=124`` and
stderr starts ``"Command timed out after Ns."``); ``mem_limit`` (Docker's units: ``"4g"`` is
4 GiB) is ``memory``; ``run_command`` runs ``bash -c`` and keeps 1,000,000 bytes of each
stream; ``read_file`` raises ``FileNotFoundError`` for a missing path and
``IsADirectoryError`` for a directory (ray_sandbox's ``SandboxFileNotFoundError`` and
``SandboxIsADirectoryError``, which are both); ``write_file`` also makes missing parent
directories (Docker's ``put_archive`` needs them); any call before ``start()`` raises
``RuntimeError``, as there. More keyword arguments are SandboxConfig fields (``cpu``,
``network``, ``user``, …) and the transport's (``service_url``, ``ray_address``,
``create_timeout``). ``fork(k)`` is ours: started copies of the running sandbox.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Any

from ..runtime.errors import ConfigError
from ..runtime.verbs import ExecRequest
from ._box import Box, Transport, make_config

BACKEND = "ray_sandbox"
MAX_OUTPUT_BYTES = 1_000_000  # DockerBackend._MAX_OUTPUT_BYTES
TIMEOUT_EXIT_CODE = 124  # timeout(1)'s, which DockerBackend wraps every command in
_TRANSPORT = set(Transport.model_fields)
_DOCKER_SIZE = re.compile(r"^\s*(\d+)\s*([bkmg]?)\s*$", re.IGNORECASE)


@dataclass
class ExecutionResult:
    """The fields of open-instruct's ``ExecutionResult`` (used when open-instruct is not
    importable; :func:`install` makes the backend return open-instruct's own class)."""

    stdout: str
    stderr: str
    exit_code: int


_result_type: Any = ExecutionResult


def docker_size(value: str | int) -> int:
    """Docker's ``mem_limit`` (``"4g"``, ``"512m"``, bytes; binary units) in bytes."""
    if isinstance(value, int):
        return value
    m = _DOCKER_SIZE.match(value)
    if not m:
        raise ConfigError(f"mem_limit {value!r}: use Docker's form, e.g. '4g' or '512m'")
    return int(m.group(1)) * 1024 ** "bkmg".index((m.group(2) or "b").lower())


class RaySandboxBackend:
    """A ``SandboxBackend`` whose container is a gVisor sandbox."""

    def __init__(self, image: str | None = None, timeout: int = 1800,
                 mem_limit: str | int | None = "4g", *, shell: str = "bash",
                 _box: Box | None = None, **options: Any) -> None:
        self._timeout = timeout
        self._shell = shell
        self.transport = Transport(**{k: options.pop(k) for k in list(options)
                                      if k in _TRANSPORT})
        memory = docker_size(mem_limit) if mem_limit is not None else None
        self.config = make_config(options, image=image, memory=memory)
        self._lock = threading.Lock()
        self._box = _box

    def _require(self) -> Box:
        if self._box is None:
            raise RuntimeError("Container not started. Call start() first.")
        return self._box

    def start(self) -> None:
        if self._box is None:
            self._box = self.transport.open(self.config)

    def run_command(self, command: str) -> Any:
        r = self._require().exec(ExecRequest(
            command=[self._shell, "-c", command], timeout=float(self._timeout),
            max_output_bytes=MAX_OUTPUT_BYTES))
        if r.timed_out:
            return _result_type(stdout=r.stdout, exit_code=TIMEOUT_EXIT_CODE, stderr=(
                f"Command timed out after {self._timeout}s.\n" + r.stderr))
        return _result_type(stdout=r.stdout, stderr=r.stderr, exit_code=r.exit_code)

    def write_file(self, path: str, content: str | bytes) -> None:
        data = content.encode("utf-8") if isinstance(content, str) else content
        self._require().write(path, data)

    def read_file(self, path: str, binary: bool = False) -> str | bytes:
        data = self._require().read(path, None)
        return data if binary else data.decode("utf-8", errors="replace")

    def close(self) -> None:
        with self._lock:
            box, self._box = self._box, None
        if box is not None:
            box.close()

    def fork(self, k: int = 1) -> list[RaySandboxBackend]:
        """``k`` started copies of the running sandbox (files, processes, memory)."""
        copies = []
        for b in self._require().fork(k):
            copy = type(self)(timeout=self._timeout, shell=self._shell, _box=b,
                              **self.transport.model_dump(exclude_unset=True))
            copy.config = self.config
            copies.append(copy)
        return copies


def install(**defaults: Any) -> None:
    """Add ``"ray_sandbox"`` to open-instruct's ``create_backend`` (``defaults`` are
    :class:`RaySandboxBackend` options under the environment's own), register the class as
    a ``SandboxBackend`` and return open-instruct's ``ExecutionResult``. Idempotent."""
    global _result_type
    from open_instruct.environments import backends

    backends.SandboxBackend.register(RaySandboxBackend)
    _result_type = backends.ExecutionResult
    original = backends.create_backend
    if getattr(original, "_ray_sandbox", False):
        return

    def create_backend(backend_type: str, **kwargs: Any) -> Any:
        if backend_type != BACKEND:
            return original(backend_type, **kwargs)
        return RaySandboxBackend(**{**defaults, **kwargs})

    create_backend._ray_sandbox = True  # type: ignore[attr-defined]
    create_backend.__wrapped__ = original  # type: ignore[attr-defined]
    backends.create_backend = create_backend
    try:  # the generic environment imported the name itself
        from open_instruct.environments import generic_sandbox
    except ImportError:  # its heavy imports (torch, ray) are absent: the factory is enough
        return
    generic_sandbox.create_backend = create_backend


__all__ = ["BACKEND", "RaySandboxBackend", "docker_size", "install"]
