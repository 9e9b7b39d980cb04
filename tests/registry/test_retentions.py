"""Retentions against a real registry on a real etcd: lifecycle, leases, supersession, watches."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from kvferry.registry.config import TtlPolicy
from kvferry.registry.etcd import EtcdGateway, EtcdSettings
from kvferry.registry.keys import KeyLayout
from kvferry.runtime.errors import NotFound
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

# etcd grants at least 2 s (1.5 x its election timeout) and checks expiry every 0.5 s.
SHORT_TTL = 2


def _ended(event: api.WatchRetentionsResponse) -> bool:
    return event.type == api.RETENTION_EVENT_TYPE_ENDED


async def _expect_missing(stub: RegistryServiceStub, tenant: str, conversation_id: str) -> None:
    assert await status_of(get(stub, tenant, conversation_id)) == grpc.StatusCode.NOT_FOUND


async def _watch(stub: RegistryServiceStub, engine_id: str) -> EventStream:
    return await EventStream.open(stub.WatchRetentions(api.WatchRetentionsRequest(engine_id=engine_id)))


async def test_publish_then_get_returns_the_stored_retention(registry: RegistryHandle) -> None:
    stub = registry.stub()
    engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
    await register(stub, engine_id)
    published = await publish(stub, retention(tenant, conversation, engine_id))
    assert published.header.revision > 0
    assert published.superseded_turn == 0
    assert published.retention.ttl_seconds == 60  # 0 asked: the default
    assert published.retention.name == f"tenants/{tenant}/conversations/{conversation}/retention"

    found = await get(stub, tenant, conversation)
    assert found.header.revision >= published.header.revision
    assert as_published(found.retention) == as_published(published.retention)
    # The lookup tells the lease's end as etcd counts it (whole seconds left): the first end or a little less.
    first_end = published.retention.expire_time.ToNanoseconds() / 1e9
    assert first_end - 2 <= found.retention.expire_time.ToNanoseconds() / 1e9 <= first_end + 0.5


async def test_published_block_generations_come_back_as_published(registry: RegistryHandle) -> None:
    """Pull-time fencing: the record hands P the holder's generations, one per block, exactly (the
    largest value JSON carries exactly included)."""
    stub = registry.stub()
    engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
    await register(stub, engine_id)
    item = retention(tenant, conversation, engine_id)
    generations = [2**53 - 1 - index for index in range(len(item.block_ids))]
    item.block_generations.extend(generations)
    await publish(stub, item)

    found = await get(stub, tenant, conversation)
    assert list(found.retention.block_generations) == generations


@pytest.mark.parametrize(
    ("requested", "reported"),
    [
        (resources.RELEASE_REASON_UNSPECIFIED, resources.RELEASE_REASON_RELEASED),
        (resources.RELEASE_REASON_RELEASED, resources.RELEASE_REASON_RELEASED),
        (resources.RELEASE_REASON_EVICTED, resources.RELEASE_REASON_EVICTED),
    ],
)
async def test_release_is_immediate_and_reports_its_reason(
    registry: RegistryHandle,
    requested: resources.ReleaseReason.ValueType,
    reported: resources.ReleaseReason.ValueType,
) -> None:
    stub = registry.stub()
    engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
    await register(stub, engine_id)
    await publish(stub, retention(tenant, conversation, engine_id))
    async with await _watch(stub, engine_id) as watch:
        released = await stub.ReleaseRetention(
            api.ReleaseRetentionRequest(tenant=tenant, conversation_id=conversation, reason=requested),
            timeout=5,
        )
        assert released.header.revision > 0
        await _expect_missing(stub, tenant, conversation)
        event = await watch.next()
    assert event.type == api.RETENTION_EVENT_TYPE_ENDED
    assert event.reason == reported
    assert event.retention.conversation_id == conversation
    assert event.header.revision == released.header.revision
    assert event.end_time.seconds > 0
    # Releasing again finds nothing.
    again = stub.ReleaseRetention(
        api.ReleaseRetentionRequest(tenant=tenant, conversation_id=conversation), timeout=5
    )
    assert await status_of(again) == grpc.StatusCode.NOT_FOUND


async def test_lease_expiry_releases_with_reason_expired(registry: RegistryHandle) -> None:
    stub = registry.stub()
    engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
    await register(stub, engine_id)
    async with await _watch(stub, engine_id) as watch:
        published = await publish(stub, retention(tenant, conversation, engine_id, ttl_seconds=SHORT_TTL))
        assert published.retention.ttl_seconds == SHORT_TTL
        event = await watch.next_matching(_ended, within=SHORT_TTL + 5)
    assert event.reason == resources.RELEASE_REASON_EXPIRED
    assert event.retention.conversation_id == conversation
    await _expect_missing(stub, tenant, conversation)


async def test_renewal_keeps_a_retention_alive_past_its_first_ttl(registry: RegistryHandle) -> None:
    stub = registry.stub()
    engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
    await register(stub, engine_id)
    published = await publish(stub, retention(tenant, conversation, engine_id, ttl_seconds=SHORT_TTL))
    first_expiry = published.retention.expire_time.ToNanoseconds()
    async with await _watch(stub, engine_id) as watch:
        renewal = api.RenewRetentionRequest(tenant=tenant, conversation_id=conversation)
        for _ in range(6):  # 3 s, well past the first 2 s lease
            await asyncio.sleep(0.5)
            renewed = await stub.RenewRetention(renewal, timeout=5)
            assert renewed.ttl_seconds == SHORT_TTL
            assert renewed.header.revision > 0
        found = await get(stub, tenant, conversation)
        assert found.retention.expire_time.ToNanoseconds() > first_expiry
        # Without renewals it now runs out. Watchers heard nothing of the renewals (they write nothing):
        # the first event is the end.
        event = await watch.next(within=SHORT_TTL + 5)
    assert (event.type, event.reason) == (api.RETENTION_EVENT_TYPE_ENDED, resources.RELEASE_REASON_EXPIRED)
    await _expect_missing(stub, tenant, conversation)


async def test_newer_turn_supersedes_atomically_and_the_old_engine_hears_superseded(
    registry: RegistryHandle,
) -> None:
    stub = registry.stub()
    first_engine, second_engine = unique("engine"), unique("engine")
    tenant, conversation = unique("tenant"), unique("conv")
    await register(stub, first_engine)
    await register(stub, second_engine)
    await publish(stub, retention(tenant, conversation, first_engine, turn=1))
    async with await _watch(stub, first_engine) as old_watch, await _watch(stub, second_engine) as new_watch:
        second = await publish(stub, retention(tenant, conversation, second_engine, turn=2, num_tokens=80))
        assert second.superseded_turn == 1
        event = await old_watch.next()
        assert event.type == api.RETENTION_EVENT_TYPE_ENDED
        assert event.reason == resources.RELEASE_REASON_SUPERSEDED
        assert event.retention.turn == 1
        assert event.header.revision == second.header.revision
        found = await get(stub, tenant, conversation)
        assert (found.retention.turn, found.retention.engine_id) == (2, second_engine)

        # Same engine, next turn: its own watch hears turn 2 end as superseded.
        third = await publish(stub, retention(tenant, conversation, second_engine, turn=3, num_tokens=96))
        assert third.superseded_turn == 2
        event = await new_watch.next()
        assert (event.reason, event.retention.turn) == (resources.RELEASE_REASON_SUPERSEDED, 2)


async def test_a_turn_not_newer_than_the_live_one_is_refused_but_an_exact_retry_is_accepted(
    registry: RegistryHandle,
) -> None:
    stub = registry.stub()
    engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
    await register(stub, engine_id)
    first = await publish(stub, retention(tenant, conversation, engine_id, turn=2))

    retry = await publish(stub, retention(tenant, conversation, engine_id, turn=2))
    assert retry.retention == first.retention  # the record as published, its first end included
    older = retention(tenant, conversation, engine_id, turn=1)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await publish(stub, older)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "turn 1 is not newer" in (caught.value.details() or "")
    same_turn_other_request = retention(tenant, conversation, engine_id, turn=2)
    same_turn_other_request.engine_request_id = "another-request"
    assert await status_of(publish(stub, same_turn_other_request)) == grpc.StatusCode.FAILED_PRECONDITION
    assert as_published((await get(stub, tenant, conversation)).retention) == as_published(first.retention)


async def test_publish_on_an_unregistered_engine_is_refused(registry: RegistryHandle) -> None:
    stub = registry.stub()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await publish(stub, retention(unique("tenant"), unique("conv"), unique("ghost")))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "RegisterEngine" in (caught.value.details() or "")


async def test_deregistering_an_engine_ends_its_retentions_with_engine_gone(registry: RegistryHandle) -> None:
    stub = registry.stub()
    engine_id, tenant = unique("engine"), unique("tenant")
    conversations = [unique("conv") for _ in range(3)]
    await register(stub, engine_id)
    for conversation in conversations:
        await publish(stub, retention(tenant, conversation, engine_id))
    async with await _watch(stub, engine_id) as watch:
        await stub.DeregisterEngine(api.DeregisterEngineRequest(engine_id=engine_id), timeout=5)
        ended = [await watch.next() for _ in conversations]
    assert {event.retention.conversation_id for event in ended} == set(conversations)
    assert {event.reason for event in ended} == {resources.RELEASE_REASON_ENGINE_GONE}
    for conversation in conversations:
        await _expect_missing(stub, tenant, conversation)


async def test_engine_lease_expiry_drops_its_retentions(registry: RegistryHandle) -> None:
    stub = registry.stub()
    engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
    await register(stub, engine_id, ttl_seconds=SHORT_TTL)
    await publish(stub, retention(tenant, conversation, engine_id, ttl_seconds=600))
    async with await _watch(stub, engine_id) as watch:
        event = await watch.next_matching(_ended, within=SHORT_TTL + 6)  # no heartbeat: the engine leaves
    assert event.reason == resources.RELEASE_REASON_ENGINE_GONE
    await _expect_missing(stub, tenant, conversation)
    heartbeat = stub.HeartbeatEngine(api.HeartbeatEngineRequest(engine_id=engine_id), timeout=5)
    assert await status_of(heartbeat) == grpc.StatusCode.NOT_FOUND


async def test_re_registering_an_engine_ends_the_previous_incarnations_retentions(
    registry: RegistryHandle,
) -> None:
    stub = registry.stub()
    engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
    await register(stub, engine_id)
    await publish(stub, retention(tenant, conversation, engine_id))
    async with await _watch(stub, engine_id) as watch:
        await register(stub, engine_id)  # e.g. the engine restarted: its KV blocks are gone
        event = await watch.next()
    assert (event.reason, event.retention.conversation_id) == (
        resources.RELEASE_REASON_ENGINE_GONE,
        conversation,
    )
    await _expect_missing(stub, tenant, conversation)
    # The new incarnation publishes afresh.
    await publish(stub, retention(tenant, conversation, engine_id, turn=2))
    assert (await get(stub, tenant, conversation)).retention.turn == 2


async def test_no_tenant_reads_renews_or_releases_another_tenants_conversation(
    registry: RegistryHandle,
) -> None:
    stub = registry.stub()
    engine_id, owner, intruder, conversation = (
        unique("engine"),
        unique("tenant"),
        unique("tenant"),
        unique("conv"),
    )
    await register(stub, engine_id)
    mine = await publish(stub, retention(owner, conversation, engine_id))

    await _expect_missing(stub, intruder, conversation)
    renew = stub.RenewRetention(
        api.RenewRetentionRequest(tenant=intruder, conversation_id=conversation), timeout=5
    )
    assert await status_of(renew) == grpc.StatusCode.NOT_FOUND
    release = stub.ReleaseRetention(
        api.ReleaseRetentionRequest(tenant=intruder, conversation_id=conversation), timeout=5
    )
    assert await status_of(release) == grpc.StatusCode.NOT_FOUND
    # The same conversation id under another tenant is another conversation.
    theirs = await publish(stub, retention(intruder, conversation, engine_id, turn=1))
    assert theirs.superseded_turn == 0
    assert as_published((await get(stub, owner, conversation)).retention) == as_published(mine.retention)
    assert (await get(stub, intruder, conversation)).retention.tenant == intruder


async def test_lookup_checks_engine_liveness_without_the_reaper(registry: RegistryHandle) -> None:
    """A store with no reaper running: deleting the engine's key alone hides its retentions."""
    stub = registry.stub()
    engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
    await register(stub, engine_id)
    await publish(stub, retention(tenant, conversation, engine_id))

    gateway = EtcdGateway(EtcdSettings(endpoints=registry.config.etcd_endpoints))
    await gateway.connect()
    prefix = "/kvferry-no-reaper/"
    stores = Stores.over(gateway, KeyLayout(prefix), TtlPolicy())
    try:
        registered = await stores.engines.register_engine(engine(engine_id), 0)
        await stores.retentions.publish_retention(retention(tenant, conversation, engine_id))
        assert (await stores.retentions.get_retention(tenant, conversation)).retention.engine_id == engine_id
        # The engine's key vanishes (as when its lease ends) and nobody reaps.
        await gateway.revoke((await gateway.range(KeyLayout(prefix).engine(engine_id))).kvs[0].lease)
        with pytest.raises(NotFound, match="left the registry"):
            await stores.retentions.get_retention(tenant, conversation)
        with pytest.raises(NotFound, match="no retention to renew"):
            await stores.retentions.renew_retention(tenant, conversation)
        assert registered.revision > 0
    finally:
        await stores.reaper.sweep_orphans()
        await gateway.close()


async def test_concurrent_publishes_of_one_conversation_leave_exactly_the_newest_turn(
    registry: RegistryHandle,
) -> None:
    stub = registry.stub()
    engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
    await register(stub, engine_id)
    outcomes = await asyncio.gather(
        *(
            status_of(publish(stub, retention(tenant, conversation, engine_id, turn=turn)))
            for turn in range(1, 9)
        )
    )
    assert set(outcomes) <= {grpc.StatusCode.OK, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED}
    assert grpc.StatusCode.OK in outcomes
    found = await get(stub, tenant, conversation)
    assert found.retention.turn == max(t for t, code in enumerate(outcomes, 1) if code == grpc.StatusCode.OK)
