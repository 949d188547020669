"""The pure parts of block reservations and routing: how many bundles fit, how big a new
block is, Ray's label selectors, and how a batch is spread over nodes."""

from __future__ import annotations

import pytest

from ray_sandbox.actor.blocks import MAX_BLOCK, MAX_GROWTH, fits, grow_sizes, shape_of
from ray_sandbox.actor.routing import plan, selector_matches


def test_fits_counts_the_scarcest_resource():
    assert fits({"CPU": 4.0, "memory": 2 * 2**30}, {"CPU": 0.5, "memory": 2**29}) == 4
    assert fits({"CPU": 4.0}, {"CPU": 1.0, "gpu_slot": 1.0}) == 0
    assert fits({"CPU": 0.3}, {"CPU": 0.1}) == 3  # no float rounding down to 2


def test_growth_doubles_capacity_within_the_room_in_blocks():
    assert grow_sizes(capacity=0, want=1, room=10) == [1]
    assert grow_sizes(capacity=4, want=1, room=10) == [4]
    assert grow_sizes(capacity=4, want=7, room=10) == [7]
    assert grow_sizes(capacity=4, want=1, room=2) == [2]
    assert grow_sizes(capacity=0, want=150, room=1000) == [MAX_BLOCK, MAX_BLOCK, 22]
    assert sum(grow_sizes(capacity=5000, want=1, room=10**6)) == MAX_GROWTH
    assert grow_sizes(capacity=4, want=1, room=0) == []


def test_shapes_ignore_key_order():
    assert shape_of({"CPU": 1, "memory": 2.0}) == shape_of({"memory": 2, "CPU": 1.0})


@pytest.mark.parametrize(("selector", "ok"), [
    ({"zone": "a"}, True),
    ({"zone": "b"}, False),
    ({"zone": "!b"}, True),
    ({"zone": "in(a, c)"}, True),
    ({"zone": "!in(a,c)"}, False),
    ({"missing": "x"}, False),
    ({"missing": "!x"}, True),
])
def test_label_selectors(selector, ok):
    assert selector_matches({"zone": "a"}, selector) is ok


def test_a_batch_goes_to_the_nodes_with_most_room_first():
    assert plan({"a": 2, "b": 5, "c": 0}, 6) == [("b", 5), ("a", 1)]
    assert plan({"a": 2}, 5) == [("a", 2)]
    assert plan({}, 3) == []
