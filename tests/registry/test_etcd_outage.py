"""etcd misbehaves: it stops in the middle of a test and comes back, or compacts its history.

Each test uses an etcd process of its own (not the session's): stopping it or compacting its
history would disturb every other test.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvferry.registry.config import RegistryConfig
from kvferry.registry.server import SERVICE_NAME
from kvferry.stack.etcd_process import EtcdProcess
from kvferry.v1 import registry_service_pb2 as api
from kvferry.v1 import resources_pb2 as resources
from kvferry.v1.registry_service_pb2_grpc import RegistryServiceStub

from tests.fixtures.registry import TEST_TTLS, RegistryHandle, running_registry, unique
from tests.registry.builders import EventStream, get, publish, register, retention

pytestmark = pytest.mark.timeout(60)


@pytest_asyncio.fixture(loop_scope="session")
async def outage_registry(own_etcd: EtcdProcess) -> AsyncIterator[RegistryHandle]:
    config = RegistryConfig(
        listen_address="127.0.0.1:0",
        etcd_endpoints=(own_etcd.endpoint,),
        etcd_timeout_seconds=1.0,
        key_prefix="/kvferry-outage/",
        ttl=TEST_TTLS,
    )
    async with running_registry(config) as handle:
        yield handle


async def _health(handle: RegistryHandle) -> int:
    stub = health_pb2_grpc.HealthStub(handle.channel())
    response = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=2)
    return int(response.status)


async def _until(predicate_call: object, within: float) -> float:
    """Seconds until ``predicate_call()`` returns True (polling every 0.2 s)."""
    start = time.monotonic()
    while True:
        if await predicate_call():  # type: ignore[operator]
            return time.monotonic() - start
        if time.monotonic() - start > within:
            raise AssertionError(f"condition not met within {within} s")
        await asyncio.sleep(0.2)


async def test_etcd_stop_and_start_fails_fast_then_recovers_without_restart(
    own_etcd: EtcdProcess, outage_registry: RegistryHandle
) -> None:
    stub: RegistryServiceStub = outage_registry.stub()
    engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
    await register(stub, engine_id, ttl_seconds=30)
    await publish(stub, retention(tenant, conversation, engine_id))
    retentions = await EventStream.open(stub.WatchRetentions(api.WatchRetentionsRequest(engine_id=engine_id)))
    engines = await EventStream.open(stub.WatchEngines(api.WatchEnginesRequest()))
    assert (await engines.next()).engine.engine_id == engine_id

    await asyncio.to_thread(own_etcd.stop)

    # Every call fails fast with UNAVAILABLE and says what to check.
    for call in (
        lambda: get(stub, tenant, conversation),
        lambda: stub.HeartbeatEngine(api.HeartbeatEngineRequest(engine_id=engine_id), timeout=5),
        lambda: publish(stub, retention(tenant, conversation, engine_id, turn=2)),
    ):
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call()  # type: ignore[no-untyped-call]
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "etcd" in (caught.value.details() or "") and "--etcd-endpoints" in (
            caught.value.details() or ""
        )
        assert time.monotonic() - started < 2.5
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    await _until(lambda: _health_is(outage_registry, not_serving), within=6)

    await asyncio.to_thread(own_etcd.start)

    async def answers() -> bool:
        try:
            await get(stub, tenant, conversation)
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            return False
        return True

    await _until(answers, within=15)
    # etcd restores leases on restart: the engine's heartbeat simply goes on.
    beat = await stub.HeartbeatEngine(api.HeartbeatEngineRequest(engine_id=engine_id), timeout=5)
    assert beat.ttl_seconds > 0
    serving = health_pb2.HealthCheckResponse.SERVING
    await _until(lambda: _health_is(outage_registry, serving), within=6)

    # Watches opened before the outage resume by themselves.
    await stub.ReleaseRetention(
        api.ReleaseRetentionRequest(tenant=tenant, conversation_id=conversation), timeout=5
    )
    ended = await retentions.next_matching(lambda e: e.type == api.RETENTION_EVENT_TYPE_ENDED, within=10)
    assert (ended.reason, ended.retention.conversation_id) == (
        resources.RELEASE_REASON_RELEASED,
        conversation,
    )
    newcomer = unique("engine")
    await register(stub, newcomer)
    joined = await engines.next_matching(lambda e: e.engine.engine_id == newcomer, within=10)
    assert joined.type == api.ENGINE_EVENT_TYPE_JOINED
    await retentions.close()
    await engines.close()


async def _health_is(handle: RegistryHandle, status: int) -> bool:
    return await _health(handle) == status


async def test_compacted_history_does_not_stop_the_registry_or_its_watches(
    own_etcd: EtcdProcess, outage_registry: RegistryHandle
) -> None:
    stub = outage_registry.stub()
    engine_id, tenant, conversation = unique("engine"), unique("tenant"), unique("conv")
    await register(stub, engine_id)
    await publish(stub, retention(tenant, conversation, engine_id, turn=1))
    await publish(stub, retention(tenant, conversation, engine_id, turn=2))
    etcd = outage_registry.registry.etcd
    await etcd.compact(await etcd.current_revision())
    await etcd.compact(1)  # already compacted: not an error
    assert (await get(stub, tenant, conversation)).retention.turn == 2
    async with await EventStream.open(stub.WatchEngines(api.WatchEnginesRequest())) as engines:
        assert (await engines.next()).engine.engine_id == engine_id
    async with await EventStream.open(
        stub.WatchRetentions(api.WatchRetentionsRequest(engine_id=engine_id))
    ) as watch:
        await stub.ReleaseRetention(
            api.ReleaseRetentionRequest(tenant=tenant, conversation_id=conversation), timeout=5
        )
        assert (await watch.next()).reason == resources.RELEASE_REASON_RELEASED
