"""How the service keeps what a tenant takes (snapshots, filesystem images), as plain asyncio:
the take runs apart from its request, so a request that gives up leaves what is made kept and
listed, and what the limit refuses is discarded, never left unnamed. The take is a stand-in
for a host call's ObjectRef (anything with ``future()``); the HTTP behaviour is in
tests/test_service.py against a real Serve app."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest

from ray_sandbox.service import from_env
from ray_sandbox.service._sandboxes import Sandboxes
from ray_sandbox.service._state import FS_IMAGE, Books, Bounds, Shared


class Take:
    """A host call that finishes when the test says so."""

    def __init__(self) -> None:
        self.done: concurrent.futures.Future[str] = concurrent.futures.Future()

    def __call__(self) -> Take:
        return self

    def future(self) -> concurrent.futures.Future[str]:
        return self.done


def _sandboxes(**settings) -> tuple[Sandboxes, Books]:
    config = from_env({"RAY_SANDBOX_API_TOKEN": "token-0123456789"}, **settings)
    books = Books(Bounds.of(config))
    return Sandboxes(config, Shared(books=books)), books


def _keep(sb: Sandboxes, take: Take, discarded: list[str]):
    return sb._keep(FS_IMAGE, "t", take, lambda made: (made, {"ref": made}), discarded.append)


def test_a_take_finished_after_its_request_gave_up_is_kept():
    async def main() -> None:
        sb, books = _sandboxes(create_timeout=0.05)
        take, discarded = Take(), []
        with pytest.raises(TimeoutError):
            await _keep(sb, take, discarded)
        take.done.set_result("late")
        await asyncio.wait_for(asyncio.gather(*sb._reports), 5)
        assert await books.kept_keys(FS_IMAGE, "t") == ["late"] and discarded == []

        cancelled = asyncio.ensure_future(_keep(sb, take := Take(), discarded))
        await asyncio.sleep(0.01)
        cancelled.cancel()  # the caller went away
        take.done.set_result("orphan")
        await asyncio.wait_for(asyncio.gather(*sb._reports), 5)
        assert await books.kept_keys(FS_IMAGE, "t") == ["late", "orphan"]

    asyncio.run(main())


def test_what_the_limit_refuses_after_the_take_is_discarded():
    async def main() -> None:
        sb, books = _sandboxes(max_fs_images=1)
        first, second, discarded = Take(), Take(), []
        one = asyncio.ensure_future(_keep(sb, first, discarded))
        two = asyncio.ensure_future(_keep(sb, second, discarded))  # both pass the first look
        await asyncio.sleep(0.01)
        first.done.set_result("a")
        assert await one == "a"
        second.done.set_result("b")
        with pytest.raises(Exception, match="1 filesystem images kept"):
            await two
        assert discarded == ["b"] and await books.kept_keys(FS_IMAGE, "t") == ["a"]

    asyncio.run(main())
