"""A renewal costs nothing in etcd whatever the conversation's length: a lease keep-alive and a read.

Real etcd of the test's own (so nothing else writes meanwhile): a 1-block and a 10,000-block retention
are renewed alike; what each renewal ships on the registry's own etcd watch and what etcd writes to its
WAL (its own metric) are measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio
from kvferry.registry.config import TtlPolicy
from kvferry.registry.etcd import EtcdGateway, EtcdSettings, WatchEvent, prefix_end
from kvferry.registry.events import RetentionEventHub
from kvferry.registry.keys import KeyLayout
from kvferry.runtime.clock import SystemClock
from kvferry.stack.etcd_process import EtcdProcess
from kvferry.v1 import registry_service_pb2 as registry
from kvferry.v1 import resources_pb2 as resources

from tests.registry.builders import BLOCK_SIZE, Stores, engine, retention

pytestmark = pytest.mark.timeout(120)

LONG_BLOCKS = 10_000
RENEWALS = 20
# The target for etcd bytes written per renewal; a renewal writes none.
MAX_WAL_BYTES_PER_RENEWAL = 200


@pytest_asyncio.fixture(loop_scope="session")
async def stores(own_etcd: EtcdProcess) -> AsyncIterator[tuple[Stores, EtcdGateway]]:
    gateway = EtcdGateway(EtcdSettings(endpoints=(own_etcd.endpoint,)))
    await gateway.connect()
    try:
        yield (
            Stores.over(gateway, KeyLayout(f"/kvferry-renewal-{uuid.uuid4().hex[:8]}/"), TtlPolicy()),
            gateway,
        )
    finally:
        await gateway.close()


async def _wal_bytes(etcd: EtcdProcess) -> int:
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"http://{etcd.endpoint}/metrics", timeout=5)).text
    match = re.search(r"^etcd_disk_wal_write_bytes_total (\S+)$", text, re.MULTILINE)
    assert match is not None, "etcd exports etcd_disk_wal_write_bytes_total"
    return int(float(match.group(1)))


def _event_bytes(event: WatchEvent) -> int:
    previous = len(event.previous.value) if event.previous is not None else 0
    return len(event.kv.key) + len(event.kv.value) + previous


async def _renewal_costs(
    stores: Stores, gateway: EtcdGateway, etcd: EtcdProcess, conversation_id: str
) -> tuple[int, float, int]:
    """Bytes of events a watch of every key under the prefix saw during the renewals; WAL bytes per
    renewal; and how far the store's revision moved."""
    prefix = stores.retentions.layout.prefix.encode()
    start = await gateway.current_revision()
    shipped = 0

    async def follow() -> None:
        nonlocal shipped
        async for events in gateway.watch(prefix, prefix_end(prefix), start_revision=start + 1):
            shipped += sum(_event_bytes(event) for event in events)

    watcher = asyncio.create_task(follow())
    before = await _wal_bytes(etcd)
    for _ in range(RENEWALS):
        await stores.retentions.renew_retention("t", conversation_id)
    wal = (await _wal_bytes(etcd) - before) / RENEWALS
    moved = await gateway.current_revision() - start
    await asyncio.sleep(0.2)  # anything the renewals wrote would be on the watch by now
    watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher
    return shipped, wal, moved


async def test_a_renewal_writes_and_ships_nothing_for_1_and_10k_blocks(
    stores: tuple[Stores, EtcdGateway], own_etcd: EtcdProcess
) -> None:
    store, gateway = stores
    big_engine = engine("e-long")
    big_engine.max_model_len = LONG_BLOCKS * BLOCK_SIZE
    big_engine.kv_capacity_blocks = LONG_BLOCKS
    await store.engines.register_engine(big_engine, 60)
    await store.retentions.publish_retention(retention("t", "short", "e-long", num_tokens=BLOCK_SIZE))
    long = retention("t", "longc", "e-long", num_tokens=LONG_BLOCKS * BLOCK_SIZE)
    assert long.ByteSize() > 100_000
    await store.retentions.publish_retention(long)
    # The cold path too: a registry that does not know the record reads its holder, not its blocks.
    store.retentions.cache.drop(store.retentions.layout.live_retentions + b"t/longc")

    short_shipped, short_wal, short_moved = await _renewal_costs(store, gateway, own_etcd, "short")
    long_shipped, long_wal, long_moved = await _renewal_costs(store, gateway, own_etcd, "longc")

    print(f"per renewal: WAL {short_wal}/{long_wal} bytes; watch {short_shipped}/{long_shipped} bytes in all")
    assert (short_shipped, long_shipped) == (0, 0)
    assert (short_moved, long_moved) == (0, 0)
    assert short_wal <= MAX_WAL_BYTES_PER_RENEWAL and long_wal <= MAX_WAL_BYTES_PER_RENEWAL, (
        short_wal,
        long_wal,
    )

    # The record is never rewritten, yet lookups see the renewed lease's end.
    found = await store.retentions.get_retention("t", "longc")
    assert len(found.retention.block_ids) == LONG_BLOCKS
    renewed = await store.retentions.renew_retention("t", "longc")
    assert (
        abs(found.retention.expire_time.ToNanoseconds() - renewed.retention.expire_time.ToNanoseconds())
        <= 1.5e9
    )


async def test_watchers_hear_nothing_of_a_renewal_and_then_the_end(
    stores: tuple[Stores, EtcdGateway],
) -> None:
    store, gateway = stores
    await store.engines.register_engine(engine("e-watch"), 60)
    await store.retentions.publish_retention(retention("t", "watched", "e-watch", num_tokens=64))
    hub = RetentionEventHub(gateway, store.retentions.layout, SystemClock())
    try:
        async with hub.subscribe("e-watch") as subscription:
            renewed = await store.retentions.renew_retention("t", "watched")
            released = await store.retentions.release_retention(
                "t", "watched", resources.RELEASE_REASON_RELEASED
            )
            event = await asyncio.wait_for(anext(subscription.events()), 5)
    finally:
        await hub.close()
    assert (event.type, event.revision) == (registry.RETENTION_EVENT_TYPE_ENDED, released)
    assert event.revision > renewed.revision
    assert event.retention.engine_request_id == renewed.retention.engine_request_id == "req-watched-1"
