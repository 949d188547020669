"""SandboxClient: the service's sandboxes from plain Python, without Ray."""

from __future__ import annotations

import builtins
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import httpx

from ..runtime.results import ExecResult, OutputChunk, SandboxLink
from . import _ops

T = TypeVar("T")


class Sandbox:
    """A sandbox of the service, called like a ``SandboxHandle`` without ``.remote``."""

    def __init__(self, client: SandboxClient, sandbox_id: str) -> None:
        self._client = client
        self.sandbox_id = sandbox_id

    def __repr__(self) -> str:
        return f"Sandbox({self.sandbox_id[:12]})"

    def _path(self, tail: str = "") -> str:
        return f"/sandboxes/{self.sandbox_id}{tail}"

    def exec(self, command: str | list[str], **options: Any) -> ExecResult:
        """Run a command (argv list, or a string for the shell) and wait for its result;
        ``options`` are ExecRequest's (timeout, env, cwd, user, shell, stdin,
        max_output_bytes), as for ``SandboxHandle.exec``."""
        body = _ops.exec_body(command, options)
        return self._client._run(_ops.run(self.sandbox_id, body))

    def exec_stream(self, command: str | list[str],
                    **options: Any) -> Iterator[OutputChunk | ExecResult]:
        """OutputChunks as the command writes them, then its ExecResult. Leaving the loop
        early (or closing the generator) kills the command."""
        body = _ops.exec_body(command, options)
        url = self._client._base + self._path("/execs/stream")
        with self._client._http.stream("POST", url, json=body, headers=self._client._headers,
                                       timeout=_ops.stream_timeout(body)) as r:
            if not r.is_success:
                r.read()
                _ops.check(r, self.sandbox_id)
            for line in r.iter_lines():
                item = _ops.stream_item(line, self.sandbox_id)
                if item is not None:
                    yield item

    def upload_dir(self, local_dir: str | Path, remote_dir: str) -> None:
        """Copy a local directory into the sandbox (a tar, unpacked there)."""
        self._client._run(_ops.one("PUT", self._path("/archive"), self.sandbox_id,
                                   params={"path": remote_dir}, content=_ops.pack(local_dir)))

    def download_dir(self, remote_dir: str, local_dir: str | Path) -> None:
        """Copy a directory of the sandbox into ``local_dir`` (nothing lands outside it)."""
        r = self._client._run(_ops.one("GET", self._path("/archive"), self.sandbox_id,
                                       params={"path": remote_dir}))
        _ops.unpack(r.content, local_dir)

    def status(self) -> dict[str, Any]:
        """``{sandbox_id, status, reason, image, cpu, memory, labels, created_at}``."""
        info: dict[str, Any] = self._client._run(_ops.one("GET", self._path(),
                                                          self.sandbox_id)).json()
        return info

    def write_file(self, path: str, data: str | bytes) -> None:
        content = data.encode() if isinstance(data, str) else data
        self._client._run(_ops.one("PUT", self._path("/files"), self.sandbox_id,
                                   params={"path": path}, content=content))

    def read_file(self, path: str) -> bytes:
        return self._client._run(_ops.one("GET", self._path("/files"), self.sandbox_id,
                                          params={"path": path})).content

    def snapshot(self) -> str:
        """Snapshot the sandbox (it keeps running); returns the snapshot's id."""
        r = self._client._run(_ops.one("POST", self._path("/snapshot"), self.sandbox_id))
        snapshot_id: str = r.json()["snapshot_id"]
        return snapshot_id

    def snapshot_filesystem(self) -> str:
        """The sandbox's files (not its processes) as an image this tenant creates sandboxes
        from: ``fs-image://<id>``, for ``create(image=...)``."""
        r = self._client._run(_ops.one("POST", self._path("/filesystem-image"),
                                        self.sandbox_id, timeout=660))
        image: str = r.json()["image"]
        return image

    def fork(self, k: int = 1) -> list[Sandbox]:
        """``k`` running copies, each created by (and deleted with) this client."""
        r = self._client._run(_ops.one("POST", self._path("/fork"), self.sandbox_id,
                                        json={"count": k}, timeout=660))
        return self._client._adopt(r.json()["sandboxes"])

    def link(self, other: Sandbox | str, port: int) -> SandboxLink:
        """Let this sandbox open TCP connections to ``port`` of ``other`` (the tenant's,
        both ``network="sandbox"`` on one node); connect to the answer's ``host:port``."""
        to = other.sandbox_id if isinstance(other, Sandbox) else other
        r = self._client._run(_ops.one("POST", self._path("/links"), self.sandbox_id,
                                        json={"to": to, "port": port}))
        return SandboxLink.model_validate(r.json())

    def unlink(self, other: Sandbox | str, port: int) -> None:
        """Close a link; its connections are cut (idempotent)."""
        to = other.sandbox_id if isinstance(other, Sandbox) else other
        self._client._run(_ops.one("DELETE", self._path(f"/links/{to}/{port}"),
                                    self.sandbox_id))

    def port_url(self, port: int, *, ttl_seconds: float | None = None) -> str:
        """A signed, expiring URL to ``port`` (published with ``expose_ports``): whoever
        holds it reaches the port without a token (Modal's tunnel URL)."""
        r = self._client._run(_ops.one("POST", self._path(f"/ports/{port}/url"),
                                        self.sandbox_id, json={"ttl_seconds": ttl_seconds}))
        return str(r.json()["url"])

    def terminate(self) -> None:
        """Delete the sandbox (idempotent)."""
        self._client._run(_ops.one("DELETE", self._path(), self.sandbox_id))
        self._client._made.pop(self.sandbox_id, None)


