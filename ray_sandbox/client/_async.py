"""AsyncSandboxClient: the same as SandboxClient for asyncio (and trio, through anyio)."""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import anyio
import httpx

from ..runtime.results import ExecResult, OutputChunk, SandboxLink
from . import _ops

T = TypeVar("T")


class AsyncSandbox:
    """A sandbox of the service; every method is a coroutine."""

    def __init__(self, client: AsyncSandboxClient, sandbox_id: str) -> None:
        self._client = client
        self.sandbox_id = sandbox_id

    def __repr__(self) -> str:
        return f"AsyncSandbox({self.sandbox_id[:12]})"

    def _path(self, tail: str = "") -> str:
        return f"/sandboxes/{self.sandbox_id}{tail}"

    async def exec(self, command: str | list[str], **options: Any) -> ExecResult:
        """As the sync client's: ``options`` are ExecRequest's."""
        body = _ops.exec_body(command, options)
        return await self._client._run(_ops.run(self.sandbox_id, body))

    async def exec_stream(
        self, command: str | list[str], **options: Any,
    ) -> AsyncIterator[OutputChunk | ExecResult]:
        """OutputChunks as the command writes them, then its ExecResult. Leaving the loop
        early (or closing the generator) kills the command."""
        body = _ops.exec_body(command, options)
        url = self._client._base + self._path("/execs/stream")
        async with self._client._http.stream("POST", url, json=body,
                                             headers=self._client._headers,
                                             timeout=_ops.stream_timeout(body)) as r:
            if not r.is_success:
                await r.aread()
                _ops.check(r, self.sandbox_id)
            async for line in r.aiter_lines():
                item = _ops.stream_item(line, self.sandbox_id)
                if item is not None:
                    yield item

    async def upload_dir(self, local_dir: str | Path, remote_dir: str) -> None:
        """Copy a local directory into the sandbox (a tar, unpacked there)."""
        await self._client._run(_ops.one("PUT", self._path("/archive"), self.sandbox_id,
                                         params={"path": remote_dir},
                                         content=_ops.pack(local_dir)))

    async def download_dir(self, remote_dir: str, local_dir: str | Path) -> None:
        """Copy a directory of the sandbox into ``local_dir`` (nothing lands outside it)."""
        r = await self._client._run(_ops.one("GET", self._path("/archive"), self.sandbox_id,
                                             params={"path": remote_dir}))
        _ops.unpack(r.content, local_dir)

    async def status(self) -> dict[str, Any]:
        r = await self._client._run(_ops.one("GET", self._path(), self.sandbox_id))
        info: dict[str, Any] = r.json()
        return info

    async def write_file(self, path: str, data: str | bytes) -> None:
        content = data.encode() if isinstance(data, str) else data
        await self._client._run(_ops.one("PUT", self._path("/files"), self.sandbox_id,
                                         params={"path": path}, content=content))

    async def read_file(self, path: str) -> bytes:
        r = await self._client._run(_ops.one("GET", self._path("/files"), self.sandbox_id,
                                             params={"path": path}))
        return r.content

    async def snapshot(self) -> str:
        """Snapshot the sandbox (it keeps running); returns the snapshot's id."""
        r = await self._client._run(_ops.one("POST", self._path("/snapshot"), self.sandbox_id))
        snapshot_id: str = r.json()["snapshot_id"]
        return snapshot_id

    async def snapshot_filesystem(self) -> str:
        """The sandbox's files (not its processes) as an image this tenant creates sandboxes
        from: ``fs-image://<id>``, for ``create(image=...)``."""
        r = await self._client._run(_ops.one("POST", self._path("/filesystem-image"),
                                              self.sandbox_id, timeout=660))
        image: str = r.json()["image"]
        return image

    async def fork(self, k: int = 1) -> list[AsyncSandbox]:
        """``k`` running copies, each created by (and deleted with) this client."""
        r = await self._client._run(_ops.one("POST", self._path("/fork"), self.sandbox_id,
                                        json={"count": k}, timeout=660))
        return self._client._adopt(r.json()["sandboxes"])

    async def link(self, other: AsyncSandbox | str, port: int) -> SandboxLink:
        """Let this sandbox open TCP connections to ``port`` of ``other`` (the tenant's,
        both ``network="sandbox"`` on one node); connect to the answer's ``host:port``."""
        to = other.sandbox_id if isinstance(other, AsyncSandbox) else other
        r = await self._client._run(_ops.one("POST", self._path("/links"), self.sandbox_id,
                                        json={"to": to, "port": port}))
        return SandboxLink.model_validate(r.json())

    async def unlink(self, other: AsyncSandbox | str, port: int) -> None:
        """Close a link; its connections are cut (idempotent)."""
        to = other.sandbox_id if isinstance(other, AsyncSandbox) else other
        await self._client._run(_ops.one("DELETE", self._path(f"/links/{to}/{port}"),
                                    self.sandbox_id))

    async def port_url(self, port: int, *, ttl_seconds: float | None = None) -> str:
        """A signed, expiring URL to ``port`` (published with ``expose_ports``): whoever
        holds it reaches the port without a token (Modal's tunnel URL)."""
        r = await self._client._run(_ops.one("POST", self._path(f"/ports/{port}/url"),
                                        self.sandbox_id, json={"ttl_seconds": ttl_seconds}))
        return str(r.json()["url"])

    async def terminate(self) -> None:
        await self._client._run(_ops.one("DELETE", self._path(), self.sandbox_id))
        self._client._made.pop(self.sandbox_id, None)


