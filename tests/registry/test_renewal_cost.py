"""A renewal costs the same whatever the conversation's length: records are immutable.

Real etcd: a 1-block and a 10,000-block retention are renewed alike; what each renewal ships on
the registry's own etcd watch and what etcd writes to its WAL (its own metric) are compared.
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

from tests.registry.builders import BLOCK_SIZE, Stores, engine, retention
from tests.sidecar.helpers import eventually

pytestmark = pytest.mark.timeout(120)

LONG_BLOCKS = 10_000
RENEWALS = 20
# What one renewal may put in etcd's key space and on its watch (key, value, previous value).
MAX_WATCH_BYTES_PER_RENEWAL = 400


@pytest_asyncio.fixture(loop_scope="session")
async def stores(etcd: EtcdProcess) -> AsyncIterator[tuple[Stores, EtcdGateway]]:
    gateway = EtcdGateway(EtcdSettings(endpoints=(etcd.endpoint,)))
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
) -> tuple[list[int], float]:
    """Per renewal: the bytes of its events on a watch of every retention key; and WAL bytes per renewal."""
    layout = stores.retentions.layout
    prefix = layout.retention_events
    start = await gateway.current_revision() + 1
    shipped: dict[int, int] = {}

    async def follow() -> None:
        async for events in gateway.watch(prefix, prefix_end(prefix), start_revision=start):
            for event in events:
                shipped[event.revision] = shipped.get(event.revision, 0) + _event_bytes(event)

    watcher = asyncio.create_task(follow())
    before = await _wal_bytes(etcd)
    revisions = []
    for _ in range(RENEWALS):
        revisions.append((await stores.retentions.renew_retention("t", conversation_id)).revision)
    wal = (await _wal_bytes(etcd) - before) / RENEWALS
    await eventually(lambda: revisions[-1] in shipped, what="the last renewal on the watch")
    watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher
    return [shipped[revision] for revision in revisions], wal


async def test_a_renewal_writes_and_ships_the_same_bytes_for_1_and_10k_blocks(
    stores: tuple[Stores, EtcdGateway], etcd: EtcdProcess
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

    short_events, short_wal = await _renewal_costs(store, gateway, etcd, "short")
    long_events, long_wal = await _renewal_costs(store, gateway, etcd, "longc")

    # Same-length ids: a renewal ships as many bytes for either record, but for varints (the size in
    # tokens, the expiry's nanoseconds: a few bytes per copy, the value and the previous value).
    assert abs(max(long_events) - max(short_events)) <= 8, (short_events, long_events)
    assert max(long_events) <= MAX_WATCH_BYTES_PER_RENEWAL
    # etcd's WAL grows by the same small amount per renewal (a 10k-block re-put would add ~200 KB).
    print(f"per renewal: watch bytes {max(short_events)}/{max(long_events)}, WAL {short_wal}/{long_wal}")
    assert abs(long_wal - short_wal) < 100, (short_wal, long_wal)
    assert long_wal < 1_000, long_wal

    # The record is never rewritten, yet lookups see the renewed expiry.
    found = await store.retentions.get_retention("t", "longc")
    assert len(found.retention.block_ids) == LONG_BLOCKS
    record = await gateway.get(store.retentions.layout.live_retentions + b"t/longc")
    assert record is not None and record.mod_revision < found.revision


async def test_watchers_see_a_renewal_as_renewed_without_blocks(stores: tuple[Stores, EtcdGateway]) -> None:
    store, gateway = stores
    await store.engines.register_engine(engine("e-watch"), 60)
    await store.retentions.publish_retention(retention("t", "watched", "e-watch", num_tokens=64))
    hub = RetentionEventHub(gateway, store.retentions.layout, SystemClock())
    try:
        async with hub.subscribe("e-watch") as subscription:
            renewed = await store.retentions.renew_retention("t", "watched")
            events = subscription.events()
            event = await asyncio.wait_for(anext(events), 5)
    finally:
        await hub.close()
    assert event.type == registry.RETENTION_EVENT_TYPE_RENEWED
    assert event.revision == renewed.revision
    got = event.retention
    assert (got.tenant, got.conversation_id, got.engine_request_id, got.turn) == (
        "t",
        "watched",
        "req-watched-1",
        1,
    )
    assert got.expire_time == renewed.retention.expire_time
    assert not got.block_ids and not got.block_digests
