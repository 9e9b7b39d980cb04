"""Relocations against a real registry on a real etcd: a decode engine moved an idle retention's KV to
another tier (its host pool) and publishes the same turn again with new block ids, naming the record it
replaces (``Retention.relocates_engine_request_id``)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
from kvferry.registry.config import TtlPolicy
from kvferry.registry.etcd import EtcdGateway, EtcdSettings, Put
from kvferry.registry.keys import KeyLayout
from kvferry.runtime.errors import FailedPrecondition
from kvferry.v1 import registry_service_pb2 as api
from kvferry.v1 import resources_pb2 as resources
from kvferry.v1.registry_service_pb2_grpc import RegistryServiceStub

from tests.fixtures.registry import RegistryHandle, unique
from tests.registry.builders import (
    EventStream,
    Stores,
    as_published,
    engine,
    get,
    publish,
    register,
    retention,
    status_of,
)

pytestmark = pytest.mark.timeout(60)

HOST = resources.MEMORY_TIER_HOST
# Where the moved blocks are numbered: past the KV cache (builders.engine: 4096 blocks).
HOST_BLOCKS = 4096


def _relocated(held: resources.Retention) -> resources.Retention:
    """``held`` moved to the host pool: a new engine request id (the old one plus a suffix), new block ids and
    generations, the same turn, tokens and digests."""
    moved = resources.Retention()
    moved.CopyFrom(held)
    moved.engine_request_id = f"{held.engine_request_id}:host"
    moved.relocates_engine_request_id = held.engine_request_id
    moved.tier = HOST
    del moved.block_ids[:]
    moved.block_ids.extend(range(HOST_BLOCKS, HOST_BLOCKS + len(held.block_ids)))
    del moved.block_generations[:]
    moved.block_generations.extend(range(900, 900 + len(held.block_ids)))
    return moved


async def _watch(stub: RegistryServiceStub, engine_id: str) -> EventStream:
    return await EventStream.open(stub.WatchRetentions(api.WatchRetentionsRequest(engine_id=engine_id)))


async def _refused(stub: RegistryServiceStub, item: resources.Retention) -> str:
    """The FAILED_PRECONDITION message publishing ``item`` gets."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await publish(stub, item)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION, caught.value.details()
    return caught.value.details() or ""


async def test_a_relocation_replaces_the_live_record_and_the_old_request_ends_superseded(
    registry: RegistryHandle,
) -> None:
    stub = registry.stub()
    engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
    await register(stub, engine_id)
    held = retention(tenant, conversation, engine_id)
    held.block_generations.extend([7] * len(held.block_ids))
    first = await publish(stub, held)
    moved = _relocated(held)
    async with await _watch(stub, engine_id) as watch:
        relocated = await publish(stub, moved)
        # The engine's own stream hears the old request end, as a replaced turn's does.
        event = await watch.next()
    assert relocated.superseded_turn == 1
    assert (event.type, event.reason) == (api.RETENTION_EVENT_TYPE_ENDED, resources.RELEASE_REASON_SUPERSEDED)
    assert event.retention.engine_request_id == held.engine_request_id
    assert list(event.retention.block_ids) == list(held.block_ids)
    assert event.header.revision == relocated.header.revision

    stored = relocated.retention
    assert stored.engine_request_id == moved.engine_request_id
    assert (stored.tier, stored.relocates_engine_request_id) == (HOST, held.engine_request_id)
    assert list(stored.block_ids) == list(moved.block_ids)
    assert list(stored.block_generations) == list(moved.block_generations)
    assert stored.publish_time.ToNanoseconds() >= first.retention.publish_time.ToNanoseconds()
    found = await get(stub, tenant, conversation)
    assert as_published(found.retention) == as_published(stored)

    # The relocated record is the live one in every way: renewed, and replaced by the next turn.
    await stub.RenewRetention(
        api.RenewRetentionRequest(tenant=tenant, conversation_id=conversation), timeout=5
    )
    # A late publish of the moved request never comes back over its relocation.
    assert "turn 1 is not newer" in await _refused(stub, held)
    async with await _watch(stub, engine_id) as watch:
        newer = await publish(stub, retention(tenant, conversation, engine_id, turn=2, num_tokens=80))
        event = await watch.next()
    assert newer.superseded_turn == 1
    assert (event.reason, event.retention.engine_request_id) == (
        resources.RELEASE_REASON_SUPERSEDED,
        moved.engine_request_id,
    )


