"""The reaper on its own (real etcd, no gRPC): what it ends, what it spares, and that it ends each once."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from kvferry.registry.config import TtlPolicy
from kvferry.registry.etcd import EtcdGateway, EtcdSettings, EventType, Put, prefix_end
from kvferry.registry.keys import KeyLayout
from kvferry.registry.metrics import RegistryMetrics
from kvferry.registry.records import decode_tombstone
from kvferry.runtime.errors import NotFound
from kvferry.stack.etcd_process import EtcdProcess
from kvferry.v1 import resources_pb2 as resources

from tests.registry.builders import Stores, engine, retention

pytestmark = pytest.mark.timeout(60)


@pytest_asyncio.fixture(loop_scope="session")
async def gateways(etcd: EtcdProcess) -> AsyncIterator[tuple[EtcdGateway, EtcdGateway]]:
    """Two gateways, as two registry replicas have."""
    pair = (
        EtcdGateway(EtcdSettings(endpoints=(etcd.endpoint,))),
        EtcdGateway(EtcdSettings(endpoints=(etcd.endpoint,))),
    )
    for gateway in pair:
        await gateway.connect()
    try:
        yield pair
    finally:
        for gateway in pair:
            await gateway.close()


def _layout() -> KeyLayout:
    return KeyLayout(f"/kvferry-reaper-{uuid.uuid4().hex[:8]}/")


async def _engine_leaves(stores: Stores, engine_id: str) -> None:
    """The engine's lease ends (as when its sidecar stops heartbeating); nobody reaps."""
    key = stores.engines.layout.engine(engine_id)
    kv = await stores.engines.etcd.get(key)
    assert kv is not None
    await stores.engines.etcd.revoke(kv.lease)


async def _indexed(stores: Stores, engine_id: str) -> int:
    start = stores.reaper.layout.engine_index_prefix(engine_id)
    return await stores.reaper.etcd.count(start, prefix_end(start))


def _engine_gone_count(metrics: RegistryMetrics) -> float:
    return metrics.registry.get_sample_value("kvferry_releases_total", {"reason": "engine_gone"}) or 0.0


async def test_reaping_ends_the_retentions_of_a_dead_incarnation_and_spares_the_live_one(
    gateways: tuple[EtcdGateway, EtcdGateway],
) -> None:
    gateway = gateways[0]
    layout = _layout()
    metrics = RegistryMetrics()
    stores = Stores.over(gateway, layout, TtlPolicy(), metrics)
    await stores.engines.register_engine(engine("e"), 60)
    for conversation in ("c1", "c2"):
        await stores.retentions.publish_retention(retention("t", conversation, "e"))
    # A new incarnation appears (its old blocks are gone) and nobody has reaped yet.
    key = layout.engine("e")
    old = await gateway.get(key)
    assert old is not None
    lease = await gateway.grant(60)
    await gateway.txn([], [Put(key, old.value, lease.id)])
    await stores.retentions.publish_retention(retention("t", "c3", "e"))
    start = await gateway.current_revision() + 1

    assert await stores.reaper.reap_engine("e") == 2
    assert await stores.reaper.reap_engine("e") == 0  # idempotent
    for conversation in ("c1", "c2"):
        with pytest.raises(NotFound):
            await stores.retentions.get_retention("t", conversation)
    assert (await stores.retentions.get_retention("t", "c3")).retention.engine_id == "e"
    assert await _indexed(stores, "e") == 1
    assert _engine_gone_count(metrics) == 2
    # Each ending wrote its reason first (the tombstone, since revoked with its lease).
    reasons = []
    async with asyncio.timeout(10):
        async for events in gateway.watch(
            layout.tombstones, prefix_end(layout.tombstones), start_revision=start
        ):
            reasons += [decode_tombstone(e.kv.value)[0] for e in events if e.type is EventType.PUT]
            if len(reasons) == 2:
                break
    assert reasons == [resources.RELEASE_REASON_ENGINE_GONE] * 2


async def test_a_sweep_reaps_every_engine_that_left_retentions_behind(
    gateways: tuple[EtcdGateway, EtcdGateway],
) -> None:
    stores = Stores.over(gateways[0], _layout(), TtlPolicy())
    for engine_id in ("gone-1", "gone-2", "alive"):
        await stores.engines.register_engine(engine(engine_id), 60)
        await stores.retentions.publish_retention(retention("t", f"c-{engine_id}", engine_id, turn=1))
    await stores.retentions.publish_retention(retention("t", "c-second", "gone-1"))
    await _engine_leaves(stores, "gone-1")
    await _engine_leaves(stores, "gone-2")

    assert await stores.reaper.sweep_orphans() == 3
    assert await stores.reaper.sweep_orphans() == 0
    assert [await _indexed(stores, e) for e in ("gone-1", "gone-2", "alive")] == [0, 0, 1]
    assert (await stores.retentions.get_retention("t", "c-alive")).retention.engine_id == "alive"


async def test_two_replicas_reaping_at_once_end_each_retention_once(
    gateways: tuple[EtcdGateway, EtcdGateway],
) -> None:
    layout = _layout()
    metrics = (RegistryMetrics(), RegistryMetrics())
    first, second = (Stores.over(g, layout, TtlPolicy(), m) for g, m in zip(gateways, metrics, strict=True))
    await first.engines.register_engine(engine("e"), 60)
    for index in range(8):
        await first.retentions.publish_retention(retention("t", f"c{index}", "e"))
    await _engine_leaves(first, "e")

    counts = await asyncio.gather(first.reaper.reap_engine("e"), second.reaper.reap_engine("e"))
    assert sum(counts) == 8
    assert sum(_engine_gone_count(m) for m in metrics) == 8
    assert await _indexed(first, "e") == 0


async def _until_none_indexed(stores: Stores, engine_id: str, since_revision: int) -> None:
    """Waits, following etcd from ``since_revision``, until no retention of ``engine_id`` is left."""
    start = stores.reaper.layout.engine_index_prefix(engine_id)
    watch = stores.reaper.etcd.watch(start, prefix_end(start), start_revision=since_revision)
    async with asyncio.timeout(10), contextlib.aclosing(watch):
        while await _indexed(stores, engine_id):
            await anext(watch)


async def test_running_it_sweeps_first_then_follows_engines_leaving_and_re_registering(
    gateways: tuple[EtcdGateway, EtcdGateway],
) -> None:
    gateway = gateways[0]
    layout = _layout()
    stores = Stores.over(gateway, layout, TtlPolicy())
    for engine_id in ("before", "leaving", "restarting"):
        await stores.engines.register_engine(engine(engine_id), 60)
        await stores.retentions.publish_retention(retention("t", f"c-{engine_id}", engine_id))
    await _engine_leaves(stores, "before")  # ended while no reaper ran
    since = await gateway.current_revision()

    running = asyncio.create_task(stores.reaper.run())
    try:
        await _until_none_indexed(stores, "before", since)
        await _engine_leaves(stores, "leaving")
        await _until_none_indexed(stores, "leaving", since)
        # Re-registered under a new lease behind the engine store's back: the old incarnation ends.
        key = layout.engine("restarting")
        old = await gateway.get(key)
        assert old is not None
        lease = await gateway.grant(60)
        await gateway.txn([], [Put(key, old.value, lease.id)])
        await _until_none_indexed(stores, "restarting", since)
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
