"""Ends the registry and the engines agree on (issue 13): expiry is etcd's lease alone, never a
replica's clock, for lookups, renewals and releases; an engine ending its own retention
(EndEngineRetention) for good; a watch that lost history cutting its streams off so their clients
resync.

Real etcd, real registries. Expiry tests drive the retention store with a clock of their own.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable

import grpc
import pytest
import pytest_asyncio
from kvferry.registry.config import RegistryConfig
from kvferry.registry.engines import EngineStore
from kvferry.registry.etcd import EtcdGateway, EtcdSettings
from kvferry.registry.events import RetentionEventHub
from kvferry.registry.keys import KeyLayout
from kvferry.registry.reaper import EngineReaper
from kvferry.registry.retentions import RetentionStore
from kvferry.registry.server import create_registry
from kvferry.runtime.clock import ManualClock
from kvferry.runtime.errors import NotFound
from kvferry.stack.etcd_process import EtcdProcess
from kvferry.v1 import registry_service_pb2 as api
from kvferry.v1 import resources_pb2 as resources
from kvferry.v1.registry_service_pb2_grpc import RegistryServiceStub

from tests.fixtures.registry import TEST_TTLS, RegistryHandle, unique
from tests.fixtures.tcp_proxy import CuttableProxy
from tests.registry.builders import EventStream, engine, get, publish, register, retention, status_of

pytestmark = pytest.mark.timeout(90)


class Replica:
    """A registry's stores over a gateway of their own, with a clock of their own."""

    def __init__(self, gateway: EtcdGateway, layout: KeyLayout) -> None:
        # A registry clock the test moves by hand (starts at the real time).
        self.clock = ManualClock(wall=time.time())
        self.gateway = gateway
        self.engines = EngineStore(
            gateway, layout, TEST_TTLS, EngineReaper(gateway, layout), clock=self.clock
        )
        self.retentions = RetentionStore(gateway, layout, TEST_TTLS, clock=self.clock)


@pytest_asyncio.fixture(loop_scope="session")
async def replicas(etcd: EtcdProcess) -> AsyncIterator[tuple[Replica, Replica]]:
    layout = KeyLayout(f"/kvferry-ends-{uuid.uuid4().hex[:8]}/")
    gateways = [EtcdGateway(EtcdSettings(endpoints=(etcd.endpoint,))) for _ in range(2)]
    for gateway in gateways:
        await gateway.connect()
    try:
        yield Replica(gateways[0], layout), Replica(gateways[1], layout)
    finally:
        for gateway in gateways:
            await gateway.close()


async def _published(replica: Replica, ttl_seconds: int = 60) -> resources.Retention:
    engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
    await replica.engines.register_engine(engine(engine_id), 60)
    published = await replica.retentions.publish_retention(
        retention(tenant, conversation, engine_id, ttl_seconds=ttl_seconds)
    )
    return published.retention


# --- no clock judges expiry: the lease does -------------------------------------------------------


async def test_a_registry_clock_far_ahead_neither_ends_nor_refuses_a_live_retention(
    replicas: tuple[Replica, Replica],
) -> None:
    """The sidecar's sweep looks a retention up on one replica and a client renews it on another: both
    ask etcd whether the lease still holds the record, so no replica's clock can end a retention the
    other still renews (an engine then freeing blocks the registry serves) or revive one etcd ended."""
    sweeping, renewing = replicas
    stored = await _published(renewing)
    await renewing.retentions.get_retention(stored.tenant, stored.conversation_id)  # now cached there
    sweeping.clock.skew(stored.ttl_seconds + 1)
    found = await sweeping.retentions.get_retention(stored.tenant, stored.conversation_id)
    assert found.retention.engine_request_id == stored.engine_request_id
    renewing.clock.skew(-(stored.ttl_seconds + 1))
    renewed = await renewing.retentions.renew_retention(stored.tenant, stored.conversation_id)
    assert renewed.retention.engine_request_id == stored.engine_request_id
    # Each answers the lease's end on its own clock: what etcd says is left, added to its own now.
    left = found.retention.expire_time.ToNanoseconds() / 1e9 - sweeping.clock.time()
    assert stored.ttl_seconds - 2 <= left <= stored.ttl_seconds