async def test_an_identical_retry_of_a_relocation_returns_the_stored_record(registry: RegistryHandle) -> None:
    stub = registry.stub()
    engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
    await register(stub, engine_id)
    held = retention(tenant, conversation, engine_id)
    await publish(stub, held)
    moved = _relocated(held)
    relocated = await publish(stub, moved)

    retry = await publish(stub, moved)
    assert retry.retention == relocated.retention  # the record as published, its first end included
    assert retry.superseded_turn == 0
    # The same request id naming another record to replace is no retry: that record is not live.
    other = _relocated(held)
    other.relocates_engine_request_id = "req-never-published"
    assert f"now retains engine request {moved.engine_request_id}" in await _refused(stub, other)
    assert as_published((await get(stub, tenant, conversation)).retention) == as_published(
        relocated.retention
    )


def _other_turn(item: resources.Retention) -> None:
    item.turn = 2


def _more_tokens(item: resources.Retention) -> None:
    item.num_tokens += 7  # 47 tokens: still two full blocks, so the digests still fit the engine


def _other_digests(item: resources.Retention) -> None:
    item.block_digests[1] = bytes(16)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_other_turn, "the relocation has turn 2, not 1"),
        (_more_tokens, "the relocation has num_tokens 47, not 40"),
        (_other_digests, "the relocation has block_digests differing from block 1 on"),
    ],
    ids=["turn", "tokens", "digests"],
)
async def test_a_relocation_of_other_kv_is_refused_and_changes_nothing(
    registry: RegistryHandle, edit: Callable[[resources.Retention], None], message: str
) -> None:
    stub = registry.stub()
    engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
    await register(stub, engine_id)
    held = retention(tenant, conversation, engine_id)
    first = await publish(stub, held)
    moved = _relocated(held)
    edit(moved)
    details = await _refused(stub, moved)
    assert message in details
    assert "publish a new turn as a new turn" in details
    assert as_published((await get(stub, tenant, conversation)).retention) == as_published(first.retention)


async def test_a_relocation_of_a_request_no_longer_live_is_refused(registry: RegistryHandle) -> None:
    stub = registry.stub()
    engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
    await register(stub, engine_id)
    held = retention(tenant, conversation, engine_id)
    await publish(stub, held)
    newer = await publish(stub, retention(tenant, conversation, engine_id, turn=2, num_tokens=80))

    details = await _refused(stub, _relocated(held))
    assert f"now retains engine request {newer.retention.engine_request_id} (turn 2" in details
    assert "free the moved blocks" in details
    assert as_published((await get(stub, tenant, conversation)).retention) == as_published(newer.retention)


async def test_only_the_holding_engine_relocates_a_retention(registry: RegistryHandle) -> None:
    stub = registry.stub()
    holder, other, tenant, conversation = unique("engine"), unique("engine"), unique("tenant"), unique("conv")
    await register(stub, holder)
    await register(stub, other)
    held = retention(tenant, conversation, holder)
    first = await publish(stub, held)
    moved = _relocated(held)
    moved.engine_id = other

    assert f"is retained on engine {holder}, not {other}" in await _refused(stub, moved)
    assert as_published((await get(stub, tenant, conversation)).retention) == as_published(first.retention)


async def test_a_relocation_never_revives_an_ended_retention(registry: RegistryHandle) -> None:
    stub = registry.stub()
    engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
    await register(stub, engine_id)
    held = retention(tenant, conversation, engine_id)
    await publish(stub, held)
    released = api.ReleaseRetentionRequest(tenant=tenant, conversation_id=conversation)
    await stub.ReleaseRetention(released, timeout=5)
    moved = _relocated(held)
    assert "retains nothing now" in await _refused(stub, moved)

    # Accepted while live; its retry after the end is refused too.
    await publish(stub, held)
    await publish(stub, moved)
    await stub.ReleaseRetention(released, timeout=5)
    assert "a relocation never brings an ended retention back" in await _refused(stub, moved)
    assert await status_of(get(stub, tenant, conversation)) == grpc.StatusCode.NOT_FOUND


async def test_a_relocation_of_an_earlier_incarnations_record_is_refused(registry: RegistryHandle) -> None:
    """The engine registered again (its blocks from before are gone) and no reaper ended the old record
    yet: the stores alone, on a prefix of their own, with the engine's key rewritten under a new lease."""
    engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
    gateway = EtcdGateway(EtcdSettings(endpoints=registry.config.etcd_endpoints))
    await gateway.connect()
    layout = KeyLayout(f"/kvferry-relocation-{unique('p')}/")
    stores = Stores.over(gateway, layout, TtlPolicy())
    try:
        await stores.engines.register_engine(engine(engine_id), 0)
        held = retention(tenant, conversation, engine_id)
        await stores.retentions.publish_retention(held)
        old_key = await gateway.get(layout.engine(engine_id))
        assert old_key is not None
        lease = await gateway.grant(30)
        await gateway.txn([], [Put(layout.engine(engine_id), old_key.value, lease.id)])

        with pytest.raises(FailedPrecondition, match="published by an earlier registration of engine"):
            await stores.retentions.publish_retention(_relocated(held))
    finally:
        await stores.reaper.sweep_orphans()
        await gateway.close()
