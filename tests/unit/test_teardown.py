"""The two-phase delete's bookkeeping, without a sandbox: tombstones (what every process sees
of a sandbox being torn down, and who finishes it) and the bounded background worker."""

from __future__ import annotations

import os
import subprocess
import threading

import pytest

from ray_sandbox.runtime.errors import SandboxNotFoundError
from ray_sandbox.runtime.launch import Teardowns
from ray_sandbox.runtime.records import Records, Tombstone, owner_fields
from tests.unit.test_records import _rec, _write

ALIVE, GONE, TORN, STALE = "1" * 32, "2" * 32, "3" * 32, "4" * 32


def test_a_tombstone_hides_the_record_from_every_process(tmp_path):
    mine, other = Records(tmp_path), Records(tmp_path)  # two runtimes of one home
    rec = _rec(ALIVE, **owner_fields(True))
    _write(mine, rec)
    mine.adopt(rec)
    mine.forget(ALIVE, "Deleted")
    mine.bury(ALIVE, "Deleted")
    for records in (mine, other):
        assert records.load(ALIVE) is None and records.on_disk() == []
        assert records.tombstone(ALIVE) == "Deleted"
        with pytest.raises(SandboxNotFoundError, match=r"deleted \(Deleted\)"):
            records.get(ALIVE)
    assert other.read(ALIVE) == rec  # what the teardown still needs (the image pin)
    mine.unbury(ALIVE)
    assert other.tombstone(ALIVE) is None


def test_a_teardown_whose_process_died_goes_to_gc(tmp_path):
    records = Records(tmp_path)
    dead = subprocess.Popen(["true"])
    dead.wait()
    for sid in (ALIVE, GONE, TORN, STALE):
        # detached records: without the tombstone gc would keep them all
        _write(records, _rec(sid, **owner_fields(True)))
    records.bury(ALIVE, "Deleted")  # by this process, which is finishing it
    stone = Tombstone(reason="TTLExpired", owner_pid=dead.pid, owner_start=1)
    (tmp_path / f"{GONE}.tombstone").write_text(stone.model_dump_json())
    (tmp_path / f"{TORN}.tombstone").write_text('{"reas')  # its writer is writing, or died
    (tmp_path / f"{STALE}.tombstone").write_text("")
    old = os.stat(tmp_path).st_mtime - 120
    os.utime(tmp_path / f"{STALE}.tombstone", (old, old))
    live, dead_ids = records.live_and_dead()
    assert live == {ALIVE, TORN}
    assert sorted(dead_ids) == [(GONE, "TTLExpired"), (STALE, "Deleted")]
    # a tombstone whose dir is already gone (a teardown that died at its last step) counts too
    records.sdir(GONE).record.unlink()
    records.sdir(GONE).path.rmdir()
    assert (GONE, "TTLExpired") in records.live_and_dead()[1]


class Finisher:
    """A teardown that blocks until released, recording what ran where."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.ran: list[tuple[str, str]] = []
        self.started = threading.Semaphore(0)

    def __call__(self, sandbox_id: str) -> None:
        self.started.release()
        self.release.wait(30)
        self.ran.append((sandbox_id, threading.current_thread().name))
        if sandbox_id == "bad":
            raise RuntimeError("a failed teardown")


def _workers() -> int:
    return sum(t.name == "ray-sandbox-teardown" for t in threading.enumerate())


def test_teardowns_are_bounded_and_overflow_runs_in_the_caller():
    fin = Finisher()
    td = Teardowns(fin, workers=2, limit=3)
    td.submit("bad")
    td.submit("a")
    assert fin.started.acquire(timeout=30) and fin.started.acquire(timeout=30)
    for sid in ("b", "c", "d", "a", "b"):  # two running, three queued (the limit); no twice
        td.submit(sid)
    assert _workers() == 2
    caller = threading.Thread(target=td.submit, args=("e",), name="caller")
    caller.start()  # the queue is full: "e" is torn down by its caller
    assert fin.started.acquire(timeout=30)
    fin.release.set()
    caller.join(30)
    assert td.drain(30)
    assert sorted(sid for sid, _ in fin.ran) == ["a", "b", "bad", "c", "d", "e"]
    assert ("e", "caller") in fin.ran
    assert {t for _, t in fin.ran} == {"ray-sandbox-teardown", "caller"}
    for t in threading.enumerate():  # a failed teardown ended none; idle workers end
        if t.name == "ray-sandbox-teardown":
            t.join(30)
    assert _workers() == 0


def test_settle_finishes_a_pending_teardown_before_the_id_is_used_again():
    fin = Finisher()
    td = Teardowns(fin, workers=1, limit=8)
    td.submit("running")
    td.submit("queued")
    assert fin.started.acquire(timeout=30)
    threading.Timer(0.2, fin.release.set).start()
    td.settle("queued", 30)  # taken off the queue and run here
    assert ("queued", threading.current_thread().name) in fin.ran
    td.settle("running", 30)  # waited for
    assert {sid for sid, _ in fin.ran} == {"running", "queued"}
    td.settle("unknown", 30)  # nothing pending: returns at once
    assert td.drain(30)
