"""A node-local channel from callers to their node's host: a verb without Ray's actor call.

A Ray actor call costs ~2 ms on its own (``benchmarks/bench_ray_floor.py``: an actor method
that sleeps 6 ms takes 8.1 ms end to end), more than the exec it carries. A caller on the same
node as the sandbox (a rollout worker placed beside its sandboxes, the service replica, the
driver of a one-node cluster) can skip it: the host listens on a Unix socket in its home and
runs the same ``SandboxHost.call`` (any verb of the table that answers once; ``run`` uses it
for exec) for whoever connects with its token.

Ray keeps its roles. The token comes from the host through an actor call, so only processes
that can already call the host use the channel; placement, the host's restarts and the
sandbox's ownership are Ray's as before. A caller on another node, a host without a channel,
a full channel or a host that restarted (its token changed) all fall back to the actor call
before anything was sent, so the command runs exactly once either way.

Bounds on the host: at most ``MAX_CONNECTIONS`` connections (each one thread; more are
refused and those callers use Ray), a request frame of at most ``MAX_REQUEST`` bytes (larger
stdin goes through Ray; at worst ``MAX_CONNECTIONS`` such requests are held at once), idle
connections closed after ``IDLE_S``, and a started frame must arrive within ``FRAME_S``.
"""

from __future__ import annotations

import enum
import hmac
import logging
import os
import pickle
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from ..runtime.errors import SandboxError

MAX_CONNECTIONS = 128
MAX_REQUEST = 16 << 20  # stdin of one exec; larger ones go through Ray's object store
IDLE_S = 60.0  # the host closes a connection idle this long
FRAME_S = 10.0  # a frame, once its header arrived, must be complete within this
_CLIENT_IDLE_S = IDLE_S / 2  # callers drop pooled connections well before the host would
_POOL = 4  # idle connections kept per host in one calling process (each holds a slot)
_ACK = b"\x01"
_FULL = b"\x00"  # sent instead of _ACK when every slot is taken
_HEADER = struct.Struct(">I")
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path minus its NUL

log = logging.getLogger(__name__)


class NotSent(enum.Enum):
    """What ``call`` returns when the channel did not take the call (nothing was sent; the
    caller uses the actor call): ``BUSY`` now, or ``STALE`` for good (no host listening, or
    one with another token: ask the host again)."""

    BUSY = "busy"
    STALE = "stale"


def _send(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket, limit: int, frame_s: float | None) -> bytes:
    """One frame: waits for its header as long as the socket's timeout allows, then for the
    rest at most ``frame_s``."""
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if n > limit:
        raise ConnectionError(f"frame of {n} bytes (limit {limit})")
    if frame_s is not None:
        sock.settimeout(frame_s)
    return _recv_exact(sock, n)


def _open(sock: socket.socket) -> bool:
    """Whether a pooled connection is still open: nothing may be waiting on it, so any
    readable byte or EOF means the host closed it (``select`` fails past fd 1023)."""
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return True  # nothing to read: open and idle
    except OSError:
        return False
    return False  # EOF, or a byte nobody asked for


# --- the host's side -------------------------------------------------------------------------


class ChannelServer:
    """Listens on ``path`` and calls ``handler(verb, sandbox_id, request)`` for each
    request from a caller that sent ``token``."""

    def __init__(self, path: Path, handler: Callable[[str, str, Any], Any]) -> None:
        self.path = path
        self.token = secrets.token_bytes(32)
        self._handler = handler
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._closed = False
        path.unlink(missing_ok=True)  # a previous incarnation's socket
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(str(path))
            # owner only; not through the umask, which is the whole process's (the token
            # is the guard: a moment with wider bits lets nobody in)
            os.chmod(path, 0o600)
            self._sock.listen(MAX_CONNECTIONS)
            threading.Thread(target=self._accept, name="ray-sandbox-channel",
                             daemon=True).start()
        except BaseException:
            self._sock.close()
            path.unlink(missing_ok=True)
            raise

    @classmethod
    def start(cls, path: Path, handler: Callable[[str, str, Any], Any]
              ) -> ChannelServer | None:
        """The server, or None where a Unix socket cannot be made (a home path too long)."""
        if len(os.fsencode(path)) > _SUN_PATH_MAX:
            log.info("no node-local channel: %s is too long for a Unix socket", path)
            return None
        try:
            return cls(path, handler)
        except OSError as exc:
            log.warning("no node-local channel at %s: %s", path, exc)
            return None

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self.path.unlink(missing_ok=True)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                self._refuse(conn)  # full: that caller uses Ray for now
                continue
            try:
                threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                 name="ray-sandbox-channel-conn").start()
            except RuntimeError:  # no thread to be had: refused like a full channel
                self._slots.release()
                self._refuse(conn)

    @staticmethod
    def _refuse(conn: socket.socket) -> None:
        try:
            conn.setblocking(False)
            conn.send(_FULL)
        except OSError:
            pass
        conn.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(FRAME_S)
            if not hmac.compare_digest(_recv(conn, 64, None), self.token):
                return
            conn.sendall(_ACK)
            while not self._closed:
                conn.settimeout(IDLE_S)
                request = _recv(conn, MAX_REQUEST + (1 << 16), FRAME_S)
                _send(conn, self._answer(request))
        except (OSError, ConnectionError, struct.error):
            pass  # the caller left, idled out or sent garbage: only its connection ends
        finally:
            conn.close()
            self._slots.release()

    def _answer(self, request: bytes) -> bytes:
        try:
            verb, sandbox_id, req = pickle.loads(request)  # noqa: S301 - token-holders only
            result: tuple[bool, Any] = (True, self._handler(verb, sandbox_id, req))
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the caller
            result = (False, exc)
        try:
            return pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001 - an exception that does not pickle
            exc = result[1]
            return pickle.dumps((False, SandboxError(f"{type(exc).__name__}: {exc}")))


