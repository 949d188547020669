"""Connections: a client made for a sandbox that a delete removed meanwhile is not kept."""

from __future__ import annotations

from pathlib import Path

from ray_sandbox.runtime.connections import Connections


def test_a_client_made_after_the_delete_closed_the_old_one_is_dropped(tmp_path: Path):
    conns = Connections(io_timeout=1.0)
    # the delete ran between the caller's record check and get(): the record is gone
    assert conns.get("a" * 32, tmp_path / "sock", exists=lambda: False) is None
    assert conns._clients == {}


def test_a_live_sandbox_keeps_one_client(tmp_path: Path):
    conns = Connections(io_timeout=1.0)
    first = conns.get("b" * 32, tmp_path / "sock", exists=lambda: True)
    assert first is not None
    assert conns.get("b" * 32, tmp_path / "sock", exists=lambda: False) is first
    conns.close("b" * 32)
    assert conns._clients == {}
