"""Turns in flight (BeginTurn / EndTurn) against a real registry on a real etcd: one turn per conversation at
a time, across registry replicas; a mark nobody renews expires."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence

import grpc
import pytest
import pytest_asyncio
from kvferry.registry.cache import RetentionCache
from kvferry.registry.errors import TurnInFlight
from kvferry.registry.etcd import Compare, Delete, EtcdGateway, EtcdSettings, Get, Op, RangeResult, TxnResult
from kvferry.registry.keys import ConversationKey, KeyLayout
from kvferry.registry.retentions import RetentionStore
from kvferry.registry.turns import LeasePool, TurnStore
from kvferry.runtime.clock import ManualClock
from kvferry.runtime.errors import Unavailable
from kvferry.stack.etcd_process import EtcdProcess
from kvferry.v1 import registry_service_pb2 as api
from kvferry.v1 import registry_service_pb2_grpc as registry_grpc

from tests.fixtures.registry import RegistryHandle, running_registry, unique
from tests.registry.builders import get, publish, register, retention, status_of

pytestmark = pytest.mark.timeout(60)


def begin(
    tenant: str, conversation_id: str, request_id: str, *, holder: str = "router-a:1", ttl_seconds: int = 0
) -> api.BeginTurnRequest:
    return api.BeginTurnRequest(
        tenant=tenant,
        conversation_id=conversation_id,
        request_id=request_id,
        holder=holder,
        ttl_seconds=ttl_seconds,
    )


def end(tenant: str, conversation_id: str, request_id: str) -> api.EndTurnRequest:
    return api.EndTurnRequest(tenant=tenant, conversation_id=conversation_id, request_id=request_id)


@pytest_asyncio.fixture(loop_scope="session")
async def second_replica(registry: RegistryHandle) -> AsyncIterator[RegistryHandle]:
    """Another registry process on the same etcd and key prefix as ``registry``."""
    async with running_registry(dataclasses.replace(registry.config, listen_address="127.0.0.1:0")) as handle:
        yield handle


async def test_a_second_turn_of_a_conversation_is_refused_naming_the_running_one(
    registry: RegistryHandle,
) -> None:
    stub = registry.stub()
    tenant, conv = unique("tenant"), unique("conv")
    begun = await stub.BeginTurn(begin(tenant, conv, "kvf-first"), timeout=5)
    assert begun.ttl_seconds >= 5 and begun.header.revision > 0
    assert (begun.turn.request_id, begun.turn.holder) == ("kvf-first", "router-a:1")
    assert begun.turn.start_time.seconds > 0 and begun.retained_turn == 0

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.BeginTurn(begin(tenant, conv, "kvf-second", holder="router-b:2"), timeout=5)
    assert refused.value.code() == grpc.StatusCode.ABORTED
    details = refused.value.details() or ""
    assert f"conversation {conv} of tenant {tenant} has a turn in flight" in details
    assert "request kvf-first (on router-a:1, started" in details

    # Other conversations, and the same conversation id of another tenant, are not held.
    await stub.BeginTurn(begin(tenant, unique("conv"), "kvf-other"), timeout=5)
    await stub.BeginTurn(begin(unique("tenant"), conv, "kvf-other"), timeout=5)

    ended = await stub.EndTurn(end(tenant, conv, "kvf-first"), timeout=5)
    assert ended.ended
    again = await stub.BeginTurn(begin(tenant, conv, "kvf-second", holder="router-b:2"), timeout=5)
    assert again.turn.request_id == "kvf-second"
    refused_count = registry.registry.metrics.registry.get_sample_value(
        "kvferry_registry_turns_refused_total"
    )
    assert refused_count is not None and refused_count >= 1


async def test_the_running_turn_renews_its_mark_and_only_it_clears_it(registry: RegistryHandle) -> None:
    stub = registry.stub()
    tenant, conv = unique("tenant"), unique("conv")
    first = await stub.BeginTurn(begin(tenant, conv, "kvf-a", ttl_seconds=2), timeout=5)
    for _ in range(3):
        await asyncio.sleep(1.0)
        renewed = await stub.BeginTurn(begin(tenant, conv, "kvf-a", ttl_seconds=2), timeout=5)
        assert renewed.turn.start_time == first.turn.start_time
    # 3 s after it was taken under a 2 s lease, the renewals kept it.
    assert await status_of(stub.BeginTurn(begin(tenant, conv, "kvf-b"), timeout=5)) == grpc.StatusCode.ABORTED
    # Another turn's EndTurn leaves it alone.
    assert not (await stub.EndTurn(end(tenant, conv, "kvf-b"), timeout=5)).ended
    assert await status_of(stub.BeginTurn(begin(tenant, conv, "kvf-b"), timeout=5)) == grpc.StatusCode.ABORTED
    assert (await stub.EndTurn(end(tenant, conv, "kvf-a"), timeout=5)).ended
    assert not (await stub.EndTurn(end(tenant, conv, "kvf-a"), timeout=5)).ended


async def test_a_mark_nobody_renews_expires_with_its_lease(registry: RegistryHandle) -> None:
    """A router that died mid-turn neither renews nor clears its mark: the conversation is free again within
    the mark's lease."""
    stub = registry.stub()
    tenant, conv = unique("tenant"), unique("conv")
    begun = await stub.BeginTurn(begin(tenant, conv, "kvf-crashed", ttl_seconds=2), timeout=5)
    taken_at = time.monotonic()
    assert begun.ttl_seconds == 2
    while True:
        try:
            await stub.BeginTurn(begin(tenant, conv, "kvf-next"), timeout=5)
            break
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.ABORTED
            assert time.monotonic() - taken_at < 6.0, "the dead router's mark outlived its lease"
            await asyncio.sleep(0.1)
    assert time.monotonic() - taken_at >= 1.5


