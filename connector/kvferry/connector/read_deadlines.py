"""The prefill side of read windows (kvferry.pd.reuse): until when P may start reading a pulled retention.

A prefill request that pulls a retention carries the time its read window has left
(``kv_transfer_params["kvferry_read_ms"]``), counted from when the client looked the retention up. P turns it
into a deadline on its own monotonic clock, counted from the request's arrival: vLLM stamps ``arrival_time``
with this host's wall clock as its API server takes the request, so both ends of that difference are read
here, another machine's clock never enters, and a skewed clock on P cancels out. The scheduler declines the
pull (P recomputes) when less than ``min_read_seconds`` is left as it schedules the request; the worker
fails the pull (vLLM recomputes) when the deadline passed before it posts the READ.

Requests from clients older than version 5 carry ``lease_expire_time`` (unix seconds) instead: compared
with this host's wall clock, as those clients expect.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvferry.connector.retention import Clock
from kvferry.pd.kvferry_params import lease_expire_time_from_params, read_ms_from_params


def read_deadline(params: Mapping[str, Any] | None, arrival_wall: float, clock: Clock) -> float | None:
    """The monotonic time (``clock.monotonic()``) by which a READ of the pulled retention must be posted;
    None when the request carries no read window (blocks vLLM holds on its own). ``arrival_wall``: the
    request's arrival on this host's wall clock. A malformed window raises ValueError."""
    ms_left = read_ms_from_params(params)
    if ms_left is not None:
        # Time spent on this host before now (HTTP, tokenization, the waiting queue) is part of the window.
        # A wall clock stepped back meanwhile only hides that time: never below 0.
        waited = max(0.0, clock.wall() - arrival_wall)
        return clock.monotonic() - waited + ms_left / 1000
    lease_expire_wall = lease_expire_time_from_params(params)
    if lease_expire_wall is not None:
        return clock.monotonic() + (lease_expire_wall - clock.wall())
    return None


def pull_allowed(deadline: float | None, now: float, min_read_seconds: float) -> bool:
    """Whether the scheduler may still schedule a pull due by ``deadline`` (monotonic; None: no deadline):
    at least ``min_read_seconds`` must be left for the READ to be posted and to run."""
    return deadline is None or deadline - now >= min_read_seconds


def read_may_start(deadline: float | None, now: float) -> bool:
    """Whether the worker may still post the READ of a pull due by ``deadline`` (monotonic; None: no
    deadline)."""
    return deadline is None or now < deadline
