"""Modal's two forms of every call: ``f(...)`` blocks, ``await f.aio(...)`` runs the same
call in a worker thread (Ray's blocking calls never hold the event loop)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any


class _Bound:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)

    async def aio(self, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(self._fn, *args, **kwargs)


class dual:  # noqa: N801 - used as a decorator, like staticmethod
    """A method (or, with ``static=True``, a static method) with Modal's ``.aio`` form."""

    def __init__(self, fn: Callable[..., Any], *, static: bool = False) -> None:
        self._fn = fn
        self._static = static
        functools.update_wrapper(self, fn)

    def __get__(self, obj: Any, objtype: type | None = None) -> _Bound:
        if self._static or obj is None:
            return _Bound(self._fn)
        return _Bound(self._fn.__get__(obj, objtype))


def static(fn: Callable[..., Any]) -> dual:
    return dual(fn, static=True)


async def aiter_in_thread(items: Iterable[Any]) -> AsyncIterator[Any]:
    """``items`` as an async iterator, each ``next`` in a worker thread."""
    it = iter(items)
    done = object()
    while (item := await asyncio.to_thread(next, it, done)) is not done:
        yield item