async def test_replicas_share_marks(registry: RegistryHandle, second_replica: RegistryHandle) -> None:
    first, second = registry.stub(), second_replica.stub()
    tenant, conv = unique("tenant"), unique("conv")
    begun = await first.BeginTurn(begin(tenant, conv, "kvf-a", ttl_seconds=2), timeout=5)
    assert (
        await status_of(second.BeginTurn(begin(tenant, conv, "kvf-b"), timeout=5)) == grpc.StatusCode.ABORTED
    )
    # The holder renews through the other replica (a router's channel may reach either).
    await asyncio.sleep(1.2)
    renewed = await second.BeginTurn(begin(tenant, conv, "kvf-a", ttl_seconds=2), timeout=5)
    assert renewed.turn.start_time == begun.turn.start_time
    await asyncio.sleep(1.2)
    assert (
        await status_of(first.BeginTurn(begin(tenant, conv, "kvf-b"), timeout=5)) == grpc.StatusCode.ABORTED
    )
    # And clears it there too.
    assert (await second.EndTurn(end(tenant, conv, "kvf-a"), timeout=5)).ended
    await first.BeginTurn(begin(tenant, conv, "kvf-b"), timeout=5)


async def test_concurrent_begins_take_the_mark_once(
    registry: RegistryHandle, second_replica: RegistryHandle
) -> None:
    stubs = [registry.stub(), second_replica.stub()]
    tenant, conv = unique("tenant"), unique("conv")
    calls = [stubs[i % 2].BeginTurn(begin(tenant, conv, f"kvf-{i}"), timeout=5) for i in range(8)]
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    won = [o for o in outcomes if isinstance(o, api.BeginTurnResponse)]
    lost = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    assert len(won) == 1 and len(lost) == 7
    assert all(error.code() == grpc.StatusCode.ABORTED for error in lost)


async def test_the_mark_reads_the_retained_turn_in_the_same_transaction(registry: RegistryHandle) -> None:
    stub = registry.stub()
    engine_id, tenant, conv = unique("engine"), unique("tenant"), unique("conv")
    await register(stub, engine_id, ttl_seconds=30)
    await publish(stub, retention(tenant, conv, engine_id, turn=3))
    begun = await stub.BeginTurn(begin(tenant, conv, "kvf-a"), timeout=5)
    assert (begun.retained_turn, begun.retained_engine_request_id) == (3, f"req-{conv}-3")
    await stub.EndTurn(end(tenant, conv, "kvf-a"), timeout=5)


