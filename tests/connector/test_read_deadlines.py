"""The prefill's read deadline (kvferry.connector.read_deadlines): from the read window's time left, on P's
own clocks. Pure; real engines decline and recompute in test_engines.py."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from kvferry.connector.read_deadlines import pull_allowed, read_deadline, read_may_start
from kvferry.pd.kvferry_params import ConversationMark, read_ms_params

ROUTER_WALL = 1_767_225_600.0
MARK = ConversationMark("acme", "c-1", 2)


@dataclass
class SkewedClock:
    """P's clocks: a monotonic clock of its own, and a wall clock ``skew`` seconds off the router's."""

    monotonic_now: float = 500.0
    router_wall: float = ROUTER_WALL
    skew: float = 0.0

    def monotonic(self) -> float:
        return self.monotonic_now

    def wall(self) -> float:
        return self.router_wall + self.skew

    def advance(self, seconds: float) -> None:
        self.monotonic_now += seconds
        self.router_wall += seconds


def test_the_deadline_counts_from_the_request_s_arrival_on_p() -> None:
    clock = SkewedClock()
    arrival = clock.wall()
    clock.advance(1.5)  # in P's API server and waiting queue
    deadline = read_deadline(read_ms_params(8_000), arrival, clock)
    assert deadline == pytest.approx(clock.monotonic() + 6.5)


@pytest.mark.parametrize("skew", [-3600.0, -30.0, 0.0, 30.0, 3600.0])
def test_a_skewed_clock_on_p_does_not_widen_the_window(skew: float) -> None:
    """The router handed out 8 s at ROUTER_WALL; P's wall clock is ``skew`` off. Both ends of the time P
    counts are its own, so the skew cancels: the pull may start for 8 s at most, whatever the skew."""
    clock = SkewedClock(skew=skew)
    params = {**read_ms_params(8_000), **MARK.to_params()}
    deadline = read_deadline(params, clock.wall(), clock)
    assert deadline == pytest.approx(clock.monotonic() + 8.0)
    clock.advance(7.0)
    assert pull_allowed(deadline, clock.monotonic(), min_read_seconds=1.0)
    clock.advance(0.5)
    assert not pull_allowed(deadline, clock.monotonic(), min_read_seconds=1.0)
    clock.advance(0.6)
    assert not read_may_start(deadline, clock.monotonic())


def test_version_2_s_wall_clock_deadline_is_what_a_skew_would_widen() -> None:
    """Why version 5 sends a duration: the old deadline (router wall clock + 8 s) on a P whose clock runs
    30 s behind leaves P 38 s. Still honoured for older clients."""
    clock = SkewedClock(skew=-30.0)
    old = {"kvferry": {**MARK.to_params()["kvferry"], "lease_expire_time": ROUTER_WALL + 8.0}}
    deadline = read_deadline(old, clock.wall(), clock)
    assert deadline == pytest.approx(clock.monotonic() + 38.0)


def test_a_wall_clock_stepped_back_on_p_never_adds_time() -> None:
    clock = SkewedClock()
    arrival = clock.wall()
    clock.skew = -60.0  # NTP stepped P's clock back after the request arrived
    assert read_deadline(read_ms_params(8_000), arrival, clock) == pytest.approx(clock.monotonic() + 8.0)


def test_no_window_means_no_kvferry_deadline_and_a_malformed_one_is_refused() -> None:
    clock = SkewedClock()
    assert read_deadline({"remote_block_ids": [[1]]}, clock.wall(), clock) is None
    assert read_deadline(None, clock.wall(), clock) is None
    with pytest.raises(ValueError, match="kvferry_read_ms"):
        read_deadline({"kvferry_read_ms": "soon"}, clock.wall(), clock)


def test_the_scheduler_wants_min_read_seconds_left_the_worker_only_an_open_window() -> None:
    assert pull_allowed(None, 100.0, 2.0)
    assert pull_allowed(103.0, 100.0, 2.0)
    assert not pull_allowed(101.5, 100.0, 2.0)
    assert not pull_allowed(99.0, 100.0, 0.0)
    assert read_may_start(None, 100.0)
    assert read_may_start(100.001, 100.0)
    assert not read_may_start(100.0, 100.0)
