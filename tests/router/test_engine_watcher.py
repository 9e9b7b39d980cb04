"""EngineWatcher's reconciliation rules with an in-memory registry (the real registry path is covered
by test_router_standin.py::test_engine_that_leaves_is_dropped_at_once): a snapshot replaces the
table, an engine that leaves while a snapshot is in flight stays gone, and the watch reconnects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvferry.router.engines import EngineInfo, EngineTable, LoadTracker
from kvferry.router.registry_client import EngineEvent, EngineWatcher, RegistryUnavailable, RetentionRecord
from kvferry.runtime.backoff import BackoffPolicy
from kvferry.v1 import resources_pb2

from tests.fixtures.polling import eventually


def engine(engine_id: str) -> EngineInfo:
    return EngineInfo(
        engine_id=engine_id,
        role=resources_pb2.ENGINE_ROLE_DECODE,
        http_endpoint=f"http://{engine_id}",
        nixl_host="127.0.0.1",
        nixl_port=1,
        model="m",
        kv_compatibility_hash="h",
        block_size=16,
        max_model_len=1024,
    )


class InMemoryRegistry:
    """Engines listed and watched from memory; ``events`` feeds the current watch."""

    def __init__(self, engines: list[EngineInfo]) -> None:
        self.engines = engines
        self.events: asyncio.Queue[EngineEvent | None] = asyncio.Queue()
        self.list_gate: asyncio.Event | None = None
        self.list_calls = 0
        self.down = False

    async def get_retention(self, tenant: str, conversation_id: str) -> RetentionRecord | None:
        return None

    async def renew_retention(self, tenant: str, conversation_id: str) -> float | None:
        return None

    async def release_retention(self, tenant: str, conversation_id: str) -> bool:
        return False

    async def list_engines(self) -> list[EngineInfo]:
        self.list_calls += 1
        if self.down:
            raise RegistryUnavailable("down")
        snapshot = list(self.engines)
        if self.list_gate is not None:
            await self.list_gate.wait()
        return snapshot

    async def watch_engines(self) -> AsyncIterator[EngineEvent]:
        while True:
            event = await self.events.get()
            if event is None:
                raise RegistryUnavailable("watch broke")
            yield event


async def test_snapshot_then_events_then_reconnect() -> None:
    registry = InMemoryRegistry([engine("a"), engine("b")])
    table, load = EngineTable(), LoadTracker()
    left: list[str] = []
    watcher = EngineWatcher(
        registry,
        table,
        load,
        backoff=BackoffPolicy(initial_seconds=0.05, max_seconds=0.05),
        on_left=left.append,
    )
    task = asyncio.create_task(watcher.run())
    try:
        await asyncio.wait_for(watcher.synced.wait(), 2)
        assert {e.engine_id for e in table.all()} == {"a", "b"}
        await registry.events.put(EngineEvent("joined", engine("c"), "c"))
        await registry.events.put(EngineEvent("left", None, "a"))
        await eventually(lambda: {e.engine_id for e in table.all()} == {"b", "c"}, within=2.0)
        assert left == ["a"]
        # The watch breaks; meanwhile "b" left. The reconnect's snapshot drops it.
        registry.engines = [engine("c")]
        await registry.events.put(None)
        await eventually(lambda: {e.engine_id for e in table.all()} == {"c"}, within=2.0)
        assert left == ["a", "b"] and watcher.connected
    finally:
        task.cancel()


async def test_engine_leaving_during_a_snapshot_stays_gone() -> None:
    registry = InMemoryRegistry([engine("a")])
    table, load = EngineTable(), LoadTracker()
    watcher = EngineWatcher(registry, table, load, resync_seconds=0.05)
    task = asyncio.create_task(watcher.run())
    try:
        await asyncio.wait_for(watcher.synced.wait(), 2)
        # The next resync's list is taken while "a" is still there, but answers after "a" left.
        registry.list_gate = asyncio.Event()
        calls = registry.list_calls
        await eventually(lambda: registry.list_calls > calls, within=2.0)
        await registry.events.put(EngineEvent("left", None, "a"))
        await eventually(lambda: table.get("a") is None, within=2.0)
        registry.list_gate.set()
        await asyncio.sleep(0.02)
        assert table.get("a") is None
    finally:
        task.cancel()


async def test_registry_down_keeps_the_last_known_engines() -> None:
    registry = InMemoryRegistry([engine("a")])
    table, load = EngineTable(), LoadTracker()
    watcher = EngineWatcher(
        registry, table, load, backoff=BackoffPolicy(initial_seconds=0.05, max_seconds=0.05)
    )
    task = asyncio.create_task(watcher.run())
    try:
        await asyncio.wait_for(watcher.synced.wait(), 2)
        registry.down = True
        await registry.events.put(None)
        await eventually(lambda: not watcher.connected, within=2.0)
        await asyncio.sleep(0.1)
        assert table.get("a") is not None
        registry.down = False
        await eventually(lambda: watcher.connected, within=2.0)
    finally:
        task.cancel()