async def test_the_mark_reports_no_record_once_the_engine_that_published_it_registered_again(
    registry: RegistryHandle, second_replica: RegistryHandle
) -> None:
    """Rule 3 in the mark's transaction too: a record of an engine incarnation that is no longer registered
    (its engine restarted, or an etcd snapshot brought it back) counts as none, before the reaper ends it,
    so a caller that found it in a lagging index looks it up again in the registry, which refuses it."""
    stub, other = registry.stub(), second_replica.stub()
    engine_id, tenant, conv = unique("engine"), unique("tenant"), unique("conv")
    await register(stub, engine_id, ttl_seconds=30)
    await publish(stub, retention(tenant, conv, engine_id, turn=3))
    # Twice on each replica: the first read of a conversation's engine follows the mark, later ones are in
    # its transaction.
    for attempt, replica in enumerate((stub, stub, other, other)):
        begun = await replica.BeginTurn(begin(tenant, conv, f"kvf-{attempt}"), timeout=5)
        assert (begun.retained_turn, begun.retained_engine_request_id) == (3, f"req-{conv}-3")
        await replica.EndTurn(end(tenant, conv, f"kvf-{attempt}"), timeout=5)
    await register(stub, engine_id, ttl_seconds=30)  # a new incarnation
    for attempt, replica in enumerate((stub, other)):
        begun = await replica.BeginTurn(begin(tenant, conv, f"kvf-again-{attempt}"), timeout=5)
        assert (begun.retained_turn, begun.retained_engine_request_id) == (0, "")
        await replica.EndTurn(end(tenant, conv, f"kvf-again-{attempt}"), timeout=5)
    assert await status_of(get(stub, tenant, conv)) == grpc.StatusCode.NOT_FOUND


