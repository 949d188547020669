"""Modal's readiness probe (``modal.Probe``): what ``Sandbox.wait_until_ready`` waits for.

``with_exec(*argv)``: the command exits 0 in the sandbox. ``with_tcp(port)``: a TCP socket
listens on ``port`` in the sandbox, read from its ``/proc/net/tcp`` and ``tcp6`` (a listening
socket accepts connections; no tool in the image is needed). Each is tried every
``interval_ms`` until it passes or the wait's ``timeout`` runs out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..runtime.errors import ModalInvalidError

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column


@dataclass(frozen=True)
class Probe:
    """A readiness probe: exactly one of ``tcp_port`` and ``exec_argv``."""

    tcp_port: int | None = None
    exec_argv: tuple[str, ...] | None = None
    interval_ms: int = 100

    def __post_init__(self) -> None:
        if (self.tcp_port is None) == (self.exec_argv is None):
            raise ModalInvalidError("a Probe is made with Probe.with_tcp(port) or "
                                    "Probe.with_exec(*argv)")

    @classmethod
    def with_tcp(cls, port: int, *, interval_ms: int = 100) -> Probe:
        if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
            raise ModalInvalidError(f"Probe.with_tcp: port must be an int in [1, 65535], "
                                    f"not {port!r}")
        return cls(tcp_port=port, interval_ms=_interval("with_tcp", interval_ms))

    @classmethod
    def with_exec(cls, *argv: str, interval_ms: int = 100) -> Probe:
        if not argv or not all(isinstance(a, str) for a in argv):
            raise ModalInvalidError("Probe.with_exec needs a command: one or more strings")
        return cls(exec_argv=tuple(argv), interval_ms=_interval("with_exec", interval_ms))

    def _label(self) -> str:
        """As kept in the sandbox's labels, so every handle of it knows its probe."""
        return json.dumps({"tcp_port": self.tcp_port, "exec_argv": self.exec_argv,
                           "interval_ms": self.interval_ms})

    @classmethod
    def _from_label(cls, text: str) -> Probe:
        d = json.loads(text)
        argv = d.get("exec_argv")
        return cls(tcp_port=d.get("tcp_port"), exec_argv=tuple(argv) if argv else None,
                   interval_ms=int(d.get("interval_ms", 100)))


def _interval(what: str, interval_ms: int) -> int:
    if not isinstance(interval_ms, int) or isinstance(interval_ms, bool) or interval_ms <= 0:
        raise ModalInvalidError(f"Probe.{what}: interval_ms must be a positive int, "
                                f"not {interval_ms!r}")
    return interval_ms


def listening(proc_net_tcp: str, port: int) -> bool:
    """Whether ``/proc/net/tcp`` (or ``tcp6``) text shows a socket listening on ``port``."""
    for line in proc_net_tcp.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 3 and fields[3] == _LISTEN:
            try:
                if int(fields[1].rsplit(":", 1)[1], 16) == port:
                    return True
            except (IndexError, ValueError):
                continue
    return False
