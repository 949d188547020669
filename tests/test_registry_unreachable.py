"""A registry this node cannot reach: the typed error says why in skopeo's words (not its log
line) and points at the images that need no registry, both from the store and from the CLI.
Real skopeo against a real port that refuses connections."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ray_sandbox.runtime.errors import RegistryUnreachableError
from ray_sandbox.runtime.images import ImageStore
from tests.fx_images import assert_store_clean

CLI = str(Path(sys.executable).parent / "ray-sandbox")
HINTS = ("ray-sandbox/python", "ray-sandbox image build")


@pytest.fixture
def refused() -> Iterator[str]:
    """A reference on a loopback port that is bound and never listens: connection refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{s.getsockname()[1]}/lab/x:v1"


def test_the_error_says_why_and_what_to_use_instead(temp_store: ImageStore, refused: str):
    with pytest.raises(RegistryUnreachableError) as info:
        temp_store.get(refused)
    assert_store_clean(temp_store)
    message = info.value.message  # what the service, Ray and the Modal facade show
    assert "connect: connection refused" in message
    for hint in HINTS:
        assert hint in message
    assert "level=fatal" not in message and 'msg="' not in message  # skopeo's words only
    assert "connection refused" in info.value.stderr  # the whole stderr is kept


def test_the_cli_prints_the_reason_and_the_hint(temp_store: ImageStore, refused: str):
    env = {**os.environ, "RAY_SANDBOX_IMAGES": str(temp_store.root), "COLUMNS": "400"}
    out = subprocess.run([CLI, "image", "pull", refused], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2
    assert "connection refused" in out.stderr
    for hint in HINTS:
        assert hint in out.stderr
