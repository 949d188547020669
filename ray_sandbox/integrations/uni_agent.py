"""veRL uni-agent's sandbox provider ``ray_sandbox``.

uni-agent (github.com/verl-project/uni-agent, not on PyPI) builds a task's sandbox by
provider name (``uni_agent/sandbox/registry.py``: ``build_sandbox(SandboxConfig(provider=
...))``); importing this module registers the provider::

    import ray_sandbox.integrations.uni_agent  # noqa: F401  (registers "ray_sandbox")
    sandbox = build_sandbox(SandboxConfig(provider="ray_sandbox", image="ray-sandbox/python",
                                          sandbox_kwargs={"network": "public"}))

(or add ``"ray_sandbox": "ray_sandbox.integrations.uni_agent"`` to the registry's
``SANDBOX_MODULES`` so the name loads lazily, as the built-in providers do).

What maps (``uni_agent/sandbox/base.py``): ``image`` is the image; ``runtime_timeout``, the
sandbox's lifetime, is ``ttl_seconds``; ``sandbox_kwargs`` are SandboxConfig fields
(``cpu``, ``memory``, ``network``, ``expose_ports``, ``user``, ``disk``, …) plus the
transport (``service_url``, ``ray_address``, ``create_timeout``). ``_exec``'s ``timeout``,
``workdir`` and ``env`` are the exec's; a timeout is ``ExecResult(-1, <output so far>,
"exec timed out after …")`` like the local provider's; a dead sandbox raises (the base
class's ``exec`` re-raises when ``is_alive()`` is False). Files use the sandbox's own file
calls (binary-safe, no base64 over exec); a missing file is ``SandboxFileNotFoundError``
(a ``FileNotFoundError``, as the local provider raises). ``expose_port(port)`` gives the
URL of a port listed in ``expose_ports``. ``fork(k)`` is this provider's own: ``k`` started
copies of the running sandbox. Not honoured: ``open_shell`` (native shells; uni-agent's
tools then keep their state through exec).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from uni_agent.sandbox.base import ExecResult, Sandbox, SandboxConfig
from uni_agent.sandbox.registry import register_sandbox

from ..runtime.agent.client import READ_MAX
from ..runtime.errors import ConfigError
from ..runtime.verbs import ExecRequest
from ._box import Box, Transport, call, make_config

PROVIDER = "ray_sandbox"
_TRANSPORT = set(Transport.model_fields)


@register_sandbox(PROVIDER)
class RaySandbox(Sandbox):
    """A uni-agent sandbox that is a gVisor sandbox of ray_sandbox."""

    def __init__(self, image: str | None = None, runtime_timeout: float | None = 3600.0,
                 *, _box: Box | None = None, **options: Any) -> None:
        self.transport = Transport(**{k: options.pop(k) for k in list(options)
                                      if k in _TRANSPORT})
        self.config = make_config(options, image=image, ttl_seconds=runtime_timeout)
        self._box = _box

    @classmethod
    def from_config(cls, config: SandboxConfig) -> RaySandbox:
        return cls(image=config.image, runtime_timeout=config.runtime_timeout,
                   **config.sandbox_kwargs)

    @property
    def box(self) -> Box:
        if self._box is None:
            raise RuntimeError("the sandbox is not started; call start() or use `async with`")
        return self._box

    async def start(self) -> None:
        if self._box is None:
            self._box = await call(self.transport.open, self.config)

    async def stop(self) -> None:
        box, self._box = self._box, None
        if box is not None:
            await call(box.close)

    async def is_alive(self) -> bool:
        return self._box is not None and await call(self._box.alive)

    async def _exec(self, argv: list[str], *, timeout: float | None = None,
                    workdir: str | None = None, env: dict[str, str] | None = None,
                    ) -> ExecResult:
        request = ExecRequest(command=list(argv), timeout=timeout, cwd=workdir, env=env)
        result = await call(self.box.exec, request)
        if result.timed_out:
            return ExecResult(-1, result.stdout, f"exec timed out after {timeout}s")
        return ExecResult(result.exit_code, result.stdout, result.stderr)

    async def read_file(self, path: str) -> bytes:
        return await call(self.box.read, path, READ_MAX)

    async def write_file(self, path: str, content: bytes | str) -> None:
        data = content.encode() if isinstance(content, str) else content
        await call(self.box.write, path, data)

    async def upload(self, local_path: Any, remote_path: str) -> None:
        src = Path(local_path)
        if src.is_dir():
            await call(self.box.upload_dir, src, str(remote_path))
        else:
            await call(self.box.upload_file, src, str(remote_path))

    async def download(self, remote_path: str, local_path: Any) -> None:
        is_dir = await call(self.box.exec, ExecRequest(command=["test", "-d", remote_path]))
        if is_dir.exit_code == 0:
            await call(self.box.download_dir, str(remote_path), Path(local_path))
        else:
            await call(self.box.download_file, str(remote_path), Path(local_path), None)

    async def expose_port(self, port: int) -> str:
        if port not in self.config.expose_ports:
            raise ConfigError(f"port {port} is not published: list it in sandbox_kwargs "
                              f"expose_ports (now {list(self.config.expose_ports)})")
        return await call(self.box.port_url, port)

    async def fork(self, k: int = 1) -> list[RaySandbox]:
        """``k`` started copies of this running sandbox (files, processes, memory); each
        is stopped on its own."""
        boxes = await call(self.box.fork, k)
        opts = self.transport.model_dump(exclude_unset=True)
        copies = []
        for b in boxes:
            copy = type(self)(_box=b, **opts)
            copy.config = self.config
            copies.append(copy)
        return copies


__all__ = ["PROVIDER", "RaySandbox"]
