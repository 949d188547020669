"""One sandbox of a framework adapter, over either transport: a Ray handle
(``ray_sandbox.create``) or a sandbox of the HTTP service (``ray_sandbox.client``).

Every adapter in this package speaks to a :class:`Box`: blocking calls that take the
runtime's own request models (``ExecRequest``) and raise the error tree
(``runtime/errors.py``), so an adapter maps its framework onto one surface and works over
both. Async frameworks call a box through :func:`call`, which runs it in a worker thread.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from ..runtime.config import SandboxConfig
from ..runtime.errors import ConfigError, FileTooLargeError, SandboxError
from ..runtime.results import ExecResult, SandboxState
from ..runtime.verbs import ExecRequest

if TYPE_CHECKING:
    from ..client import Sandbox as ClientSandbox
    from ..client import SandboxClient

T = TypeVar("T")

ALIVE_TIMEOUT = 10.0  # seconds an is_alive probe may take; past it the sandbox counts as gone
_ray_lock = threading.Lock()


class Box(ABC):
    """A running sandbox, called synchronously. ``close`` is idempotent."""

    sandbox_id: str

    @abstractmethod
    def exec(self, request: ExecRequest) -> ExecResult: ...

    @abstractmethod
    def read(self, path: str, max_bytes: int | None) -> bytes:
        """The file's bytes; FileTooLargeError past ``max_bytes``."""

    @abstractmethod
    def write(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write a file; missing parent directories are made."""

    @abstractmethod
    def upload_dir(self, local_dir: Path, remote_dir: str) -> None: ...

    @abstractmethod
    def download_dir(self, remote_dir: str, local_dir: Path) -> None: ...

    def upload_file(self, local_file: Path, remote_file: str) -> None:
        data = Path(local_file).read_bytes()
        self.write(remote_file, data, Path(local_file).stat().st_mode & 0o777)

    def download_file(self, remote_file: str, local_file: Path, max_bytes: int | None) -> None:
        data = self.read(remote_file, max_bytes)
        dst = Path(local_file)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(data)

    @abstractmethod
    def alive(self) -> bool:
        """Whether the sandbox still runs; never raises."""

    @abstractmethod
    def port_url(self, port: int) -> str:
        """Where the caller reaches ``port`` of the sandbox (it must be in ``expose_ports``)."""

    @abstractmethod
    def fork(self, k: int) -> list[Box]:
        """``k`` running copies (processes, memory and files), each a sandbox of its own."""

    @abstractmethod
    def snapshot_filesystem(self) -> str:
        """The sandbox's files as an image reference a new sandbox starts from."""

    @abstractmethod
    def close(self) -> None:
        """Delete the sandbox (idempotent)."""


# --- over Ray -------------------------------------------------------------------------------

def join_ray(address: str | None = None) -> None:
    """Join the Ray cluster at ``address`` ($RAY_ADDRESS, else a local one) once per process."""
    import ray

    with _ray_lock:
        if not ray.is_initialized():
            ray.init(address=address or os.environ.get("RAY_ADDRESS") or None,
                     log_to_driver=False)


class RayBox(Box):
    """A sandbox placed by Ray (``ray_sandbox.create``)."""

    def __init__(self, handle: Any, timeout: float | None = None) -> None:
        self.handle = handle
        self.sandbox_id: str = handle.sandbox_id
        self.timeout = timeout  # how long a create or a fork may wait for room
        self._closed = False

    @classmethod
    def create(cls, config: SandboxConfig, *, timeout: float | None = None,
               ray_address: str | None = None) -> RayBox:
        from ..actor import create

        join_ray(ray_address)
        # the fields the adapter set, as options: the rest are Ray's defaults for agent
        # workloads (a writable root capped by disk=), as over the service
        options = {k: getattr(config, k) for k in config.model_fields_set}
        return cls(create(timeout=timeout, **options), timeout)

    def _get(self, ref: Any, timeout: float | None = None) -> Any:
        import ray

        return ray.get(ref, timeout=timeout)

    def exec(self, request: ExecRequest) -> ExecResult:
        result: ExecResult = self.handle.run(request)
        return result

    def read(self, path: str, max_bytes: int | None) -> bytes:
        data: bytes = self._get(self.handle.read_file.remote(path, max_bytes=max_bytes))
        return data

    def write(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self._get(self.handle.write_file.remote(path, data, mode=mode))

    def upload_file(self, local_file: Path, remote_file: str) -> None:
        self._get(self.handle.upload_file.remote(str(local_file), remote_file))

    def download_file(self, remote_file: str, local_file: Path, max_bytes: int | None) -> None:
        kw = {} if max_bytes is None else {"max_bytes": max_bytes}
        self._get(self.handle.download_file.remote(remote_file, str(local_file), **kw))

    def upload_dir(self, local_dir: Path, remote_dir: str) -> None:
        self._get(self.handle.upload_dir.remote(str(local_dir), remote_dir))

    def download_dir(self, remote_dir: str, local_dir: Path) -> None:
        self._get(self.handle.download_dir.remote(remote_dir, str(local_dir)))

    def alive(self) -> bool:
        if self._closed:
            return False
        try:
            status = self._get(self.handle.status.remote(), ALIVE_TIMEOUT)
        except Exception:  # noqa: BLE001 - a probe: any failure means not usable
            return False
        return bool(status.state == SandboxState.RUNNING)

    def port_url(self, port: int) -> str:
        return f"http://{_node_address(self.handle.node_id)}:{port}"

    def fork(self, k: int) -> list[Box]:
        return [RayBox(h, self.timeout) for h in self.handle.fork(k, timeout=self.timeout)]

    def snapshot_filesystem(self) -> str:
        ref: str = self._get(self.handle.snapshot_filesystem.remote())
        return ref

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._get(self.handle.terminate.remote())


def _node_address(node_id: str | None) -> str:
    """Where the caller reaches what a node publishes (``expose_ports`` bind to the node's
    ``RAY_SANDBOX_NET_EXPOSE_ADDR``, loopback by default: docs/network.md)."""
    import ray

    if node_id is None or node_id == ray.get_runtime_context().get_node_id():
        return "127.0.0.1"
    for node in ray.nodes():
        if node["NodeID"] == node_id and node["Alive"]:
            return str(node["NodeManagerAddress"])
    raise SandboxError(f"the sandbox's node {node_id} is gone")


# --- over the service -----------------------------------------------------------------------

class ClientBox(Box):
    """A sandbox of the HTTP service (docs/service.md), through ``ray_sandbox.client``."""

    def __init__(self, client: SandboxClient, sandbox: ClientSandbox) -> None:
        self.client = client
        self.sandbox = sandbox
        self.sandbox_id = sandbox.sandbox_id
        # a client this package opened is shared by a box and its forks and closed with the
        # last of them (closing it deletes what it made)
        self.shared: _Shared | None = None
        self._closed = False

    @classmethod
    def create(cls, client: SandboxClient, config: SandboxConfig, *,
               timeout: float | None = None) -> ClientBox:
        # only what the adapter set: the service applies its tenant policy to the rest
        body = config.model_dump(mode="json", exclude_unset=True, exclude={"spec_transform"})
        return cls(client, client.create(timeout=timeout or 600.0, **body))

    def exec(self, request: ExecRequest) -> ExecResult:
        options = request.model_dump(exclude={"command"}, exclude_none=True)
        return self.sandbox.exec(request.command, **options)

    def read(self, path: str, max_bytes: int | None) -> bytes:
        data = self.sandbox.read_file(path)  # the service bounds a read itself
        if max_bytes is not None and len(data) > max_bytes:
            raise FileTooLargeError(f"{path} is larger than max_bytes={max_bytes}",
                                    sandbox_id=self.sandbox_id)
        return data

    def write(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self.sandbox.write_file(path, data)
        if mode != 0o644:
            self.sandbox.exec(["chmod", oct(mode)[2:], path], timeout=60)

    def upload_dir(self, local_dir: Path, remote_dir: str) -> None:
        self.sandbox.upload_dir(local_dir, remote_dir)

    def download_dir(self, remote_dir: str, local_dir: Path) -> None:
        self.sandbox.download_dir(remote_dir, local_dir)

    def alive(self) -> bool:
        if self._closed:
            return False
        try:
            return bool(self.sandbox.status().get("status") == "running")
        except Exception:  # noqa: BLE001 - a probe: any failure means not usable
            return False

    def port_url(self, port: int) -> str:
        return self.sandbox.port_url(port)

    def fork(self, k: int) -> list[Box]:
        copies = [ClientBox(self.client, sb) for sb in self.sandbox.fork(k)]
        if self.shared is not None:
            for c in copies:
                c.shared = self.shared.take()
        boxes: list[Box] = list(copies)
        return boxes

    def snapshot_filesystem(self) -> str:
        return self.sandbox.snapshot_filesystem()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.sandbox.terminate()
        finally:
            if self.shared is not None:
                self.shared.drop()


class _Shared:
    """A client and how many open boxes use it."""

    def __init__(self, client: SandboxClient) -> None:
        self.client = client
        self.users = 1
        self.lock = threading.Lock()

    def take(self) -> _Shared:
        with self.lock:
            self.users += 1
        return self

    def drop(self) -> None:
        with self.lock:
            self.users -= 1
            last = self.users == 0
        if last:
            self.client.close()


# --- what adapters share ----------------------------------------------------------------------

def make_config(options: Mapping[str, Any], **mapped: Any) -> SandboxConfig:
    """A SandboxConfig from the framework's mapped fields and the user's ``sandbox`` options;
    a field set both ways is a ConfigError (the framework's setting must not silently lose)."""
    if clash := sorted(k for k, v in mapped.items() if v is not None and k in options):
        raise ConfigError(f"sandbox option(s) {', '.join(clash)} come from the framework's own "
                          "settings; set them there")
    fields = {**{k: v for k, v in mapped.items() if v is not None}, **options}
    try:
        return SandboxConfig(**fields)
    except ValueError as exc:
        raise ConfigError(f"invalid sandbox options: {exc}") from None


URL_ENV, TOKEN_ENV = "RAY_SANDBOX_URL", "RAY_SANDBOX_API_TOKEN"  # as the CLI's --url/--token


class Transport(BaseModel):
    """Where an adapter's sandboxes come from: the HTTP service when ``service_url`` (or
    $RAY_SANDBOX_URL) names one, with the tenant token from $RAY_SANDBOX_API_TOKEN (never a
    config field: frameworks write their configs into trajectories); else Ray."""

    model_config = ConfigDict(extra="forbid")

    service_url: str | None = Field(None, description="the ray_sandbox service (docs/"
                                    "service.md); default $RAY_SANDBOX_URL, else Ray")
    ray_address: str | None = Field(None, description="Ray cluster to join; default "
                                    "$RAY_ADDRESS, else ray.init()'s own choice")
    create_timeout: float | None = Field(
        None, gt=0, description="seconds a create (through Ray also a fork) may wait for "
        "room (Ray: forever by default; service: 600)")

    def open(self, config: SandboxConfig) -> Box:
        """A new sandbox of ``config``."""
        url = self.service_url or os.environ.get(URL_ENV)
        if not url:
            return RayBox.create(config, timeout=self.create_timeout,
                                 ray_address=self.ray_address)
        from ..client import SandboxClient

        token = os.environ.get(TOKEN_ENV)
        if not token:
            raise ConfigError(f"the service at {url} needs a tenant token in ${TOKEN_ENV}")
        client = SandboxClient(url, token)
        try:
            box = ClientBox.create(client, config, timeout=self.create_timeout)
        except BaseException:
            client.close()
            raise
        box.shared = _Shared(client)
        return box


async def call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in the default executor's threads (bounded by asyncio)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, functools.partial(fn, *args, **kwargs))


def merged_output(interpreter: list[str], command: str) -> list[str]:
    """argv that runs ``command`` through ``interpreter`` with stderr folded into stdout in
    the order written, as one stream (what ``subprocess.STDOUT`` gives frameworks that read
    one output)."""
    return [*interpreter, "exec 2>&1\n" + command]


__all__ = ["Box", "ClientBox", "RayBox", "Transport", "call", "join_ray", "make_config",
           "merged_output"]
