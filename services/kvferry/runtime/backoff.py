"""Growing, jittered pauses between retries; the settings are a dataclass, the state a small object."""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvferry.runtime.clock import Clock, SystemClock


@dataclass(frozen=True)
class BackoffPolicy:
    """Exponential backoff: ``initial_seconds``, times ``multiplier`` per failure, up to ``max_seconds``."""

    initial_seconds: float = 0.2
    max_seconds: float = 5.0
    multiplier: float = 2.0
    # Each delay is drawn from [delay * (1 - jitter), delay * (1 + jitter)], so many clients that lost
    # the same server do not all retry in lockstep.
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.initial_seconds <= 0 or self.max_seconds < self.initial_seconds:
            raise ValueError(
                f"backoff needs 0 < initial_seconds <= max_seconds, got {self.initial_seconds} "
                f"and {self.max_seconds}"
            )
        if self.multiplier < 1:
            raise ValueError(f"backoff multiplier must be at least 1, got {self.multiplier}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"backoff jitter must be in [0, 1), got {self.jitter}")


class Backoff:
    """The running state of one retry loop: :meth:`next_delay` after each failure, :meth:`reset` after a
    success; :meth:`wait` sleeps the next delay on ``clock``."""

    def __init__(
        self,
        policy: BackoffPolicy | None = None,
        *,
        clock: Clock | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.policy = policy if policy is not None else BackoffPolicy()
        self._clock = clock if clock is not None else SystemClock()
        self._rng = rng if rng is not None else random.Random()
        self._next = self.policy.initial_seconds

    def next_delay(self) -> float:
        delay = self._next
        self._next = min(self._next * self.policy.multiplier, self.policy.max_seconds)
        spread = delay * self.policy.jitter
        return max(0.0, delay - spread + self._rng.random() * 2 * spread)

    def reset(self) -> None:
        self._next = self.policy.initial_seconds

    async def wait(self) -> None:
        await self._clock.sleep(self.next_delay())
