"""When a pin is stale (ray_sandbox/runtime/images/pins.py), decided from what the pin file
says and whether its home still has the sandbox; and what a pin file is read as."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ray_sandbox.runtime import procfs
from ray_sandbox.runtime.errors import ConfigError
from ray_sandbox.runtime.images.pins import GRACE_S, Pin, home_key, pin, read, stale
from ray_sandbox.runtime.images.storedir import StoreDir

SID = "0123456789abcdef0123456789abcdef"
DIGEST = "sha256:" + "ab" * 32
NOW = 1_000_000.0


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(proc.stdout)


def _pin(home: Path | None, *, age: float, writer: str = "alive",
         key: str | None = None) -> Pin:
    me = procfs.stat(os.getpid())
    pid, start = {"alive": (os.getpid(), me.start if me else None),
                  "dead": (_dead_pid(), 1), "unknown": (None, None)}[writer]
    key = key or home_key(home or Path("/nowhere"))
    return Pin(DIGEST, f"{key}:{SID}", NOW - age, key, SID, home and home.resolve(), pid,
               start)


def _gone(home: Path, sandbox_id: str) -> bool:
    return False


def _there(home: Path, sandbox_id: str) -> bool:
    return True


@pytest.mark.parametrize(("writer", "age", "expected"), [
    ("alive", 1.0, False),  # a create in flight
    ("alive", GRACE_S + 1, True),
    ("dead", 1.0, True),  # nothing of a dead writer is in flight
    ("unknown", 1.0, False),
    ("unknown", GRACE_S + 1, True),
])
def test_a_pin_whose_home_lacks_the_sandbox(tmp_path, writer, age, expected):
    p = _pin(tmp_path, age=age, writer=writer)
    assert stale(p, _gone, now=NOW) is expected
    assert stale(p, _there, now=NOW) is False  # the sandbox exists: never


def test_a_pin_that_names_no_home(tmp_path):
    old = _pin(None, age=GRACE_S + 1, writer="unknown", key=home_key(tmp_path))
    assert stale(old, _gone, now=NOW) is False  # no home to look in
    assert stale(old, _gone, own_home=tmp_path, now=NOW) is True  # its own home's key
    assert stale(old, _there, own_home=tmp_path, now=NOW) is False
    assert stale(old, _gone, own_home=tmp_path / "other", now=NOW) is False
    assert stale(old, _there, unknown=True, now=NOW) is True  # told so: taken when old
    young = _pin(None, age=1.0, writer="unknown", key="0" * 12)
    assert stale(young, _gone, unknown=True, now=NOW) is False


def test_a_pin_of_another_owner_is_never_judged():
    assert stale(Pin(DIGEST, "mine", 0.0), _gone, unknown=True, now=NOW) is False


def test_pin_files_name_their_home_and_writer(tmp_path):
    store = StoreDir(tmp_path / "store")
    store.make_dirs()
    (store.image(DIGEST) / "pins").mkdir(parents=True)
    home = tmp_path / "home"
    owner = f"{home_key(home)}:{SID}"
    pin(store, DIGEST, owner, home)
    p = read(store, DIGEST, owner)
    assert (p.key, p.sandbox_id, p.home, p.writer_pid) == (
        home_key(home), SID, home.resolve(), os.getpid())
    with pytest.raises(ConfigError):
        pin(store, DIGEST, f"{'0' * 12}:{SID}", home)  # not that home's key
    # a pin whose content names another home than its key says names none
    (store.image(DIGEST) / "pins" / owner).write_text(json.dumps({"home": "/elsewhere"}))
    assert read(store, DIGEST, owner).home is None
    (store.image(DIGEST) / "pins" / owner).write_text("{torn")
    assert read(store, DIGEST, owner).home is None
    os.symlink("/etc/passwd", store.image(DIGEST) / "pins" / f"{'1' * 12}:{SID}")
    assert read(store, DIGEST, f"{'1' * 12}:{SID}").key is None  # never judged
