"""SandboxHandle: a serializable reference to one sandbox, called like an actor.

``sb.exec.remote("true")`` returns an ObjectRef (awaitable); ``sb.exec_stream.remote(...)``
returns an ObjectRefGenerator. File methods that name a *local* path (``upload_file``,
``download_file``, ``upload_dir``, ``download_dir``) read or write that path on the caller's
node and move the bytes through Ray's object store in chunks, so sandboxes on other nodes work
the same; they do the transfer (``transfer.py``) during ``.remote()`` and return a ref to its
completion.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import ray

from ..runtime.errors import ConfigError
from ..runtime.records import ray_id
from ..runtime.results import ExecResult
from . import channel, copies, transfer


def _id_of(sandbox: SandboxHandle | str) -> str:
    return sandbox.sandbox_id if isinstance(sandbox, SandboxHandle) else sandbox


class _Method:
    """``handle.name.remote(...)`` / ``handle.name.options(...).remote(...)``."""

    def __init__(self, call: Callable[..., Any]) -> None:
        self._call = call

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)


class SandboxHandle:
    """A sandbox running on some node of the Ray cluster."""

    def __init__(self, sandbox_id: str, host: Any, *, name: str | None = None,
                 node_id: str | None = None) -> None:
        self.sandbox_id = sandbox_id
        self.name = name
        self.node_id = node_id
        self._host = host

    def __repr__(self) -> str:
        return f"SandboxHandle({self.sandbox_id[:12]}, node={str(self.node_id)[:8]})"

    def __reduce__(self):
        return (SandboxHandle, (self.sandbox_id, self._host),
                {"name": self.name, "node_id": self.node_id})

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SandboxHandle) and other.sandbox_id == self.sandbox_id

    def __hash__(self) -> int:
        return hash(self.sandbox_id)

    # --- Ray's sandbox actor: two more names ----------------------------------------------

    @property
    def get_instance_id(self) -> _Method:
        """``.remote()`` -> ObjectRef of Ray's form of the id, ``ray-sandbox-<32 hex>``
        (docs/compat.md, "Ids")."""
        return _Method(lambda: ray.put(ray_id(self.sandbox_id)))

    @property
    def get_config(self) -> _Method:
        """``.remote()`` -> ObjectRef of the :class:`SandboxConfig` the sandbox runs with
        (its caller's labels only)."""
        return _Method(lambda: self._host.config.remote(self.sandbox_id))

    # --- exec ------------------------------------------------------------------------------

    @property
    def exec(self) -> _Method:
        """``exec.remote(command, timeout=, cwd=, env=, user=, shell=, stdin=,
        max_output_bytes=)`` -> ObjectRef[ExecResult]."""
        return _Method(lambda cmd, **kw: self._host.exec.remote(self.sandbox_id, cmd, **kw))

    def run(self, command: str | list[str], **kwargs: Any) -> ExecResult:
        """``exec`` that blocks and returns the :class:`ExecResult` itself, with the same
        arguments. From a process on the sandbox's node it skips Ray's actor call (~2 ms)
        through the host's node-local channel (``channel.py``); elsewhere it is
        ``ray.get(exec.remote(...))``."""
        client = channel.client_for(self._host)
        if client is not None:
            result = client.call("exec", self.sandbox_id, command, kwargs)
            if not isinstance(result, channel.NotSent):
                return result
            if result is channel.NotSent.STALE:
                channel.forget(self._host)  # asked again next time (a restarted host)
        return ray.get(self._host.exec.remote(self.sandbox_id, command, **kwargs))

    @property
    def exec_stream(self) -> _Method:
        """A Ray generator of OutputChunk objects, then the ExecResult."""
        return _Method(lambda cmd, **kw: self._host.exec_stream.options(
            num_returns="streaming").remote(self.sandbox_id, cmd, **kw))

    @property
    def run_python(self) -> _Method:
        """Run code in a warm, stateful interpreter (``context=`` names it)."""
        return _Method(lambda code, **kw: self._host.run_python.remote(self.sandbox_id, code,
                                                                       **kw))

    @property
    def spawn(self) -> _Method:
        """Start a background process -> ObjectRef[(process key, pid)]; drive it with
        ``process.remote(key, "read" | "read_both" | "write_stdin" | "wait" | "kill" | ...)``.
        ``timeout=`` kills its tree in the sandbox after that many seconds."""
        return _Method(lambda cmd, **kw: self._host.spawn.remote(self.sandbox_id, cmd, **kw))

    @property
    def process(self) -> _Method:
        return _Method(lambda key, op, *a, **kw: self._host.process.remote(key, op, *a, **kw))

    @property
    def processes(self) -> _Method:
        return _Method(lambda: self._host.processes.remote(self.sandbox_id))

    # --- status and lifecycle --------------------------------------------------------------

    @property
    def status(self) -> _Method:
        return _Method(lambda: self._host.status.remote(self.sandbox_id))

    get_status = status

    @property
    def set_egress(self) -> _Method:
        """``set_egress.remote(EgressPolicy | dict)``: change a networked sandbox's egress
        policy while it runs."""
        return _Method(lambda policy: self._host.set_egress.remote(self.sandbox_id, policy))

    @property
    def link(self) -> _Method:
        """``link.remote(other, port)`` -> ObjectRef[SandboxLink]: let this sandbox open TCP
        connections to ``port`` of ``other`` (a handle or an id); both ``network="sandbox"``
        on one node (create the other with ``node_id=`` this one's). Nothing else opens."""
        return _Method(lambda other, port: self._host.link.remote(
            self.sandbox_id, self._peer(other), port))

    @property
    def unlink(self) -> _Method:
        """``unlink.remote(other, port)``: close a link; its open connections are cut."""
        return _Method(lambda other, port: self._host.unlink.remote(
            self.sandbox_id, _id_of(other), port))

    @property
    def links(self) -> _Method:
        """``links.remote()`` -> ObjectRef[list[SandboxLink]] to peers that still exist."""
        return _Method(lambda: self._host.links.remote(self.sandbox_id))

    def _peer(self, other: SandboxHandle | str) -> str:
        if isinstance(other, SandboxHandle) and None not in (other.node_id, self.node_id) \
                and other.node_id != self.node_id:
            raise ConfigError(f"links join sandboxes on one node: {other.sandbox_id} is on "
                              f"node {other.node_id}, this one on {self.node_id}; create it "
                              "with node_id=", sandbox_id=self.sandbox_id)
        return _id_of(other)

    @property
    def terminate(self) -> _Method:
        """Delete the sandbox and release its Ray reservation (idempotent)."""
        return _Method(lambda: self._host.delete.remote(self.sandbox_id))

    delete = terminate

    # --- pause, snapshots, copies, suspension ----------------------------------------------

    @property
    def pause(self) -> _Method:
        """Freeze every process; exec and file calls raise SandboxStateError until resume."""
        return _Method(lambda: self._host.pause.remote(self.sandbox_id))

    @property
    def resume(self) -> _Method:
        """Thaw a paused sandbox (a suspended one comes back with ``ray_sandbox.resume``)."""
        return _Method(lambda: self._host.resume.remote(self.sandbox_id))

    @property
    def snapshot(self) -> _Method:
        """``snapshot.remote()`` -> ObjectRef[Snapshot]; the sandbox keeps running. Restore it
        with ``ray_sandbox.restore``; delete it with ``ray_sandbox.delete_snapshot``."""
        return _Method(lambda: self._host.snapshot.remote(self.sandbox_id))

    @property
    def snapshot_filesystem(self) -> _Method:
        """``snapshot_filesystem.remote(max_bytes=None)`` -> ObjectRef[str]: the sandbox's
        files as an image reference that ``create(image=...)`` takes on any node (fetched
        there once); processes and memory are not kept (docs/snapshots.md)."""
        return _Method(lambda max_bytes=None: self._host.snapshot_filesystem.remote(
            self.sandbox_id, max_bytes))

    @property
    def suspend(self) -> _Method:
        """Checkpoint to disk, delete the container and release the Ray reservation; status
        becomes SUSPENDED until ``ray_sandbox.resume(handle or name)``."""
        return _Method(lambda: self._host.suspend.remote(self.sandbox_id))

    def fork(self, k: int = 1, *, placement: str = "local", timeout: float | None = None,
             lifetime: str | None = None) -> list[SandboxHandle]:
        """``k`` running copies, each with its own reservation (blocks until all are ready;
        see ``ray_sandbox.fork``)."""
        return [SandboxHandle(**c._asdict()) for c in copies.fork(
            self._host, self.sandbox_id, k, placement=placement, timeout=timeout,
            lifetime=lifetime)]

    # --- files inside the sandbox ----------------------------------------------------------

    def _file(self, op: str) -> _Method:
        return _Method(lambda *a, **kw: self._host.file_op.remote(self.sandbox_id, op, *a, **kw))

    @property
    def read_file(self) -> _Method:
        return self._file("read_file")

    @property
    def write_file(self) -> _Method:
        """``write_file.remote(path, str | bytes, mode=0o644, append=False)``."""
        return self._file("write_file")

    @property
    def stat(self) -> _Method:
        return self._file("stat")

    @property
    def exists(self) -> _Method:
        return self._file("exists")

    @property
    def list_dir(self) -> _Method:
        return self._file("list_dir")

    @property
    def mkdir(self) -> _Method:
        return self._file("mkdir")

    @property
    def remove(self) -> _Method:
        return self._file("remove")

    # --- transfers between the caller's node and the sandbox -------------------------------

    def _transfer(self, fn: Callable[..., Any]) -> _Method:
        return _Method(partial(fn, self._host, self.sandbox_id))

    @property
    def upload_file(self) -> _Method:
        """``upload_file.remote(local_path, remote_path)``: the caller's file."""
        return self._transfer(transfer.upload_file)

    @property
    def download_file(self) -> _Method:
        """``download_file.remote(remote_path, local_path, max_bytes=1 GiB)``: written on
        the caller's node, atomically and never through a link (``hostfs.write_atomic``),
        with the file's permission bits (never setuid/setgid)."""
        return self._transfer(transfer.download_file)

    @property
    def upload_dir(self) -> _Method:
        """``upload_dir.remote(local_dir, remote_dir)`` (modes, symlinks, empty dirs kept)."""
        return self._transfer(transfer.upload_dir)

    @property
    def download_dir(self) -> _Method:
        """``download_dir.remote(remote_dir, local_dir)``; nothing lands outside local_dir."""
        return self._transfer(transfer.download_dir)
