"""The etcd gateway on its own (real etcd): typed requests in, typed results, events and errors out."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from kvferry.registry.errors import EtcdUnavailable
from kvferry.registry.etcd import (
    Delete,
    DeleteResult,
    EtcdGateway,
    EtcdSettings,
    EventType,
    Get,
    KeyValue,
    LeaseIs,
    LeaseNotFound,
    ModRevisionIs,
    Put,
    Txn,
    WatchEvent,
    prefix_end,
)
from kvferry.stack.etcd_process import EtcdProcess, free_port

pytestmark = pytest.mark.timeout(30)


@pytest_asyncio.fixture(loop_scope="session")
async def gateway(etcd: EtcdProcess) -> AsyncIterator[EtcdGateway]:
    connected = EtcdGateway(EtcdSettings(endpoints=(etcd.endpoint,)))
    await connected.connect()
    try:
        yield connected
    finally:
        await connected.close()


def _prefix() -> bytes:
    return f"/kvferry-gateway-{uuid.uuid4().hex[:8]}/".encode()


def test_a_transaction_names_every_key_either_branch_writes() -> None:
    txn = Txn(
        [ModRevisionIs(b"guard", 0)],
        [Put(b"a", b"1"), Get(b"read-only"), Txn([], [Delete(b"nested")])],
        [Delete(b"b")],
    )
    assert txn.written_keys() == {b"a", b"nested", b"b"}


async def test_compares_choose_the_branch_and_results_come_back_typed(gateway: EtcdGateway) -> None:
    key = _prefix() + b"k"
    created = await gateway.txn([ModRevisionIs(key, 0)], [Put(key, b"v1", prev_kv=True)], [Get(key)])
    assert created.succeeded and created.put(0).previous is None
    replaced = await gateway.txn([ModRevisionIs(key, created.revision)], [Put(key, b"v2", prev_kv=True)])
    previous = replaced.put(0).previous
    assert replaced.succeeded and previous == KeyValue(key, b"v1", 0, created.revision)
    # A stale revision fails the compare: the failure branch reads what won.
    stale = await gateway.txn([ModRevisionIs(key, created.revision)], [Delete(key)], [Get(key)])
    assert not stale.succeeded
    assert stale.range(0).first == KeyValue(key, b"v2", 0, replaced.revision)
    assert stale.revision >= replaced.revision
    with pytest.raises(TypeError, match="RangeResult"):
        replaced.range(0)  # the result of a put is not a read
    assert await gateway.get(key) == KeyValue(key, b"v2", 0, replaced.revision)
    assert await gateway.get(key + b"-absent") is None


async def test_nested_transactions_are_judged_one_by_one_at_one_revision(gateway: EtcdGateway) -> None:
    prefix = _prefix()
    held, free = prefix + b"held", prefix + b"free"
    lease = await gateway.grant(30)
    try:
        await gateway.txn([], [Put(held, b"x", lease.id)])
        outer = await gateway.txn(
            [],
            [
                Txn([LeaseIs(held, lease.id)], [Delete(held)]),
                Txn([LeaseIs(free, lease.id)], [Put(free, b"never")], [Get(free)]),
            ],
        )
        first, second = outer.txn(0), outer.txn(1)
        assert first.succeeded and first.results == [DeleteResult(1, outer.revision)]
        assert not second.succeeded and second.range(0).kvs == []
        assert first.revision == second.revision == outer.revision
    finally:
        await gateway.revoke(lease.id)


async def test_scan_reads_a_range_page_by_page_in_key_order(gateway: EtcdGateway) -> None:
    prefix = _prefix()
    keys = [prefix + f"k{index:02}".encode() for index in range(7)]
    await gateway.txn([], [Put(key, b"") for key in reversed(keys)])
    pages = [page async for page in gateway.scan(prefix, prefix_end(prefix), page_size=3)]
    assert [len(page.kvs) for page in pages] == [3, 3, 1]
    assert [kv.key for page in pages for kv in page.kvs] == keys
    assert (await gateway.range(prefix, prefix_end(prefix), limit=2)).count == 7
    assert await gateway.count(prefix, prefix_end(prefix)) == 7
    empty = [
        page async for page in gateway.scan(prefix + b"none/", prefix_end(prefix + b"none/"), page_size=3)
    ]
    assert [page.kvs for page in empty] == [[]]


async def test_a_lease_lives_until_revoked_and_then_is_not_found(gateway: EtcdGateway) -> None:
    key = _prefix() + b"leased"
    lease = await gateway.grant(30)
    assert lease.ttl_seconds == 30
    await gateway.txn([], [Put(key, b"v", lease.id)])
    held = await gateway.get(key)
    assert held is not None and held.lease == lease.id
    renewal = await gateway.keep_alive_once(lease.id)
    assert renewal.ttl_seconds == 30 and renewal.revision > 0
    assert await gateway.revoke(lease.id) > 0
    assert await gateway.get(key) is None  # its keys went with it
    with pytest.raises(LeaseNotFound):
        await gateway.keep_alive_once(lease.id)
    assert await gateway.revoke(lease.id) == 0  # unknown leases are ignored
    with pytest.raises(LeaseNotFound):
        await gateway.txn([], [Put(key, b"v", lease.id)])


async def test_a_watch_yields_typed_events_one_transaction_together(gateway: EtcdGateway) -> None:
    prefix = _prefix()
    first, second = prefix + b"a", prefix + b"b"
    start = await gateway.current_revision() + 1
    created = await gateway.txn([], [Put(first, b"1")])
    together = await gateway.txn([], [Put(first, b"2"), Put(second, b"x")])
    deleted = await gateway.txn([], [Delete(first)])
    batches: list[list[WatchEvent]] = []
    watch = gateway.watch(prefix, prefix_end(prefix), start_revision=start)
    async with asyncio.timeout(10):
        async for events in watch:
            batches.append(events)
            if events[-1].revision == deleted.revision:
                break
    await watch.aclose()
    events = [event for batch in batches for event in batch]
    assert events == [
        WatchEvent(EventType.PUT, KeyValue(first, b"1", 0, created.revision), None),
        WatchEvent(
            EventType.PUT,
            KeyValue(first, b"2", 0, together.revision),
            KeyValue(first, b"1", 0, created.revision),
        ),
        WatchEvent(EventType.PUT, KeyValue(second, b"x", 0, together.revision), None),
        WatchEvent(
            EventType.DELETE,
            KeyValue(first, b"", 0, deleted.revision),
            KeyValue(first, b"2", 0, together.revision),
        ),
    ]
    # Both puts of one transaction arrive in the same batch.
    assert any(len(batch) >= 2 and {e.kv.key for e in batch} == {first, second} for batch in batches)


async def test_an_unreachable_etcd_fails_fast_with_what_to_check_and_is_counted() -> None:
    failures: list[str] = []
    nowhere = EtcdGateway(
        EtcdSettings(endpoints=(f"127.0.0.1:{free_port()}",), timeout_seconds=0.3), on_error=failures.append
    )
    await nowhere.connect()
    try:
        with pytest.raises(EtcdUnavailable, match="--etcd-endpoints"):
            await nowhere.get(b"k")
        with pytest.raises(EtcdUnavailable):
            await nowhere.txn([], [Put(b"k", b"v")])
        with pytest.raises(EtcdUnavailable):
            await nowhere.keep_alive_once(1)
        await nowhere.revoke_quietly(1, "a test")  # logged, not raised
    finally:
        await nowhere.close()
    assert failures == ["range", "txn", "lease_keepalive", "lease_revoke"]
