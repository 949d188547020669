"""Image pins on a store several homes share: a pin names its home, and any home's gc removes
the pins of sandboxes that no home has any more (the home deleted without its runtime
closing), never a pin whose sandbox may still live (in any state, or still being created)."""

from __future__ import annotations


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
        runtime.delete_snapshot(snap)
