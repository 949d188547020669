"""Modal's ``Sandbox`` over a ray_sandbox handle: created through :func:`ray_sandbox.create`
(so placed by Ray like any sandbox), driven through the handle's exec, process and file
calls. Exit codes follow Modal: the command's own, 124 when ``timeout`` ran out, 137 when
terminated."""

from __future__ import annotations

import builtins
import dataclasses
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import ray
from ray.exceptions import RayError

from .. import actor
from ..actor.handle import SandboxHandle
from ..runtime.errors import (
    ModalInvalidError,
    ModalNotFoundError,
    ModalSandboxTerminatedError,
    ModalSandboxTimeoutError,
    SandboxError,
)
from ..runtime.records import parse_id
from ..runtime.results import SandboxState
from ._aio import aiter_in_thread, dual, static
from ._options import APP_LABEL, ENCRYPTED_LABEL, PORTS_LABEL, create_options, refuse
from .app import App, Image, Secret
from .io import ContainerProcess, FileIO, Process, StreamReader, StreamType, StreamWriter
from .tunnel import Tunnel, node_address, require_service
from .volume import Volume

TIMEOUT_EXIT = 124  # Modal's return code of a sandbox whose timeout ran out
TERMINATED_EXIT = 137  # ... and of one that was terminated
_POLL_S = 0.2  # how often wait() asks a sandbox without a command whether it still runs


def _env(env: Mapping[str, str | None] | None, secrets: Sequence[Secret] | None) -> dict:
    merged: dict[str, str] = {}
    for s in secrets or ():
        merged.update(s.env)
    merged.update({k: v for k, v in (env or {}).items() if v is not None})
    return merged


