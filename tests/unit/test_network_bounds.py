"""Pure pieces of the network layer's host-side bounds (issue 15): the DNS helper's TCP read
deadline and lease ownership in the node-wide allocation table."""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path

import pytest

from ray_sandbox.runtime.network import alloc, dns

QUERY = bytes.fromhex("abcd0100000100000000000003777777076578616d706c6503636f6d0000010001")


def test_a_framed_read_gets_no_time_past_its_deadline() -> None:
    """A peer trickling bytes gets no more time than a silent one: the deadline covers the
    whole message, not each read."""
    a, b = socket.socketpair()
    with a, b:
        b.sendall(struct.pack("!H", len(QUERY)) + QUERY)
        with pytest.raises(TimeoutError):
            dns._read_framed(a, time.monotonic() - 1)  # data waiting, deadline passed
        assert dns._read_framed(a, time.monotonic() + 10) == QUERY
        b.sendall(struct.pack("!H", len(QUERY)) + QUERY[:5])  # then silence
        with pytest.raises(TimeoutError):
            dns._read_framed(a, time.monotonic() + 0.2)


def test_thread_bound_covers_every_helper_thread() -> None:
    assert dns.MAX_THREADS == 3 + dns.UDP_WORKERS + dns.TCP_MAX_CONNS


def test_leases_are_judged_by_their_owner_only(tmp_path: Path) -> None:
    mine, theirs = tmp_path / "a" / "sandboxes", tmp_path / "b" / "sandboxes"
    a = alloc.Alloc(
        subnets={"10.213.0.0/30": alloc.Lease(sandbox_id="1" * 32, owner=alloc.owner(mine))},
        ports={":8080": alloc.Lease(sandbox_id="2" * 32, owner=alloc.owner(theirs))},
        state_dirs={"1" * 32: str(mine / ("1" * 32)), "3" * 32: str(theirs / ("3" * 32))},
    )
    assert a.sandbox_ids(alloc.owner(mine)) == {"1" * 32}
    assert a.sandbox_ids(alloc.owner(theirs)) == {"2" * 32, "3" * 32}
    assert a.sandbox_ids() == {"1" * 32, "2" * 32, "3" * 32}


def test_slirp4netns_not_ready_says_whether_it_died_or_timed_out(tmp_path):
    """A public sandbox on a freshly started (busy) node failed 1 in 3 with "slirp4netns
    did not come up" after 5 s; the wait is longer now and its error says which it was."""
    import os
    import subprocess

    import pytest

    from ray_sandbox.runtime.errors import NetworkError
    from ray_sandbox.runtime.network import slirp4netns

    for argv, why in ((["sleep", "5"], "not ready within 0.2 s (timeout)"),
                      (["sh", "-c", "exit 3"], "exited with code 3")):
        r, w = os.pipe()
        proc = subprocess.Popen(argv)
        os.close(w)
        if why.startswith("exited"):
            proc.wait()
        with pytest.raises(NetworkError, match=why.replace("(", r"\(").replace(")", r"\)")):
            slirp4netns.wait_ready(slirp4netns.Starting(proc, r), tmp_path / "log", 0.2)
        proc.kill()
        proc.wait()
