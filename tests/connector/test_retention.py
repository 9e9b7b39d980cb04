"""The retention table: every end confirmed by the registry before the grace starts (issue 13), the
hard cap, renewals, revisions that keep stale news from ending newer retentions, supersession and
the LRU budget. Pure logic with a fake clock."""

from __future__ import annotations

import grpc
import pytest
from kvferry.connector.keeper import RetentionKeeper
from kvferry.connector.retention import END_CALL_RETRY_SECONDS, EndReason, RetainedEntry, RetentionTable, Tier
from kvferry.connector.sidecar_link import EndCall, RetentionReport

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


def add(
    t: RetentionTable, request_id: str, conversation: str = "c", turn: int = 1, blocks: int = 4
) -> list[RetainedEntry]:
    _, superseded = t.add(
        request_id=request_id,
        tenant="acme",
        conversation_id=conversation,
        turn=turn,
        block_ids=range(blocks),
        num_tokens=blocks * 16,
    )
    return superseded


def publish(t: RetentionTable, request_id: str, revision: int, lease_end: float | None = None) -> None:
    """The link takes the report and the sidecar acknowledges it."""
    taken = t.take_call()
    assert taken is not None and taken == ("report", t.get(request_id)), taken
    entry = t.get(request_id)
    assert entry is not None
    t.acknowledged(
        request_id, lease_end, revision, tenant=entry.tenant, conversation_id=entry.conversation_id
    )


def freed(t: RetentionTable) -> list[tuple[str, bool]]:
    return [(e.request_id, e.confirmed) for e in t.collect_due()]


def confirm_end(t: RetentionTable, request_id: str, revision: int) -> None:
    taken = t.take_call()
    assert taken is not None and taken[0] == "end" and taken[1].request_id == request_id, taken
    assert t.end_confirmed(request_id, revision)


# --- the hard cap ---------------------------------------------------------------------------------


def test_at_the_hard_cap_the_registry_is_asked_first_and_unconfirmed_blocks_go_a_grace_later(
    clock: FakeClock,
) -> None:
    t = table(clock)
    add(t, "r1")
    assert t.next_due() == clock.now + CAP
    clock.advance(CAP - 0.1)
    assert t.begin_hard_caps() == [] and not t.has_due()
    clock.advance(0.1)
    assert t.has_due()
    (capped,) = t.begin_hard_caps()
    assert capped.request_id == "r1" and capped.end_reason is EndReason.HARD_CAP
    assert freed(t) == []
    taken = t.take_call()
    assert taken is not None and taken[0] == "end"
    # No answer (the sidecar is away): freed a grace later, unconfirmed (the connector fences them).
    clock.advance(GRACE)
    assert freed(t) == [("r1", False)]
    assert len(t) == 0 and t.next_due() is None
    assert t.freed_total == {EndReason.HARD_CAP: 1} and t.unconfirmed_frees == 1


def test_a_hard_cap_the_registry_confirms_is_freed_a_grace_after_the_confirmation(clock: FakeClock) -> None:
    t = table(clock)
    add(t, "r1")
    clock.advance(CAP)
    t.begin_hard_caps()
    clock.advance(GRACE / 2)
    confirm_end(t, "r1", revision=9)
    clock.advance(GRACE - 0.01)
    assert freed(t) == []
    clock.advance(0.01)
    assert freed(t) == [("r1", True)]
    assert t.unconfirmed_frees == 0


def test_a_prefill_reading_the_blocks_frees_nothing(clock: FakeClock) -> None:
    # There is no "read" input at all: only the registry's word, the cap and the budget free.
    t = table(clock)
    add(t, "r1")
    clock.advance(CAP / 2)
    assert freed(t) == [] and "r1" in t


def test_renewals_extend_and_never_shorten_the_hold(clock: FakeClock) -> None:
    t = table(clock)
    add(t, "r1")
    lease_end = clock.wall() + 3 * CAP
    assert t.renew("r1", lease_end)
    assert t.next_due() == pytest.approx(clock.now + 3 * CAP + GRACE)
    # An older (shorter) expiry arriving late does not pull the deadline in.
    assert t.renew("r1", clock.wall() + 10)
    assert t.next_due() == pytest.approx(clock.now + 3 * CAP + GRACE)
    clock.advance(3 * CAP + GRACE)
    assert [e.request_id for e in t.begin_hard_caps()] == ["r1"]


