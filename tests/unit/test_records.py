"""The node's records of its sandboxes and the states derived from them (no sandbox runs)."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from ray_sandbox.runtime.errors import SandboxNotFoundError
from ray_sandbox.runtime.launch import all_or_nothing
from ray_sandbox.runtime.records import Records, SandboxRecord, owner_fields
from ray_sandbox.runtime.results import SandboxState
from ray_sandbox.runtime.status import derive


def _rec(sid: str, **kw) -> SandboxRecord:
    return SandboxRecord(sandbox_id=sid, config={"labels": kw.pop("labels", {})}, image="i",
                         image_digest="d", rootfs="/r", image_rootfs="/i",
                         created_at=time.time(), **kw)


def _write(records: Records, rec: SandboxRecord) -> None:
    records.sdir(rec.sandbox_id).path.mkdir()
    records.write(rec)


def test_a_deleted_id_says_why(tmp_path):
    records = Records(tmp_path)
    rec = _rec("a" * 32)
    _write(records, rec)
    records.adopt(rec)
    assert records.get("a" * 32) == rec and records.owned() == ["a" * 32]
    records.forget("a" * 32, "Deleted")
    (tmp_path / ("a" * 32) / "record.json").unlink()
    with pytest.raises(SandboxNotFoundError, match=r"deleted \(Deleted\)"):
        records.get("a" * 32)
    with pytest.raises(SandboxNotFoundError, match="not a sandbox id"):
        records.get("../etc")


def test_the_dead_are_told_from_the_living(tmp_path):
    records = Records(tmp_path)
    dead_owner = subprocess.Popen(["true"])
    dead_owner.wait()
    alive, orphan, expired, detached = "1" * 32, "2" * 32, "3" * 32, "4" * 32
    _write(records, _rec(alive, **owner_fields(False)))
    _write(records, _rec(orphan, owner_pid=dead_owner.pid, owner_start=1))
    _write(records, _rec(expired, ttl_deadline=time.time() - 1, **owner_fields(False)))
    _write(records, _rec(detached, **owner_fields(True)))
    (tmp_path / ("5" * 32)).mkdir()  # being created by another process: no record yet
    live, dead = records.live_and_dead()
    assert live == {alive, detached, "5" * 32}
    assert sorted(dead) == [(orphan, "OwnerDied"), (expired, "TTLExpired")]


def test_labels_select(tmp_path):
    records = Records(tmp_path)
    _write(records, _rec("1" * 32, labels={"job": "a"}))
    _write(records, _rec("2" * 32, labels={"job": "b"}))
    assert records.select(records.on_disk(), {"job": "b"}) == ["2" * 32]


@pytest.mark.parametrize(("runsc", "phase", "state", "reason"), [
    (None, "creating", SandboxState.PENDING, None),
    (None, "created", SandboxState.ERROR, "ContainerMissing"),
    ("created", "created", SandboxState.PENDING, None),
    ("running", "created", SandboxState.RUNNING, None),
    ("paused", "paused", SandboxState.PAUSED, None),
    ("stopped", "created", SandboxState.ERROR, "SandboxExited"),
])
def test_state_comes_from_runsc(runsc, phase, state, reason):
    assert derive(_rec("f" * 32, phase=phase), runsc) == (state, reason)


def test_all_or_nothing_undoes_the_ones_made():
    undone: list[str] = []

    def start(i: str) -> None:
        if i == "b":
            raise ValueError("b failed")

    with pytest.raises(ValueError, match="b failed"):
        all_or_nothing(["a", "b", "c"], start, undone.append, parallel=2)
    assert sorted(undone) == ["a", "c"]
    all_or_nothing(["a"], lambda i: None, undone.append, parallel=8)
    assert sorted(undone) == ["a", "c"]


def test_owner_fields_name_this_process():
    assert owner_fields(False)["owner_pid"] == os.getpid()
    assert owner_fields(True) == {"owner_pid": None, "owner_start": None}
