"""Image pins on a store several homes share: a pin names its home, and any home's gc removes
the pins of sandboxes that no home has any more (the home deleted without its runtime
closing), never a pin whose sandbox may still live (in any state, or still being created)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from ray_sandbox.runtime import ImageStore, SandboxRuntime, _mount, reaper
from ray_sandbox.runtime.errors import ImageInUseError, SandboxCreationError
from ray_sandbox.runtime.images import pins
from tests.fx_images import busybox_variant, scratch_dir
from tests.fx_runtime import leftovers, leftovers_after_teardown

CLI = str(Path(sys.executable).parent / "ray-sandbox")


def test_a_restore_under_a_used_id_keeps_its_pin(runtime):
    """A copy restored under the id of a sandbox whose teardown is pending (suspend and
    resume do this) is pinned once that old teardown, which unpins the same owner, is done."""
    sid = runtime.create(image="ray-sandbox/busybox", memory="64Mi")
    digest = runtime.record(sid).image_digest
    owner = runtime._launcher._pin_owner(sid)
    snap = runtime.snapshot(sid)
    try:
        # deleted, its teardown not run yet (what a delete leaves until its background
        # teardown runs, or a process killed between the two phases leaves to gc)
        runtime._launcher._stop(sid, "Deleted")
        assert runtime.restore(snap, sandbox_ids=[sid]) == [sid]
        assert owner in runtime.images.pins(digest)
    finally:
        runtime.delete(sid)
        runtime.snapshots.delete(snap)


def test_a_restore_that_fails_before_its_record_leaves_no_pin(runtime, default_image):
    """The copy is pinned before its record is written; a failure in between (here the
    snapshot names another image digest than the node has) is torn down without a record,
    and its pin goes with it, not only at the home's next gc."""
    src = runtime.create(image="ray-sandbox/busybox", memory="64Mi")
    snap = runtime.snapshot(src)
    runtime.delete(src)
    _, sd = runtime.snapshots.open(snap)
    sd.write(snap.model_copy(update={"image_digest": default_image.digest}))
    sid = uuid.uuid4().hex
    try:
        with pytest.raises(SandboxCreationError, match="the snapshot needs"):
            runtime.restore(snap.snapshot_id, sandbox_ids=[sid])
        assert runtime._launcher._pin_owner(sid) not in {
            p.owner for p in runtime.images.pin_list()}
    finally:
        runtime.snapshots.delete(snap.snapshot_id)
    assert leftovers_after_teardown(runtime.home, {src, sid}) == {}


