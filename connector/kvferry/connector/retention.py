"""Which retained conversations a decode engine holds, and when each one's blocks may be freed.

Pure bookkeeping (no vLLM, no gRPC): the connector's scheduler half adds entries when marked
requests finish and frees the blocks of the entries :meth:`RetentionTable.collect_due` returns;
the sidecar link feeds the registry's word (acknowledged, renewed, ended, sync) in from its own
thread, so every method takes the table's lock.

When an entry's blocks are freed:

- the registry ended it (expired, released, superseded, engine gone, evicted) -> ``grace``
  seconds after the connector heard of it (rule 1: a prefill handed the retention just before
  can still finish reading);
- or no word came for ``max_retention_seconds`` since the last contact (report acknowledged,
  renewal) and the last known lease plus grace has passed too -> the hard cap (rule 4);
- a newer turn of the same conversation retained here ends older ones (local supersession,
  also with grace), as does the retained-block budget (least recently used first).

Reading by a prefill engine never frees anything: a retry may hand the retention out again.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def wall(self) -> float: ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


class EndReason(StrEnum):
    """Why the connector let a retention go (mirrors kvferry.v1.ReleaseReason, plus local causes)."""

    EXPIRED = "expired"
    RELEASED = "released"
    SUPERSEDED = "superseded"
    ENGINE_GONE = "engine_gone"
    EVICTED = "evicted"
    # The registry's snapshot no longer lists it.
    NOT_IN_REGISTRY = "not_in_registry"
    # No word from the registry within the hard cap.
    HARD_CAP = "hard_cap"


@dataclass
class RetainedEntry:
    request_id: str
    tenant: str
    conversation_id: str
    turn: int
    block_ids: tuple[int, ...]
    num_tokens: int
    block_digests: tuple[bytes, ...]
    created_at: float
    # Monotonic times.
    last_used: float
    last_contact: float
    # Last lease end the registry granted, wall clock (None until acknowledged).
    lease_expire_wall: float | None = None
    lease_deadline: float | None = None
    # Set once the retention ended: blocks are freed at this monotonic time.
    release_at: float | None = None
    end_reason: EndReason | None = None
    published: bool = False
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def ended(self) -> bool:
        return self.release_at is not None

    def hold_until(self, max_retention_seconds: float) -> float:
        """When the hard cap frees it if no further word comes (monotonic)."""
        cap = self.last_contact + max_retention_seconds
        return max(cap, self.lease_deadline) if self.lease_deadline is not None else cap

    def free_at(self, max_retention_seconds: float) -> float:
        """When its blocks are freed: the end plus grace once ended, else the hard cap."""
        if self.release_at is not None:
            return self.release_at
        return self.hold_until(max_retention_seconds)


class RetentionTable:
    """Thread-safe table of one engine's retentions."""

    def __init__(
        self,
        *,
        max_retention_seconds: float,
        grace_seconds: float,
        budget_blocks: int,
        clock: Clock | None = None,
    ) -> None:
        if budget_blocks < 0:
            raise ValueError(f"budget_blocks must be >= 0, got {budget_blocks}")
        self.max_retention_seconds = max_retention_seconds
        self.grace_seconds = grace_seconds
        self.budget_blocks = budget_blocks
        self._clock = clock or SystemClock()
        self._lock = threading.RLock()
        self._entries: dict[str, RetainedEntry] = {}
        # Totals since start, for stats and logs.
        self.freed_total: dict[EndReason, int] = {}

    # -- adding and the registry's word -------------------------------------------------------

    def add(
        self,
        *,
        request_id: str,
        tenant: str,
        conversation_id: str,
        turn: int,
        block_ids: Sequence[int],
        num_tokens: int,
        block_digests: Sequence[bytes] = (),
    ) -> tuple[RetainedEntry, list[RetainedEntry]]:
        """Records a new retention. Returns it and the older turns of the same conversation it
        superseded locally (now ending with grace)."""
        now = self._clock.monotonic()
        entry = RetainedEntry(
            request_id=request_id,
            tenant=tenant,
            conversation_id=conversation_id,
            turn=turn,
            block_ids=tuple(block_ids),
            num_tokens=num_tokens,
            block_digests=tuple(block_digests),
            created_at=now,
            last_used=now,
            last_contact=now,
        )
        with self._lock:
            if request_id in self._entries:
                raise ValueError(f"request {request_id} is already retained")
            superseded = [
                old
                for old in self._entries.values()
                if not old.ended
                and old.tenant == tenant
                and old.conversation_id == conversation_id
                and old.turn <= turn
            ]
            for old in superseded:
                self._end(old, EndReason.SUPERSEDED, now)
            self._entries[request_id] = entry
        return entry, superseded

    def acknowledge(self, request_id: str, lease_expire_wall: float | None) -> bool:
        """The sidecar published the retention (its lease ends at ``lease_expire_wall``)."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None:
                return False
            entry.published = True
            self._contact(entry, lease_expire_wall)
            return True

    def renew(self, request_id: str, lease_expire_wall: float | None) -> bool:
        """The registry renewed the lease: never free before its new end plus grace."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.ended:
                return False
            entry.published = True
            entry.last_used = self._clock.monotonic()
            self._contact(entry, lease_expire_wall)
            return True

    def end(self, request_id: str, reason: EndReason) -> bool:
        """The registry ended the retention: free its blocks after the grace period."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.ended:
                return False
            self._end(entry, reason, self._clock.monotonic())
            return True

    def sync(self, live_request_ids: Iterable[str]) -> list[str]:
        """The registry's snapshot: published entries it no longer lists have ended.

        Entries never acknowledged are kept (their report may still be on its way); live ones
        count as contact (the hard cap restarts).
        """
        live = set(live_request_ids)
        ended: list[str] = []
        with self._lock:
            now = self._clock.monotonic()
            for entry in self._entries.values():
                if entry.ended:
                    continue
                if entry.request_id in live:
                    entry.published = True
                    entry.last_contact = now
                elif entry.published:
                    self._end(entry, EndReason.NOT_IN_REGISTRY, now)
                    ended.append(entry.request_id)
        return ended

    def unpublished(self) -> list[RetainedEntry]:
        """Live entries the sidecar has not acknowledged (to report again after a reconnect)."""
        with self._lock:
            return [e for e in self._entries.values() if not e.ended and not e.published]

    # -- budget and freeing ---------------------------------------------------------------------

    def evict_over_budget(self) -> list[RetainedEntry]:
        """Ends least recently used retentions until the live ones fit the budget."""
        evicted: list[RetainedEntry] = []
        with self._lock:
            now = self._clock.monotonic()
            live = sorted((e for e in self._entries.values() if not e.ended), key=lambda e: e.last_used)
            held = sum(len(e.block_ids) for e in live)
            for entry in live:
                if held <= self.budget_blocks:
                    break
                self._end(entry, EndReason.EVICTED, now)
                held -= len(entry.block_ids)
                evicted.append(entry)
        return evicted

    def collect_due(self) -> list[RetainedEntry]:
        """Removes and returns the entries whose blocks must be freed now."""
        with self._lock:
            now = self._clock.monotonic()
            due = [e for e in self._entries.values() if e.free_at(self.max_retention_seconds) <= now]
            for entry in due:
                if entry.end_reason is None:
                    entry.end_reason = EndReason.HARD_CAP
                    entry.release_at = now
                del self._entries[entry.request_id]
                reason = entry.end_reason
                self.freed_total[reason] = self.freed_total.get(reason, 0) + 1
            return due

    def next_due(self) -> float | None:
        """Monotonic time of the next free, or None when nothing is held."""
        with self._lock:
            if not self._entries:
                return None
            return min(e.free_at(self.max_retention_seconds) for e in self._entries.values())

    def has_due(self) -> bool:
        due = self.next_due()
        return due is not None and due <= self._clock.monotonic()

    # -- views ----------------------------------------------------------------------------------

    def get(self, request_id: str) -> RetainedEntry | None:
        with self._lock:
            return self._entries.get(request_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        with self._lock:
            return request_id in self._entries

    def held_blocks(self) -> int:
        """Blocks not yet freed (live retentions and those in their grace period)."""
        with self._lock:
            return sum(len(e.block_ids) for e in self._entries.values())

    def live_blocks(self) -> int:
        """Blocks of retentions that have not ended (what the budget counts)."""
        with self._lock:
            return sum(len(e.block_ids) for e in self._entries.values() if not e.ended)

    def request_ids(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    # -- internals ------------------------------------------------------------------------------

    def _contact(self, entry: RetainedEntry, lease_expire_wall: float | None) -> None:
        now = self._clock.monotonic()
        entry.last_contact = now
        if lease_expire_wall is not None and math.isfinite(lease_expire_wall):
            lease_deadline = now + (lease_expire_wall - self._clock.wall()) + self.grace_seconds
            # A renewal only ever extends what the engine promised to keep.
            if entry.lease_deadline is None or lease_deadline > entry.lease_deadline:
                entry.lease_deadline = lease_deadline
                entry.lease_expire_wall = lease_expire_wall

    def _end(self, entry: RetainedEntry, reason: EndReason, now: float) -> None:
        entry.release_at = now + self.grace_seconds
        entry.end_reason = reason
