"""Modal's ``Sandbox`` over a ray_sandbox handle: created through :func:`ray_sandbox.create`
(so placed by Ray like any sandbox), driven through the handle's exec, process and file
calls. Exit codes follow Modal: the command's own, 124 when ``timeout`` ran out, 137 when
terminated."""

from __future__ import annotations

import base64
import builtins
import dataclasses
import json
import posixpath
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import ray
from ray.exceptions import RayError

from .. import actor
from ..actor.handle import SandboxHandle
from ..runtime.errors import (
    CommandError,
    FileTooLargeError,
    ModalAlreadyExistsError,
    ModalConflictError,
    ModalInvalidError,
    ModalNotFoundError,
    ModalSandboxTerminatedError,
    ModalSandboxTimeoutError,
    ModalTimeoutError,
    SandboxError,
    SandboxExistsError,
)
from ..runtime.records import parse_id
from ..runtime.results import SandboxState
from ..runtime.snapshot import Snapshot
from ._aio import aiter_in_thread, dual, static
from ._options import (
    APP_LABEL,
    ENCRYPTED_LABEL,
    MODAL_LABELS,
    PORTS_LABEL,
    PROBE_LABEL,
    create_options,
    refuse,
)
from ._probe import Probe, listening
from ._refuse import refused, refused_property
from .app import App, Secret
from .image import Image
from .io import ContainerProcess, FileIO, Process, StreamReader, StreamType, StreamWriter
from .sandbox_fs import SandboxFilesystem
from .tunnel import Tunnel, node_address, require_service
from .volume import Volume

TIMEOUT_EXIT = 124  # Modal's return code of a sandbox whose timeout ran out
TERMINATED_EXIT = 137  # ... and of one that was terminated
_POLL_S = 0.2  # how often wait() asks a sandbox without a command whether it still runs
_PROBE_ATTEMPT_MAX_S = 60.0  # one exec probe may run this long (less if the wait ends first)
_PROBE_ENDED_EVERY_S = 1.0  # how often wait_until_ready asks whether the sandbox ended
_PROC_NET_MAX = 4 << 20  # /proc/net/tcp{,6} is read up to this many bytes
_SNAPSHOT_PREFIX = "rsnap-"  # a SandboxSnapshot's id: this and the snapshot's reference


def _env(env: Mapping[str, str | None] | None, secrets: Sequence[Secret] | None) -> dict:
    merged: dict[str, str] = {}
    for s in secrets or ():
        merged.update(s.env)
    merged.update({k: v for k, v in (env or {}).items() if v is not None})
    return merged


