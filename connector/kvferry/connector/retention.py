"""Which retained conversations a decode engine holds, and when each one's blocks may be freed.

Pure bookkeeping (no vLLM, no gRPC): the connector's scheduler half adds entries when marked
requests finish and frees the blocks of the entries :meth:`RetentionTable.collect_due` returns;
the sidecar link feeds the registry's word in and takes the calls to make out
(:meth:`RetentionTable.take_call`) from its own thread, so every method takes the table's lock.

The invariant: a block is freed only once the registry confirmed that no one is handed the
retention any more (rule 1), plus ``grace`` seconds for reads handed out just before. An entry is

- LIVE until something ends it;
- ENDING while an end waits for that confirmation. Ends that start here ask the registry:
  a newer turn retained here (local supersession) waits for that turn's publish (accepted: the
  older one is superseded in the registry too; refused, or ended before it was acknowledged: the
  older one is LIVE again and the newer one ends instead), the budget's evictions, the hard cap
  and refused reports need an EndRetention call (``take_call``), which the registry answers once
  the record is gone and that request can never be published again;
- ENDED (confirmed) once the registry confirmed it: an EndRetention answered, or the registry's own
  word (an ENDED event, a SYNC no longer listing it) arrived, provided no report of it can still
  land (a report in flight or unanswered asks for an EndRetention first). Its blocks are freed
  ``grace`` seconds later.

The registry's word carries a revision: an ENDED or SYNC older than the acknowledgement or renewal
the entry already has is stale and ends nothing; an acknowledgement newer than an end (a report
that landed after it) makes the entry ask the registry to end it again.

Without confirmation (sidecar or registry unreachable) nothing is freed before the hard cap: a
LIVE entry starts ending at ``max_retention_seconds`` after the last word from the registry (or
its last known lease end plus grace, if later), and an ENDING one is freed unconfirmed ``grace``
seconds after that (``RetainedEntry.confirmed`` false: the connector fences those blocks first).

Reading by a prefill engine never frees anything: a retry may hand the retention out again.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal, Protocol


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
    # The registry refused to publish it (a turn as new or newer is live; the request was ended).
    REFUSED = "refused"


class Tier(StrEnum):
    """Where a retention's blocks are (kvferry.v1.MemoryTier): the KV cache, or the host pool
    (kvferry.connector.host_tier)."""

    DEVICE = "device"
    HOST = "host"


# Seconds before an EndRetention the sidecar refused outright (not a lost link) is asked again.
END_CALL_RETRY_SECONDS = 30.0


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
    # --- the registry's word
    # Acknowledged at least once.
    published: bool = False
    # Newest registry revision it is known live at (acknowledgement, renewal); 0: none.
    revision: int = 0
    # A report of it is in flight.
    reporting: bool = False
    # A report of it failed without an answer: it may have landed all the same.
    maybe_published: bool = False
    # --- its end
    end_reason: EndReason | None = None
    # Monotonic time the end began (orders the calls to make).
    end_started_at: float | None = None
    # Ending because this newer turn was retained here: settled by that turn's publish.
    superseded_by: str | None = None
    # Ending: the registry must confirm it (an EndRetention call), not before ``end_call_after``.
    end_call_due: bool = False
    end_call_after: float = 0.0
    # Registry revision of the end (0: a local end not confirmed by a revision yet).
    end_revision: int = 0
    # Confirmed: blocks are freed at this monotonic time.
    release_at: float | None = None
    # Set when collected: freed after the registry confirmed the end (else at the hard cap).
    confirmed: bool = False
    # The blocks' generations when retained (published with the record; kvferry.connector.generations).
    block_generations: tuple[int, ...] = ()
    tier: Tier = Tier.DEVICE
    # A relocation (host tier): the request id of the retention of the same turn it replaces.
    relocates: str = ""
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def live(self) -> bool:
        return self.end_reason is None

    @property
    def ended(self) -> bool:
        """Ending or ended: no longer offered, renewed or reported."""
        return self.end_reason is not None

    @property
    def end_confirmed(self) -> bool:
        return self.release_at is not None

    @property
    def unsettled(self) -> bool:
        """A report of it may still land in the registry."""
        return self.reporting or self.maybe_published

    def hold_until(self, max_retention_seconds: float) -> float:
        """When the hard cap begins its end if no further word comes (monotonic)."""
        cap = self.last_contact + max_retention_seconds
        return max(cap, self.lease_deadline) if self.lease_deadline is not None else cap

    def free_at(self, max_retention_seconds: float, grace_seconds: float = 0.0) -> float:
        """When its blocks are freed: the confirmed end plus grace, else the hard cap plus grace."""
        if self.release_at is not None:
            return self.release_at
        return self.hold_until(max_retention_seconds) + grace_seconds


Call = tuple[Literal["report", "end"], RetainedEntry]


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
        # Requests freed already whose report landed afterwards: the registry must end them.
        self._orphans: dict[str, RetainedEntry] = {}
        # Requests that may need a call, oldest first (``take_call`` drops the ones that do not).
        self._wanting: dict[str, None] = {}
        # Request ids by conversation, and the turns each request superseded here.
        self._by_conversation: dict[tuple[str, str], set[str]] = {}
        self._superseding: dict[str, set[str]] = {}
        # Totals since start, for stats and logs.
        self.freed_total: dict[EndReason, int] = {}
        self.unconfirmed_frees = 0

    # -- adding ----------------------------------------------------------------------------------

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
        block_generations: Sequence[int] = (),
        tier: Tier = Tier.DEVICE,
        relocates: str = "",
    ) -> tuple[RetainedEntry, list[RetainedEntry]]:
        """Records a new retention. Returns it and the live turns of the same conversation (not
        newer) it supersedes here: they end once this one's publish is accepted (a relocation
        supersedes the retention of its own turn it moved)."""
        now = self._clock.monotonic()
        entry = RetainedEntry(
            request_id=request_id,
            tenant=tenant,
            conversation_id=conversation_id,
            turn=turn,
            block_ids=tuple(block_ids),
            num_tokens=num_tokens,
            block_digests=tuple(block_digests),
            block_generations=tuple(block_generations),
            created_at=now,
            last_used=now,
            last_contact=now,
            tier=tier,
            relocates=relocates,
        )
        with self._lock:
            if request_id in self._entries:
                raise ValueError(f"request {request_id} is already retained")
            same_conversation = self._by_conversation.setdefault((tenant, conversation_id), set())
            superseded = [
                old
                for old in (self._entries[other] for other in same_conversation)
                if old.live and old.turn <= turn
            ]
            for old in superseded:
                self._begin_end(old, EndReason.SUPERSEDED, now, superseded_by=request_id)
            self._entries[request_id] = entry
            same_conversation.add(request_id)
            self._wanting[request_id] = None
        return entry, superseded

    # -- the calls the sidecar link makes ----------------------------------------------------------

    def take_call(self) -> Call | None:
        """The next call to make: an EndRetention, or a report of a live retention not yet
        acknowledged (oldest first); a report taken is in flight until its outcome is given."""
        with self._lock:
            now = self._clock.monotonic()
            done: list[str] = []
            taken: Call | None = None
            for request_id in self._wanting:
                entry = self._entries.get(request_id) or self._orphans.get(request_id)
                kind = self._call_for(entry, now) if entry is not None else None
                if kind is not None and entry is not None:
                    taken = (kind, entry)
                    break
                if entry is None or not self._may_want_call(entry):
                    done.append(request_id)
            for request_id in done:
                del self._wanting[request_id]
            if taken is not None and taken[0] == "report":
                taken[1].reporting = True
            return taken

    @staticmethod
    def _call_for(entry: RetainedEntry, now: float) -> Literal["report", "end"] | None:
        if entry.reporting:
            return None
        if entry.end_call_due and entry.release_at is None:
            return "end" if entry.end_call_after <= now else None
        if entry.live and not entry.published:
            return "report"
        return None

    @staticmethod
    def _may_want_call(entry: RetainedEntry) -> bool:
        return (
            entry.reporting
            or (entry.end_call_due and entry.release_at is None)
            or (entry.live and not entry.published)
        )

    def acknowledged(
        self,
        request_id: str,
        lease_expire_wall: float | None,
        revision: int,
        *,
        tenant: str,
        conversation_id: str,
    ) -> None:
        """The sidecar published it (lease until ``lease_expire_wall``, at registry ``revision``)."""
        with self._lock:
            now = self._clock.monotonic()
            entry = self._entries.get(request_id)
            if entry is None:
                # Freed already (at its hard cap) and published after all: end it in the registry.
                orphan = RetainedEntry(
                    request_id=request_id,
                    tenant=tenant,
                    conversation_id=conversation_id,
                    turn=0,
                    block_ids=(),
                    num_tokens=0,
                    block_digests=(),
                    created_at=now,
                    last_used=now,
                    last_contact=now,
                    published=True,
                    revision=revision,
                )
                self._begin_end(orphan, EndReason.HARD_CAP, now)
                orphan.end_call_due = True
                self._orphans[request_id] = orphan
                self._wanting[request_id] = None
                return
            entry.reporting = False
            entry.maybe_published = False
            entry.published = True
            entry.revision = max(entry.revision, revision)
            self._contact(entry, lease_expire_wall, now)
            if entry.end_confirmed and (entry.end_revision == 0 or entry.end_revision < revision):
                # Landed after its end was confirmed: live in the registry again, end it again.
                entry.release_at = None
                entry.end_call_due = True
                entry.end_started_at = now
                self._wanting[request_id] = None
            self._settle_superseded(request_id, accepted=True, revision=revision, now=now)

    def refused(self, request_id: str) -> list[RetainedEntry]:
        """The registry refused to publish it: it ends (never served by that report), and the turns
        it superseded here are live again. Returns those."""
        with self._lock:
            now = self._clock.monotonic()
            entry = self._entries.get(request_id)
            if entry is None:
                return []
            entry.reporting = False
            if entry.live or entry.superseded_by is not None:
                self._begin_end(entry, EndReason.REFUSED, now)
                self._confirm_or_call(entry, now, revision=0)
            return self._settle_superseded(request_id, accepted=False, revision=0, now=now)

    def report_failed(self, request_id: str) -> None:
        """A report of it got no answer: it may have landed (it is reported again while live)."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is not None:
                entry.reporting = False
                entry.maybe_published = True

    def end_confirmed(self, request_id: str, revision: int) -> bool:
        """The registry confirmed the end asked for: the grace period starts."""
        with self._lock:
            now = self._clock.monotonic()
            if self._orphans.pop(request_id, None) is not None:
                return True
            entry = self._entries.get(request_id)
            if entry is None or not entry.end_call_due or entry.end_confirmed:
                return False
            entry.maybe_published = False
            self._confirm(entry, now, revision)
            return True

    def end_call_refused(self, request_id: str) -> None:
        """The sidecar refused the EndRetention outright: ask again later (the hard cap bounds it)."""
        with self._lock:
            after = self._clock.monotonic() + END_CALL_RETRY_SECONDS
            for holder in (self._entries, self._orphans):
                entry = holder.get(request_id)
                if entry is not None:
                    entry.end_call_after = after

    # -- the registry's word (WatchReleases) -----------------------------------------------------

    def renew(self, request_id: str, lease_expire_wall: float | None, revision: int = 0) -> bool:
        """The registry renewed the lease: never free before its new end plus grace."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.end_confirmed:
                return False
            now = self._clock.monotonic()
            entry.published = True
            entry.revision = max(entry.revision, revision)
            entry.last_used = now
            self._contact(entry, lease_expire_wall, now)
            return True

    def end(self, request_id: str, reason: EndReason, revision: int = 0) -> bool:
        """The registry ended it at ``revision`` (0: unknown): the grace period starts, unless a
        report of it may still land (then the registry is asked to end it for good first)."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.end_confirmed:
                return False
            if revision and revision < entry.revision:
                return False  # older than what the registry said of it since
            now = self._clock.monotonic()
            if entry.live:
                self._begin_end(entry, reason, now)
            self._set_superseded_by(entry, None)
            self._confirm_or_call(entry, now, revision)
            # Only an accepted publish replaced the turns it superseded here (``acknowledged`` settled
            # those). Never acknowledged, the registry not holding it says nothing of them: its report
            # may never have landed (no answer, e.g. etcd out of space, then the sidecar's sweep found
            # the older turn held), so they are live again until the registry's own word ends them.
            self._settle_superseded(request_id, accepted=entry.published, revision=revision, now=now)
            return True

    def sync(self, live_request_ids: Iterable[str], revision: int = 0) -> list[str]:
        """The registry's snapshot at ``revision`` (0: unknown): acknowledged entries it does not list
        have ended, unless they were acknowledged or renewed at a later revision.

        Entries never acknowledged are kept (their report may still be on its way); listed ones
        count as contact (the hard cap restarts).
        """
        live = set(live_request_ids)
        ended: list[str] = []
        with self._lock:
            now = self._clock.monotonic()
            for entry in list(self._entries.values()):
                if entry.end_confirmed:
                    continue
                if entry.request_id in live:
                    entry.last_contact = now
                elif entry.published and not (revision and entry.revision > revision):
                    if self.end(entry.request_id, EndReason.NOT_IN_REGISTRY, revision):
                        ended.append(entry.request_id)
        return ended

    # -- budget, hard cap and freeing --------------------------------------------------------------

    def evict_over_budget(self, *, leaving: Collection[str] = ()) -> list[RetainedEntry]:
        """Ends least recently used retentions in the KV cache until the live ones fit the budget (each
        then waits for the registry to confirm the end). Those ``leaving`` it (being moved to the host
        tier) neither count nor are evicted."""
        evicted: list[RetainedEntry] = []
        with self._lock:
            now = self._clock.monotonic()
            live = self.live_entries(Tier.DEVICE, leaving=leaving)
            held = sum(len(e.block_ids) for e in live)
            for entry in live:
                if held <= self.budget_blocks:
                    break
                self._begin_local_end(entry, EndReason.EVICTED, now)
                held -= len(entry.block_ids)
                evicted.append(entry)
        return evicted

    def live_entries(self, tier: Tier, *, leaving: Collection[str] = ()) -> list[RetainedEntry]:
        """Live retentions of a tier, least recently used first."""
        with self._lock:
            return sorted(
                (
                    e
                    for e in self._entries.values()
                    if e.live and e.tier is tier and e.request_id not in leaving
                ),
                key=lambda e: e.last_used,
            )

    def evict(self, request_id: str) -> bool:
        """Ends a live retention to make room (EVICTED): freed once the registry confirms."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or not entry.live:
                return False
            self._begin_local_end(entry, EndReason.EVICTED, self._clock.monotonic())
            return True

    def begin_hard_caps(self) -> list[RetainedEntry]:
        """Live entries past their hard cap start ending: the registry is asked to end them."""
        with self._lock:
            now = self._clock.monotonic()
            capped = [
                e
                for e in self._entries.values()
                if e.live and e.hold_until(self.max_retention_seconds) <= now
            ]
            for entry in capped:
                self._begin_local_end(entry, EndReason.HARD_CAP, now)
            return capped

    def collect_due(self) -> list[RetainedEntry]:
        """Removes and returns the entries whose blocks must be freed now: confirmed ends past their
        grace, and (``confirmed`` false) unconfirmed ones past the hard cap plus grace."""
        with self._lock:
            now = self._clock.monotonic()
            due = [e for e in self._entries.values() if self._free_at(e) <= now]
            for entry in due:
                if entry.release_at is None:
                    entry.end_reason = entry.end_reason or EndReason.HARD_CAP
                    entry.release_at = now
                    self.unconfirmed_frees += 1
                else:
                    entry.confirmed = True
                del self._entries[entry.request_id]
                self._forget(entry)
                reason = entry.end_reason or EndReason.HARD_CAP
                self.freed_total[reason] = self.freed_total.get(reason, 0) + 1
            return due

    def next_due(self) -> float | None:
        """Monotonic time of the next change due (a hard cap beginning, a free), or None."""
        with self._lock:
            if not self._entries:
                return None
            return min(self._due_at(e) for e in self._entries.values())

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

    def held_blocks(self, tier: Tier | None = None) -> int:
        """Blocks not yet freed (live retentions, ending ones and those in their grace period), of one tier
        or (None) of both."""
        with self._lock:
            return sum(len(e.block_ids) for e in self._entries.values() if tier is None or e.tier is tier)

    def live_blocks(self) -> int:
        """Blocks of retentions that have not begun to end (what the budget counts)."""
        with self._lock:
            return sum(len(e.block_ids) for e in self._entries.values() if e.live)

    def request_ids(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    # -- internals ------------------------------------------------------------------------------

    def _free_at(self, entry: RetainedEntry) -> float:
        if entry.release_at is not None:
            return entry.release_at
        if entry.live:
            return math.inf  # a live entry first starts ending at its hard cap (begin_hard_caps)
        return entry.hold_until(self.max_retention_seconds) + self.grace_seconds

    def _due_at(self, entry: RetainedEntry) -> float:
        if entry.live:
            return entry.hold_until(self.max_retention_seconds)
        return self._free_at(entry)

    def _contact(self, entry: RetainedEntry, lease_expire_wall: float | None, now: float) -> None:
        entry.last_contact = now
        if lease_expire_wall is not None and math.isfinite(lease_expire_wall):
            lease_deadline = now + (lease_expire_wall - self._clock.wall()) + self.grace_seconds
            # A renewal only ever extends what the engine promised to keep.
            if entry.lease_deadline is None or lease_deadline > entry.lease_deadline:
                entry.lease_deadline = lease_deadline
                entry.lease_expire_wall = lease_expire_wall

    def _forget(self, entry: RetainedEntry) -> None:
        key = (entry.tenant, entry.conversation_id)
        same_conversation = self._by_conversation.get(key)
        if same_conversation is not None:
            same_conversation.discard(entry.request_id)
            if not same_conversation:
                del self._by_conversation[key]
        self._set_superseded_by(entry, None)

    def _set_superseded_by(self, entry: RetainedEntry, superseder: str | None) -> None:
        if entry.superseded_by is not None:
            waiting = self._superseding.get(entry.superseded_by)
            if waiting is not None:
                waiting.discard(entry.request_id)
                if not waiting:
                    del self._superseding[entry.superseded_by]
        entry.superseded_by = superseder
        if superseder is not None:
            self._superseding.setdefault(superseder, set()).add(entry.request_id)

    def _begin_end(
        self, entry: RetainedEntry, reason: EndReason, now: float, *, superseded_by: str | None = None
    ) -> None:
        entry.end_reason = reason
        entry.end_started_at = now
        self._set_superseded_by(entry, superseded_by)

    def _begin_local_end(self, entry: RetainedEntry, reason: EndReason, now: float) -> None:
        """An end this engine starts: the registry must confirm it. A turn waiting for this one's
        publish to settle its end is live again (this one will not be published now)."""
        self._begin_end(entry, reason, now)
        entry.end_call_due = True
        self._wanting[entry.request_id] = None
        self._settle_superseded(entry.request_id, accepted=False, revision=0, now=now)

    def _confirm_or_call(self, entry: RetainedEntry, now: float, revision: int) -> None:
        """The registry no longer serves it; confirmed unless a report of it may still land."""
        if entry.unsettled:
            entry.end_call_due = True
            self._wanting[entry.request_id] = None
        else:
            self._confirm(entry, now, revision)

    def _confirm(self, entry: RetainedEntry, now: float, revision: int) -> None:
        self._set_superseded_by(entry, None)
        entry.end_call_due = False
        entry.end_revision = revision
        entry.release_at = now + self.grace_seconds

    def _settle_superseded(
        self, request_id: str, *, accepted: bool, revision: int, now: float
    ) -> list[RetainedEntry]:
        """Settles the turns ``request_id`` superseded here: ended with it accepted (its publish
        replaced whatever older turn the registry held, so those superseded in turn end too), live
        again with it refused or ended before its publish. Returns the ones live again."""
        restored: list[RetainedEntry] = []
        for waiting in sorted(self._superseding.pop(request_id, ())):
            entry = self._entries[waiting]
            entry.superseded_by = None
            if accepted:
                self._confirm_or_call(entry, now, revision)
                self._settle_superseded(entry.request_id, accepted=True, revision=revision, now=now)
            else:
                entry.end_reason = None
                entry.end_started_at = None
                self._wanting[entry.request_id] = None
                restored.append(entry)
        return restored
