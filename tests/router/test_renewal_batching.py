"""Renewals a router sends together go to the registry as one RenewRetentions call.

The batching rule with plain functions, then GrpcRegistry against the real registry (real etcd).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from kvferry.router.registry_client import GrpcRegistry, RenewalBatcher, RenewalOutcome
from kvferry.runtime.errors import Internal

from tests.fixtures.registry import RegistryHandle, unique
from tests.registry.builders import publish, register, retention

pytestmark = pytest.mark.timeout(60)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[list[tuple[str, str]]] = []
        self.release = asyncio.Event()

    async def one(self, renewal: tuple[str, str]) -> float | None:
        self.calls.append([renewal])
        await self.release.wait()
        return 1.0

    async def many(self, renewals: Sequence[tuple[str, str]]) -> list[RenewalOutcome]:
        self.calls.append(list(renewals))
        return [None if conversation == "gone" else 2.0 for _, conversation in renewals]


async def test_renewals_arriving_while_one_is_in_flight_share_the_next_call() -> None:
    recorder = Recorder()
    batcher = RenewalBatcher(recorder.one, recorder.many, max_batch=3)
    first = asyncio.create_task(batcher.renew("t", "a"))
    await asyncio.sleep(0)
    rest = [asyncio.create_task(batcher.renew("t", name)) for name in ("b", "gone", "c", "d")]
    await asyncio.sleep(0)
    recorder.release.set()
    assert await first == 1.0  # a lone renewal went out at once, alone
    assert [await task for task in rest] == [2.0, None, 2.0, 1.0]
    assert recorder.calls == [[("t", "a")], [("t", "b"), ("t", "gone"), ("t", "c")], [("t", "d")]]


async def test_a_failed_call_fails_each_renewal_it_carried() -> None:
    async def one(renewal: tuple[str, str]) -> float | None:
        raise Internal("registry failed")

    async def many(renewals: Sequence[tuple[str, str]]) -> list[RenewalOutcome]:
        raise AssertionError("not batched")

    batcher = RenewalBatcher(one, many)
    with pytest.raises(Internal):
        await batcher.renew("t", "a")


async def test_grpc_registry_batches_renewals_against_the_real_registry(registry: RegistryHandle) -> None:
    stub = registry.stub()
    tenant, engine_id = unique("tenant"), unique("engine")
    await register(stub, engine_id)
    live = [f"c{index}" for index in range(20)]
    for conversation in live:
        await publish(stub, retention(tenant, conversation, engine_id))
    client = GrpcRegistry(registry.channel(), timeout_seconds=5)
    outcomes = await asyncio.gather(
        *(client.renew_retention(tenant, conversation) for conversation in [*live, "never-published"])
    )
    assert all(isinstance(outcome, float) and outcome > 0 for outcome in outcomes[:-1])
    assert outcomes[-1] is None
