"""Keeping a conversation's retained KV alive while the agent is busy (e.g. running a tool).

The schedule is pure (``next_renewal_delay``, ``delay_after_failure``); ``KeepAlive`` runs it in a
background task against an injected renew call and ``Clock``, so it is testable without a server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Protocol

from kvferry.sdk._errors import ErrorCode, RpcError

_log = logging.getLogger("kvferry.sdk.keepalive")

# Failures worth another try: the lease may still be alive and the router back soon.
_TRANSIENT = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.DEADLINE_EXCEEDED, ErrorCode.RESOURCE_EXHAUSTED})


class Clock(Protocol):
    """Time as the keep-alive sees it (injected so tests need not wait)."""

    def wall_time(self) -> float:
        """Seconds since the Unix epoch (compared with the lease's expire time)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Waits ``seconds``."""
        ...


class SystemClock:
    """The real clock."""

    def wall_time(self) -> float:
        return time.time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@dataclass(frozen=True)
class KeepAliveSettings:
    """How often a keep-alive renews when no fixed interval is given."""

    # Renew when this fraction of the lease's remaining time has passed: two renewals can fail
    # before the lease runs out.
    ttl_fraction: float = 1 / 3
    min_interval_seconds: float = 0.2
    max_interval_seconds: float = 120.0
    # Used while the lease's end is unknown (or looks already past: a skewed clock).
    fallback_interval_seconds: float = 5.0
    # After a transient failure: exponential backoff from this, capped as below.
    failure_backoff_seconds: float = 0.25
    max_failure_backoff_seconds: float = 5.0

    def __post_init__(self) -> None:
        if not 0 < self.ttl_fraction < 1:
            raise ValueError(f"ttl_fraction must be in (0, 1), got {self.ttl_fraction}")
        if not 0 < self.min_interval_seconds <= self.max_interval_seconds:
            raise ValueError("need 0 < min_interval_seconds <= max_interval_seconds")
        if self.fallback_interval_seconds <= 0 or self.failure_backoff_seconds <= 0:
            raise ValueError("intervals must be positive")


def next_renewal_delay(
    settings: KeepAliveSettings, *, interval: float | None, seconds_to_expiry: float | None
) -> float:
    """Seconds from a successful renewal to the next one.

    A fixed ``interval`` is used as given; otherwise ``ttl_fraction`` of the lease's remaining time,
    clamped to [min, max] interval.
    """
    if interval is not None:
        return interval
    if seconds_to_expiry is None or seconds_to_expiry <= 0:
        return settings.fallback_interval_seconds
    return min(
        settings.max_interval_seconds,
        max(settings.min_interval_seconds, seconds_to_expiry * settings.ttl_fraction),
    )


def delay_after_failure(
    settings: KeepAliveSettings, *, failures: int, seconds_to_expiry: float | None
) -> float:
    """Seconds to wait after ``failures`` transient failures in a row: backoff, but never so long
    that the lease (if its end is known) runs out before the next try."""
    backoff: float = min(
        settings.max_failure_backoff_seconds,
        settings.failure_backoff_seconds * 2.0 ** max(0, failures - 1),
    )
    if seconds_to_expiry is not None and seconds_to_expiry > 0:
        backoff = min(backoff, seconds_to_expiry * settings.ttl_fraction)
    return max(settings.min_interval_seconds, backoff)


def renewal_deadline(settings: KeepAliveSettings, *, seconds_to_expiry: float | None) -> float | None:
    """Deadline for one renewal: a renewal still hanging when the lease ends is useless, so give it
    ``ttl_fraction`` of the time left (at least 1 s); None (the client's default) while unknown."""
    if seconds_to_expiry is None:
        return None
    return max(1.0, seconds_to_expiry * settings.ttl_fraction)


class KeepAlive:
    """Renews a conversation in the background between ``__aenter__`` and ``__aexit__``.

    ``renew(deadline_seconds)`` renews once and returns the lease's new end.

    It never raises into the block: losing the retention only means the next turn recomputes. After
    the block, ``renewals`` counts successful renewals, ``expire_time`` is the lease's last known
    end, and ``error`` holds what stopped it early (``lost`` when nothing is retained anymore).
    """

    def __init__(
        self,
        conversation_id: str,
        renew: Callable[[float | None], Awaitable[datetime]],
        *,
        settings: KeepAliveSettings,
        interval: float | None = None,
        clock: Clock | None = None,
    ) -> None:
        if interval is not None and interval <= 0:
            raise ValueError(f"keep-alive interval must be positive, got {interval}")
        self.conversation_id = conversation_id
        self.interval = interval
        self.renewals = 0
        self.failures = 0
        self.expire_time: datetime | None = None
        self.error: RpcError | None = None
        self._renew = renew
        self._settings = settings
        self._clock = clock or SystemClock()
        self._task: asyncio.Task[None] | None = None
        self._warned_interval = False

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def lost(self) -> bool:
        """True when the router said nothing is retained for the conversation anymore."""
        return self.error is not None and self.error.code is ErrorCode.NOT_FOUND

    async def __aenter__(self) -> KeepAlive:
        if self._task is not None:
            raise RuntimeError("a KeepAlive block can be entered only once")
        self._task = asyncio.create_task(self._run(), name=f"kvferry-keepalive-{self.conversation_id}")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.stop()

    async def stop(self) -> None:
        """Stops renewing (idempotent)."""
        task = self._task
        if task is None or task.done():
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def _seconds_to_expiry(self) -> float | None:
        if self.expire_time is None:
            return None
        return self.expire_time.timestamp() - self._clock.wall_time()

    async def _run(self) -> None:
        while True:
            try:
                self.expire_time = await self._renew(
                    renewal_deadline(self._settings, seconds_to_expiry=self._seconds_to_expiry())
                )
            except RpcError as error:
                if error.code not in _TRANSIENT:
                    self.error = error
                    _log.warning(
                        "keep-alive stopped: %s",
                        error,
                        extra={"conversation_id": self.conversation_id, "code": error.code.value},
                    )
                    return
                self.failures += 1
                delay = delay_after_failure(
                    self._settings, failures=self.failures, seconds_to_expiry=self._seconds_to_expiry()
                )
                _log.info(
                    "keep-alive renewal failed, retrying in %.2fs: %s",
                    delay,
                    error,
                    extra={"conversation_id": self.conversation_id, "code": error.code.value},
                )
            else:
                self.renewals += 1
                self.failures = 0
                left = self._seconds_to_expiry()
                delay = next_renewal_delay(self._settings, interval=self.interval, seconds_to_expiry=left)
                if self.interval is not None and left is not None and self.interval >= left:
                    self._warn_interval(left)
            await self._clock.sleep(delay)

    def _warn_interval(self, seconds_left: float) -> None:
        if self._warned_interval:
            return
        self._warned_interval = True
        _log.warning(
            "keep-alive interval %.1fs is not shorter than the lease's %.1fs left: the retention may "
            "expire between renewals; pass interval=None to renew at a third of the lease",
            self.interval,
            seconds_left,
            extra={"conversation_id": self.conversation_id},
        )
