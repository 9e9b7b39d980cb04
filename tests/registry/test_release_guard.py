"""ReleaseRetention with ``engine_request_id``: release only that request, never a newer turn.

Real registry, real etcd. The race tests drive the store over a gateway that lets a test act
between the store's read of the record and its release transaction.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc
import pytest
from kvferry.registry.etcd import Compare, EtcdGateway, EtcdSettings, Op, TxnResult
from kvferry.registry.keys import KeyLayout
from kvferry.registry.retentions import RetentionStore
from kvferry.runtime.errors import FailedPrecondition
from kvferry.v1 import registry_service_pb2 as api
from kvferry.v1 import resources_pb2 as resources
from kvferry.v1.registry_service_pb2_grpc import RegistryServiceStub

from tests.fixtures.registry import TEST_TTLS, RegistryHandle, unique
from tests.registry.builders import EventStream, get, publish, register, retention, status_of

pytestmark = pytest.mark.timeout(60)


def _release(
    stub: RegistryServiceStub,
    tenant: str,
    conversation_id: str,
    engine_request_id: str = "",
    reason: resources.ReleaseReason.ValueType = resources.RELEASE_REASON_EVICTED,
) -> Awaitable[api.ReleaseRetentionResponse]:
    call: Awaitable[api.ReleaseRetentionResponse] = stub.ReleaseRetention(
        api.ReleaseRetentionRequest(
            tenant=tenant, conversation_id=conversation_id, reason=reason, engine_request_id=engine_request_id
        ),
        timeout=5,
    )
    return call


async def test_a_guarded_release_ends_the_named_request_and_refuses_any_other(
    registry: RegistryHandle,
) -> None:
    stub = registry.stub()
    engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
    await register(stub, engine_id)
    old = (await publish(stub, retention(tenant, conversation, engine_id, turn=1))).retention
    new = (await publish(stub, retention(tenant, conversation, engine_id, turn=2))).retention

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _release(stub, tenant, conversation, old.engine_request_id)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = refused.value.details() or ""
    assert new.engine_request_id in details and "nothing was released" in details
    assert (await get(stub, tenant, conversation)).retention.engine_request_id == new.engine_request_id

    watch = await EventStream.open(stub.WatchRetentions(api.WatchRetentionsRequest(engine_id=engine_id)))
    async with watch:
        released = await _release(stub, tenant, conversation, new.engine_request_id)
        ended = await watch.next_matching(lambda e: e.type == api.RETENTION_EVENT_TYPE_ENDED)
    assert ended.retention.engine_request_id == new.engine_request_id
    assert ended.reason == resources.RELEASE_REASON_EVICTED
    assert ended.header.revision == released.header.revision
    # Gone now: the same guarded release finds nothing.
    assert (
        await status_of(_release(stub, tenant, conversation, new.engine_request_id))
        == grpc.StatusCode.NOT_FOUND
    )


async def test_an_unguarded_release_still_ends_whatever_turn_is_live(registry: RegistryHandle) -> None:
    stub = registry.stub()
    engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
    await register(stub, engine_id)
    await publish(stub, retention(tenant, conversation, engine_id, turn=1))
    await publish(stub, retention(tenant, conversation, engine_id, turn=2))
    await _release(stub, tenant, conversation, reason=resources.RELEASE_REASON_RELEASED)
    assert await status_of(get(stub, tenant, conversation)) == grpc.StatusCode.NOT_FOUND


async def test_a_malformed_engine_request_id_is_invalid(registry: RegistryHandle) -> None:
    stub = registry.stub()
    engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
    await register(stub, engine_id)
    await publish(stub, retention(tenant, conversation, engine_id, turn=1))
    assert (
        await status_of(_release(stub, tenant, conversation, "no/slashes"))
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    assert (await get(stub, tenant, conversation)).retention.turn == 1


class InterleavingGateway(EtcdGateway):
    """A real gateway that runs ``before_next_txn`` once, right before its next transaction goes out."""

    before_next_txn: Callable[[], Awaitable[None]] | None = None

    async def txn(
        self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        hook, self.before_next_txn = self.before_next_txn, None
        if hook is not None:
            await hook()
        return await super().txn(compare, success, failure)


@pytest.fixture
async def interleaving_store(
    registry: RegistryHandle,
) -> AsyncIterator[tuple[RetentionStore, InterleavingGateway]]:
    """A second retention store over the fixture registry's keys, whose release a test can interleave with."""
    gateway = InterleavingGateway(EtcdSettings(endpoints=registry.config.etcd_endpoints))
    await gateway.connect()
    try:
        yield RetentionStore(gateway, KeyLayout(registry.key_prefix), TEST_TTLS), gateway
    finally:
        await gateway.close()


async def test_a_turn_published_between_the_check_and_the_release_is_never_released(
    registry: RegistryHandle, interleaving_store: tuple[RetentionStore, InterleavingGateway]
) -> None:
    store, gateway = interleaving_store
    stub = registry.stub()
    engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
    await register(stub, engine_id)
    old = (await publish(stub, retention(tenant, conversation, engine_id, turn=1))).retention
    newer = retention(tenant, conversation, engine_id, turn=2)

    async def publish_newer_turn() -> None:
        await publish(stub, newer)

    # The store reads turn 1 (the request asked for), then turn 2 lands, then the store's transaction.
    gateway.before_next_txn = publish_newer_turn
    with pytest.raises(FailedPrecondition, match=newer.engine_request_id):
        await store.release_retention(
            tenant, conversation, resources.RELEASE_REASON_EVICTED, old.engine_request_id
        )
    assert gateway.before_next_txn is None, "the interleaving ran"
    assert (await get(stub, tenant, conversation)).retention.engine_request_id == newer.engine_request_id


async def test_a_renewal_between_the_check_and_the_release_does_not_stop_it(
    registry: RegistryHandle, interleaving_store: tuple[RetentionStore, InterleavingGateway]
) -> None:
    store, gateway = interleaving_store
    stub = registry.stub()
    engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
    await register(stub, engine_id)
    live = (await publish(stub, retention(tenant, conversation, engine_id, turn=1))).retention

    async def renew() -> None:
        await stub.RenewRetention(
            api.RenewRetentionRequest(tenant=tenant, conversation_id=conversation), timeout=5
        )

    # A renewal re-writes the record (new revision, same request): the release re-checks and goes on.
    gateway.before_next_txn = renew
    revision = await store.release_retention(
        tenant, conversation, resources.RELEASE_REASON_EVICTED, live.engine_request_id
    )
    assert revision > 0 and gateway.before_next_txn is None
    assert await status_of(get(stub, tenant, conversation)) == grpc.StatusCode.NOT_FOUND