class SandboxClient:
    """The service at ``base_url`` as ``token``'s tenant. As a context manager it deletes the
    sandboxes it created when the block ends."""

    def __init__(self, base_url: str, token: str, *, timeout: float = 60.0,
                 http: httpx.Client | None = None) -> None:
        self._http = http or httpx.Client(timeout=timeout)
        self._base = _ops.api_url(base_url)
        self._headers = {"Authorization": f"Bearer {token}"}
        self._made: dict[str, Sandbox] = {}

    def _run(self, op: _ops.Op[T]) -> T:
        try:
            call = next(op)
            while True:
                call = op.send(self._send(call))
        except StopIteration as done:
            result: T = done.value
            return result

    def _send(self, call: _ops.Call) -> httpx.Response:
        attempt = 0
        while True:
            try:
                r = self._http.request(call.method, self._base + call.path, params=call.params,
                                       json=call.json, content=call.content,
                                       headers=self._headers, timeout=call.timeout)
            except httpx.TransportError:
                delay = _ops.retry(call, attempt, None)
                if delay is None:
                    raise
            else:
                delay = _ops.retry(call, attempt, r)
                if delay is None:
                    return r
            time.sleep(delay)
            attempt += 1

    def create(self, image: str | None = None, *, timeout: float = 600.0,
               detach: bool = False, client_token: str | None = None,
               **options: Any) -> Sandbox:
        """A running sandbox; ``options`` are SandboxConfig's (cpu, memory, env, labels, …).
        Waits up to ``timeout`` seconds for it to start. It is deleted when this client
        closes, unless ``detach``. ``client_token`` makes the create idempotent within the
        tenant for the service's ``client_token_seconds`` [24 h]: the same token returns the
        same sandbox (by default each call sends a token of its own, so its retries after a
        lost connection never make two)."""
        body = {**options, **({"image": image} if image is not None else {}),
                **({"client_token": client_token} if client_token else {})}
        sb = Sandbox(self, self._run(_ops.create(body, timeout)))
        if not detach:
            self._made[sb.sandbox_id] = sb
        return sb

    def get(self, sandbox_id: str) -> Sandbox:
        """The sandbox with this id (SandboxNotFoundError if this tenant has none)."""
        sb = Sandbox(self, sandbox_id)
        sb.status()
        return sb

    def list(self, labels: Mapping[str, str] | None = None) -> list[Sandbox]:  # noqa: A003
        return [Sandbox(self, s["sandbox_id"]) for s in self.statuses(labels)]

    def statuses(self, labels: Mapping[str, str] | None = None) -> builtins.list[dict[str, Any]]:
        """This tenant's sandboxes as ``status()`` describes each, in one request."""
        params = {"label": [f"{k}={v}" for k, v in (labels or {}).items()]}
        r = self._run(_ops.one("GET", "/sandboxes", params=params))
        sandboxes: builtins.list[dict[str, Any]] = r.json()["sandboxes"]
        return sandboxes

    def restore(self, snapshot_id: str, k: int = 1) -> builtins.list[Sandbox]:
        """``k`` running copies of a snapshot this tenant took."""
        r = self._run(_ops.one("POST", f"/snapshots/{snapshot_id}/restore",
                                  json={"count": k}, timeout=660))
        return self._adopt(r.json()["sandboxes"])

    def delete_snapshot(self, snapshot_id: str) -> None:
        self._run(_ops.one("DELETE", f"/snapshots/{snapshot_id}"))

    def filesystem_images(self) -> builtins.list[str]:
        """This tenant's filesystem images (``Sandbox.snapshot_filesystem``)."""
        r = self._run(_ops.one("GET", "/filesystem-images"))
        images: builtins.list[str] = r.json()["images"]
        return images

    def delete_filesystem_image(self, image: str) -> None:
        """Idempotent; ``ImageInUseError`` while a sandbox runs from it."""
        self._run(_ops.one("DELETE", _ops.fs_image_path(image)))

    def _adopt(self, ids: builtins.list[str]) -> builtins.list[Sandbox]:
        made = [Sandbox(self, i) for i in ids]
        self._made.update((sb.sandbox_id, sb) for sb in made)
        return made

    def health(self) -> bool:
        status: str | None = self._run(_ops.one("GET", "/health")).json().get("status")
        return status == "ok"

    def close(self) -> None:
        """Delete the sandboxes this client created, then close its connections."""
        try:
            for sb in list(self._made.values()):
                sb.terminate()
        finally:
            self._http.close()

    def __enter__(self) -> SandboxClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
