"""The service's books (``service/_state.py``) on their real databases, without Ray: SQLite
files and a real PostgreSQL started for this module (tests/fx_postgres.py). The rules every
replica relies on (one atomic step per call, bounds per tenant), and what a restart keeps:
books reopened on the same database know everything they were told."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from ray_sandbox.service._bounds import FS_IMAGE, SNAPSHOT, Bounds
from ray_sandbox.service._state import LOST, UNSEEDED, Books
from tests.fx_postgres import postgres  # noqa: F401 - the fixture

QUOTA = {"sandboxes": 2, "cpu": 1.0, "memory": 1 << 30}


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request, tmp_path) -> Iterator[str]:
    """A fresh database of each kind: its spec, as ``state_db`` takes it."""
    if request.param == "sqlite":
        yield str(tmp_path / "books.sqlite3")
    else:
        yield request.getfixturevalue("postgres").new_database()


def books(db: str, **bounds) -> Books:
    return Books(Bounds(**{"max_execs_per_sandbox": 2, "max_errored": 2, "max_snapshots": 1,
                           "max_fs_images": 1, "create_timeout": 60.0,
                           "max_running_execs_per_tenant": 3,
                           "max_result_bytes_per_tenant": 10, **bounds}), db)


def run(coro):
    return asyncio.run(coro)


async def seeded(b: Books, tenant: str = "t") -> None:
    await b.reconcile(tenant, {}, await b.epoch())


def test_the_books_keep_each_kind_per_tenant_within_its_own_limit(db):
    async def main() -> None:
        b = books(db, max_fs_images=2)
        assert await b.kept.keep(SNAPSHOT, "t", "s1", {"n": 1}) is None
        assert "1 snapshots kept" in await b.kept.keep(SNAPSHOT, "t", "s2", {})
        for key in ("i1", "i2"):  # another kind counts apart
            assert await b.kept.keep(FS_IMAGE, "t", key, {"ref": key}) is None
        assert "2 filesystem images kept" in await b.kept.keep(FS_IMAGE, "t", "i3", {})
        assert await b.kept.keep(SNAPSHOT, "u", "s1", {"n": 2}) is None  # and another tenant
        assert await b.kept.kept(SNAPSHOT, "u", "s1") == {"n": 2}
        assert await b.kept.kept(FS_IMAGE, "u", "i1") is None
        assert await b.kept.kept_keys(FS_IMAGE, "t") == ["i1", "i2"]
        assert await b.kept.drop(FS_IMAGE, "t", "i1") == {"ref": "i1"}
        assert await b.kept.drop(FS_IMAGE, "t", "i1") is None
        assert await b.kept.keep(FS_IMAGE, "t", "i3", {}) is None
        # lost: listed apart, still counted until deleted, found again when seen
        await b.kept.mark_lost(FS_IMAGE, "t", "i2", "lost: gone")
        assert await b.kept.kept_list(FS_IMAGE, "t") == {"keys": ["i3"], "lost": ["i2"]}
        assert (await b.kept.kept(FS_IMAGE, "t", "i2"))["lost"] == "lost: gone"
        assert "(1 of them lost)" in await b.kept.keep(FS_IMAGE, "t", "i4", {})
        await b.kept.mark_lost(FS_IMAGE, "t", "i2", None)
        assert await b.kept.kept_keys(FS_IMAGE, "t") == ["i2", "i3"]

    run(main())


def test_the_books_admit_in_one_step_and_reconcile_only_what_ended_before_a_look(db):
    async def main():
        b = books(db)
        assert await b.admit("t", QUOTA, ["a"], 0.25, 1, {}) == UNSEEDED
        await seeded(b)
        assert await b.admit("t", QUOTA, ["a"], 0.25, 1, {"image": "i"}) is None
        assert await b.admit("t", QUOTA, ["b", "c"], 0.25, 1) is not None  # both or none
        assert await b.admit("t", QUOTA, ["b"], 0.25, 1) is None
        assert "at most 2" in await b.admit("t", QUOTA, ["c"], 0.25, 1)
        await b.settle("t", ["b"], ["b-id"], {"image": "i"})
        look = await b.epoch()
        assert await b.created("a", None) is False  # finished after the look began
        # the hosts listed neither: b-id ended (lost: no TTL said so), a is new
        assert await b.reconcile("t", {}, look) == ["b-id"]
        assert await b.admit("t", QUOTA, ["c"], 0.25, 1) is None
        assert await b.admit("t", QUOTA, ["d"], 0.25, 1) is not None
        await b.gone("t", "a")
        assert await b.was_deleted("a") and await b.admit("t", QUOTA, ["d"], 0.25, 1) is None

    run(main())


def test_a_sandbox_the_nodes_lack_is_lost_unless_its_ttl_ended(db):
    async def main():
        b = books(db)
        await seeded(b)
        assert await b.admit("t", QUOTA, ["x"], 0.25, 1, {"image": "i", "ttl": 0.01}) is None
        assert await b.admit("t", QUOTA, ["y"], 0.25, 1, {"image": "j", "labels": {}}) is None
        await b.created("x", None)
        await b.created("y", None)
        time.sleep(0.02)
        assert await b.reconcile("t", {}, await b.epoch()) == ["y"]
        assert await b.create_record("t", "x") is None  # its TTL: gone as asked
        rec = await b.create_record("t", "y")
        assert (rec["lost"], rec["error"], rec["image"]) == (True, LOST, "j")
        assert [r["sandbox_id"] for r in await b.creates("t")] == ["y"]
        assert await b.create_record("u", "y") is None  # another tenant's: unknown
        # seen again (its node came back): made and charged again
        await b.reconcile("t", {"y": [0.25, 1]}, await b.epoch())
        assert await b.create_record("t", "y") is None
        assert "at most 2" not in str(await b.admit("t", QUOTA, ["z"], 0.25, 1))
        assert "at most 2" in await b.admit("t", QUOTA, ["w"], 0.25, 1)
        # one lookup of one sandbox tells the same
        look = await b.epoch()
        assert (await b.vanished("t", "y", look))["lost"] is True
        assert await b.delete_create("t", "y") == "error"  # DELETE forgets it
        assert await b.create_record("t", "y") is None and await b.was_deleted("y")

    run(main())


def test_a_client_token_answers_with_the_same_create_or_a_conflict(db):
    async def main():
        b = books(db, client_token_seconds=0.3)
        await seeded(b)
        assert await b.admit("t", QUOTA, ["a"], 0.25, 1, {}, ["tok", "d1"]) is None
        # the same token and body: the same sandbox, also while its create runs, no charge
        assert await b.admit("t", QUOTA, ["b"], 0.25, 1, {}, ["tok", "d1"]) == {"same": "a"}
        assert await b.client_token("t", ["tok", "d1"]) == {"same": "a"}
        assert "conflict" in await b.admit("t", QUOTA, ["b"], 0.25, 1, {}, ["tok", "d2"])
        # another tenant's token of the same name is its own
        await seeded(b, "u")
        assert await b.admit("u", QUOTA, ["c"], 0.25, 1, {}, ["tok", "d2"]) is None
        assert await b.admit("t", QUOTA, ["b"], 0.25, 1, {}) is None  # quota: a and b
        assert await b.admit("t", QUOTA, ["b2"], 0.25, 1, {}, ["tok", "d1"]) == {"same": "a"}
        time.sleep(0.35)  # past its life the token is new again (and quota-checked)
        assert "at most 2" in await b.admit("t", QUOTA, ["e"], 0.25, 1, {}, ["tok", "d1"])

    run(main())


def test_the_books_bound_exec_results_and_wake_a_waiting_poll(db):
    async def main():
        b = books(db)
        assert await b.execs.exec_started("t", "s", "e1", 60) is None
        assert await b.execs.exec_started("t", "s", "e2", 60) is None
        assert "running" in await b.execs.exec_started("t", "s", "e3", 60)  # none finished: 429
        waiting = asyncio.ensure_future(b.execs.exec_record("t", "s", "e1", 30))
        await asyncio.sleep(0)
        t0 = time.monotonic()
        await b.execs.exec_finished("s", "e1", {"exec_id": "e1", "status": "completed",
                                          "stdout": "x"})
        assert (await waiting)["status"] == "completed"
        assert time.monotonic() - t0 < 20  # woken, not timed out (a loose bound)
        assert await b.execs.exec_record("u", "s", "e1") is None  # another tenant's: unknown
        assert await b.execs.exec_started("t", "s", "e3", 60) is None  # e1, finished, evicted
        assert await b.execs.exec_record("t", "s", "e1") is None
        assert (await b.execs.exec_record("t", "s", "e2"))["status"] == "running"

    run(main())


def test_the_books_count_running_execs_and_kept_output_per_tenant(db):
    """One tenant's execs (streamed ones too) are bounded, and its output evicts only its
    own finished results: another tenant's 150 execs of 2 MiB evicted an unread result."""

    def done(ex: str, out: str) -> dict:
        return {"exec_id": ex, "status": "completed", "stdout": out}

    async def main():
        b = books(db)
        assert await b.execs.exec_started("u", "theirs", "kept", 60) is None
        await b.execs.exec_finished("theirs", "kept", done("kept", "yes"))
        assert await b.execs.exec_started("t", "s1", "a", 60) is None
        assert await b.execs.stream_started("t", "s1", "st", "key") is None
        assert await b.execs.stream_key("t", "s1", "st") == "key"
        assert await b.execs.stream_key("u", "s1", "st") is None
        assert await b.execs.exec_started("t", "s2", "b", 60) is None
        assert "max_running_execs_per_tenant" in await b.execs.exec_started("t", "s2", "c", 60)
        assert "max_running_execs_per_tenant" in await b.execs.stream_started("t", "s2", "x", "k")
        assert await b.execs.exec_started("u", "theirs", "more", 60) is None  # the other's own
        await b.execs.stream_ended("s1", "st")
        assert await b.execs.exec_started("t", "s2", "c", 60) is None
        for ex in ("a", "b", "c"):  # 3 x 6 bytes over a share of 10: its own go
            await b.execs.exec_finished({"a": "s1"}.get(ex, "s2"), ex, done(ex, "x" * 6))
        assert await b.execs.exec_record("t", "s1", "a") is None
        assert (await b.execs.exec_record("t", "s2", "c"))["stdout"] == "xxxxxx"
        assert (await b.execs.exec_record("u", "theirs", "kept"))["stdout"] == "yes"
        await b.gone("t", "s2")
        for n in range(3):  # the deleted sandbox's execs count no more
            assert await b.execs.exec_started("t", f"s{3 + n}", "n", 60) is None

    run(main())


