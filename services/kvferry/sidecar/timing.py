"""Time and retry pacing, injectable so the sidecar's loops are testable without real waits."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Protocol


class Clock(Protocol):
    """What the sidecar's loops need from time."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (intervals, deadlines)."""
        ...

    def time(self) -> float:
        """Wall-clock seconds since the epoch (timestamps shown to people)."""
        ...

    async def sleep(self, seconds: float) -> None: ...

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
        await asyncio.sleep(seconds)

    async def wait(self, event: asyncio.Event, within_seconds: float) -> bool:
        if event.is_set():
            return True
        try:
            await asyncio.wait_for(event.wait(), timeout=max(within_seconds, 0.0))
        except TimeoutError:
            return False
        return True


@dataclass(frozen=True)
class BackoffPolicy:
    """Exponential backoff with jitter for reconnecting to the registry."""

    initial_seconds: float = 0.2
    max_seconds: float = 5.0
    multiplier: float = 2.0
    # Fraction of each delay drawn at random, so many sidecars do not retry in lockstep.
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.initial_seconds <= 0 or self.max_seconds < self.initial_seconds or self.multiplier < 1:
            raise ValueError(f"invalid backoff policy: {self}")


class Backoff:
    """The running state of one retry loop under a ``BackoffPolicy``."""

    def __init__(self, policy: BackoffPolicy, rng: random.Random | None = None) -> None:
        self._policy = policy
        self._rng = rng or random.Random()
        self._next = policy.initial_seconds

    def next_delay(self) -> float:
        delay = self._next
        self._next = min(self._next * self._policy.multiplier, self._policy.max_seconds)
        spread = delay * self._policy.jitter
        return max(0.0, delay - spread + self._rng.random() * 2 * spread)

    def reset(self) -> None:
        self._next = self._policy.initial_seconds