class AsyncSandboxClient:
    """``async with AsyncSandboxClient(url, token) as c:``; deletes what it created on exit."""

    def __init__(self, base_url: str, token: str, *, timeout: float = 60.0,
                 http: httpx.AsyncClient | None = None) -> None:
        self._http = http or httpx.AsyncClient(timeout=timeout)
        self._base = _ops.api_url(base_url)
        self._headers = {"Authorization": f"Bearer {token}"}
        self._made: dict[str, AsyncSandbox] = {}

    async def _run(self, op: _ops.Op[T]) -> T:
        try:
            call = next(op)
            while True:
                call = op.send(await self._send(call))
        except StopIteration as done:
            result: T = done.value
            return result

    async def _send(self, call: _ops.Call) -> httpx.Response:
        attempt = 0
        while True:
            try:
                r = await self._http.request(call.method, self._base + call.path,
                                             params=call.params, json=call.json,
                                             content=call.content, headers=self._headers,
                                             timeout=call.timeout)
            except httpx.TransportError:
                delay = _ops.retry(call, attempt, None)
                if delay is None:
                    raise
            else:
                delay = _ops.retry(call, attempt, r)
                if delay is None:
                    return r
            await anyio.sleep(delay)
            attempt += 1

    async def create(self, image: str | None = None, *, timeout: float = 600.0,
                     detach: bool = False, client_token: str | None = None,
                     **options: Any) -> AsyncSandbox:
        """As the sync client's (``client_token`` included)."""
        body = {**options, **({"image": image} if image is not None else {}),
                **({"client_token": client_token} if client_token else {})}
        sb = AsyncSandbox(self, await self._run(_ops.create(body, timeout)))
        if not detach:
            self._made[sb.sandbox_id] = sb
        return sb

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        sb = AsyncSandbox(self, sandbox_id)
        await sb.status()
        return sb

    async def list(self, labels: Mapping[str, str] | None = None) -> list[AsyncSandbox]:
        return [AsyncSandbox(self, s["sandbox_id"]) for s in await self.statuses(labels)]

    async def statuses(
        self, labels: Mapping[str, str] | None = None,
    ) -> builtins.list[dict[str, Any]]:
        params = {"label": [f"{k}={v}" for k, v in (labels or {}).items()]}
        r = await self._run(_ops.one("GET", "/sandboxes", params=params))
        sandboxes: builtins.list[dict[str, Any]] = r.json()["sandboxes"]
        return sandboxes

    async def restore(self, snapshot_id: str, k: int = 1) -> builtins.list[AsyncSandbox]:
        """``k`` running copies of a snapshot this tenant took."""
        r = await self._run(_ops.one("POST", f"/snapshots/{snapshot_id}/restore",
                                  json={"count": k}, timeout=660))
        return self._adopt(r.json()["sandboxes"])

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self._run(_ops.one("DELETE", f"/snapshots/{snapshot_id}"))

    async def filesystem_images(self) -> builtins.list[str]:
        """This tenant's filesystem images (``AsyncSandbox.snapshot_filesystem``)."""
        r = await self._run(_ops.one("GET", "/filesystem-images"))
        images: builtins.list[str] = r.json()["images"]
        return images

    async def delete_filesystem_image(self, image: str) -> None:
        """Idempotent; ``ImageInUseError`` while a sandbox runs from it."""
        await self._run(_ops.one("DELETE", _ops.fs_image_path(image)))

    def _adopt(self, ids: builtins.list[str]) -> builtins.list[AsyncSandbox]:
        made = [AsyncSandbox(self, i) for i in ids]
        self._made.update((sb.sandbox_id, sb) for sb in made)
        return made

    async def health(self) -> bool:
        r = await self._run(_ops.one("GET", "/health"))
        status: str | None = r.json().get("status")
        return status == "ok"

    async def aclose(self) -> None:
        try:
            for sb in list(self._made.values()):
                await sb.terminate()
        finally:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncSandboxClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
