"""Wake-ups of the books' long polls (memory only): a step that waits for a create or an
exec to end waits on an event of its key, set and dropped by the step that ends it."""

from __future__ import annotations

import asyncio


class Wakeups:
    """key -> (event, waiters); an event lives while someone waits on it."""

    def __init__(self) -> None:
        self._events: dict[tuple[str, ...], tuple[asyncio.Event, list[int]]] = {}

    async def wait(self, key: tuple[str, ...], timeout: float) -> None:
        """Until ``key`` is woken or ``timeout`` s pass (at once if it is not positive)."""
        if timeout <= 0:
            return
        got = self._events.get(key)
        if got is None:
            got = self._events[key] = (asyncio.Event(), [0])
        event, waiters = got
        waiters[0] += 1
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            pass
        finally:
            waiters[0] -= 1
            if not waiters[0] and self._events.get(key) is got:
                del self._events[key]

    def wake(self, key: tuple[str, ...]) -> None:
        got = self._events.pop(key, None)
        if got is not None:
            got[0].set()
