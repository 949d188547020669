"""SandboxHandle: a serializable reference to one sandbox, called like an actor.

``sb.exec.remote("true")`` returns an ObjectRef (awaitable); ``sb.exec_stream.remote(...)``
returns an ObjectRefGenerator; ``sb.exec.options(...).remote(...)`` passes Ray's call options
through. The sandbox's verbs (``runtime/verbs.py``: exec, files, links, status, ...) are not
written here: each row of the table becomes a method whose request is checked at the caller
and sent to the node's host, which dispatches it. File methods that name a *local* path
(``upload_file``, ``download_file``, ``upload_dir``, ``download_dir``) read or write that path
on the caller's node and move the bytes through Ray's object store in chunks, so sandboxes on
other nodes work the same; they do the transfer (``transfer.py``) during ``.remote()`` and
return a ref to its completion.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import ray

from ..runtime.errors import ConfigError
from ..runtime.records import ray_id
from ..runtime.results import ExecResult
from ..runtime.verbs import VERBS, ExecRequest, Verb
from . import channel, copies, transfer


def _id_of(sandbox: SandboxHandle | str) -> str:
    return sandbox.sandbox_id if isinstance(sandbox, SandboxHandle) else sandbox


class _Method:
    """``handle.name.remote(...)`` / ``handle.name.options(**ray_options).remote(...)``:
    ``call(options, *args, **kwargs)`` with Ray's call options (``num_returns``,
    ``concurrency_group``, ...) passed through untouched where the call is a Ray call."""

    def __init__(self, call: Callable[..., Any], options: Mapping[str, Any] | None = None,
                 ) -> None:
        self._call = call
        self._options = dict(options or {})

    def options(self, **options: Any) -> _Method:
        return _Method(self._call, {**self._options, **options})

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(self._options, *args, **kwargs)


def _plain(fn: Callable[..., Any]) -> _Method:
    """A method that is not one Ray call (a transfer, a local value): no options to pass."""
    def call(options: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        if options:
            raise ConfigError(f"this call takes no Ray options, got {sorted(options)}")
        return fn(*args, **kwargs)

    return _Method(call)


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
        return _plain(lambda: ray.put(ray_id(self.sandbox_id)))

    @property
    def get_config(self) -> _Method:
        """``.remote()`` -> ObjectRef of the :class:`SandboxConfig` the sandbox runs with
        (its caller's labels only)."""
        return self._host_call("config")

    def _host_call(self, method: str, *fixed: Any) -> _Method:
        """The host's ``method`` for this sandbox, with Ray's options passed through."""
        return _Method(lambda o, *a, **kw: getattr(self._host, method).options(**o).remote(
            self.sandbox_id, *fixed, *a, **kw))

    # --- the verbs: built from the table at the end of this module ------------------------

    def _verb(self, row: Verb, options: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        """Check the request here, at the caller, and send it to the host's generic
        dispatch in the verb's group of threads (Ray options of the caller win)."""
        if row.name == "link":
            self._same_node(args[0] if args else kwargs.get("to"))
        args = tuple(_id_of(a) if isinstance(a, SandboxHandle) else a for a in args)
        if isinstance(kwargs.get("to"), SandboxHandle):
            kwargs["to"] = kwargs["to"].sandbox_id
        request = row.request.of(args, kwargs, sandbox_id=self.sandbox_id)
        ray_options = {"concurrency_group": row.group, **options}
        if row.streams:
            return self._host.stream.options(num_returns="streaming", **ray_options).remote(
                row.name, self.sandbox_id, request)
        return self._host.call.options(**ray_options).remote(row.name, self.sandbox_id,
                                                             request)

    def run(self, command: str | list[str], **kwargs: Any) -> ExecResult:
        """``exec`` that blocks and returns the :class:`ExecResult` itself, with the same
        arguments. From a process on the sandbox's node it skips Ray's actor call (~2 ms)
        through the host's node-local channel (``channel.py``); elsewhere it is
        ``ray.get(exec.remote(...))``."""
        request = ExecRequest.of((command,), kwargs, sandbox_id=self.sandbox_id)
        client = channel.client_for(self._host)
        if client is not None:
            result = client.call("exec", self.sandbox_id, request)
            if not isinstance(result, channel.NotSent):
                return result
            if result is channel.NotSent.STALE:
                channel.forget(self._host)  # asked again next time (a restarted host)
        return ray.get(self._host.call.options(concurrency_group="work").remote(
            "exec", self.sandbox_id, request))

    @property
    def process(self) -> _Method:
        """``process.remote(key, op, *args)``: drive a process ``spawn`` started, by the key
        it returned (``op``: read, read_both, write_stdin, close_stdin, wait, kill, ...)."""
        return _Method(lambda o, key, op, *a, **kw: self._host.process.options(**o).remote(
            key, op, *a, **kw))

    @property
    def processes(self) -> _Method:
        return self._host_call("processes")

    def _same_node(self, other: Any) -> None:
        if isinstance(other, SandboxHandle) and None not in (other.node_id, self.node_id) \
                and other.node_id != self.node_id:
            raise ConfigError(f"links join sandboxes on one node: {other.sandbox_id} is on "
                              f"node {other.node_id}, this one on {self.node_id}; create it "
                              "with node_id=", sandbox_id=self.sandbox_id)

    # --- lifecycle, snapshots, copies, suspension ------------------------------------------

    @property
    def terminate(self) -> _Method:
        """Delete the sandbox and release its Ray reservation (idempotent)."""
        return self._host_call("delete")

    delete = terminate

    @property
    def snapshot(self) -> _Method:
        """``snapshot.remote()`` -> ObjectRef[Snapshot]; the sandbox keeps running. Restore it
        with ``ray_sandbox.restore``; delete it with ``ray_sandbox.delete_snapshot``."""
        return self._host_call("snapshot")

    @property
    def snapshot_filesystem(self) -> _Method:
        """``snapshot_filesystem.remote(max_bytes=None)`` -> ObjectRef[str]: the sandbox's
        files as an image reference that ``create(image=...)`` takes on any node (fetched
        there once); processes and memory are not kept (docs/snapshots.md)."""
        return self._host_call("snapshot_filesystem")

    @property
    def suspend(self) -> _Method:
        """``suspend.remote()`` -> ObjectRef[SandboxStatus]: checkpoint to disk in place, end
        the container and give the Ray reservation back; status SUSPENDED until the next
        call into it (which resumes it first) or ``ray_sandbox.resume(handle or name)``."""
        return self._host_call("suspend")

    def fork(self, k: int = 1, *, placement: str = "local", timeout: float | None = None,
             lifetime: str | None = None) -> list[SandboxHandle]:
        """``k`` running copies, each with its own reservation (blocks until all are ready;
        see ``ray_sandbox.fork``)."""
        return [SandboxHandle(**c._asdict()) for c in copies.fork(
            self._host, self.sandbox_id, k, placement=placement, timeout=timeout,
            lifetime=lifetime)]

    # --- transfers between the caller's node and the sandbox -------------------------------

    @property
    def upload_file(self) -> _Method:
        """``upload_file.remote(local_path, remote_path)``: the caller's file."""
        return _plain(partial(transfer.upload_file, self._host, self.sandbox_id))

    @property
    def download_file(self) -> _Method:
        """``download_file.remote(remote_path, local_path, max_bytes=1 GiB)``: written on
        the caller's node, atomically and never through a link (``hostfs.write_atomic``),
        with the file's permission bits (never setuid/setgid)."""
        return _plain(partial(transfer.download_file, self._host, self.sandbox_id))

    @property
    def upload_dir(self) -> _Method:
        """``upload_dir.remote(local_dir, remote_dir)`` (modes, symlinks, empty dirs kept)."""
        return _plain(partial(transfer.upload_dir, self._host, self.sandbox_id))

    @property
    def download_dir(self) -> _Method:
        """``download_dir.remote(remote_dir, local_dir)``; nothing lands outside local_dir."""
        return _plain(partial(transfer.download_dir, self._host, self.sandbox_id))


def _verb_property(row: Verb) -> property:
    def get(self: SandboxHandle) -> _Method:
        return _Method(partial(self._verb, row))

    fields = ", ".join(f"{n}=" for n in row.request.model_fields if n not in
                       row.request.POSITIONAL)
    get.__doc__ = (f"``{row.name}.remote({', '.join(row.request.POSITIONAL)}"
                   f"{', ' if fields and row.request.POSITIONAL else ''}{fields})``: "
                   f"{row.doc} (runtime/verbs.py, {row.request.__name__})")
    return property(get)


for _row in VERBS.values():  # one method per verb of the table
    setattr(SandboxHandle, _row.name, _verb_property(_row))
SandboxHandle.get_status = SandboxHandle.status  # type: ignore[attr-defined]  # Ray's name
