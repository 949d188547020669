"""Entering network namespaces: argv prefixes for ``nsenter``/``unshare`` and in-process work.

The ``/proc/sys/net`` mask that lets ``runsc --network=sandbox`` start on kernels >= 6.x lives
here and only here (gVisor issue 10704;
docs/platform.md, "Network: --network=sandbox on kernel 6.x").
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from ..errors import ConfigError, NetworkError

T = TypeVar("T")
NETNS_DIR = Path("/run/netns")
_CLONE_NEWNET = 0x40000000


def netns_path(name: str) -> str:
    return str(NETNS_DIR / name)


def enter(name: str | None) -> list[str]:
    """Prefix that runs a command in netns ``name`` (none for the node's namespace)."""
    return ["nsenter", f"--net={netns_path(name)}", "--"] if name else []


def private_mounts() -> list[str]:
    """Prefix giving a command its own mount namespace, so nothing it (un)mounts reaches the
    host (slirp4netns ``--enable-sandbox`` unmounts every /run/netns bind otherwise)."""
    return ["unshare", "--mount", "--propagation", "private", "--"]


def enter_with_resolv(name: str, resolv_conf: Path) -> list[str]:
    """Prefix that runs a command in netns ``name`` with ``resolv_conf`` as its
    /etc/resolv.conf, as ``ip netns exec`` does with /etc/netns/NAME/resolv.conf, but with no
    file in /etc: the bind is made in a mount namespace of the command's own and ends with it."""
    script = 'mount --bind "$1" /etc/resolv.conf && shift && exec "$@"'
    return [*enter(name), *private_mounts(), "sh", "-c", script, "rsb-resolv", str(resolv_conf)]


def mask_proc_sys_net() -> list[str]:
    """Prefix for ``runsc run|restore --network=sandbox``: hide /proc/sys/net from that process
    only, because runsc takes its presence to mean "root netns" and refuses to start."""
    script = 'mount -t tmpfs -o size=4k,mode=555 rsb-mask /proc/sys/net && exec "$@"'
    return [*private_mounts(), "sh", "-c", script, "rsb-mask"]


def run_in(name: str | None, fn: Callable[[], T]) -> T:
    """Call ``fn`` in netns ``name``: sockets it creates and /proc/sys/net it opens belong there.

    setns() only moves the calling thread, so the work runs on a fresh thread that ends with it.
    """
    if not name:
        return fn()
    value: list[T] = []  # what fn returned, or
    error: list[BaseException] = []  # what it raised

    def target() -> None:
        try:
            fd = os.open(netns_path(name), os.O_RDONLY | os.O_CLOEXEC)
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns({name}): {os.strerror(err)}")
            finally:
                os.close(fd)
            value.append(fn())
        except BaseException as exc:  # handed to the caller's thread
            error.append(exc)

    thread = threading.Thread(target=target, name=f"netns-{name}")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return value[0]


def write_sysctl(name: str | None, key: str, value: str) -> str:
    """Set ``net.*`` sysctl ``key`` in netns ``name``; returns the previous value."""
    path = "/proc/sys/" + key.replace(".", "/")

    def write() -> str:
        with open(path, "r+") as f:
            old = f.read().strip()
            f.seek(0)
            f.write(value)
        return old

    try:
        return run_in(name, write)
    except OSError as exc:
        raise NetworkError(f"cannot set {key}={value}: {exc}") from exc


def port_free(name: str | None, addr: str, port: int) -> bool:
    """True if TCP ``addr:port`` can be bound in netns ``name`` right now."""

    def probe() -> bool:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # as a listener binds: connections of a sandbox gone (TIME_WAIT) do not count
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((addr, port))
            except OSError:
                return False
            return True

    return run_in(name, probe)


def hold_ports(name: str | None, addr: str, ports: Sequence[int]) -> list[socket.socket]:
    """A listening TCP socket on each ``addr:port`` in netns ``name``, never accepted from:
    a published port is a DNAT rule, which binds nothing, so without it a host service
    could bind the port later and its local clients would reach the sandbox instead."""

    def bind() -> list[socket.socket]:
        held: list[socket.socket] = []
        try:
            for port in ports:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                held.append(s)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((addr, port))
                s.listen(1)
        except OSError:
            for s in held:
                s.close()
            raise
        return held

    try:
        return run_in(name, bind)
    except OSError as exc:
        raise ConfigError(f"a published port on {addr} is already in use: {exc}") from exc


def bind_dns(name: str | None, addr: str, port: int) -> tuple[socket.socket, socket.socket]:
    """A UDP and a TCP socket on the same ``addr:port`` in netns ``name`` (port 0 = any)."""

    def bind() -> tuple[socket.socket, socket.socket]:
        for _ in range(20):
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            udp.bind((addr, port))
            tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                tcp.bind((addr, udp.getsockname()[1]))
            except OSError:
                udp.close()
                tcp.close()
                if port:
                    raise
                continue  # the ephemeral UDP port is taken for TCP: draw another
            tcp.listen(64)
            return udp, tcp
        raise OSError(f"no port free for both UDP and TCP on {addr}")

    try:
        return run_in(name, bind)
    except OSError as exc:
        raise NetworkError(f"cannot bind the DNS helper on {addr}:{port}: {exc}") from exc


def bind_proxy(name: str | None, addr: str, port: int) -> socket.socket:
    """The egress proxy's listening TCP socket on ``addr:port`` in netns ``name`` (port 0 =
    any); its backlog holds connections that arrive before the helper accepts."""

    def bind() -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((addr, port))
            s.listen(256)
        except OSError:
            s.close()
            raise
        return s

    try:
        return run_in(name, bind)
    except OSError as exc:
        raise NetworkError(f"cannot bind the egress proxy on {addr}:{port}: {exc}") from exc
