"""etcd out of space (its NOSPACE alarm): the registry says so and serves again by itself.

A real one-member etcd with a small quota (kvferry.testing's cluster), filled until it refuses writes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvferry.registry.config import RegistryConfig
from kvferry.registry.server import Registry, create_registry
from kvferry.testing.etcd_cluster import EtcdCluster
from kvferry.testing.loop_thread import LoopThread
from kvferry.v1 import registry_service_pb2 as api
from kvferry.v1 import registry_service_pb2_grpc as api_grpc

from tests.fixtures.polling import eventually
from tests.fixtures.registry import TEST_TTLS
from tests.registry.builders import engine

pytestmark = pytest.mark.timeout(180)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest_asyncio.fixture(loop_scope="session")
async def small_etcd(tmp_path: Path) -> AsyncIterator[EtcdCluster]:
    with LoopThread() as loop:
        cluster = EtcdCluster(tmp_path / "etcd", loop, size=1, quota_backend_bytes=8 * 1024 * 1024)
        await asyncio.to_thread(cluster.start)
        try:
            yield cluster
        finally:
            await asyncio.to_thread(cluster.stop)


async def _health_becomes(channel: grpc.aio.Channel, wanted: int) -> None:
    stub = health_pb2_grpc.HealthStub(channel)

    async def reached() -> bool:
        return bool((await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == wanted)

    await eventually(reached, within=30, what=f"health {wanted}")


async def test_nospace_turns_the_registry_not_serving_until_the_alarm_is_disarmed(
    small_etcd: EtcdCluster, caplog: pytest.LogCaptureFixture
) -> None:
    config = RegistryConfig(
        listen_address="127.0.0.1:0", etcd_endpoints=small_etcd.endpoints, ttl=TEST_TTLS, history_seconds=0
    )
    running: Registry = await create_registry(config)
    channel = grpc.aio.insecure_channel(running.address)
    stub = api_grpc.RegistryServiceStub(channel)
    try:
        await _health_becomes(channel, SERVING)
        await asyncio.to_thread(small_etcd.fill_to_quota)

        await _health_becomes(channel, NOT_SERVING)
        assert any("NOSPACE" in str(getattr(r, "reason", "")) for r in caplog.records)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.RegisterEngine(api.RegisterEngineRequest(engine=engine("e-space")), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "out of space" in (refused.value.details() or "")

        await asyncio.to_thread(small_etcd.free_space)
        await _health_becomes(channel, SERVING)
        await stub.RegisterEngine(api.RegisterEngineRequest(engine=engine("e-space")), timeout=10)
    finally:
        await channel.close()
        await running.stop(grace_seconds=0.2)
