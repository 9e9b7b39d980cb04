"""What an engine pulled versus computed, and the rates the router's cost model reads.

Pure bookkeeping fed by the connector's scheduler half; times are monotonic seconds.

The rates are what the engine really got, so the router can stop trusting a profile that was wrong
for this machine: the prefill rate counts only compute (from when the pulled prefix was in, not from
when the pull started), and pull rates are kept per peer engine, because the transport differs per
pair (another GPU over NVLink, the same GPU through UCX's host path, another host): one figure over
all peers would hide a pair 600x slower than the rest; and per tier of the peer (its KV cache or its
host pool, kvferry.connector.host_tier), since a pull from host memory runs at its own rate. The first
pull from each peer is no sample: it waits for NIXL's handshake with that peer (1.3 s on one H200
against a 6 ms transfer, docs/calibration.md), a cost paid once that would price every later pull as
200x slower than it is and keep the router from ever pulling again. :func:`rates_moved` says when the figures
changed enough to report them at once instead of at the next stats interval.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass

from kvferry.connector.retention import Tier

# Pulls per peer a peer's rate covers: few, so a changed transport shows within a few pulls.
PEER_WINDOW = 8
# Peers (and tiers) whose rates are kept (least recently pulled from dropped first).
MAX_PEERS = 64


@dataclass
class _RequestRecord:
    prompt_tokens: int
    local_cached_tokens: int = 0
    external_tokens: int = 0
    peer_engine_id: str = ""
    peer_tier: Tier = Tier.DEVICE
    pull_started_at: float | None = None
    pull_done_at: float | None = None
    pull_done: bool = False
    pull_failed: bool = False
    # The first pull from its peer: it waited for the NIXL handshake, so it is no rate sample.
    handshake: bool = False
    first_scheduled_at: float | None = None


@dataclass(frozen=True)
class PeerPullRate:
    peer_engine_id: str
    bytes_per_second: float
    pulls: int
    # Which of the peer's tiers the pulls read.
    tier: Tier = Tier.DEVICE


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
    # Sorted by peer engine id, then tier.
    peer_pull_rates: tuple[PeerPullRate, ...] = ()


class Accounting:
    """Counters and recent-rate windows of one engine (thread-safe: read by the sidecar link)."""

    def __init__(self, *, kv_bytes_per_token: int, window: int = 32) -> None:
        self.kv_bytes_per_token = kv_bytes_per_token
        self._lock = threading.Lock()
        self._requests: dict[str, _RequestRecord] = {}
        self._prefill_rates: deque[tuple[int, float]] = deque(maxlen=window)
        self._transfer_rates: deque[tuple[int, float]] = deque(maxlen=window)
        self._peer_rates: OrderedDict[tuple[str, Tier], deque[tuple[int, float]]] = OrderedDict()
        # Peers a pull has started from (the handshake is behind it).
        self._peers_pulled: set[str] = set()
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

    def on_allocated(
        self,
        request_id: str,
        external_tokens: int,
        now: float,
        peer_engine_id: str = "",
        peer_tier: Tier = Tier.DEVICE,
    ) -> None:
        """``peer_engine_id``: the engine the ``external_tokens`` are pulled from ("" when unknown);
        ``peer_tier``: where on it they are."""
        with self._lock:
            record = self._requests.get(request_id)
            if record is None:
                return
            record.first_scheduled_at = record.first_scheduled_at or now
            if external_tokens > 0 and record.pull_started_at is None:
                record.external_tokens = external_tokens
                record.peer_engine_id = peer_engine_id
                record.peer_tier = peer_tier
                record.pull_started_at = now
                if peer_engine_id:
                    record.handshake = peer_engine_id not in self._peers_pulled
                    self._peers_pulled.add(peer_engine_id)

    def on_received(self, request_id: str, now: float, *, failed: bool) -> bool:
        """A pull ended; True when it gave a new rate sample."""
        with self._lock:
            record = self._requests.get(request_id)
            if record is None or record.pull_started_at is None or record.pull_done:
                return False
            record.pull_done = True
            record.pull_done_at = now
            record.pull_failed = failed
            self._version += 1
            if failed or record.external_tokens <= 0 or record.handshake:
                return False
            sample = (
                record.external_tokens * self.kv_bytes_per_token,
                max(now - record.pull_started_at, 1e-6),
            )
            self._transfer_rates.append(sample)
            if record.peer_engine_id:
                self._peer_window((record.peer_engine_id, record.peer_tier)).append(sample)
            return True

    def _peer_window(self, peer: tuple[str, Tier]) -> deque[tuple[int, float]]:
        window = self._peer_rates.get(peer)
        if window is None:
            window = self._peer_rates[peer] = deque(maxlen=PEER_WINDOW)
            while len(self._peer_rates) > MAX_PEERS:
                self._peer_rates.popitem(last=False)
        self._peer_rates.move_to_end(peer)
        return window

    def on_finished(self, request_id: str, now: float) -> bool:
        """A request ended; True when it gave a new prefill rate sample."""
        with self._lock:
            record = self._requests.pop(request_id, None)
            if record is None:
                return False
            pulled = record.external_tokens if record.pull_done and not record.pull_failed else 0
            computed = max(0, record.prompt_tokens - record.local_cached_tokens - pulled)
            self.pulled_tokens_total += pulled
            self.computed_tokens_total += computed
            self._version += 1
            if computed <= 0 or record.first_scheduled_at is None:
                return False
            started = record.first_scheduled_at
            if record.pull_done_at is not None:
                # Compute starts once the pulled prefix is in: the pull's time is the pull rate's.
                started = max(started, record.pull_done_at)
            self._prefill_rates.append((computed, max(now - started, 1e-6)))
            return True

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
                peer_pull_rates=tuple(
                    PeerPullRate(peer, _rate(samples), len(samples), tier)
                    for (peer, tier), samples in sorted(self._peer_rates.items())
                ),
            )


def _rate(samples: deque[tuple[int, float]]) -> float:
    amount = sum(a for a, _ in samples)
    seconds = sum(s for _, s in samples)
    return amount / seconds if seconds > 0 else 0.0


def rates_moved(previous: StatsSnapshot | None, current: StatsSnapshot, tolerance: float = 0.25) -> bool:
    """Whether a rate the router decides on changed by more than ``tolerance`` (relative) since
    ``previous`` was reported, or appeared: worth reporting now rather than at the next interval."""
    if previous is None:
        return bool(current.prefill_tokens_per_second or current.peer_pull_rates)
    before = {(p.peer_engine_id, p.tier): p.bytes_per_second for p in previous.peer_pull_rates}
    pairs = [(previous.prefill_tokens_per_second, current.prefill_tokens_per_second)]
    pairs += [
        (before.get((p.peer_engine_id, p.tier), 0.0), p.bytes_per_second) for p in current.peer_pull_rates
    ]
    return any(_moved(old, new, tolerance) for old, new in pairs)


def _moved(old: float, new: float, tolerance: float) -> bool:
    if old <= 0:
        return new > 0
    return abs(new - old) > tolerance * old