class Sandbox:
    """A sandbox, as Modal's ``modal.Sandbox``. ``object_id`` is its ray_sandbox id."""

    def __init__(self, handle: SandboxHandle, entrypoint: Process | None = None, *,
                 workdir: str | None = None, probe: Probe | None = None) -> None:
        # its verbs (exec, status, read_file, …) are made from the verb table at import
        # (actor/handle.py): Any, so that type checks do not miss them
        self._handle: Any = handle
        self._entrypoint = entrypoint
        self._command = None if entrypoint is None else ContainerProcess(
            entrypoint, stdout=StreamType.PIPE, stderr=StreamType.PIPE, text=True, bufsize=-1)
        self._ended: tuple[int, str] | None = None
        self._terminated = False
        self._workdir = workdir  # where relative paths start; asked of the sandbox once
        self._probe = probe
        self._filesystem: SandboxFilesystem | None = None

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
        cpu_limit: float | None = None, memory_limit: int | None = None,
        block_network: bool = False, outbound_cidr_allowlist: Sequence[str] | None = None,
        outbound_domain_allowlist: Sequence[str] | None = None,
        cidr_allowlist: Sequence[str] | None = None,
        unencrypted_ports: Sequence[int] = (), encrypted_ports: Sequence[int] = (),
        volumes: Mapping[str, Volume] | None = None, idle_timeout: float | None = None,
        readiness_probe: Probe | None = None, runtime: str | None = None,
        _experimental_enable_snapshot: bool = False, verbose: bool = False, **others: Any,
    ) -> Sandbox:
        """Create a sandbox; with ``args`` it runs that command and ends when it exits. An
        image with build steps is built first (once; ``modal.enable_output()`` shows it)."""
        require_service(encrypted_ports)
        if workdir is not None and not posixpath.isabs(workdir):
            raise ModalInvalidError(f"workdir must be an absolute path, not {workdir!r}")
        if readiness_probe is not None and not isinstance(readiness_probe, Probe):
            raise ModalInvalidError("readiness_probe takes a modal.Probe (Probe.with_tcp or "
                                    "Probe.with_exec)")
        options = create_options(
            image=None, app=app.app_id if app else None,
            name=name, tags=tags, env=env, secrets_env=[s.env for s in secrets or ()],
            timeout=timeout, workdir=workdir, cpu=cpu, memory=memory, cpu_limit=cpu_limit,
            memory_limit=memory_limit, block_network=block_network,
            cidr_allowlist=cidr_allowlist, outbound_cidr_allowlist=outbound_cidr_allowlist,
            outbound_domain_allowlist=outbound_domain_allowlist,
            unencrypted_ports=unencrypted_ports, encrypted_ports=encrypted_ports,
            volumes=volumes, idle_timeout=idle_timeout, runtime=runtime,
            probe=readiness_probe._label() if readiness_probe else None,
            snapshots=_experimental_enable_snapshot, others=others)
        if image is not None:  # after the options are checked: a build takes a while
            options["image"] = image.ref
        try:
            handle = actor.create(**options)
        except SandboxExistsError as exc:
            raise ModalAlreadyExistsError(exc.message) from None
        entrypoint = None
        if args:
            try:
                entrypoint = Process(handle, list(args), cwd=None, env=None, timeout=None)
            except BaseException:
                ray.get(handle.terminate.remote())
                raise
        return Sandbox(handle, entrypoint, workdir=workdir, probe=readiness_probe)

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
    def from_name(app_name: str, name: str, *,  # noqa: ARG004 - names are cluster-wide
                  environment_name: str | None = None, include_terminated: bool = False,
                  client: Any = None) -> Sandbox:
        """The sandbox created with ``name=`` (names are cluster-wide here)."""
        refuse({"environment_name": environment_name, "include_terminated": include_terminated,
                "client": client}, "Sandbox.from_name")
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
        for key in others:
            if key not in ("pty", "pty_info", "_pty_info"):
                raise TypeError(f"Sandbox.exec() got an unexpected keyword argument {key!r}")
        refuse(others, "Sandbox.exec")
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
            # killed by a signal: maybe by the sandbox's own end (its timeout ran out), which
            # the agent may report as the command's exit before it goes
            if code is not None and (code < 128 or self._ended_by_status() is None):
                ray.get(self._handle.terminate.remote())  # it ends with its command
                return code, "command"
        if self._terminated:
            return TERMINATED_EXIT, "terminated"
        return self._ended_by_status()

    def _ended_by_status(self) -> tuple[int, str] | None:
        try:
            status = ray.get(self._handle.status.remote())
        except SandboxError:
            return TERMINATED_EXIT, "terminated"  # gone (deleted) without a word
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
    def terminate(self, *, wait: bool = False) -> int | None:
        """End the sandbox (nothing happens if it ended already); with ``wait`` return its
        exit code once it is gone (137, or its command's if that had exited)."""
        if self.poll() is None:  # an ended one keeps its code (its command's, 124, 137)
            self._terminated = True
            ray.get(self._handle.terminate.remote())
        if wait:
            self.wait(raise_on_termination=False)
            return self.returncode
        return None

    @dual
    def detach(self) -> None:
        """Nothing to release: the handle holds no connection (the sandbox keeps running)."""

    # --- files -----------------------------------------------------------------------------

    def _resolve(self, path: str) -> str:
        """A path of the sandbox: absolute, or relative to its working directory (its
        ``workdir``, else its image's, else ``/``: what its commands start in)."""
        if not isinstance(path, str) or not path:
            raise ModalInvalidError(f"not a path: {path!r}")
        if path.startswith("/"):
            return path
        if self._workdir is None:
            try:
                res = ray.get(self._handle.exec.remote("pwd", timeout=30))
                out = res.stdout.strip()
                self._workdir = out if res.exit_code == 0 and out.startswith("/") else "/"
            except SandboxError:
                self._workdir = "/"  # no shell in the image: its commands start at / too
        return posixpath.normpath(posixpath.join(self._workdir, path))

    @property
    def filesystem(self) -> SandboxFilesystem:
        """Modal 1.6's file API (``read_text``, ``write_bytes``, ``list_files``,
        ``copy_from_local``, …; sandbox_fs.py)."""
        if self._filesystem is None:
            self._filesystem = SandboxFilesystem(self._handle, self._resolve)
        return self._filesystem

    @dual
    def open(self, path: str, mode: str = "r") -> FileIO:
        """Modal's file API before 1.4 (gone from Modal 1.6's client, kept here)."""
        return FileIO(self._handle, self._resolve(path), mode)

    @dual
    def ls(self, path: str) -> builtins.list[str]:
        return [f.name for f in ray.get(self._handle.list_dir.remote(self._resolve(path)))]

    @dual
    def mkdir(self, path: str, parents: bool = False) -> None:
        ray.get(self._handle.mkdir.remote(self._resolve(path), parents=parents))

    @dual
    def rm(self, path: str, recursive: bool = False) -> None:
        ray.get(self._handle.remove.remote(self._resolve(path), recursive=recursive))

    watch = refused("Sandbox.watch", "the sandbox's agent has no file-watching operation; "
                    "poll with sb.filesystem.stat()")

    # --- readiness ---------------------------------------------------------------------------

    def _readiness_probe(self) -> Probe | None:
        if self._probe is None:
            text = self._labels().get(PROBE_LABEL)
            self._probe = Probe._from_label(text) if text else None
        return self._probe

    def _probe_passes(self, probe: Probe, left: float) -> bool:
        if probe.exec_argv is not None:
            res = ray.get(self._handle.exec.remote(
                list(probe.exec_argv), timeout=max(0.1, min(left, _PROBE_ATTEMPT_MAX_S))))
            return res.exit_code == 0 and not res.timed_out
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                text = ray.get(self._handle.read_file.remote(table, max_bytes=_PROC_NET_MAX))
            except (FileNotFoundError, FileTooLargeError):
                continue
            if listening(text.decode("ascii", errors="replace"), probe.tcp_port or 0):
                return True
        return False

    @dual
    def wait_until_ready(self, *, timeout: int = 300) -> None:
        """Wait until the sandbox's ``readiness_probe`` passes (tried every
        ``interval_ms``). ``TimeoutError`` when it has not within ``timeout`` seconds;
        ``ConflictError`` if the sandbox has no probe or ended before it passed."""
        if not isinstance(timeout, int | float) or timeout <= 0:
            raise ModalInvalidError(f"timeout must be positive, not {timeout!r}")
        probe = self._readiness_probe()
        if probe is None:
            raise ModalConflictError("the sandbox was created without a readiness_probe",
                                     sandbox_id=self.object_id)
        deadline = time.monotonic() + timeout
        checked = float("-inf")
        while True:
            now = time.monotonic()
            if now - checked >= _PROBE_ENDED_EVERY_S:
                checked = now
                if self.poll() is not None:
                    raise ModalConflictError("the sandbox ended before it was ready",
                                             sandbox_id=self.object_id)
            try:
                if self._probe_passes(probe, deadline - now):
                    return
            except (SandboxError, RayError):
                checked = float("-inf")  # gone? the next round asks
            left = deadline - time.monotonic()
            if left <= 0:
                raise ModalTimeoutError(f"the readiness probe did not pass within {timeout} s",
                                        sandbox_id=self.object_id)
            time.sleep(min(probe.interval_ms / 1000, left))

    # --- memory snapshots ----------------------------------------------------------------------

    @dual
    def _experimental_snapshot(self) -> SandboxSnapshot:
        """Its memory, processes and files (``handle.snapshot()``); the sandbox runs on. It
        must have been created with ``_experimental_enable_snapshot=True``, as on Modal."""
        try:
            return SandboxSnapshot(ray.get(self._handle.snapshot.remote()))
        except CommandError as exc:
            if "hostinet" not in f"{exc.stderr} {exc.message}":
                raise
            raise ModalInvalidError("a memory snapshot needs a sandbox created with "
                                    "_experimental_enable_snapshot=True",
                                    sandbox_id=self.object_id) from None

    @static
    def _experimental_from_snapshot(snapshot: SandboxSnapshot, **options: Any) -> Sandbox:
        """A new sandbox from a memory snapshot (``ray_sandbox.restore``), its processes
        running on where they were."""
        refuse(options, "Sandbox._experimental_from_snapshot")
        if not isinstance(snapshot, SandboxSnapshot):
            raise ModalInvalidError("_experimental_from_snapshot takes a SandboxSnapshot")
        (handle,) = actor.restore(snapshot._snapshot)
        return Sandbox(handle)

    # --- tags and what is not here ---------------------------------------------------------

    def _labels(self) -> dict[str, str]:
        return ray.get(self._handle.status.remote()).labels

    @dual
    def get_tags(self) -> dict[str, str]:
        """The ``tags=`` it was created with."""
        return {k: v for k, v in self._labels().items()
                if k not in MODAL_LABELS and "/" not in k}

    @dual
    def tunnels(self, timeout: int = 50) -> dict[int, Tunnel]:
        """Its ``unencrypted_ports``, published on its node, and its ``encrypted_ports``, as
        signed URLs of the service (docs/compat.md, "tunnels")."""
        labels = self._labels()
        out: dict[int, Tunnel] = {}
        if labels.get(PORTS_LABEL):
            host = node_address(self._handle.node_id)
            out.update({p: Tunnel._node_local(host, p)
                        for p in map(int, labels[PORTS_LABEL].split(","))})
        for p in map(int, filter(None, labels.get(ENCRYPTED_LABEL, "").split(","))):
            signed, local = Tunnel._through_service(self._handle, p, timeout), out.get(p)
            out[p] = signed if local is None else dataclasses.replace(
                signed, unencrypted_host=local.host, unencrypted_port=local.port)
        return out

    set_tags = refused("Sandbox.set_tags", "tags are fixed at create here "
                       "(Sandbox.create(tags=...))")

    @dual
    def snapshot_filesystem(self, timeout: int = 55, *, ttl: int | None = 2592000) -> Image:
        """Its files as an :class:`Image` that later ``Sandbox.create(image=...)`` start
        from, on any node (docs/snapshots.md, "Filesystem images"). The image stays until
        ``ray_sandbox.delete_filesystem_image(image.object_id)``, whatever ``ttl`` says."""
        ref = self._handle.snapshot_filesystem.remote()
        return Image(ray.get(ref, timeout=timeout))

    @dual
    def reload_volumes(self, *, timeout: int = 55) -> None:
        """Nothing to do: a volume's files are the same for every sandbox at once."""

    @dual
    def hydrate(self, client: Any = None) -> Sandbox:
        refuse({"client": client}, "Sandbox.hydrate")
        return self

    _NO_MOUNTS = ("a running sandbox's mounts are fixed at create here; start a sandbox "
                  "from the image instead (Sandbox.create(image=...))")
    create_connect_token = refused(
        "Sandbox.create_connect_token", "no token-checking proxy here; publish the port with "
        "encrypted_ports and use tunnels()[port].url, a signed URL of the ray_sandbox service")
    snapshot_directory = refused("Sandbox.snapshot_directory", "snapshot the whole root with "
                                 "snapshot_filesystem()")
    mount_image = refused("Sandbox.mount_image", _NO_MOUNTS)
    unmount_image = refused("Sandbox.unmount_image", _NO_MOUNTS)
    get_dashboard_url = refused("Sandbox.get_dashboard_url", "no Modal dashboard here")
    _experimental_set_outbound_network_policy = refused(
        "Sandbox._experimental_set_outbound_network_policy", "change egress with ray_sandbox's "
        "handle: SandboxHandle.set_egress (docs/network.md)")
    logs = refused_property("Sandbox.logs", "a sandbox's command output is read from "
                            "sb.stdout/sb.stderr here")
    client = refused_property("Sandbox.client", "there is no Modal client here")
    _experimental_sidecars = refused_property(
        "Sandbox._experimental_sidecars", "no sidecar containers here; create a second sandbox "
        "and connect the two with ray_sandbox's SandboxHandle.link (docs/network.md)")