def test_the_books_lease_a_key_to_one_holder_until_it_lets_go_or_expires(db):
    async def main():
        b = books(db)
        assert await b.lease("volumes:t", "a", 60) and await b.lease("volumes:t", "a", 60)
        assert not await b.lease("volumes:t", "b", 60)
        assert await b.lease("volumes:u", "b", 60)  # another tenant's key
        await b.unlease("volumes:t", "b")  # not b's to let go
        assert not await b.lease("volumes:t", "b", 60)
        await b.unlease("volumes:t", "a")
        assert await b.lease("volumes:t", "b", -1)  # expired at once
        assert await b.lease("volumes:t", "c", 60)

    run(main())


def test_books_reopened_on_their_database_know_everything_they_were_told(db):
    """What a restart of the holder (a replica, the state actor, the whole app) keeps."""

    async def tell() -> None:
        b = books(db, max_snapshots=4)
        await seeded(b)
        assert await b.admit("t", QUOTA, ["made"], 0.25, 1, {"image": "i"}, ["tok", "d"]) \
            is None
        await b.created("made", None)
        assert await b.admit("t", QUOTA, ["failed"], 0.5, 1, {"image": "bad"}) is None
        await b.created("failed", "image_not_found: no such image")
        assert await b.kept.keep(SNAPSHOT, "t", "snap", {"snapshot": {"id": 1}}) is None
        assert await b.kept.keep(FS_IMAGE, "t", "img", {"ref": "oci:/x"}) is None
        assert await b.execs.exec_started("t", "made", "e", 60) is None
        await b.execs.exec_finished("made", "e", {"exec_id": "e", "status": "completed",
                                            "stdout": "out"})
        await b.gone("t", "old")
        await b.volume_made("t", "ws", "node-1", 1 << 20)
        await b.kept.take_started("take-1", FS_IMAGE, "t", "runtime-id")
        b.close()

    async def recall() -> None:
        b = books(db, max_snapshots=4)
        # the charge of "made" holds (no re-seeding needed): one more fits, then no more
        assert await b.admit("t", QUOTA, ["x"], 0.25, 1) is None
        assert "at most 2 sandboxes" in await b.admit("t", QUOTA, ["y"], 0.25, 1)
        assert await b.admit("t", QUOTA, ["z"], 0.25, 1, {}, ["tok", "d"]) == {"same": "made"}
        failed = await b.create_record("t", "failed")
        assert (failed["image"], failed["error"]) == ("bad", "image_not_found: no such image")
        assert await b.kept.kept(SNAPSHOT, "t", "snap") == {"snapshot": {"id": 1}}
        assert await b.kept.kept_keys(FS_IMAGE, "t") == ["img"]
        assert (await b.execs.exec_record("t", "made", "e"))["stdout"] == "out"
        assert await b.was_deleted("old")
        assert await b.volumes_seen("t", {}) == ["ws"]  # the node lacks it: lost
        assert [t[0] for t in await b.kept.takes()] == ["take-1"]
        stats = await b.stats()
        assert stats["rows"]["sandboxes"] >= 2 and stats["rows"]["kept"] == 2
        assert stats["seconds"]["admit"][0] >= 1

    run(tell())
    run(recall())


