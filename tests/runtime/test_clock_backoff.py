"""The kit's time pieces: the manual clock tests drive loops with, backoff, Timestamp conversion."""

from __future__ import annotations

import asyncio
import random

import pytest
from kvferry.runtime.backoff import Backoff, BackoffPolicy
from kvferry.runtime.clock import ManualClock, SystemClock
from kvferry.runtime.timestamps import from_timestamp, to_timestamp

pytestmark = pytest.mark.timeout(10)


async def test_a_manual_clock_wakes_sleepers_in_due_order_only_when_advanced() -> None:
    clock = ManualClock(monotonic=10.0, wall=1000.0)
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, seconds: float) -> None:
        await clock.sleep(seconds)
        woke.append((name, clock.monotonic()))

    tasks = [asyncio.create_task(sleeper("late", 5)), asyncio.create_task(sleeper("early", 2))]
    await asyncio.sleep(0)
    assert clock.sleepers == 2
    await clock.advance(1)
    assert woke == [] and clock.monotonic() == 11.0 and clock.time() == 1001.0
    await clock.advance(10)
    assert woke == [("early", 12.0), ("late", 15.0)]
    assert clock.monotonic() == 21.0
    await asyncio.gather(*tasks)


def test_a_manual_clock_skews_wall_time_either_way_without_moving_monotonic_time() -> None:
    clock = ManualClock(monotonic=5.0, wall=100.0)
    clock.skew(30)
    assert (clock.monotonic(), clock.time()) == (5.0, 130.0)
    clock.skew(-50)
    assert (clock.monotonic(), clock.time()) == (5.0, 80.0)


async def test_a_manual_clock_waits_for_an_event_or_its_time() -> None:
    clock = ManualClock()
    event = asyncio.Event()
    waiting = asyncio.create_task(clock.wait(event, 3))
    await asyncio.sleep(0)
    await clock.advance(3)
    assert await waiting is False
    waiting = asyncio.create_task(clock.wait(event, 3))
    await asyncio.sleep(0)
    event.set()
    assert await waiting is True
    assert clock.sleepers == 0, "a wait that the event ended leaves no sleep behind"


async def test_the_system_clock_waits_for_an_event_or_its_time() -> None:
    clock = SystemClock()
    assert await clock.wait(asyncio.Event(), 0.01) is False
    event = asyncio.Event()
    event.set()
    assert await clock.wait(event, 10) is True


@pytest.mark.parametrize("clock", [SystemClock(), ManualClock()], ids=["system", "manual"])
@pytest.mark.parametrize("turns", [0, 1, 2, 3])
async def test_a_loop_waiting_on_a_clock_stops_when_cancelled_just_after_its_event_was_set(
    clock: SystemClock | ManualClock, turns: int
) -> None:
    """The event set and the waiting task cancelled within the same few turns of the loop (a sidecar
    poked while it stops): the cancellation wins. Python 3.11's ``asyncio.wait_for`` returned the event
    instead, so a loop around the wait ran on and ``task.cancel(); await task`` never returned."""
    event = asyncio.Event()

    async def heartbeat_loop() -> None:
        while True:
            await clock.wait(event, 3600)
            event.clear()

    task = asyncio.create_task(heartbeat_loop())
    await asyncio.sleep(0)
    event.set()
    for _ in range(turns):
        await asyncio.sleep(0)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=2)
    assert task in done, f"the loop ran on after its cancellation ({turns} turns after the event)"
    assert task.cancelled()


def test_backoff_grows_caps_and_resets() -> None:
    backoff = Backoff(BackoffPolicy(initial_seconds=0.1, max_seconds=0.4, jitter=0.0), rng=random.Random(1))
    assert [backoff.next_delay() for _ in range(5)] == pytest.approx([0.1, 0.2, 0.4, 0.4, 0.4])
    backoff.reset()
    assert backoff.next_delay() == pytest.approx(0.1)


def test_backoff_jitter_stays_within_its_spread() -> None:
    backoff = Backoff(BackoffPolicy(initial_seconds=1.0, max_seconds=1.0, jitter=0.5), rng=random.Random(7))
    delays = [backoff.next_delay() for _ in range(200)]
    assert min(delays) >= 0.5 and max(delays) <= 1.5
    assert max(delays) - min(delays) > 0.5, "the delays are spread, not in lockstep"


@pytest.mark.parametrize(
    "settings",
    [
        {"initial_seconds": 1.0, "max_seconds": 0.5},
        {"initial_seconds": 0.0},
        {"multiplier": 0.5},
        {"jitter": 1.0},
    ],
)
def test_a_backoff_policy_refuses_settings_that_make_no_sense(settings: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="backoff"):
        BackoffPolicy(**settings)


async def test_backoff_waits_on_its_clock() -> None:
    clock = ManualClock()
    backoff = Backoff(BackoffPolicy(initial_seconds=2.0, max_seconds=8.0, jitter=0.0), clock=clock)
    waiting = asyncio.create_task(backoff.wait())
    await asyncio.sleep(0)
    await clock.advance(1.9)
    assert not waiting.done()
    await clock.advance(0.1)
    assert waiting.done()


def test_timestamps_round_trip_seconds() -> None:
    stamp = to_timestamp(1_700_000_000.5)
    assert (stamp.seconds, stamp.nanos) == (1_700_000_000, 500_000_000)
    assert from_timestamp(stamp) == 1_700_000_000.5
