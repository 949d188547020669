"""Fixtures for Modal's gRPC API (docs/modal.md): the real ``modal`` client from PyPI in a venv
of its own (no Ray in it, made once per machine and client range, kept in a cache directory),
and running a script there against the module's service with only Modal's three environment
variables set."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.fx_service import TOKENS, Service

MODAL_SPEC = "modal>=1.6,<1.7"  # the client range the [modal] extra pins
CACHE = Path(os.environ.get("RAY_SANDBOX_TEST_CACHE", "/var/tmp/ray_sandbox_test_cache"))


def _python() -> str:
    """A Python for the client's venv: this one (the client supports 3.10 and later)."""
    return sys.executable


@pytest.fixture(scope="session")
def modal_python() -> Path:
    """The Python of a venv holding the real ``modal`` client and not Ray, made once (a
    lock file guards concurrent test runs) and reused while its marker names the spec."""
    import fcntl

    venv = CACHE / "modal-client-1.6"
    marker = venv / ".installed"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "modal-client.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not marker.is_file() or marker.read_text() != MODAL_SPEC:
            subprocess.run([_python(), "-m", "venv", "--clear", str(venv)], check=True,
                           timeout=300)
            subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "-q",
                            MODAL_SPEC, "requests"], check=True, timeout=900)
            marker.write_text(MODAL_SPEC)
    python = venv / "bin/python"
    no_ray = subprocess.run([str(python), "-c", "import ray"], capture_output=True,
                            timeout=60)
    assert no_ray.returncode != 0, "the Modal client's venv must not have Ray"
    return python


@dataclass(frozen=True)
class ModalService:
    service: Service
    url: str  # MODAL_SERVER_URL
    python: Path

    def env(self, tenant: str = "alice", secret: str | None = None,
            home: Path | None = None) -> dict[str, str]:
        """Only Modal's three variables (and a PATH, and a HOME with no ~/.modal.toml)."""
        return {"PATH": "/usr/bin:/bin", "HOME": str(home or "/nonexistent"),
                "MODAL_SERVER_URL": self.url, "MODAL_TOKEN_ID": tenant,
                "MODAL_TOKEN_SECRET": TOKENS.get(tenant, "") if secret is None else secret}

    def run(self, code: str, tmp: Path, *, tenant: str = "alice", secret: str | None = None,
            timeout: float = 300, args: tuple[str, ...] = (),
            extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run ``code`` (a script as a user would write it) with the client's Python;
        ``extra_env`` adds a client setting (``MODAL_SANDBOX_V2=0``) where a test says so."""
        script = tmp / f"script_{time.monotonic_ns()}.py"
        script.write_text(textwrap.dedent(code))
        home = tmp / "home"
        home.mkdir(exist_ok=True)
        return subprocess.run([str(self.python), str(script), *args], cwd=tmp,
                              env={**self.env(tenant, secret, home), **(extra_env or {})},
                              capture_output=True,
                              text=True, timeout=timeout)

    def ok(self, code: str, tmp: Path, **kw) -> str:
        res = self.run(code, tmp, **kw)
        assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout}\n{res.stderr}"
        return res.stdout


def wait_port(port: int, limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2):
                return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on {port} after {limit} s"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def modal_service(request, service: Service, modal_python: Path,
                  image_store) -> Iterator[ModalService]:
    """The module's service (tests/fx_service.py) with its Modal port up; the images its
    Modal clients had built are removed from the node's store at the end."""
    from tests.test_docker_harbor import builds_now, forget_new_builds

    port = request.module.SERVICE_SETTINGS["modal_port"]
    before = builds_now(image_store)
    wait_port(port)
    try:
        yield ModalService(service, f"http://127.0.0.1:{port}", modal_python)
    finally:
        forget_new_builds(image_store, before)