def test_contact_restarts_the_hard_cap(clock: FakeClock) -> None:
    t = table(clock)
    add(t, "r1")
    clock.advance(CAP - 1)
    publish(t, "r1", revision=5, lease_end=clock.wall() + 5)
    entry = t.get("r1")
    assert entry is not None and entry.published and entry.revision == 5
    clock.advance(CAP - 1)
    assert t.begin_hard_caps() == []


# --- the registry's own ends ----------------------------------------------------------------------


def test_an_end_from_the_registry_is_freed_after_the_grace_period(clock: FakeClock) -> None:
    t = table(clock)
    add(t, "r1")
    publish(t, "r1", revision=5)
    t.renew("r1", clock.wall() + 10 * CAP, revision=6)
    assert t.end("r1", EndReason.RELEASED, revision=7)
    assert not t.end("r1", EndReason.EXPIRED, revision=8), "a second end changes nothing"
    assert not t.renew("r1", clock.wall() + 20 * CAP), "an ended retention is not renewed"
    assert t.take_call() is None, "the registry's own end needs no confirmation"
    clock.advance(GRACE - 0.01)
    assert freed(t) == []
    clock.advance(0.01)
    (entry,) = t.collect_due()
    assert (entry.end_reason, entry.confirmed, entry.end_revision) == (EndReason.RELEASED, True, 7)


def test_sync_ends_acknowledged_retentions_the_registry_no_longer_holds(clock: FakeClock) -> None:
    t = table(clock)
    add(t, "published-gone")
    add(t, "published-live", conversation="c2")
    publish(t, "published-gone", revision=3)
    publish(t, "published-live", revision=4)
    add(t, "unpublished", conversation="c3")
    assert t.sync(["published-live"], revision=10) == ["published-gone"]
    assert t.get("unpublished") is not None and t.get("unpublished").live  # type: ignore[union-attr]
    clock.advance(GRACE)
    assert freed(t) == [("published-gone", True)]


def test_a_sync_older_than_an_acknowledgement_ends_nothing(clock: FakeClock) -> None:
    """The sidecar built the SYNC before the publish; the connector read it after the answer."""
    t = table(clock)
    add(t, "r1")
    publish(t, "r1", revision=20)
    assert t.sync([], revision=19) == []
    assert t.get("r1") is not None and t.get("r1").live  # type: ignore[union-attr]
    # A SYNC from after the publish that does not list it is news.
    assert t.sync([], revision=21) == ["r1"]


def test_an_end_older_than_the_acknowledgement_ends_nothing(clock: FakeClock) -> None:
    t = table(clock)
    add(t, "r1")
    publish(t, "r1", revision=20)
    assert not t.end("r1", EndReason.RELEASED, revision=15)
    assert t.get("r1").live  # type: ignore[union-attr]


def test_an_end_while_a_report_may_still_land_asks_the_registry_to_end_it_for_good(
    clock: FakeClock,
) -> None:
    t = table(clock)
    add(t, "r1")
    taken = t.take_call()
    assert taken is not None and taken[0] == "report"
    t.report_failed("r1")  # no answer: it may have landed
    assert t.end("r1", EndReason.EXPIRED, revision=30)
    clock.advance(GRACE)
    assert freed(t) == [], "not confirmed while the report may still land"
    confirm_end(t, "r1", revision=31)
    clock.advance(GRACE)
    assert freed(t) == [("r1", True)]


def test_a_report_landing_after_the_end_was_confirmed_is_ended_again(clock: FakeClock) -> None:
    t = table(clock)
    add(t, "r1")
    publish(t, "r1", revision=10)
    t.end("r1", EndReason.RELEASED, revision=11)
    # A retry of the report (its first answer lost) lands after the end: live again in the registry.
    t.acknowledged("r1", None, 12, tenant="acme", conversation_id="c")
    clock.advance(GRACE)
    assert freed(t) == []
    confirm_end(t, "r1", revision=13)
    clock.advance(GRACE)
    assert freed(t) == [("r1", True)]


def test_an_acknowledgement_of_a_request_already_freed_ends_it_in_the_registry(clock: FakeClock) -> None:
    t = table(clock)
    t.acknowledged("gone", None, 40, tenant="acme", conversation_id="c")
    taken = t.take_call()
    assert taken is not None and taken[0] == "end" and taken[1].request_id == "gone"
    assert t.end_confirmed("gone", 41)
    assert t.take_call() is None


