"""Retentions against a real registry on a real etcd: lifecycle, leases, supersession, watches."""

from __future__ import annotations

import grpc
import pytest
from kvferry.v1 import registry_service_pb2 as api
from kvferry.v1 import resources_pb2 as resources
from kvferry.v1.registry_service_pb2_grpc import RegistryServiceStub

from tests.fixtures.registry import RegistryHandle, unique
from tests.registry.builders import EventStream, get, publish, register, retention, status_of

pytestmark = pytest.mark.timeout(60)


async def _expect_missing(stub: RegistryServiceStub, tenant: str, conversation_id: str) -> None:
    assert await status_of(get(stub, tenant, conversation_id)) == grpc.StatusCode.NOT_FOUND


async def test_publish_then_get_returns_the_stored_retention(registry: RegistryHandle) -> None:
    stub = registry.stub()
    engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
    await register(stub, engine_id)
    published = await publish(stub, retention(tenant, conversation, engine_id))
    assert published.header.revision > 0
    assert published.superseded_turn == 0
    assert published.retention.ttl_seconds == 60
    assert published.retention.name == f"tenants/{tenant}/conversations/{conversation}/retention"

    found = await get(stub, tenant, conversation)
    assert found.header.revision >= published.header.revision
    assert found.retention == published.retention
    assert found.retention.expire_time.seconds > found.retention.publish_time.seconds


async def test_release_is_immediate_and_reported_released(registry: RegistryHandle) -> None:
    stub = registry.stub()
    engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
    await register(stub, engine_id)
    await publish(stub, retention(tenant, conversation, engine_id))
    async with await EventStream.open(
        stub.WatchRetentions(api.WatchRetentionsRequest(engine_id=engine_id))
    ) as watch:
        released = await stub.ReleaseRetention(
            api.ReleaseRetentionRequest(tenant=tenant, conversation_id=conversation), timeout=5
        )
        assert released.header.revision > 0
        await _expect_missing(stub, tenant, conversation)
        event = await watch.next()
    assert event.type == api.RETENTION_EVENT_TYPE_ENDED
    assert event.reason == resources.RELEASE_REASON_RELEASED
    assert event.retention.conversation_id == conversation
    assert event.header.revision == released.header.revision