# --- the caller's side -------------------------------------------------------------------------


class _Client:
    """Pooled connections of one calling process to one host."""

    def __init__(self, path: str, token: bytes) -> None:
        self._path = path
        self._token = token
        self._lock = threading.Lock()
        self._idle: list[tuple[socket.socket, float]] = []

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock, _ in idle:
            sock.close()

    def _connect(self) -> socket.socket | NotSent:
        with self._lock:
            while self._idle:
                sock, since = self._idle.pop()
                # unusable if old (the host may be closing it) or closed by a host that
                # restarted: telling that apart from a failed call comes too late
                if time.monotonic() - since < _CLIENT_IDLE_S and _open(sock):
                    return sock
                sock.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(FRAME_S)
            sock.connect(self._path)
        except OSError:
            sock.close()
            return NotSent.STALE  # no host listening
        try:
            _send(sock, self._token)
        except OSError:  # a full host answers and closes before reading the token: the
            pass  # answer is still there to read (EPIPE here is not a stranger's refusal)
        try:
            answer = _recv_exact(sock, 1)
        except (OSError, ConnectionError):
            sock.close()
            return NotSent.STALE  # it closed on our token (a restarted host)
        if answer != _ACK:
            sock.close()
            return NotSent.BUSY
        return sock

    def call(self, op: str, sandbox_id: str, req: Any) -> Any:
        """The host's answer to the verb ``op`` with its request, or a :class:`NotSent` when
        the channel did not take the call and nothing was sent: the caller uses the actor
        call."""
        request = pickle.dumps((op, sandbox_id, req), protocol=pickle.HIGHEST_PROTOCOL)
        if len(request) > MAX_REQUEST:
            return NotSent.BUSY
        sock = self._connect()
        if isinstance(sock, NotSent):
            return sock
        try:
            sock.settimeout(None)  # the host bounds the call (exec timeouts); its death is EOF
            _send(sock, request)
            ok, value = pickle.loads(_recv(sock, 1 << 62, None))  # noqa: S301 - our host
        except BaseException as exc:
            sock.close()
            if isinstance(exc, OSError | ConnectionError | struct.error):
                raise SandboxError(f"the node's sandbox host went away during {op} ({exc}); "
                                   "the command may have run", sandbox_id=sandbox_id) from None
            raise  # KeyboardInterrupt and the like: the connection is dropped, not reused
        with self._lock:
            if len(self._idle) < _POOL:
                self._idle.append((sock, time.monotonic()))
                sock = None
        if sock is not None:
            sock.close()
        if not ok:
            raise value
        return value


_clients_lock = threading.Lock()
# host actor id -> (its node, its channel); a host without a channel: (node, None)
_clients: dict[str, tuple[str | None, _Client | None]] = {}


def _key(host: Any) -> str:
    return host._actor_id.hex()


def client_for(host: Any) -> _Client | None:
    """The channel to ``host`` when it runs on this process's node, else None. The first
    call per host in a process asks the host (one actor call); handles found by ``list`` or
    ``get`` need not know their node."""
    if not ray.is_initialized():
        return None
    key = _key(host)
    with _clients_lock:
        known = _clients.get(key)
    if known is None:
        try:
            info = ray.get(host.channel.remote(), timeout=FRAME_S)
        except Exception:  # noqa: BLE001 - no channel from this host now: Ray serves the call
            return None
        known = (info[0], _Client(info[1], info[2]) if info[1] else None)
        with _clients_lock:
            _clients[key] = known
    node, client = known
    return client if node == ray.get_runtime_context().get_node_id() else None


def forget(host: Any) -> None:
    """Drop the cached channel and close its pooled connections (each holds one of the
    host's slots); the host is asked again next time."""
    with _clients_lock:
        client = _clients.pop(_key(host), None)
    if client is not None and client[1] is not None:
        client[1].close()


__all__ = ["FRAME_S", "IDLE_S", "MAX_CONNECTIONS", "MAX_REQUEST", "ChannelServer", "NotSent",
           "client_for", "forget"]
