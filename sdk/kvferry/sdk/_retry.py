"""Retry settings and the pure decision of whether, and after how long, to send a call again."""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.sdk._errors import ErrorCode, RpcError


@dataclass(frozen=True)
class RetryPolicy:
    """How calls are retried: only on UNAVAILABLE, with exponential backoff, within the call's deadline.

    A Generate stream is retried only while no chunk has arrived; once text streamed, a failure is
    raised to the caller (whose history is untouched, so resending the turn is safe).
    ``max_attempts`` counts the first try; 1 disables retries.
    """

    max_attempts: int = 5
    initial_backoff_seconds: float = 0.1
    max_backoff_seconds: float = 3.0
    backoff_multiplier: float = 2.0
    # Each delay is scaled by a factor drawn in [1 - jitter, 1 + jitter] so clients do not retry in lockstep.
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if self.initial_backoff_seconds < 0 or self.max_backoff_seconds < 0:
            raise ValueError("backoff seconds must not be negative")
        if self.backoff_multiplier < 1:
            raise ValueError(f"backoff_multiplier must be at least 1, got {self.backoff_multiplier}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {self.jitter}")

    def backoff_seconds(self, failed_attempts: int, unit_random: float = 0.5) -> float:
        """Delay before the next try after ``failed_attempts`` failures (1 for the first retry).

        ``unit_random`` in [0, 1) picks the jitter; 0.5 gives the nominal delay.
        """
        nominal = min(
            self.max_backoff_seconds,
            self.initial_backoff_seconds * self.backoff_multiplier ** max(0, failed_attempts - 1),
        )
        return nominal * (1 + self.jitter * (2 * unit_random - 1))

    def retry_delay(
        self,
        error: RpcError,
        *,
        failed_attempts: int,
        seconds_left: float,
        unit_random: float = 0.5,
    ) -> float | None:
        """Seconds to wait before trying again, or None when ``error`` must be raised.

        Retries only UNAVAILABLE before any chunk arrived, at most ``max_attempts`` tries in all, and
        only when the wait still leaves part of the deadline (``seconds_left``) for the next try.
        """
        if error.code is not ErrorCode.UNAVAILABLE or error.chunks_received > 0:
            return None
        if failed_attempts >= self.max_attempts:
            return None
        delay = self.backoff_seconds(failed_attempts, unit_random)
        if delay >= seconds_left:
            return None
        return delay


NO_RETRY = RetryPolicy(max_attempts=1)
