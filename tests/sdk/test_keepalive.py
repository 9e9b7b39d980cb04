"""Keep-alive scheduling with an injected clock: a third of the lease, backoff on transient failures,
stop on a lost retention, and nothing after the block exits."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime

import pytest
from kvferry.sdk import ErrorCode, KeepAlive, KeepAliveSettings
from kvferry.sdk._errors import make_error
from kvferry.sdk._keepalive import delay_after_failure, next_renewal_delay, renewal_deadline

SETTINGS = KeepAliveSettings()


class FakeClock:
    """Wall time that only moves when the keep-alive sleeps."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0
        self.sleeps: list[float] = []

    def wall_time(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)


class FakeLease:
    """Renewals answer with now + ttl; ``failures`` lists errors to raise first, in order."""

    def __init__(self, clock: FakeClock, ttl: float, failures: list[ErrorCode] | None = None) -> None:
        self.clock = clock
        self.ttl = ttl
        self.failures = list(failures or [])
        self.renewed_at: list[float] = []
        self.deadlines: list[float | None] = []

    async def renew(self, deadline_seconds: float | None) -> datetime:
        self.deadlines.append(deadline_seconds)
        if self.failures:
            raise make_error(self.failures.pop(0), "scripted failure")
        self.renewed_at.append(self.clock.now)
        return datetime.fromtimestamp(self.clock.now + self.ttl, tz=UTC)


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


def test_learnt_interval_is_a_third_of_the_lease() -> None:
    assert next_renewal_delay(SETTINGS, interval=None, seconds_to_expiry=30) == pytest.approx(10)
    assert next_renewal_delay(SETTINGS, interval=None, seconds_to_expiry=480) == pytest.approx(120)  # capped
    assert next_renewal_delay(SETTINGS, interval=None, seconds_to_expiry=0.3) == pytest.approx(0.2)  # floor
    assert next_renewal_delay(SETTINGS, interval=None, seconds_to_expiry=None) == 5.0
    assert next_renewal_delay(SETTINGS, interval=None, seconds_to_expiry=-3) == 5.0  # skewed clock
    assert next_renewal_delay(SETTINGS, interval=7.0, seconds_to_expiry=30) == 7.0


def test_failure_backoff_stays_inside_the_lease() -> None:
    delays = [delay_after_failure(SETTINGS, failures=n, seconds_to_expiry=None) for n in range(1, 7)]
    assert delays == pytest.approx([0.25, 0.5, 1.0, 2.0, 4.0, 5.0])
    assert delay_after_failure(SETTINGS, failures=6, seconds_to_expiry=3.0) == pytest.approx(1.0)
    assert delay_after_failure(SETTINGS, failures=6, seconds_to_expiry=0.1) == pytest.approx(0.2)


def test_a_renewal_must_end_well_before_the_lease() -> None:
    assert renewal_deadline(SETTINGS, seconds_to_expiry=None) is None
    assert renewal_deadline(SETTINGS, seconds_to_expiry=30) == pytest.approx(10)
    assert renewal_deadline(SETTINGS, seconds_to_expiry=0.5) == 1.0


async def test_renews_at_once_then_every_third_of_the_ttl() -> None:
    clock = FakeClock()
    lease = FakeLease(clock, ttl=30)
    start = clock.now
    async with KeepAlive("c1", lease.renew, settings=SETTINGS, clock=clock) as keep_alive:
        await _until(lambda: len(lease.renewed_at) >= 5)
    assert not keep_alive.running
    assert lease.renewed_at[:5] == pytest.approx([start, start + 10, start + 20, start + 30, start + 40])
    assert keep_alive.renewals >= 5
    assert keep_alive.error is None
    # The first renewal does not know the lease yet; later ones get a third of the 20 s left.
    assert lease.deadlines[:3] == pytest.approx([None, 20 / 3, 20 / 3])
    stopped_at = len(lease.renewed_at)
    await asyncio.sleep(0)
    assert len(lease.renewed_at) == stopped_at  # nothing after the block


async def test_fixed_interval_is_used_as_given() -> None:
    clock = FakeClock()
    lease = FakeLease(clock, ttl=30)
    async with KeepAlive("c1", lease.renew, settings=SETTINGS, interval=7.0, clock=clock):
        await _until(lambda: len(clock.sleeps) >= 3)
    assert clock.sleeps[:3] == [7.0, 7.0, 7.0]


async def test_transient_failures_back_off_then_resume() -> None:
    clock = FakeClock()
    lease = FakeLease(clock, ttl=30, failures=[ErrorCode.UNAVAILABLE])
    async with KeepAlive("c1", lease.renew, settings=SETTINGS, clock=clock) as keep_alive:
        await _until(lambda: len(lease.renewed_at) >= 1)
        lease.failures = [ErrorCode.UNAVAILABLE, ErrorCode.DEADLINE_EXCEEDED]
        await _until(lambda: len(lease.renewed_at) >= 3)
    # unknown lease end -> backoff; success -> 10 s; two failures -> 0.25, 0.5; success -> 10 s.
    assert clock.sleeps[:5] == pytest.approx([0.25, 10, 0.25, 0.5, 10])
    assert keep_alive.error is None and keep_alive.failures == 0


async def test_lost_retention_stops_without_raising() -> None:
    clock = FakeClock()
    lease = FakeLease(clock, ttl=30)
    async with KeepAlive("c1", lease.renew, settings=SETTINGS, clock=clock) as keep_alive:
        await _until(lambda: len(lease.renewed_at) >= 2)
        lease.failures = [ErrorCode.NOT_FOUND]
        await _until(lambda: not keep_alive.running)
    assert keep_alive.lost
    assert keep_alive.error is not None and keep_alive.error.code is ErrorCode.NOT_FOUND


async def test_permission_denied_stops_and_is_not_lost() -> None:
    clock = FakeClock()
    lease = FakeLease(clock, ttl=30, failures=[ErrorCode.PERMISSION_DENIED])
    async with KeepAlive("c1", lease.renew, settings=SETTINGS, clock=clock) as keep_alive:
        await _until(lambda: not keep_alive.running)
    assert not keep_alive.lost
    assert keep_alive.error is not None and keep_alive.error.code is ErrorCode.PERMISSION_DENIED
    assert lease.renewed_at == []


def test_rejects_bad_settings() -> None:
    with pytest.raises(ValueError):
        KeepAliveSettings(ttl_fraction=1.0)
    with pytest.raises(ValueError):
        KeepAliveSettings(min_interval_seconds=10, max_interval_seconds=1)
    with pytest.raises(ValueError):
        KeepAlive("c1", FakeLease(FakeClock(), 1).renew, settings=SETTINGS, interval=0)
