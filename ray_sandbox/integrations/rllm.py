"""rLLM's ``Sandbox`` protocol on a ray_sandbox sandbox.

rLLM (github.com/rllm-org/rllm, not on PyPI) gives a sandboxed flow its sandbox as
``flow.run(task, config, *, env=sandbox)``: the engine creates it with
``rllm.sandbox.sandboxed_flow.create_sandbox(backend, name, image, **kw)`` and closes it
(``SandboxedAgentFlow.set_sandbox`` is gone upstream since the engine owns the sandbox).
That factory is a fixed if/elif over docker/local/modal/daytona, so there are two ways in:

- pass one directly: ``flow.run(task, config, env=RLLMSandbox(image=...))``;
- or :func:`install` once, then select it like a built-in: ``--sandbox-backend
  ray_sandbox`` / ``task.metadata["sandbox_backend"] = "ray_sandbox"``; ``install`` wraps
  ``create_sandbox`` and leaves the other names to rLLM.

The protocol is duck-typed (``rllm/sandbox/protocol.py``, ``@runtime_checkable``) and this
class follows its Docker backend: ``exec(command, timeout=None, user=None)`` runs ``bash -c
command`` as ``user`` and returns stdout; a non-zero exit raises ``RuntimeError("Command
failed (exit N) …")``, which rLLM's ``_safe_exec`` catches; a timeout (which Docker's backend
ignores) kills the command and raises ``RuntimeError("Command timed out …")``; a dead sandbox
raises ray_sandbox's ``SandboxNotFoundError``/``SandboxDiedError`` (not a command failure).
``is_alive`` never raises. Output past ``max_output_bytes`` (per stream) is dropped on the
host. Beyond the protocol: ``fork(k)`` (running copies, for branching a rollout) and
``snapshot_filesystem()`` (an image reference a new ``RLLMSandbox(image=ref)`` starts from).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from ..runtime.errors import ConfigError
from ..runtime.verbs import ExecRequest
from ._box import Box, Transport, make_config

BACKEND = "ray_sandbox"
_TRANSPORT = set(Transport.model_fields)
DEFAULT_MAX_OUTPUT = 16 * 2**20


class RLLMSandbox:
    """A sandbox for an rLLM flow. ``options`` are SandboxConfig fields (cpu, memory,
    network, …) and the transport's (service_url, ray_address, create_timeout); the
    sandbox starts here."""

    def __init__(self, name: str | None = None, image: str | None = None, *,
                 shell: str = "bash", max_output_bytes: int = DEFAULT_MAX_OUTPUT,
                 _box: Box | None = None, **options: Any) -> None:
        self.name = name
        self.shell = shell
        self.max_output_bytes = max_output_bytes
        transport = Transport(**{k: options.pop(k) for k in list(options) if k in _TRANSPORT})
        self._options = (transport, options)
        labels = {"rllm-name": name[:63]} if name else None
        if labels and "labels" in options:
            labels = None  # the caller's labels win over the name's
        self.config = make_config(options, image=image, labels=labels)
        self._lock = threading.Lock()
        self._box: Box | None = _box if _box is not None else transport.open(self.config)

    def _require(self) -> Box:
        if self._box is None:
            raise RuntimeError(f"sandbox {self.name} is closed")
        return self._box

    @property
    def sandbox_id(self) -> str:
        return self._require().sandbox_id

    def exec(self, command: str, timeout: float | None = None, user: str | None = None) -> str:
        result = self._require().exec(ExecRequest(
            command=[self.shell, "-c", command], timeout=timeout, user=user,
            max_output_bytes=self.max_output_bytes))
        where = f"in sandbox {self.name or self.sandbox_id}"
        if result.timed_out:
            raise RuntimeError(f"Command timed out after {timeout or self.config.timeout_seconds}"
                               f" s {where}: {command}\nstderr (tail):\n{result.stderr[-600:]}")
        if result.exit_code != 0:
            raise RuntimeError(f"Command failed (exit {result.exit_code}) {where}: {command}\n"
                               f"stderr (tail):\n{result.stderr[-600:]}")
        return result.stdout

    def upload_file(self, local_path: str, remote_path: str) -> None:
        self._require().upload_file(Path(local_path), remote_path)

    def upload_dir(self, local_path: str, remote_path: str) -> None:
        if not Path(local_path).is_dir():
            raise ConfigError(f"upload_dir: {local_path} is not a directory")
        self._require().upload_dir(Path(local_path), remote_path)

    def close(self) -> None:
        with self._lock:
            box, self._box = self._box, None
        if box is not None:
            box.close()

    def is_alive(self) -> bool:
        box = self._box
        return box is not None and box.alive()

    def fork(self, k: int = 1) -> list[RLLMSandbox]:
        """``k`` running copies (files, processes, memory); each is closed on its own."""
        transport, options = self._options
        copies = []
        for i, b in enumerate(self._require().fork(k)):
            copies.append(type(self)(
                f"{self.name}-fork{i}" if self.name else None, shell=self.shell,
                max_output_bytes=self.max_output_bytes, _box=b,
                **transport.model_dump(exclude_unset=True)))
            copies[-1].config = self.config
        return copies

    def snapshot_filesystem(self) -> str:
        """The sandbox's files as an image reference (``RLLMSandbox(image=ref)``)."""
        return self._require().snapshot_filesystem()


def install(**defaults: Any) -> None:
    """Make ``create_sandbox("ray_sandbox", name, image, **kw)`` of rLLM return an
    :class:`RLLMSandbox` (``defaults`` are its options under the call's own); every other
    backend name goes to rLLM's factory as before. Idempotent."""
    from rllm.sandbox import sandboxed_flow

    original = sandboxed_flow.create_sandbox
    if getattr(original, "_ray_sandbox", False):
        return

    def create_sandbox(backend: str, name: str, image: str, **kwargs: Any) -> Any:
        if backend != BACKEND:
            return original(backend, name, image, **kwargs)
        if "timeout" in kwargs:  # Modal's meaning, which rLLM's build paths pass: a lifetime
            kwargs["ttl_seconds"] = kwargs.pop("timeout")
        return RLLMSandbox(name=name, image=image, **{**defaults, **kwargs})

    create_sandbox._ray_sandbox = True  # type: ignore[attr-defined]
    create_sandbox.__wrapped__ = original  # type: ignore[attr-defined]
    sandboxed_flow.create_sandbox = create_sandbox


__all__ = ["BACKEND", "RLLMSandbox", "install"]
