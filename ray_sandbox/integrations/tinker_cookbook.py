"""tinker-cookbook's ``SandboxInterface`` on a ray_sandbox sandbox.

tinker-cookbook takes sandboxes from a factory it is handed
(``tinker_cookbook/sandbox/sandbox_interface.py``; no registry):

- evaluations: ``BenchmarkConfig(sandbox_factory=factory(image="ray-sandbox/python"))``,
  a zero-argument async factory like ``ModalSandbox.create``;
- the Harbor RL recipe: ``HarborDatasetBuilder(..., sandbox_factory=harbor_factory(
  image=...))``, an ``async (env_dir, timeout)`` factory. Modal's builds ``env_dir``'s
  Dockerfile; here the image is given (a name, or a function of ``env_dir``): build a task's
  Dockerfile once with ``ray-sandbox image build -t NAME env_dir`` (under gVisor).

What maps, following the reference ``ModalSandbox`` (``sandbox/modal_sandbox.py``):
``run_command(command, workdir, timeout, max_output_bytes)`` runs ``bash -lc command`` in
``workdir`` (None: the image's WORKDIR) for ``timeout`` seconds, keeping ``max_output_bytes``
per stream (default 128 KiB; the rest is dropped on the host, ``metrics["truncated"]``); a
command that times out is killed and comes back as ``exit_code=124`` with what it wrote so far
and a note on stderr; a failure to run it is ``exit_code=-1`` with the error on stderr, as
Modal's; a dead sandbox raises tinker-cookbook's ``SandboxTerminatedError``.
``read_file(path, max_bytes)`` gives the content in ``stdout`` (a missing file: non-zero
``exit_code``, as ``cat`` gives there); ``write_file(..., executable=)`` makes parent
directories. ``send_heartbeat`` checks the sandbox is alive. ``cleanup`` deletes it. The
lifetime (``timeout`` of ``create``) is ``ttl_seconds``. ``fork(k)`` is ours: running
copies, for branching a rollout group from one prepared state.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from tinker_cookbook.sandbox.sandbox_interface import SandboxResult, SandboxTerminatedError

from ..runtime.errors import (
    SandboxDiedError,
    SandboxError,
    SandboxNotFoundError,
    SandboxStateError,
)
from ..runtime.verbs import ExecRequest
from ._box import Box, Transport, call, make_config

DEFAULT_MAX_OUTPUT = 128 * 1024  # ModalSandbox's max_stream_output_bytes
TIMEOUT_EXIT_CODE = 124  # what timeout(1) returns
_TRANSPORT = set(Transport.model_fields)
_GONE = (SandboxNotFoundError, SandboxDiedError, SandboxStateError)


class RaySandbox:
    """A tinker-cookbook sandbox (``SandboxInterface``) that is a gVisor sandbox."""

    def __init__(self, box: Box, *, max_stream_output_bytes: int = DEFAULT_MAX_OUTPUT,
                 shell: str = "bash") -> None:
        self._box: Box | None = box
        self._max_output = max_stream_output_bytes
        self._shell = shell
        self._lock = threading.Lock()

    @classmethod
    async def create(cls, image: str | None = None, timeout: int = 600, *,
                     max_stream_output_bytes: int = DEFAULT_MAX_OUTPUT, shell: str = "bash",
                     **options: Any) -> RaySandbox:
        """A started sandbox living ``timeout`` seconds at most; ``options`` are SandboxConfig
        fields (cpu, memory, network, …) and the transport's (service_url, ray_address,
        create_timeout)."""
        transport = Transport(**{k: options.pop(k) for k in list(options) if k in _TRANSPORT})
        config = make_config(options, image=image, ttl_seconds=float(timeout))
        box = await call(transport.open, config)
        return cls(box, max_stream_output_bytes=max_stream_output_bytes, shell=shell)

    @property
    def sandbox_id(self) -> str:
        return self._require().sandbox_id

    def _require(self) -> Box:
        if self._box is None:
            raise SandboxTerminatedError("the sandbox was cleaned up")
        return self._box

    async def _run(self, request: ExecRequest) -> SandboxResult:
        try:
            r = await call(self._require().exec, request)
        except _GONE as exc:
            raise SandboxTerminatedError(str(exc)) from exc
        except SandboxError as exc:
            return SandboxResult(stdout="", stderr=str(exc), exit_code=-1)
        metrics: dict[str, Any] = {"duration_seconds": r.duration_seconds}
        if r.truncated:
            metrics["truncated"] = True
        if r.timed_out:
            return SandboxResult(stdout=r.stdout, stderr=r.stderr + (
                f"\ncommand timed out after {request.timeout} s and was killed"),
                exit_code=TIMEOUT_EXIT_CODE, metrics=metrics)
        return SandboxResult(stdout=r.stdout, stderr=r.stderr, exit_code=r.exit_code,
                             metrics=metrics)

    async def send_heartbeat(self, timeout: int = 30) -> None:
        box = self._require()
        try:
            alive = await asyncio.wait_for(call(box.alive), timeout)
        except TimeoutError:
            alive = False
        if not alive:
            raise SandboxTerminatedError(f"sandbox {box.sandbox_id} is not running")

    async def run_command(self, command: str, workdir: str | None = None, timeout: int = 60,
                          max_output_bytes: int | None = None) -> SandboxResult:
        return await self._run(ExecRequest(
            command=[self._shell, "-lc", command], cwd=workdir, timeout=float(timeout),
            max_output_bytes=max_output_bytes or self._max_output))

    async def read_file(self, path: str, max_bytes: int | None = None, timeout: int = 60
                        ) -> SandboxResult:
        argv = ["head", "-c", str(max_bytes), path] if max_bytes is not None else ["cat", path]
        return await self._run(ExecRequest(command=argv, timeout=float(timeout),
                                           max_output_bytes=max_bytes or self._max_output))

    async def write_file(self, path: str, content: str | bytes, executable: bool = False,
                         timeout: int = 60) -> SandboxResult:
        data = content.encode() if isinstance(content, str) else content
        box = self._require()
        try:
            await asyncio.wait_for(call(box.write, path, data, 0o755 if executable else 0o644),
                                   timeout)
        except _GONE as exc:
            raise SandboxTerminatedError(str(exc)) from exc
        except (SandboxError, TimeoutError) as exc:
            return SandboxResult(stdout="", stderr=f"write_file {path}: {exc}", exit_code=1)
        return SandboxResult(stdout="", stderr="", exit_code=0)

    async def cleanup(self) -> None:
        with self._lock:
            box, self._box = self._box, None
        if box is not None:
            await call(box.close)

    async def fork(self, k: int = 1) -> list[RaySandbox]:
        """``k`` running copies (files, processes, memory); each is cleaned up on its own."""
        boxes = await call(self._require().fork, k)
        return [RaySandbox(b, max_stream_output_bytes=self._max_output, shell=self._shell)
                for b in boxes]


def factory(image: str | None = None, timeout: int = 600, **options: Any
            ) -> Callable[[], Awaitable[RaySandbox]]:
    """For ``BenchmarkConfig(sandbox_factory=...)``: each call starts one sandbox."""
    async def create() -> RaySandbox:
        return await RaySandbox.create(image, timeout, **options)

    return create


def harbor_factory(image: str | Callable[[Path], str], **options: Any
                   ) -> Callable[[Path, int], Awaitable[RaySandbox]]:
    """For the Harbor RL recipe's ``sandbox_factory``: ``(env_dir, timeout)`` -> a sandbox
    of ``image`` (or ``image(env_dir)``) living ``timeout`` seconds."""
    async def create(env_dir: Path, timeout: int) -> RaySandbox:
        ref = image(Path(env_dir)) if callable(image) else image
        return await RaySandbox.create(ref, timeout, **options)

    return create


__all__ = ["RaySandbox", "factory", "harbor_factory"]