async def test_a_lease_that_ran_out_is_gone_for_every_replica_and_no_renewal_revives_it(
    replicas: tuple[Replica, Replica],
) -> None:
    first, second = replicas
    stored = await _published(first, ttl_seconds=2)  # etcd's shortest lease
    # Both replicas know the record (their caches), so neither would read the record again.
    await first.retentions.get_retention(stored.tenant, stored.conversation_id)
    await second.retentions.get_retention(stored.tenant, stored.conversation_id)
    hub = RetentionEventHub(first.gateway, first.retentions.layout, first.clock)
    try:
        async with hub.subscribe(stored.engine_id) as subscription:
            event = await asyncio.wait_for(anext(aiter(subscription.events())), 10)
    finally:
        await hub.close()
    assert (event.type, event.reason) == (api.RETENTION_EVENT_TYPE_ENDED, resources.RELEASE_REASON_EXPIRED)
    for replica in (first, second):
        with pytest.raises(NotFound):
            await replica.retentions.renew_retention(stored.tenant, stored.conversation_id)
        with pytest.raises(NotFound):
            await replica.retentions.get_retention(stored.tenant, stored.conversation_id)
        with pytest.raises(NotFound):
            await replica.retentions.release_retention(
                stored.tenant, stored.conversation_id, resources.RELEASE_REASON_RELEASED
            )


# --- EndEngineRetention -------------------------------------------------------------------------


def _end(
    stub: RegistryServiceStub,
    item: resources.Retention,
    *,
    engine_id: str | None = None,
    request_id: str | None = None,
    reason: resources.ReleaseReason.ValueType = resources.RELEASE_REASON_EVICTED,
) -> Awaitable[api.EndEngineRetentionResponse]:
    call: Awaitable[api.EndEngineRetentionResponse] = stub.EndEngineRetention(
        api.EndEngineRetentionRequest(
            tenant=item.tenant,
            conversation_id=item.conversation_id,
            engine_id=item.engine_id if engine_id is None else engine_id,
            engine_request_id=item.engine_request_id if request_id is None else request_id,
            reason=reason,
        ),
        timeout=5,
    )
    return call


async def test_an_engine_ends_its_live_retention_and_it_is_never_published_again(
    registry: RegistryHandle,
) -> None:
    stub = registry.stub()
    engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
    await register(stub, engine_id)
    item = retention(tenant, conversation, engine_id)
    await publish(stub, item)
    async with await EventStream.open(
        stub.WatchRetentions(api.WatchRetentionsRequest(engine_id=engine_id))
    ) as watch:
        ended = await _end(stub, item)
        event = await watch.next_matching(lambda e: e.type == api.RETENTION_EVENT_TYPE_ENDED)
    assert ended.ended
    assert (event.reason, event.retention.engine_request_id) == (
        resources.RELEASE_REASON_EVICTED,
        item.engine_request_id,
    )
    assert event.header.revision == ended.header.revision
    assert await status_of(get(stub, tenant, conversation)) == grpc.StatusCode.NOT_FOUND
    # A publish of that request still in flight (a sidecar retrying one whose answer was lost) is refused.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await publish(stub, item)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "never published again" in (refused.value.details() or "")
    # Ending it again is a no-op that still confirms.
    assert not (await _end(stub, item)).ended


async def test_ending_a_request_before_its_publish_lands_refuses_the_publish(
    registry: RegistryHandle,
) -> None:
    """The connector gave up on a report (its deadline is shorter than the sidecar's registry calls) and
    its budget then evicted the retention: the publish landing after the end must not make it live."""
    stub = registry.stub()
    engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
    await register(stub, engine_id)
    item = retention(tenant, conversation, engine_id)
    assert not (await _end(stub, item)).ended
    assert await status_of(publish(stub, item)) == grpc.StatusCode.FAILED_PRECONDITION
    assert await status_of(get(stub, tenant, conversation)) == grpc.StatusCode.NOT_FOUND
    # The engine's next turn of the conversation publishes as usual.
    await publish(stub, retention(tenant, conversation, engine_id, turn=2))
    assert (await get(stub, tenant, conversation)).retention.turn == 2


async def test_an_engine_end_leaves_a_newer_turn_and_other_engines_alone(registry: RegistryHandle) -> None:
    stub = registry.stub()
    engine_id, other_engine, tenant, conversation = (
        unique("engine"),
        unique("engine"),
        unique("tenant"),
        unique("conv"),
    )
    await register(stub, engine_id)
    await register(stub, other_engine)
    old = retention(tenant, conversation, engine_id, turn=1)
    await publish(stub, old)
    newer = retention(tenant, conversation, engine_id, turn=2)
    await publish(stub, newer)
    assert not (await _end(stub, old)).ended
    assert (await get(stub, tenant, conversation)).retention.engine_request_id == newer.engine_request_id
    # The same request id on another engine names another retention.
    assert not (await _end(stub, newer, engine_id=other_engine)).ended
    assert (await get(stub, tenant, conversation)).retention.engine_request_id == newer.engine_request_id
    assert (await _end(stub, newer, reason=resources.RELEASE_REASON_HARD_CAP)).ended
    assert await status_of(get(stub, tenant, conversation)) == grpc.StatusCode.NOT_FOUND