class _ReadsRefused(EtcdGateway):
    """etcd taking the mark's write but refusing reads, plain or in a transaction that only reads (a read
    that fails after the mark was written)."""

    async def range(
        self, key: bytes, range_end: bytes = b"", *, limit: int = 0, keys_only: bool = False
    ) -> RangeResult:
        raise Unavailable("etcd refused the read (test)")

    async def txn(
        self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        if all(isinstance(op, Get) for op in (*success, *failure)):
            raise Unavailable("etcd refused the read (test)")
        return await super().txn(compare, success, failure)


async def test_a_mark_whose_engine_read_fails_is_kept_and_reports_no_record(
    registry: RegistryHandle, etcd: EtcdProcess
) -> None:
    """The record's engine is read after the mark when the registry has not cached the record: if that read
    fails, the mark stays (failing the call would leave it blocking the conversation until its lease ends)
    and no record is reported, so the caller asks the registry. The marks share the registry's record cache
    (``RetentionStore.cache``): once a lookup cached the record, its engine is read in the mark's own
    transaction, with no read after it (which this etcd refuses)."""
    stub = registry.stub()
    engine_id, tenant, conv = unique("engine"), unique("tenant"), unique("conv")
    await register(stub, engine_id, ttl_seconds=30)
    await publish(stub, retention(tenant, conv, engine_id, turn=3))
    layout = KeyLayout(registry.key_prefix)
    gateway = EtcdGateway(EtcdSettings(endpoints=(etcd.endpoint,)))
    refusing = _ReadsRefused(EtcdSettings(endpoints=(etcd.endpoint,)))
    await gateway.connect()
    await refusing.connect()
    retentions = RetentionStore(gateway, layout, registry.config.ttl)
    turns = TurnStore(refusing, layout, registry.config.ttl, records=retentions.cache)
    try:
        begun = await turns.begin_turn(tenant, conv, "kvf-a", "router-a:1", 5)
        assert (begun.retained_turn, begun.retained_request_id) == (0, "")
        with pytest.raises(TurnInFlight):
            await turns.begin_turn(tenant, conv, "kvf-b", "router-a:1", 5)
        assert (await turns.end_turn(tenant, conv, "kvf-a")).ended
        await retentions.get_retention(tenant, conv)  # a lookup caches the record
        again = await turns.begin_turn(tenant, conv, "kvf-c", "router-a:1", 5)
        assert (again.retained_turn, again.retained_request_id) == (3, f"req-{conv}-3")
        await turns.end_turn(tenant, conv, "kvf-c")
    finally:
        await turns.close()
        await refusing.close()
        await gateway.close()


async def test_the_mark_reads_after_itself_what_it_did_not_guess(
    registry: RegistryHandle, etcd: EtcdProcess
) -> None:
    """A record the registry has not cached, one on another engine than the cached one (the conversation
    moved), or one without a renewal key (published before renewal keys were written with the record): the
    mark reads it after itself (and caches it) and reports it while its engine incarnation is registered."""
    stub = registry.stub()
    first, second, tenant, conv = unique("engine"), unique("engine"), unique("tenant"), unique("conv")
    await register(stub, first, ttl_seconds=30)
    await register(stub, second, ttl_seconds=30)
    await publish(stub, retention(tenant, conv, first, turn=3))
    layout = KeyLayout(registry.key_prefix)
    live_key = layout.live(ConversationKey(tenant, conv))
    gateway = EtcdGateway(EtcdSettings(endpoints=(etcd.endpoint,)))
    await gateway.connect()
    records = RetentionCache(1 << 20)
    turns = TurnStore(gateway, layout, registry.config.ttl, records=records)

    async def retained(request_id: str) -> tuple[int, str]:
        begun = await turns.begin_turn(tenant, conv, request_id, "router-a:1", 5)
        await turns.end_turn(tenant, conv, request_id)
        return begun.retained_turn, begun.retained_request_id

    try:
        assert await retained("kvf-a") == (3, f"req-{conv}-3")
        cached = records.get(live_key)
        assert cached is not None and cached.stored.retention.engine_id == first
        await publish(stub, retention(tenant, conv, second, turn=4))  # the registry's cache, not this one's
        assert await retained("kvf-b") == (4, f"req-{conv}-4")
        cached = records.get(live_key)
        assert cached is not None and cached.stored.retention.engine_id == second
        await gateway.txn([], [Delete(layout.holder(ConversationKey(tenant, conv)))])
        assert await retained("kvf-c") == (4, f"req-{conv}-4")
        await register(stub, second, ttl_seconds=30)  # a new incarnation: the record counts as none
        assert await retained("kvf-d") == (0, "")
    finally:
        await turns.close()
        await gateway.close()


@pytest.mark.parametrize(
    ("request_", "fragment"),
    [
        (begin("", "c", "r"), "tenant is required"),
        (begin("t", "c/x", "r"), "conversation_id"),
        (begin("t", "c", ""), "request_id is required"),
        (begin("t", "c", "r", holder="a b"), "holder"),
        (begin("t", "c", "r", ttl_seconds=-1), "turn ttl_seconds is -1"),
        (begin("t", "c", "r", ttl_seconds=3600), "at most 60 s"),
    ],
)
async def test_bad_begin_turn_requests_are_invalid(
    registry: RegistryHandle, request_: api.BeginTurnRequest, fragment: str
) -> None:
    stub: registry_grpc.RegistryServiceStub = registry.stub()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.BeginTurn(request_, timeout=5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in (refused.value.details() or "")


async def test_the_lease_pool_hands_out_only_leases_with_two_thirds_of_their_ttl_left(
    etcd: EtcdProcess,
) -> None:
    gateway = EtcdGateway(EtcdSettings(endpoints=(etcd.endpoint,)))
    await gateway.connect()
    clock = ManualClock()
    pool = LeasePool(gateway, 6, spares=2, clock=clock)
    try:
        first = await pool.take()  # nothing granted ahead yet: granted now
        pool.fill()
        await asyncio.sleep(1.0)  # two grants in the background
        spare = await pool.take()
        assert spare.id != first.id and spare.ttl_seconds == 6
        await clock.advance(2.5)  # more than a third of 6 s: the other spare is too old to hand out
        late = await pool.take()
        assert late.id not in (first.id, spare.id)
    finally:
        await pool.close()
        await gateway.close()