PINNER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from ray_sandbox.runtime import ImageStore, SandboxRuntime
    rt = SandboxRuntime(Path(sys.argv[1]), images=ImageStore(sys.argv[2]), reap=False)
    rt._launcher._pinned(sys.argv[3], sys.argv[4])  # what a create does first
    rt.records.sdir(sys.argv[4]).create()  # and next; then this process ends
    """
)


def _pin_as_a_create_does(rt: SandboxRuntime, ref: str) -> str:
    """Pin ``ref`` for a new sandbox id and make its directory, the first two steps of a
    create, in this process; returns the id."""
    sid = uuid.uuid4().hex
    rt._launcher._pinned(ref, sid)
    rt.records.sdir(sid).create()
    return sid


def _delete_home(home: Path) -> None:
    """Remove a home as the end of its pod does: its mounts go, then its files."""
    for point in _mount.mounts_under(home):
        _mount.unmount(point)
    shutil.rmtree(home)


def _pin_file(store: ImageStore, p: pins.Pin) -> Path:
    return store.root / "sha256" / p.digest.removeprefix("sha256:") / "pins" / p.owner


def _age(store: ImageStore, p: pins.Pin) -> None:
    """Date the pin back past the grace period, as a pin of a sandbox long gone is."""
    old = time.time() - pins.GRACE_S - 1
    os.utime(_pin_file(store, p), (old, old))


def _pins_of(store: ImageStore, home: Path) -> list[pins.Pin]:
    return [p for p in store.pin_list() if p.key == pins.home_key(home)]


def test_another_homes_gc_removes_the_pins_of_a_deleted_home(tmp_path, temp_store):
    with scratch_dir("rsb-pins-") as work:
        busybox_variant(work / "oci", "gone", marker="pins of a deleted home")
        ref = f"oci:{work / 'oci'}:gone"
        digest = temp_store.get(ref).digest
        # home a: a runtime in this process (alive, never closed) pinned the image for a
        # sandbox; home c: a runtime in a process that has ended did the same
        home_a, home_b, home_c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
        rt_a = SandboxRuntime(home_a, images=temp_store)
        sid_a = _pin_as_a_create_does(rt_a, ref)
        sid_c = uuid.uuid4().hex
        subprocess.run([sys.executable, "-c", PINNER, str(home_c), str(temp_store.root), ref,
                        sid_c], check=True, timeout=120)
        (pin_a,), (pin_c,) = _pins_of(temp_store, home_a), _pins_of(temp_store, home_c)
        assert (pin_a.home, pin_a.sandbox_id, pin_a.writer_pid) == (
            home_a.resolve(), sid_a, os.getpid())
        assert (pin_c.home, pin_c.sandbox_id) == (home_c.resolve(), sid_c)
        # both homes go away (a pod restart with an emptyDir home, an operator's rm), their
        # runtimes never closed
        _delete_home(home_a)
        _delete_home(home_c)
        with pytest.raises(ImageInUseError):
            temp_store.remove(ref)

        rt_b = SandboxRuntime(home_b, images=temp_store)  # its gc runs at start
        # c's pin goes at once: its writer is dead, nothing of it is in flight. a's is
        # kept while it is young and its writer runs (a create in flight looks the same)
        assert {p.owner for p in temp_store.pin_list()} == {pin_a.owner}
        assert reaper.stale_pins(temp_store, home_b) == []
        _age(temp_store, pin_a)
        assert [p.owner for p in reaper.stale_pins(temp_store, home_b)] == [pin_a.owner]
        assert rt_b.gc() == []
        assert temp_store.pin_list() == []
        assert temp_store.remove(ref) == [digest]
        assert not (temp_store.root / "sha256" / digest.removeprefix("sha256:")).exists()
        rt_b.close()
    assert leftovers(home_b, store=temp_store.root) == {}


OWNER = textwrap.dedent(
    """
    import sys, time
    from ray_sandbox.runtime import SandboxRuntime
    rt = SandboxRuntime(sys.argv[1])
    print(rt.create(image="ray-sandbox/busybox", memory="64Mi", cpu=0.2), flush=True)
    time.sleep(600)
    """
)


def test_a_live_homes_pins_are_never_touched(runtime, image_store, busybox_image, tmp_path):
    """Whatever the state of a home's sandbox (running, created by a process that died, being
    created, being torn down), another home's gc leaves its pin: only that home's own gc
    judges its sandboxes."""
    live = runtime.create(image="ray-sandbox/busybox", memory="64Mi", cpu=0.2)
    creating = uuid.uuid4().hex
    runtime._launcher._pinned("ray-sandbox/busybox", creating)  # no directory yet
    orphan_home = tmp_path / "orphan"
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(orphan_home)],
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "RAY_SANDBOX_IMAGES": str(image_store.root)})
    try:
        orphan = proc.stdout.readline().strip()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    buried = runtime.create(image="ray-sandbox/busybox", memory="64Mi", cpu=0.2)
    runtime._launcher._stop(buried, "Deleted")  # its teardown pending
    mine = {p.owner: p for p in _pins_of(image_store, runtime.home)}
    theirs = _pins_of(image_store, orphan_home)
    assert [p.sandbox_id for p in theirs] == [orphan]
    for p in [*mine.values(), *theirs]:
        if p.sandbox_id != creating:
            _age(image_store, p)
    assert {p.sandbox_id for p in mine.values()} >= {live, creating, buried}
    try:
        other = SandboxRuntime(tmp_path / "other", images=image_store)  # its gc runs at start
        assert other.gc() == []
        kept = {p.owner for p in image_store.pin_list()}
        assert set(mine) | {theirs[0].owner} <= kept
        # the orphan's own home reaps it, pin included
        assert SandboxRuntime(orphan_home, images=image_store, reap=False).gc() == [orphan]
        assert theirs[0].owner not in {p.owner for p in image_store.pin_list()}
        assert leftovers(orphan_home, {orphan}) == {}
        other.close()
        assert leftovers(tmp_path / "other") == {}
    finally:
        runtime.delete(live)
        runtime._launcher.destroy(creating)  # the create that never went on
        runtime._launcher.destroy(buried)
    assert leftovers_after_teardown(runtime.home, {live, creating, buried}) == {}


def test_old_pins_without_a_home_are_judged_by_their_own_home_only(tmp_path, temp_store,
                                                                   busybox_layout):
    """A pin written before pins named their home is an empty file: the runtime whose home
    has its key judges it; another home keeps it unless told that no older runtime uses the
    store (--unknown-pins)."""
    ref = f"oci:{busybox_layout}:latest"
    digest = temp_store.get(ref).digest
    home_a, home_b = tmp_path / "a", tmp_path / "b"
    old_a = f"{pins.home_key(home_a)}:{uuid.uuid4().hex}"
    old_x = f"{'0' * 12}:{uuid.uuid4().hex}"  # a home nobody can name
    for owner in (old_a, old_x, "not-a-sandbox"):
        temp_store.pin(digest, owner)  # no home: as the older version wrote them
    for p in temp_store.pin_list():
        _age(temp_store, p)
    rt_b = SandboxRuntime(home_b, images=temp_store)
    assert temp_store.pins(digest) == {old_a, old_x, "not-a-sandbox"}
    rt_a = SandboxRuntime(home_a, images=temp_store)  # its gc maps its key to its home
    assert temp_store.pins(digest) == {old_x, "not-a-sandbox"}
    assert [p.owner for p in reaper.unpin_stale(temp_store, home_b, unknown=True)] == [old_x]
    assert temp_store.pins(digest) == {"not-a-sandbox"}  # never judged
    temp_store.unpin(digest, "not-a-sandbox")
    rt_a.close()
    rt_b.close()


def test_doctor_reports_stale_pins_and_gc_removes_them(tmp_path, temp_store, busybox_layout):
    ref = f"oci:{busybox_layout}:latest"
    gone = tmp_path / "gone"
    subprocess.run([sys.executable, "-c", PINNER, str(gone), str(temp_store.root), ref,
                    uuid.uuid4().hex], check=True, timeout=120)
    _delete_home(gone)
    (pin,) = temp_store.pin_list()
    env = {**os.environ, "RAY_SANDBOX_HOME": str(tmp_path / "home"),
           "RAY_SANDBOX_IMAGES": str(temp_store.root)}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([CLI, *args], env=env, capture_output=True, text=True,
                              timeout=300)

    doctor = cli("doctor", "--json")
    (check,) = [c for c in json.loads(doctor.stdout)["checks"] if c["name"] == "image pins"]
    assert not check["ok"], check
    assert "stale: 1, of sandboxes that no home has any more" in check["detail"]
    assert doctor.returncode == 1
    gc = cli("gc", "--json")
    assert gc.returncode == 0, gc.stderr
    assert json.loads(gc.stdout) == {"removed": [], "unpinned": [
        {"image": pin.digest, "owner": pin.owner, "home": str(gone.resolve())}]}
    assert temp_store.pin_list() == []
    (check,) = [c for c in json.loads(cli("doctor", "--json").stdout)["checks"]
                if c["name"] == "image pins"]
    assert check["ok"], check
    assert leftovers(tmp_path / "home", store=temp_store.root) == {}