# --- supersession here and two turns of one conversation ------------------------------------------


def test_a_newer_turn_supersedes_older_ones_once_its_publish_is_accepted(clock: FakeClock) -> None:
    t = table(clock)
    add(t, "t1", turn=1)
    publish(t, "t1", revision=5)
    add(t, "other", conversation="other", turn=1)
    superseded = add(t, "t2", turn=2)
    assert [e.request_id for e in superseded] == ["t1"]
    assert t.get("t1").end_reason is EndReason.SUPERSEDED  # type: ignore[union-attr]
    clock.advance(GRACE)
    assert freed(t) == [], "not before the registry replaced it"
    publish(t, "other", revision=6)
    publish(t, "t2", revision=8)
    clock.advance(GRACE)
    assert freed(t) == [("t1", True)]
    with pytest.raises(ValueError, match="already retained"):
        add(t, "t2")


def test_two_turns_of_one_conversation_the_refused_one_is_freed_the_live_one_kept(clock: FakeClock) -> None:
    """Two concurrent requests with the same conversation and turn: the registry keeps the first
    and refuses the second; D must free the second and keep serving the first."""
    t = table(clock)
    add(t, "first", turn=3)
    publish(t, "first", revision=5)
    add(t, "second", turn=3)  # supersedes "first" here, for now
    taken = t.take_call()
    assert taken is not None and taken == ("report", t.get("second"))
    kept = t.refused("second")
    assert [e.request_id for e in kept] == ["first"]
    assert t.get("first").live  # type: ignore[union-attr]
    second = t.get("second")
    assert second is not None and second.end_reason is EndReason.REFUSED
    clock.advance(GRACE)
    assert freed(t) == [("second", True)], "the refused one goes (its report could not land)"
    clock.advance(CAP / 2)
    assert freed(t) == [] and "first" in t


def test_a_refused_report_that_may_have_landed_earlier_is_ended_in_the_registry(clock: FakeClock) -> None:
    t = table(clock)
    add(t, "r1")
    t.take_call()
    t.report_failed("r1")
    t.take_call()
    t.refused("r1")
    clock.advance(GRACE)
    assert freed(t) == []
    confirm_end(t, "r1", revision=3)
    clock.advance(GRACE)
    assert freed(t) == [("r1", True)]


def test_a_chain_of_turns_superseded_here_ends_with_the_newest_accepted(clock: FakeClock) -> None:
    t = table(clock)
    add(t, "t1", turn=1)
    add(t, "t2", turn=2)
    add(t, "t3", turn=3)
    taken = t.take_call()
    assert taken is not None and taken[1].request_id == "t3", "only live retentions are reported"
    t.acknowledged("t3", None, 9, tenant="acme", conversation_id="c")
    clock.advance(GRACE)
    assert sorted(freed(t)) == [("t1", True), ("t2", True)]


def test_the_end_of_a_turn_never_acknowledged_leaves_the_turn_it_superseded_live(clock: FakeClock) -> None:
    """The registry's word that a newer turn is not held says nothing of the older turn: the newer one's
    report got no answer (etcd out of space) and never landed, the sidecar's sweep then found the registry
    holding the older turn and announced the newer one ENDED. Seen in the fault harness: D freed turn 2 a
    grace later while the registry kept handing it out, and the next turn's prefill read the freed blocks."""
    t = table(clock)
    add(t, "t2", turn=2)
    publish(t, "t2", revision=5)
    add(t, "t3", turn=3)  # supersedes t2 here, until t3's publish is accepted
    taken = t.take_call()
    assert taken == ("report", t.get("t3"))
    t.report_failed("t3")  # no answer: it may or may not have landed
    assert t.end("t3", EndReason.SUPERSEDED, revision=7)
    assert t.get("t2").live  # type: ignore[union-attr]
    clock.advance(GRACE)
    assert freed(t) == [], "t3 may still land: ended in the registry first; t2 is still served"
    confirm_end(t, "t3", revision=8)
    clock.advance(GRACE)
    assert freed(t) == [("t3", True)]
    clock.advance(CAP / 2)
    assert freed(t) == [] and "t2" in t
    # The registry's own end of t2 (its lease ran out) frees it, as any live retention.
    assert t.end("t2", EndReason.EXPIRED, revision=9)
    clock.advance(GRACE)
    assert freed(t) == [("t2", True)]


