"""The in-sandbox agent: a static C binary (init + executor) and its host-side client.

``rsb-agent`` is bind-mounted read-only into every sandbox and runs as its PID 1
(``rsb-agent init <socket>``); the host talks to it over that unix socket with
:class:`AgentClient`. See docs/agent.md for the protocol and process model.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..errors import ToolMissingError
from .client import DEFAULT_MAX_OUTPUT, AgentClient, AgentProcess
from .protocol import PROTOCOL_VERSION
from .pyrepl import PythonContext, PythonResult

SOURCE_DIR = Path(__file__).resolve().parent
# Where the runtime mounts things inside every sandbox.
SANDBOX_BIN_DIR = "/.rsb/bin"
SANDBOX_RUN_DIR = "/.rsb/run"
SANDBOX_SOCKET = f"{SANDBOX_RUN_DIR}/agent.sock"
INIT_ARGS = [f"{SANDBOX_BIN_DIR}/rsb-agent", "init", SANDBOX_SOCKET]


def binary_path() -> Path:
    """The built agent; raises :class:`ToolMissingError` if ``make`` has not run."""
    path = SOURCE_DIR / "rsb-agent"
    if not path.is_file():
        raise ToolMissingError(f"{path} is not built (run: make -C {SOURCE_DIR})")
    return path


def expected_version() -> str:
    """The version a current agent reports from ``ping``: the protocol version plus a hash of
    the C sources, computed exactly like the Makefile does."""
    sources = sorted(p for p in SOURCE_DIR.iterdir() if p.suffix in (".c", ".h"))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:12]
    return f"rsb-agent/{PROTOCOL_VERSION}+{digest}"


__all__ = [
    "DEFAULT_MAX_OUTPUT",
    "INIT_ARGS",
    "SANDBOX_BIN_DIR",
    "SANDBOX_RUN_DIR",
    "SANDBOX_SOCKET",
    "AgentClient",
    "AgentProcess",
    "PythonContext",
    "PythonResult",
    "binary_path",
    "expected_version",
]
