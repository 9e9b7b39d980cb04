"""Transactions batched into one etcd call keep their own outcomes (real etcd)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence

import pytest
import pytest_asyncio
from kvferry.registry.batching import ReadBatcher, TxnBatcher
from kvferry.registry.etcd import (
    Compare,
    EtcdGateway,
    EtcdSettings,
    Get,
    LeaseNotFound,
    ModRevisionIs,
    Op,
    Put,
    TxnResult,
)
from kvferry.stack.etcd_process import EtcdProcess

pytestmark = pytest.mark.timeout(30)


class CountingGateway(EtcdGateway):
    """The real gateway, counting the transactions it sends."""

    calls = 0

    async def txn(
        self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        self.calls += 1
        return await super().txn(compare, success, failure)


@pytest_asyncio.fixture(loop_scope="session")
async def gateway(etcd: EtcdProcess) -> AsyncIterator[CountingGateway]:
    counting = CountingGateway(EtcdSettings(endpoints=(etcd.endpoint,)))
    await counting.connect()
    try:
        yield counting
    finally:
        await counting.close()


def _key(name: str) -> bytes:
    return f"/kvferry-batching-{uuid.uuid4().hex[:8]}/{name}".encode()


async def test_concurrent_calls_share_etcd_calls_and_keep_their_own_outcomes(
    gateway: CountingGateway,
) -> None:
    batcher = TxnBatcher(gateway)
    keys = [_key(f"k{index}") for index in range(40)]
    results = await asyncio.gather(*(batcher.txn([], [Put(key, b"v")]) for key in keys))
    assert all(result.succeeded for result in results)
    assert gateway.calls < len(keys)  # the first goes alone, the rest ride along
    assert len({result.revision for result in results}) < len(keys)

    # Compares are judged per call: only the ones expecting "absent" fail now.
    checks = await asyncio.gather(
        *(batcher.txn([ModRevisionIs(key, 0)], [], [Get(key)]) for key in keys[:10]),
        batcher.txn([ModRevisionIs(_key("never"), 0)], [], []),
    )
    assert [check.succeeded for check in checks] == [False] * 10 + [True]
    assert checks[0].range(0).kvs[0].value == b"v"


async def test_one_callers_bad_lease_or_duplicate_key_does_not_fail_the_others(
    gateway: CountingGateway,
) -> None:
    batcher = TxnBatcher(gateway)
    lease = (await gateway.grant(30)).id
    await gateway.revoke(lease)
    shared = _key("same")
    outcomes = await asyncio.gather(
        batcher.txn([], [Put(_key("a"), b"1")]),
        batcher.txn([], [Put(_key("gone-lease"), b"x", lease)]),
        batcher.txn([], [Put(shared, b"first")]),
        batcher.txn([], [Put(shared, b"second")]),
        batcher.txn([], [Put(_key("b"), b"2")]),
        return_exceptions=True,
    )
    assert isinstance(outcomes[1], LeaseNotFound)
    assert all(
        not isinstance(outcome, BaseException) and outcome.succeeded
        for i, outcome in enumerate(outcomes)
        if i != 1
    )
    assert (await gateway.range(shared)).kvs[0].value == b"second"  # never in one batch, kept in order


async def test_large_writes_are_split_under_etcds_request_limit(gateway: CountingGateway) -> None:
    """Twelve 170 KB records (128k-token conversations) exceed etcd's 1.5 MiB request limit together."""
    batcher = TxnBatcher(gateway)
    value = b"x" * 170_000
    keys = [_key(f"big{index}") for index in range(12)]
    before = gateway.calls
    results = await asyncio.gather(*(batcher.txn([], [Put(key, value)]) for key in keys))
    assert all(result.succeeded for result in results)
    assert 2 <= gateway.calls - before < 12
    for key in keys:
        stored = await gateway.get(key)
        assert stored is not None and stored.value == value


async def test_concurrent_reads_share_flat_read_only_calls(gateway: CountingGateway) -> None:
    """Reads go out as one flat transaction of reads, which etcd serves without a raft entry (a nested
    one would be written to its WAL like a write; test_renewal_cost.py measures the WAL): many reads,
    each its own answer, one revision each."""
    writes = TxnBatcher(gateway)
    keys = [_key(f"r{index}") for index in range(150)]
    await asyncio.gather(*(writes.txn([], [Put(key, key)]) for key in keys[::2]))
    reads = ReadBatcher(gateway)
    calls_before = gateway.calls
    answers = await asyncio.gather(*(reads.read(Get(key), Get(keys[0], keys_only=True)) for key in keys))
    # 150 callers of 2 gets each, the shared one sent once per call: at most 127 callers a call.
    assert gateway.calls - calls_before <= 3
    for index, (own, shared) in enumerate(answers):
        found = own.first
        assert (found.value if found is not None else None) == (keys[index] if index % 2 == 0 else None)
        assert shared.first is not None and shared.first.value == b"" and own.revision == shared.revision
    with pytest.raises(ValueError):
        await reads.read()
