"""What an engine pulled versus computed, and the rates the router's cost model reads.

Pure bookkeeping fed by the connector's scheduler half; times are monotonic seconds.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass


@dataclass
class _RequestRecord:
    prompt_tokens: int
    local_cached_tokens: int = 0
    external_tokens: int = 0
    pull_started_at: float | None = None
    pull_done: bool = False
    pull_failed: bool = False
    first_scheduled_at: float | None = None


@dataclass(frozen=True)
class StatsSnapshot:
    prefill_tokens_per_second: float
    transfer_bytes_per_second: float
    kv_bytes_per_token: int
    inflight_prefill_tokens: int
    running_requests: int
    retained_blocks: int
    pulled_tokens_total: int
    computed_tokens_total: int
    declined_pulls_total: int
    # Pulls whose holder's generations had changed (dropped and recomputed; kvferry.connector.fence).
    fenced_pulls_total: int = 0


class Accounting:
    """Counters and recent-rate windows of one engine (thread-safe: read by the sidecar link)."""

    def __init__(self, *, kv_bytes_per_token: int, window: int = 32) -> None:
        self.kv_bytes_per_token = kv_bytes_per_token
        self._lock = threading.Lock()
        self._requests: dict[str, _RequestRecord] = {}
        self._prefill_rates: deque[tuple[int, float]] = deque(maxlen=window)
        self._transfer_rates: deque[tuple[int, float]] = deque(maxlen=window)
        self.pulled_tokens_total = 0
        self.computed_tokens_total = 0
        self.declined_pulls_total = 0
        self.fenced_pulls_total = 0
        self.retained_blocks = 0
        self._version = 0

    @property
    def version(self) -> int:
        """Changes whenever a counter does (the stats sender skips unchanged snapshots)."""
        return self._version

    def on_matched(self, request_id: str, prompt_tokens: int, local_cached_tokens: int) -> None:
        with self._lock:
            record = self._requests.setdefault(request_id, _RequestRecord(prompt_tokens=prompt_tokens))
            record.local_cached_tokens = local_cached_tokens

    def on_declined(self) -> None:
        with self._lock:
            self.declined_pulls_total += 1
            self._version += 1

    def on_allocated(self, request_id: str, external_tokens: int, now: float) -> None:
        with self._lock:
            record = self._requests.get(request_id)
            if record is None:
                return
            record.first_scheduled_at = record.first_scheduled_at or now
            if external_tokens > 0 and record.pull_started_at is None:
                record.external_tokens = external_tokens
                record.pull_started_at = now

    def on_received(self, request_id: str, now: float, *, failed: bool) -> None:
        with self._lock:
            record = self._requests.get(request_id)
            if record is None or record.pull_started_at is None or record.pull_done:
                return
            record.pull_done = True
            record.pull_failed = failed
            if not failed and record.external_tokens > 0:
                elapsed = max(now - record.pull_started_at, 1e-6)
                self._transfer_rates.append((record.external_tokens * self.kv_bytes_per_token, elapsed))

    def on_finished(self, request_id: str, now: float) -> None:
        with self._lock:
            record = self._requests.pop(request_id, None)
            if record is None:
                return
            pulled = record.external_tokens if record.pull_done and not record.pull_failed else 0
            computed = max(0, record.prompt_tokens - record.local_cached_tokens - pulled)
            self.pulled_tokens_total += pulled
            self.computed_tokens_total += computed
            self._version += 1
            if computed > 0 and record.first_scheduled_at is not None:
                started = record.first_scheduled_at
                if record.pull_started_at is not None and record.pull_done:
                    # Compute starts once the pulled prefix is in.
                    started = max(started, record.pull_started_at)
                self._prefill_rates.append((computed, max(now - started, 1e-6)))

    def set_fenced_pulls(self, total: int) -> None:
        """The workers' count of fenced pulls (they keep it; the scheduler reads it for the stats)."""
        with self._lock:
            if total != self.fenced_pulls_total:
                self.fenced_pulls_total = total
                self._version += 1

    def set_retained_blocks(self, blocks: int) -> None:
        with self._lock:
            if blocks != self.retained_blocks:
                self.retained_blocks = blocks
                self._version += 1

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            inflight = sum(
                r.prompt_tokens - r.local_cached_tokens - r.external_tokens for r in self._requests.values()
            )
            return StatsSnapshot(
                prefill_tokens_per_second=_rate(self._prefill_rates),
                transfer_bytes_per_second=_rate(self._transfer_rates),
                kv_bytes_per_token=self.kv_bytes_per_token,
                inflight_prefill_tokens=max(0, inflight),
                running_requests=len(self._requests),
                retained_blocks=self.retained_blocks,
                pulled_tokens_total=self.pulled_tokens_total,
                computed_tokens_total=self.computed_tokens_total,
                declined_pulls_total=self.declined_pulls_total,
                fenced_pulls_total=self.fenced_pulls_total,
            )


def _rate(samples: deque[tuple[int, float]]) -> float:
    amount = sum(a for a, _ in samples)
    seconds = sum(s for _, s in samples)
    return amount / seconds if seconds > 0 else 0.0
