"""Time as the services see it: a ``Clock`` Protocol, the system clock, and a manual clock for tests.

Loops take a ``Clock`` in their constructor (the composition root passes ``SystemClock()``), so a test
can drive them with :class:`ManualClock` instead of waiting in real time.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from typing import Any, Protocol


class Clock(Protocol):
    """What a service's logic needs from time."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (intervals, deadlines)."""
        ...

    def time(self) -> float:
        """Wall-clock seconds since the Unix epoch (expiry times, timestamps shown to people)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Waits ``seconds`` (at once when not positive)."""
        ...

    async def wait(self, event: asyncio.Event, within_seconds: float) -> bool:
        """Waits for ``event`` at most ``within_seconds``; True if it was set."""
        ...


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(seconds, 0.0))

    async def wait(self, event: asyncio.Event, within_seconds: float) -> bool:
        if event.is_set():
            return True
        # Not asyncio.wait_for: on Python 3.11 it waits in a task of its own and, when cancelled after
        # that task ended (the event set a turn or two before), returns instead of raising, so a loop
        # around this wait would outlive its cancellation. ``asyncio.timeout`` waits in this task.
        try:
            async with asyncio.timeout(max(within_seconds, 0.0)):
                await event.wait()
        except TimeoutError:
            return False
        return True


class ManualClock:
    """A clock that moves only when a test calls :meth:`advance`; sleepers wake as their time comes."""

    def __init__(self, *, monotonic: float = 1000.0, wall: float = 1_700_000_000.0) -> None:
        self._monotonic = monotonic
        self._offset = wall - monotonic
        # (due time, tie-breaker, future) of every pending sleep.
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def monotonic(self) -> float:
        return self._monotonic

    def time(self) -> float:
        return self._monotonic + self._offset

    def skew(self, seconds: float) -> None:
        """Moves wall-clock time only (either way), as an adjusted or skewed system clock would;
        monotonic time and sleepers are untouched."""
        self._offset += seconds

    @property
    def sleepers(self) -> int:
        """Sleeps not yet woken (a test can wait for a loop to reach its next sleep)."""
        return sum(1 for _, _, future in self._sleepers if not future.done())

    def _timer(self, seconds: float) -> asyncio.Future[None]:
        # Registered at once (not from a task yet to run), so an advance() right after sees it.
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if seconds <= 0:
            future.set_result(None)
        else:
            heapq.heappush(self._sleepers, (self._monotonic + seconds, next(self._order), future))
        return future

    async def sleep(self, seconds: float) -> None:
        await self._timer(seconds)

    async def wait(self, event: asyncio.Event, within_seconds: float) -> bool:
        if event.is_set():
            return True
        timer = self._timer(within_seconds)
        waiter = asyncio.ensure_future(event.wait())
        either: set[asyncio.Future[Any]] = {waiter, timer}
        try:
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            timer.cancel()
        return event.is_set()

    async def advance(self, seconds: float) -> None:
        """Moves time forward, waking (in due order) every sleep that ends by then, and lets the woken
        tasks run until they block again."""
        target = self._monotonic + seconds
        while self._sleepers and self._sleepers[0][0] <= target:
            due, _, future = heapq.heappop(self._sleepers)
            self._monotonic = max(self._monotonic, due)
            if not future.done():
                future.set_result(None)
                await _settle()
        self._monotonic = target
        await _settle()


async def _settle() -> None:
    # A few loop passes: a woken task may await other ready work before it sleeps again.
    for _ in range(5):
        await asyncio.sleep(0)
