"""The retry policy: UNAVAILABLE only, before any chunk, capped exponential backoff, within the deadline."""

from __future__ import annotations

import pytest
from kvferry.sdk import ErrorCode, RetryPolicy
from kvferry.sdk._errors import make_error

POLICY = RetryPolicy(
    max_attempts=5, initial_backoff_seconds=0.1, max_backoff_seconds=1.0, backoff_multiplier=2.0, jitter=0.2
)
UNAVAILABLE = make_error(ErrorCode.UNAVAILABLE, "down")


def test_backoff_grows_then_caps() -> None:
    delays = [POLICY.backoff_seconds(n) for n in range(1, 7)]
    assert delays == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])


def test_jitter_stays_within_bounds() -> None:
    assert POLICY.backoff_seconds(2, unit_random=0.0) == pytest.approx(0.16)
    assert POLICY.backoff_seconds(2, unit_random=0.999999) == pytest.approx(0.24, abs=1e-6)


def test_retries_unavailable_until_max_attempts() -> None:
    delays = [POLICY.retry_delay(UNAVAILABLE, failed_attempts=n, seconds_left=60) for n in range(1, 6)]
    assert delays[:4] == pytest.approx([0.1, 0.2, 0.4, 0.8])
    assert delays[4] is None  # the fifth failure was the last allowed attempt


@pytest.mark.parametrize(
    "code",
    [c for c in ErrorCode if c is not ErrorCode.UNAVAILABLE],
)
def test_never_retries_other_codes(code: ErrorCode) -> None:
    assert POLICY.retry_delay(make_error(code, "x"), failed_attempts=1, seconds_left=60) is None


def test_never_retries_once_a_chunk_arrived() -> None:
    mid_stream = make_error(ErrorCode.UNAVAILABLE, "lost", chunks_received=1)
    assert POLICY.retry_delay(mid_stream, failed_attempts=1, seconds_left=60) is None


def test_never_waits_past_the_deadline() -> None:
    assert POLICY.retry_delay(UNAVAILABLE, failed_attempts=3, seconds_left=0.3) is None
    assert POLICY.retry_delay(UNAVAILABLE, failed_attempts=3, seconds_left=0.5) == pytest.approx(0.4)


def test_one_attempt_disables_retries() -> None:
    assert RetryPolicy(max_attempts=1).retry_delay(UNAVAILABLE, failed_attempts=1, seconds_left=60) is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": 0},
        {"initial_backoff_seconds": -1},
        {"backoff_multiplier": 0.5},
        {"jitter": 1.0},
    ],
)
def test_rejects_bad_settings(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]
