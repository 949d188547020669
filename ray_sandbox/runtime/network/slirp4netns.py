"""The ``slirp4netns`` wrapper: user-mode egress for a netns, and its API socket (port forwards).

slirp4netns runs in the upstream namespace and forwards what arrives on ``tap0`` in the
sandbox's namespace through ordinary sockets of its own. It drops its capabilities and applies
seccomp (``--enable-sandbox --enable-seccomp``), refuses 10.0.2.2 -> host loopback
(``--disable-host-loopback``) and offers no DNS of its own (``--disable-dns``).
"""

from __future__ import annotations

import json
import os
import select
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen
from typing import Any

from .. import _proc
from ..errors import ConfigError, NetworkError
from . import netns as _netns

GUEST_ADDR = "10.0.2.100"  # slirp4netns' fixed address for the namespace side of tap0
MTU = 65520
_MAX_SUN_PATH = 107


@dataclass
class Starting:
    proc: Popen[bytes]
    ready_fd: int
    argv: Sequence[str] = ()  # for errors: Popen.args is typed as any command form


def start(*, netns: str, upstream: str | None, api_socket: Path, log: Path) -> Starting:
    """Start slirp4netns for netns ``netns``; finish with :func:`wait_ready`."""
    if len(str(api_socket)) > _MAX_SUN_PATH:
        raise ConfigError(f"slirp4netns API socket path too long: {api_socket}")
    api_socket.unlink(missing_ok=True)
    r, w = os.pipe()
    argv = [
        *_netns.enter(upstream),
        # --enable-sandbox unmounts every /run/netns bind of its mount namespace
        # (docs/platform.md, "Network: slirp4netns --enable-sandbox")
        *_netns.private_mounts(),
        "slirp4netns",
        "--configure",
        f"--mtu={MTU}",
        "--disable-host-loopback",
        "--disable-dns",
        "--enable-sandbox",
        "--enable-seccomp",
        f"--api-socket={api_socket}",
        f"--ready-fd={w}",
        "--netns-type=path",
        _netns.netns_path(netns),
        "tap0",
    ]
    try:
        with open(log, "ab") as out:
            proc = _proc.spawn(argv, stdout=out, stderr=out, pass_fds=[w])
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    return Starting(proc, r, argv)


READY_TIMEOUT = 30.0  # it is ready in ~10 ms; a node busy starting Ray took over 5 s


def wait_ready(starting: Starting, log: Path, timeout: float = READY_TIMEOUT) -> None:
    """Block until tap0 is configured; :class:`NetworkError` if slirp4netns exited first,
    or was not ready within ``timeout`` seconds (each says which)."""
    try:
        ready, _, _ = select.select([starting.ready_fd], [], [], timeout)
        ok = bool(ready) and os.read(starting.ready_fd, 1) == b"1"
    finally:
        os.close(starting.ready_fd)
    if not ok:
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        code = starting.proc.poll()
        why = (f"exited with code {code} before it was ready" if code is not None
               else f"was not ready within {timeout:g} s (timeout)")
        raise NetworkError(f"slirp4netns {why}", argv=starting.argv, stderr=tail)


def add_hostfwd(api_socket: Path, host_addr: str, host_port: int, guest_port: int) -> None:
    """Publish ``guest_port`` of the namespace on ``host_addr:host_port`` of the upstream."""
    request = {
        "execute": "add_hostfwd",
        "arguments": {"proto": "tcp", "host_addr": host_addr, "host_port": host_port,
                      "guest_addr": GUEST_ADDR, "guest_port": guest_port},
    }
    answer = _call(api_socket, request)
    if "error" in answer:
        desc = answer["error"].get("desc", answer["error"])
        raise NetworkError(f"cannot publish port {guest_port} on {host_addr}:{host_port}: {desc}")


def _call(api_socket: Path, request: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(str(api_socket))
            s.sendall(json.dumps(request).encode())
            s.shutdown(socket.SHUT_WR)
            data = b""
            while time.monotonic() < deadline and (chunk := s.recv(4096)):
                data += chunk
        except OSError as exc:
            raise NetworkError(f"slirp4netns API {api_socket}: {exc}") from exc
    try:
        answer: dict[str, Any] = json.loads(data)
    except ValueError as exc:
        raise NetworkError(f"slirp4netns API answered {data[:200]!r}") from exc
    return answer
