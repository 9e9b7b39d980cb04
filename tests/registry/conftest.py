"""Registry tests that need a key space of their own (listings, watches of every engine), or an etcd of their
own (outages, compaction, measuring what etcd writes)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

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


@pytest_asyncio.fixture(loop_scope="session")
async def own_etcd(tmp_path: Path) -> AsyncIterator[EtcdProcess]:
    """An etcd of the test's own (one member, a fresh data directory), stopped after it."""
    server = EtcdProcess(data_dir=tmp_path / "data", log_path=tmp_path / "etcd.log")
    await asyncio.to_thread(server.start)
    try:
        yield server
    finally:
        await asyncio.to_thread(server.stop)
