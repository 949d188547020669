"""Two replicas whose books are held by the state actor, in its default database (a SQLite
file on the head node): the state actor killed in the middle of snapshots, images, creates
and execs loses no promise (tests/fx_books.py, ``kill_the_state_actor_mid_load``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fx_books import Deployed, deploy, kill_the_state_actor_mid_load, teardown


@pytest.fixture(scope="module")
def svc(ray_cluster) -> Iterator[Deployed]:
    d = None
    try:
        d = deploy(quotas=("bob:sandboxes=3,cpu=1,memory=1Gi",), replicas=2,
                   max_snapshots=64, max_fs_images=64)
        yield d
    finally:
        teardown(d)


def test_the_state_actor_killed_mid_load_loses_no_snapshot_image_charge_or_create(
        svc: Deployed):
    kill_the_state_actor_mid_load(svc)