def test_two_holders_of_one_database_never_both_admit_past_the_quota(db):
    """Two processes holding the books at once (a rolling update's old and new replica):
    the writers' lock makes each admit one step, whichever holder takes it."""
    quota = {"sandboxes": 5, "cpu": 100.0, "memory": 1 << 40}
    holders = [books(db), books(db)]
    run(seeded(holders[0]))
    answers: list = []
    lock = threading.Lock()

    def admit(i: int) -> None:
        for n in range(6):
            got = run(holders[i].admit("t", quota, [f"k{i}-{n}"], 1.0, 1, {}))
            with lock:
                answers.append(got)

    threads = [threading.Thread(target=admit, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sum(1 for a in answers if a is None) == 5, answers
    assert len(answers) == 12


def test_the_schema_is_versioned_and_a_newer_one_is_refused(db):
    from ray_sandbox.runtime.errors import ConfigError
    from ray_sandbox.service._store import SCHEMA_VERSION, open_store

    store = open_store(db, "x")
    with store.read("t") as tx:
        assert tx.one("SELECT MAX(version) FROM schema_version")[0] == SCHEMA_VERSION
    with store.write("t") as tx:
        tx.run("INSERT INTO schema_version (version) VALUES (?)", SCHEMA_VERSION + 1)
    store.close()
    with pytest.raises(ConfigError, match="newer than this release"):
        open_store(db, "x")


def test_old_exec_results_and_tokens_are_swept_by_age(db):
    async def main():
        b = books(db, max_exec_result_age=0.05, client_token_seconds=0.05)
        await seeded(b)
        assert await b.execs.exec_started("t", "s", "e", 60) is None
        await b.execs.exec_finished("s", "e", {"exec_id": "e", "status": "completed"})
        assert await b.admit("t", QUOTA, ["a"], 0.25, 1, {}, ["tok", "d"]) is None
        time.sleep(0.1)
        stats = await b.stats()  # sweeps now
        assert stats["rows"]["execs"] == 0 and stats["rows"]["tokens"] == 0
        assert await b.execs.exec_record("t", "s", "e") is None

    run(main())