class Sandbox:
    """A sandbox, as Modal's ``modal.Sandbox``. ``object_id`` is its ray_sandbox id."""

    def __init__(self, handle: SandboxHandle, entrypoint: Process | None = None) -> None:
        self._handle = handle
        self._entrypoint = entrypoint
        self._command = None if entrypoint is None else ContainerProcess(
            entrypoint, stdout=StreamType.PIPE, stderr=StreamType.PIPE, text=True, bufsize=-1)
        self._ended: tuple[int, str] | None = None
        self._terminated = False

    def __repr__(self) -> str:
        return f"Sandbox({self.object_id})"

    @property
    def object_id(self) -> str:
        return self._handle.sandbox_id

    # --- create and find -------------------------------------------------------------------

    @static
    def create(
        *args: str, app: App | None = None, name: str | None = None,
        tags: Mapping[str, str] | None = None, image: Image | None = None,
        env: Mapping[str, str | None] | None = None, secrets: Sequence[Secret] | None = None,
        timeout: float = 300, workdir: str | None = None, cpu: Any = None, memory: Any = None,
        block_network: bool = False, cidr_allowlist: Sequence[str] | None = None,
        outbound_domain_allowlist: Sequence[str] | None = None,
        unencrypted_ports: Sequence[int] = (), encrypted_ports: Sequence[int] = (),
        volumes: Mapping[str, Volume] | None = None,
        idle_timeout: float | None = None, verbose: bool = False, **others: Any,
    ) -> Sandbox:
        """Create a sandbox; with ``args`` it runs that command and ends when it exits."""
        require_service(encrypted_ports)
        handle = actor.create(**create_options(
            image=image.ref if image is not None else None, app=app.app_id if app else None,
            name=name, tags=tags, env=env, secrets_env=[s.env for s in secrets or ()],
            timeout=timeout, workdir=workdir, cpu=cpu, memory=memory,
            block_network=block_network, cidr_allowlist=cidr_allowlist,
            outbound_domain_allowlist=outbound_domain_allowlist,
            unencrypted_ports=unencrypted_ports, encrypted_ports=encrypted_ports,
            volumes=volumes, idle_timeout=idle_timeout,
            others=others))
        entrypoint = None
        if args:
            try:
                entrypoint = Process(handle, list(args), cwd=None, env=None, timeout=None)
            except BaseException:
                ray.get(handle.terminate.remote())
                raise
        return Sandbox(handle, entrypoint)

    @static
    def from_id(sandbox_id: str, client: Any = None) -> Sandbox:
        """The sandbox with this id (ours or ``ray-sandbox-<id>``), on any node."""
        refuse({"client": client}, "Sandbox.from_id")
        try:
            wanted = parse_id(sandbox_id)
        except SandboxError:
            raise ModalNotFoundError(f"no sandbox {sandbox_id!r}") from None
        for handle in actor.list():
            if handle.sandbox_id == wanted:
                return Sandbox(handle)
        raise ModalNotFoundError(f"no sandbox {sandbox_id!r}", sandbox_id=wanted)

    @static
    def from_name(app_name: str, name: str, **options: Any) -> Sandbox:  # noqa: ARG004
        """The sandbox created with ``name=`` (names are cluster-wide here)."""
        refuse(options, "Sandbox.from_name")
        try:
            return Sandbox(actor.get(name))
        except SandboxError:
            raise ModalNotFoundError(f"no sandbox named {name!r}") from None

    @staticmethod
    def _list(app_id: str | None = None, tags: Mapping[str, str] | None = None,
              client: Any = None) -> builtins.list[Sandbox]:
        refuse({"client": client}, "Sandbox.list")
        labels = {**(tags or {}), **({APP_LABEL: app_id} if app_id else {})}
        return [Sandbox(h) for h in actor.list(labels=labels or None)]

    class _Lister:
        """``Sandbox.list(...)`` iterates the cluster's sandboxes; ``.aio`` asynchronously."""

        def __call__(self, **kw: Any) -> builtins.list[Sandbox]:
            return Sandbox._list(**kw)

        def aio(self, **kw: Any) -> AsyncIterator[Sandbox]:
            return aiter_in_thread(Sandbox._list(**kw))

    list = _Lister()

    # --- commands --------------------------------------------------------------------------

    @dual
    def exec(
        self, *args: str, stdout: StreamType = StreamType.PIPE,
        stderr: StreamType = StreamType.PIPE, timeout: float | None = None,
        workdir: str | None = None, env: Mapping[str, str | None] | None = None,
        secrets: Sequence[Secret] | None = None, text: bool = True, bufsize: int = -1,
        **others: Any,
    ) -> ContainerProcess:
        """Run ``args`` (an argv; no shell) and return it as it runs."""
        refuse(others, "Sandbox.exec")  # pty, pty_info
        if not args:
            raise ModalInvalidError("exec needs a command")
        merged = _env(env, secrets)
        process = Process(self._handle, list(args), cwd=workdir, env=merged or None,
                          timeout=timeout)
        return ContainerProcess(process, stdout=stdout, stderr=stderr, text=text,
                                bufsize=bufsize)

    def _main(self) -> ContainerProcess:
        if self._command is None:
            raise ModalInvalidError("the sandbox was created without a command")
        return self._command

    @property
    def stdout(self) -> StreamReader:
        return self._main().stdout

    @property
    def stderr(self) -> StreamReader:
        return self._main().stderr

    @property
    def stdin(self) -> StreamWriter:
        return self._main().stdin

    # --- lifecycle -------------------------------------------------------------------------

    def _end(self) -> tuple[int, str] | None:
        """(exit code, why) once the sandbox ended: its command's code ("command"), or
        Modal's 124 ("timeout") or 137 ("terminated")."""
        if self._entrypoint is not None:
            try:
                code = self._entrypoint.poll()
            except (SandboxError, RayError):
                code = None  # the sandbox went with it: its status says how
            if code is not None:
                ray.get(self._handle.terminate.remote())  # it ends with its command
                return code, "command"
        if self._terminated:
            return TERMINATED_EXIT, "terminated"
        status = ray.get(self._handle.status.remote())
        if status.state in (SandboxState.TERMINATED, SandboxState.ERROR):
            if status.reason == "TTLExpired":
                return TIMEOUT_EXIT, "timeout"
            return TERMINATED_EXIT, "terminated"
        return None

    @dual
    def poll(self) -> int | None:
        """The exit code if the sandbox ended, else None."""
        if self._ended is None:
            self._ended = self._end()
        return None if self._ended is None else self._ended[0]

    @property
    def returncode(self) -> int | None:
        return self.poll()

    @dual
    def wait(self, raise_on_termination: bool = True) -> None:
        """Wait until the sandbox ends (its command exits, its timeout runs out, or it is
        terminated); with ``raise_on_termination`` the last two raise."""
        while self.poll() is None:
            if self._entrypoint is None:
                time.sleep(_POLL_S)
                continue
            try:
                self._entrypoint.wait()
            except (SandboxError, RayError):
                pass  # the sandbox went with its command; poll() reads why
        assert self._ended is not None
        if raise_on_termination and self._ended[1] == "timeout":
            raise ModalSandboxTimeoutError("the sandbox's timeout ran out",
                                           sandbox_id=self.object_id)
        if raise_on_termination and self._ended[1] == "terminated":
            raise ModalSandboxTerminatedError("the sandbox was terminated",
                                              sandbox_id=self.object_id)

    @dual
    def terminate(self) -> None:
        self._terminated = True
        ray.get(self._handle.terminate.remote())

    @dual
    def detach(self) -> None:
        """Nothing to release: the handle holds no connection (the sandbox keeps running)."""

    # --- files -----------------------------------------------------------------------------

    @dual
    def open(self, path: str, mode: str = "r") -> FileIO:
        return FileIO(self._handle, path, mode)

    @dual
    def ls(self, path: str) -> builtins.list[str]:
        return [f.name for f in ray.get(self._handle.list_dir.remote(path))]

    @dual
    def mkdir(self, path: str, parents: bool = False) -> None:
        ray.get(self._handle.mkdir.remote(path, parents=parents))

    @dual
    def rm(self, path: str, recursive: bool = False) -> None:
        ray.get(self._handle.remove.remote(path, recursive=recursive))

    # --- tags and what is not here ---------------------------------------------------------

    def _labels(self) -> dict[str, str]:
        return ray.get(self._handle.status.remote()).labels

    @dual
    def get_tags(self) -> dict[str, str]:
        """The ``tags=`` it was created with."""
        return {k: v for k, v in self._labels().items()
                if k not in (APP_LABEL, PORTS_LABEL, ENCRYPTED_LABEL) and "/" not in k}

    @dual
    def tunnels(self, timeout: int = 50) -> dict[int, Tunnel]:
        """Its ``unencrypted_ports``, published on its node, and its ``encrypted_ports``, as
        signed URLs of the service (docs/compat.md, "tunnels")."""
        labels = self._labels()
        out: dict[int, Tunnel] = {}
        if labels.get(PORTS_LABEL):
            host = node_address(self._handle.node_id)
            out.update({p: Tunnel.node_local(host, p)
                        for p in map(int, labels[PORTS_LABEL].split(","))})
        for p in map(int, filter(None, labels.get(ENCRYPTED_LABEL, "").split(","))):
            signed, local = Tunnel.through_service(self._handle, p, timeout), out.get(p)
            out[p] = signed if local is None else dataclasses.replace(
                signed, unencrypted_host=local.host, unencrypted_port=local.port)
        return out

    def set_tags(self, tags: Mapping[str, str], **options: Any) -> None:
        raise NotImplementedError("Sandbox.set_tags: tags are fixed at create here "
                                  "(Sandbox.create(tags=...)); docs/compat.md")

    @dual
    def snapshot_filesystem(self, timeout: int = 55) -> Image:
        """Its files as an :class:`Image` that later ``Sandbox.create(image=...)`` start
        from, on any node (docs/snapshots.md, "Filesystem images")."""
        ref = self._handle.snapshot_filesystem.remote()
        return Image(ray.get(ref, timeout=timeout))
