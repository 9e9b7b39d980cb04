"""Registry tests that need a key space of their own (listings, watches of every engine)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest_asyncio
from kvferry.registry.config import RegistryConfig
from kvferry.stack.etcd_process import EtcdProcess

from tests.fixtures.registry import TEST_TTLS, RegistryHandle, running_registry


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
    async with running_registry(config) as handle:
        yield handle
