"""Two registry replicas on one etcd: what one caches never hides what the other changed.

Uses the stores directly (no gRPC) on the session's real etcd.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from kvferry.registry.cache import RetentionCache
from kvferry.registry.config import TtlPolicy
from kvferry.registry.etcd import EtcdGateway, EtcdSettings, Put
from kvferry.registry.keys import KeyLayout
from kvferry.registry.records import StoredRetention
from kvferry.runtime.errors import NotFound
from kvferry.stack.etcd_process import EtcdProcess
from kvferry.v1 import resources_pb2 as resources

from tests.registry.builders import Stores, engine, retention

pytestmark = pytest.mark.timeout(60)


@pytest_asyncio.fixture(loop_scope="session")
async def replicas(etcd: EtcdProcess) -> AsyncIterator[tuple[Stores, Stores]]:
    layout = KeyLayout(f"/kvferry-replicas-{uuid.uuid4().hex[:8]}/")
    gateways = [EtcdGateway(EtcdSettings(endpoints=(etcd.endpoint,))) for _ in range(2)]
    for gateway in gateways:
        await gateway.connect()
    try:
        yield (
            Stores.over(gateways[0], layout, TtlPolicy()),
            Stores.over(gateways[1], layout, TtlPolicy()),
        )
    finally:
        for gateway in gateways:
            await gateway.close()


async def test_lookups_on_one_replica_see_changes_made_through_the_other(
    replicas: tuple[Stores, Stores],
) -> None:
    first, second = replicas
    await first.engines.register_engine(engine("e-1"), 60)
    await first.engines.register_engine(engine("e-2"), 60)
    await first.retentions.publish_retention(retention("t", "c", "e-1", turn=1))
    assert (await first.retentions.get_retention("t", "c")).retention.turn == 1  # now cached by the first

    await second.retentions.publish_retention(retention("t", "c", "e-2", turn=2))
    found = await first.retentions.get_retention("t", "c")
    assert (found.retention.turn, found.retention.engine_id) == (2, "e-2")

    before = found.retention.expire_time.ToNanoseconds()
    renewed = await second.retentions.renew_retention("t", "c")
    assert renewed.retention.expire_time.ToNanoseconds() >= before
    # The renewal wrote nothing; the other replica reads the lease's end from etcd (whole seconds left).
    seen = (await first.retentions.get_retention("t", "c")).retention.expire_time.ToNanoseconds()
    assert abs(seen - renewed.retention.expire_time.ToNanoseconds()) <= 1.5e9

    # The first renews with a stale view of the lease: it still renews the live turn.
    await second.retentions.publish_retention(retention("t", "c", "e-2", turn=3))
    assert (await first.retentions.renew_retention("t", "c")).retention.turn == 3

    await second.retentions.release_retention("t", "c", resources.RELEASE_REASON_RELEASED)
    with pytest.raises(NotFound):
        await first.retentions.get_retention("t", "c")
    with pytest.raises(NotFound):
        await first.retentions.renew_retention("t", "c")


async def test_a_cached_lookup_notices_its_engine_re_registered(
    replicas: tuple[Stores, Stores],
) -> None:
    first, second = replicas
    await first.engines.register_engine(engine("e-3"), 60)
    await first.retentions.publish_retention(retention("t", "c-3", "e-3"))
    assert (await first.retentions.get_retention("t", "c-3")).retention.engine_id == "e-3"
    # A new incarnation appears (its old blocks are gone) and nobody has reaped yet.
    gateway = second.engines.etcd
    key = second.engines.layout.engine("e-3")
    current = await gateway.get(key)
    assert current is not None
    lease = await gateway.grant(60)
    await gateway.txn([], [Put(key, current.value, lease.id)])
    with pytest.raises(NotFound, match="left the registry"):
        await first.retentions.get_retention("t", "c-3")
    with pytest.raises(NotFound):
        await first.retentions.renew_retention("t", "c-3")
    # Registering through the registry reaps them for good.
    await second.engines.register_engine(engine("e-3"), 60)
    assert await second.reaper.reap_engine("e-3") == 0


def test_the_cache_stays_within_its_byte_budget_evicting_the_least_recently_used() -> None:
    cache = RetentionCache(max_bytes=3000)
    stored = StoredRetention(retention("t", "c", "e"), 1)
    for index in range(5):
        cache.put(f"k{index}".encode(), stored, lease=1, mod_revision=index, encoded_size=700)
        cache.get(b"k0")  # keep k0 in use
    assert cache.bytes_used <= 3000
    assert cache.get(b"k0") is not None and cache.get(b"k4") is not None
    assert cache.get(b"k1") is None
    cache.drop(b"k0")
    assert cache.get(b"k0") is None
    cache.put(b"huge", stored, lease=1, mod_revision=1, encoded_size=10_000)  # never fits
    assert cache.get(b"huge") is None