async def test_an_engine_end_with_a_reason_not_for_engines_is_invalid(registry: RegistryHandle) -> None:
    stub = registry.stub()
    item = retention(unique("tenant"), unique("conv"), unique("engine"))
    not_for_engines = (
        resources.RELEASE_REASON_ENGINE_GONE,
        resources.RELEASE_REASON_EXPIRED,
        resources.ReleaseReason.ValueType(99),
    )
    for reason in not_for_engines:
        assert await status_of(_end(stub, item, reason=reason)) == grpc.StatusCode.INVALID_ARGUMENT
    assert await status_of(_end(stub, item, request_id="")) == grpc.StatusCode.INVALID_ARGUMENT


async def test_an_engine_end_racing_a_newer_publish_never_ends_the_newer_turn(
    replicas: tuple[Replica, Replica],
) -> None:
    first, second = replicas
    for _ in range(10):
        stored = await _published(first)
        newer = retention(stored.tenant, stored.conversation_id, stored.engine_id, turn=2)
        end, published = await asyncio.gather(
            first.retentions.end_engine_retention(
                stored.tenant,
                stored.conversation_id,
                stored.engine_id,
                stored.engine_request_id,
                resources.RELEASE_REASON_EVICTED,
            ),
            second.retentions.publish_retention(newer),
        )
        live = await second.retentions.get_retention(stored.tenant, stored.conversation_id)
        assert live.retention.engine_request_id == newer.engine_request_id
        assert published.superseded_turn in (0, 1)
        # Whichever came first, turn 1 is not served: it ended, or turn 2 replaced it.
        assert end.ended == (published.superseded_turn == 0)


# --- a watch that lost history -------------------------------------------------------------------


async def test_a_watch_resumed_past_compacted_history_cuts_its_streams_off(own_etcd: EtcdProcess) -> None:
    """The registry serving a sidecar's stream loses etcd for a while; meanwhile another replica ends
    a retention and etcd compacts past it. The end cannot be replayed: the stream must be cut off
    (ABORTED) so its sidecar watches again and re-checks its book, not left open and silent."""
    proxy = CuttableProxy(own_etcd.endpoint)
    await proxy.start()
    prefix = f"/kvferry-compact-{uuid.uuid4().hex[:8]}/"
    lagging = await create_registry(
        RegistryConfig(
            listen_address="127.0.0.1:0",
            etcd_endpoints=(proxy.endpoint,),
            etcd_timeout_seconds=1.0,
            key_prefix=prefix,
            ttl=TEST_TTLS,
            history_seconds=0,
        )
    )
    direct = await create_registry(
        RegistryConfig(
            listen_address="127.0.0.1:0",
            etcd_endpoints=(own_etcd.endpoint,),
            key_prefix=prefix,
            ttl=TEST_TTLS,
            history_seconds=0,
        )
    )
    lagging_channel = grpc.aio.insecure_channel(lagging.address)
    direct_channel = grpc.aio.insecure_channel(direct.address)
    try:
        stub, other = RegistryServiceStub(lagging_channel), RegistryServiceStub(direct_channel)
        engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
        await register(other, engine_id, ttl_seconds=60)
        await publish(other, retention(tenant, conversation, engine_id))
        watch = await EventStream.open(stub.WatchRetentions(api.WatchRetentionsRequest(engine_id=engine_id)))
        async with watch:
            await proxy.cut()
            await other.ReleaseRetention(
                api.ReleaseRetentionRequest(tenant=tenant, conversation_id=conversation), timeout=5
            )
            await direct.etcd.compact(await direct.etcd.current_revision())
            proxy.resume()
            code = await asyncio.wait_for(watch.call.code(), 20)
            assert code == grpc.StatusCode.ABORTED
            assert "watch again" in (await watch.call.details() or "")
    finally:
        await lagging_channel.close()
        await direct_channel.close()
        await lagging.stop(grace_seconds=0.2)
        await direct.stop(grace_seconds=0.2)
        await proxy.stop()
