"""The retention table: deadlines, renewals, ends with grace, sync, supersession, LRU budget."""

from __future__ import annotations

import pytest
from kvferry.connector.retention import EndReason, RetentionTable

CAP = 100.0
GRACE = 10.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.wall_offset = 5_000_000.0

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.now + self.wall_offset

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def table(clock: FakeClock, budget: int = 1000) -> RetentionTable:
    return RetentionTable(max_retention_seconds=CAP, grace_seconds=GRACE, budget_blocks=budget, clock=clock)


def add(t: RetentionTable, request_id: str, conversation: str = "c", turn: int = 1, blocks: int = 4) -> None:
    t.add(
        request_id=request_id,
        tenant="acme",
        conversation_id=conversation,
        turn=turn,
        block_ids=range(blocks),
        num_tokens=blocks * 16,
    )


def test_without_word_from_the_registry_blocks_are_freed_at_the_hard_cap(clock: FakeClock) -> None:
    t = table(clock)
    add(t, "r1")
    assert t.next_due() == clock.now + CAP
    clock.advance(CAP - 0.1)
    assert t.collect_due() == [] and not t.has_due()
    clock.advance(0.1)
    assert t.has_due()
    (freed,) = t.collect_due()
    assert freed.request_id == "r1" and freed.end_reason is EndReason.HARD_CAP
    assert len(t) == 0 and t.next_due() is None
    assert t.freed_total == {EndReason.HARD_CAP: 1}


def test_a_prefill_reading_the_blocks_frees_nothing(clock: FakeClock) -> None:
    # There is no "read" input at all: only the registry's word, the cap and the budget free.
    t = table(clock)
    add(t, "r1")
    clock.advance(CAP / 2)
    assert t.collect_due() == [] and "r1" in t


def test_renewals_extend_and_never_shorten_the_hold(clock: FakeClock) -> None:
    t = table(clock)
    add(t, "r1")
    lease_end = clock.wall() + 3 * CAP
    assert t.renew("r1", lease_end)
    assert t.next_due() == pytest.approx(clock.now + 3 * CAP + GRACE)
    # An older (shorter) expiry arriving late does not pull the deadline in.
    assert t.renew("r1", clock.wall() + 10)
    assert t.next_due() == pytest.approx(clock.now + 3 * CAP + GRACE)
    clock.advance(3 * CAP)
    assert t.collect_due() == []
    clock.advance(GRACE)
    assert [e.request_id for e in t.collect_due()] == ["r1"]


def test_contact_restarts_the_hard_cap(clock: FakeClock) -> None:
    t = table(clock)
    add(t, "r1")
    clock.advance(CAP - 1)
    t.acknowledge("r1", clock.wall() + 5)
    assert t.get("r1") is not None and t.get("r1").published  # type: ignore[union-attr]
    clock.advance(CAP - 1)
    assert t.collect_due() == []


def test_an_ended_retention_is_freed_after_the_grace_period(clock: FakeClock) -> None:
    t = table(clock)
    add(t, "r1")
    t.renew("r1", clock.wall() + 10 * CAP)
    assert t.end("r1", EndReason.RELEASED)
    assert not t.end("r1", EndReason.EXPIRED), "a second end changes nothing"
    assert not t.renew("r1", clock.wall() + 20 * CAP), "an ended retention is not renewed"
    clock.advance(GRACE - 0.01)
    assert t.collect_due() == []
    clock.advance(0.01)
    (freed,) = t.collect_due()
    assert freed.end_reason is EndReason.RELEASED


def test_sync_ends_published_retentions_the_registry_no_longer_holds(clock: FakeClock) -> None:
    t = table(clock)
    add(t, "published-gone")
    add(t, "published-live", conversation="c2")
    add(t, "unpublished", conversation="c3")
    t.acknowledge("published-gone", None)
    t.acknowledge("published-live", None)
    assert t.sync(["published-live"]) == ["published-gone"]
    assert [e.request_id for e in t.unpublished()] == ["unpublished"]
    clock.advance(GRACE)
    assert [e.request_id for e in t.collect_due()] == ["published-gone"]


def test_a_newer_turn_supersedes_older_ones_of_the_same_conversation(clock: FakeClock) -> None:
    t = table(clock)
    add(t, "t1", turn=1)
    add(t, "other", conversation="other", turn=1)
    _, superseded = t.add(
        request_id="t2", tenant="acme", conversation_id="c", turn=2, block_ids=[9], num_tokens=16
    )
    assert [e.request_id for e in superseded] == ["t1"]
    assert t.get("t1").end_reason is EndReason.SUPERSEDED  # type: ignore[union-attr]
    clock.advance(GRACE)
    assert [e.request_id for e in t.collect_due()] == ["t1"]
    with pytest.raises(ValueError, match="already retained"):
        add(t, "t2")


def test_budget_evicts_least_recently_used_first(clock: FakeClock) -> None:
    t = table(clock, budget=10)
    add(t, "oldest", conversation="a", blocks=4)
    clock.advance(1)
    add(t, "middle", conversation="b", blocks=4)
    clock.advance(1)
    t.renew("oldest", clock.wall() + 50)  # used again: now the most recent
    clock.advance(1)
    add(t, "newest", conversation="c", blocks=4)
    evicted = t.evict_over_budget()
    assert [e.request_id for e in evicted] == ["middle"]
    assert t.live_blocks() == 8 and t.held_blocks() == 12, "evicted blocks stay held during the grace"
    assert t.evict_over_budget() == []
    clock.advance(GRACE)
    assert [e.end_reason for e in t.collect_due()] == [EndReason.EVICTED]
