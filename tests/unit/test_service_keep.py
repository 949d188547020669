"""How the service keeps what a tenant takes (snapshots, filesystem images), as plain asyncio:
the take runs apart from its request, so a request that gives up leaves what is made kept and
listed, and what the limit refuses is discarded, never left unnamed. The take is a stand-in
for a host call's ObjectRef (anything with ``future()``); the HTTP behaviour is in
tests/test_service.py against a real Serve app."""

from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ray_sandbox.service import from_env
from ray_sandbox.service._bounds import FS_IMAGE, Bounds
from ray_sandbox.service._kept import TenantKept
from ray_sandbox.service._state import Books, Shared


class Take:
    """A host call that finishes when the test says so; ``started`` once it was asked."""

    def __init__(self) -> None:
        self.done: concurrent.futures.Future[str] = concurrent.futures.Future()
        self.started = asyncio.Event()

    def __call__(self) -> Take:
        self.started.set()
        return self

    def future(self) -> concurrent.futures.Future[str]:
        return self.done


class Kept:
    """TenantKept over its own books, with the tasks it leaves running in view."""

    def __init__(self, db: Path, **settings: Any) -> None:
        config = from_env({"RAY_SANDBOX_API_TOKEN": "token-0123456789"}, **settings)
        self.books = Books(Bounds.of(config), str(db))
        self.tasks: set[asyncio.Task[Any]] = set()
        self.discarded: list[str] = []

        async def blocking(fn: Any, *args: Any) -> Any:
            return fn(*args)

        self.kept = TenantKept(config, Shared(books=self.books), blocking, self.tasks.add)

    def take(self, take: Take):
        source = SimpleNamespace(sandbox_id="s" * 32)  # the sandbox taken of, as a handle
        return self.kept._keep(FS_IMAGE, "t", source, take, lambda made: (made, {"ref": made}),
                               self.discarded.append)

    async def settled(self) -> None:
        await asyncio.wait_for(asyncio.gather(*self.tasks), 5)


def test_a_take_finished_after_its_request_gave_up_is_kept(tmp_path):
    async def main() -> None:
        k = Kept(tmp_path / "books.sqlite3", create_timeout=0.05)
        take = Take()
        with pytest.raises(TimeoutError):
            await k.take(take)
        take.done.set_result("late")
        await k.settled()
        assert await k.books.kept.kept_keys(FS_IMAGE, "t") == ["late"] and k.discarded == []

        request = asyncio.ensure_future(k.take(take := Take()))
        await asyncio.wait_for(take.started.wait(), 5)
        request.cancel()  # the caller went away
        take.done.set_result("orphan")
        await k.settled()
        assert await k.books.kept.kept_keys(FS_IMAGE, "t") == ["late", "orphan"]
        assert await k.books.kept.takes() == []  # each take's record ended with its keeping

    asyncio.run(main())


def test_what_the_limit_refuses_after_the_take_is_discarded(tmp_path):
    async def main() -> None:
        k = Kept(tmp_path / "books.sqlite3", max_fs_images=1)
        first, second = Take(), Take()
        one = asyncio.ensure_future(k.take(first))
        two = asyncio.ensure_future(k.take(second))
        # both passed the first look at the limit before either was kept
        await asyncio.wait_for(asyncio.gather(first.started.wait(), second.started.wait()), 5)
        first.done.set_result("a")
        assert await one == "a"
        second.done.set_result("b")
        with pytest.raises(Exception, match="1 filesystem images kept"):
            await two
        assert k.discarded == ["b"] and await k.books.kept.kept_keys(FS_IMAGE, "t") == ["a"]
        assert await k.books.kept.takes() == []

    asyncio.run(main())
