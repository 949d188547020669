"""Directories in and out as tar streams, through the handle's public calls: the tar is
written into the sandbox and unpacked there by the image's own ``tar`` (so whatever the
archive holds lands inside the sandbox, never on the host), and packed there for a download,
bounded by the service's file limit."""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from ..runtime.results import ExecResult
from . import _errors

Call = Callable[[Any], Awaitable[Any]]

# argv, never a shell string built from the caller's path: $1 the directory, $2 the tar
_UNPACK = 'tar -xf "$2" -C "$1"; rc=$?; rm -f "$2"; exit $rc'


async def upload(handle: Any, call: Call, directory: str, data: bytes) -> None:
    tar = f"{directory.rstrip('/')}/.rsb-upload-{secrets.token_hex(8)}.tar"
    await call(handle.write_file.remote(tar, data))  # makes the directory too
    _check(await call(handle.exec.remote(["sh", "-c", _UNPACK, "sh", directory, tar],
                                         timeout=300, max_output_bytes=64 * 1024)), directory)


async def download(handle: Any, call: Call, directory: str, max_bytes: int) -> bytes:
    res: ExecResult = await call(handle.exec.remote(
        ["tar", "-cf", "-", "-C", directory, "."], timeout=300, max_output_bytes=max_bytes))
    _check(res, directory)
    if res.truncated:
        raise _errors.refusal(413, f"{directory} packs to more than {max_bytes} bytes")
    return res.stdout_bytes


def _check(res: ExecResult, directory: str) -> None:
    if res.exit_code == 0:
        return
    message = f"tar failed in {directory}: {res.stderr.strip()[-500:]}"
    if res.exit_code == 127:
        raise _errors.refusal(409, "the sandbox's image has no tar")
    raise _errors.refusal(404 if "No such file" in res.stderr or "can't" in res.stderr
                          else 400, message)
