"""Registry tests that need a key space of their own (listings, watches of every engine)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest_asyncio
from kvferry.registry.config import RegistryConfig
from kvferry.registry.server import create_registry
from kvferry.stack.etcd_process import EtcdProcess

from tests.fixtures.registry import TEST_TTLS, RegistryHandle


@pytest_asyncio.fixture(loop_scope="session")
async def isolated_registry(etcd: EtcdProcess) -> AsyncIterator[RegistryHandle]:
    """A registry of its own on the session's etcd, under a fresh key prefix."""
    config = RegistryConfig(
        listen_address="127.0.0.1:0",
        etcd_endpoints=(etcd.endpoint,),
        key_prefix=f"/kvferry-isolated-{uuid.uuid4().hex[:8]}/",
        ttl=TEST_TTLS,
        history_seconds=0,
    )
    running = await create_registry(config)
    handle = RegistryHandle(address=running.address, registry=running, config=config)
    try:
        yield handle
    finally:
        await handle.close()
        await running.stop(grace_seconds=0.2)