def test_a_turn_superseded_by_one_evicted_before_its_publish_is_live_again(clock: FakeClock) -> None:
    t = table(clock, budget=4)
    add(t, "t1", turn=1)
    publish(t, "t1", revision=2)
    add(t, "t2", turn=2, blocks=8)  # over budget alone
    assert [e.request_id for e in t.evict_over_budget()] == ["t2"]
    assert t.get("t1").live  # type: ignore[union-attr]


# --- the budget -----------------------------------------------------------------------------------


def test_budget_evicts_least_recently_used_and_frees_only_once_the_registry_confirms(
    clock: FakeClock,
) -> None:
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
    assert t.live_blocks() == 8 and t.held_blocks() == 12, "evicted blocks stay held until freed"
    assert t.evict_over_budget() == []
    clock.advance(GRACE)
    assert freed(t) == [], "no confirmation yet"
    confirm_end(t, "middle", revision=4)
    clock.advance(GRACE)
    assert [(e.request_id, e.end_reason, e.confirmed) for e in t.collect_due()] == [
        ("middle", EndReason.EVICTED, True)
    ]


def test_no_eviction_is_ever_lost_however_many_wait(clock: FakeClock) -> None:
    """Calls are not queued (where a full queue dropped the oldest, perhaps an eviction): each one
    waiting is found in the table until the registry confirms it."""
    t = table(clock, budget=0)
    count = 12_000
    for i in range(count):
        add(t, f"r{i}", conversation=f"c{i}", blocks=1)
    assert len(t.evict_over_budget()) == count
    confirmed: set[str] = set()
    while (taken := t.take_call()) is not None:
        kind, entry = taken
        assert kind == "end"
        assert t.end_confirmed(entry.request_id, 1)
        confirmed.add(entry.request_id)
    assert len(confirmed) == count


def test_an_end_call_the_sidecar_refuses_is_asked_again_later(clock: FakeClock) -> None:
    t = table(clock, budget=0)
    add(t, "r1")
    t.evict_over_budget()
    taken = t.take_call()
    assert taken is not None and taken[0] == "end"
    t.end_call_refused("r1")
    assert t.take_call() is None
    clock.advance(END_CALL_RETRY_SECONDS)
    taken = t.take_call()
    assert taken is not None and taken[0] == "end"


def test_a_report_failing_internally_is_ended_through_the_registry(clock: FakeClock) -> None:
    t = table(clock)
    keeper = RetentionKeeper(t, engine_id="decode-0", lease_ttl_seconds=30)
    add(t, "definitive", conversation="a")
    add(t, "internal", conversation="b")
    for request_id, code in (
        ("definitive", grpc.StatusCode.FAILED_PRECONDITION),
        ("internal", grpc.StatusCode.INTERNAL),
    ):
        call = keeper.take_call()
        assert isinstance(call, RetentionReport) and call.request_id == request_id
        keeper.on_report_refused(call, code, "no")
    clock.advance(GRACE)
    assert freed(t) == [("definitive", True)]
    end = keeper.take_call()
    assert isinstance(end, EndCall) and (end.request_id, end.reason) == ("internal", EndReason.REFUSED)


# --- tiers (kvferry.connector.host_tier) -----------------------------------------------------------------


def test_a_relocation_supersedes_its_own_turn_and_the_budget_counts_the_kv_cache_only(
    clock: FakeClock,
) -> None:
    t = table(clock, budget=6)
    add(t, "r1", blocks=4)
    publish(t, "r1", revision=10)
    _, superseded = t.add(
        request_id="r1.host",
        tenant="acme",
        conversation_id="c",
        turn=1,
        block_ids=range(100, 104),
        num_tokens=64,
        tier=Tier.HOST,
        relocates="r1",
    )
    assert [e.request_id for e in superseded] == ["r1"]
    assert (t.held_blocks(Tier.DEVICE), t.held_blocks(Tier.HOST), t.held_blocks()) == (4, 4, 8)
    # Past the KV cache's budget of 6 only with both tiers counted: nothing to evict.
    add(t, "r2", conversation="d", blocks=5)
    assert t.evict_over_budget() == []
    assert [e.request_id for e in t.live_entries(Tier.HOST)] == ["r1.host"]
    # The move is accepted: the KV-cache retention ends with it and its blocks go a grace later.
    publish(t, "r1.host", revision=11)
    clock.advance(GRACE + 0.1)
    assert freed(t) == [("r1", True)]
    assert t.held_blocks(Tier.DEVICE) == 5
