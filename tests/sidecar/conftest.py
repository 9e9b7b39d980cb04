"""A registry of the test's own, for tests that stop and restart it (the session one stays up)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from kvferry.registry.config import RegistryConfig
from kvferry.registry.server import Registry, create_registry
from kvferry.stack.etcd_process import EtcdProcess, free_port

from tests.fixtures.registry import TEST_TTLS


class RestartableRegistry:
    """A real registry on a fixed loopback port that a test can stop and start again."""

    def __init__(self, etcd: EtcdProcess) -> None:
        self.port = free_port()
        self.config = RegistryConfig(
            listen_address=f"127.0.0.1:{self.port}",
            etcd_endpoints=(etcd.endpoint,),
            etcd_timeout_seconds=2.0,
            key_prefix=f"/kvferry-sidecar-test-{uuid.uuid4().hex[:8]}/",
            ttl=TEST_TTLS,
        )
        self.running: Registry | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.running = await create_registry(self.config)

    async def stop(self) -> None:
        if self.running is not None:
            await self.running.stop(grace_seconds=0.2)
            self.running = None


@pytest.fixture
async def restartable_registry(etcd: EtcdProcess) -> AsyncIterator[RestartableRegistry]:
    registry = RestartableRegistry(etcd)
    await registry.start()
    yield registry
    await registry.stop()


RestartableRegistryFactory = Callable[[], Awaitable[RestartableRegistry]]