class SandboxSnapshot:
    """A memory snapshot (``sb._experimental_snapshot()``): ``object_id`` carries the
    snapshot's reference, so ``SandboxSnapshot.from_id`` works in any process of the
    cluster. It stays until ``ray_sandbox.delete_snapshot(snap._snapshot)``."""

    def __init__(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def __repr__(self) -> str:
        return f"SandboxSnapshot({self._snapshot.snapshot_id})"

    @property
    def object_id(self) -> str:
        raw = self._snapshot.model_dump_json().encode()
        return _SNAPSHOT_PREFIX + base64.urlsafe_b64encode(raw).decode()

    @static
    def from_id(sandbox_snapshot_id: str, client: Any = None) -> SandboxSnapshot:
        refuse({"client": client}, "SandboxSnapshot.from_id")
        try:
            raw = base64.urlsafe_b64decode(sandbox_snapshot_id.removeprefix(_SNAPSHOT_PREFIX))
            return SandboxSnapshot(Snapshot.model_validate(json.loads(raw)))
        except (ValueError, TypeError, AttributeError):
            raise ModalNotFoundError(f"not a snapshot id: {sandbox_snapshot_id[:40]!r}"
                                     ) from None

    get_dashboard_url = refused("SandboxSnapshot.get_dashboard_url", "no Modal dashboard here")
