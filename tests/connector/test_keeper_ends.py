"""The connector's end protocol against a REAL sidecar, registry and etcd, without vLLM: the
connector's own retention table, keeper and sidecar link (what runs inside the engine), with
blocks "freed" where the engine would free them. With real engines: tests/sidecar/test_sidecar_engines.py.

Each test checks the invariant of issue 13 where the connector can break it: a retention it frees
(or will free) is not served by the registry, and what the registry serves is not freed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import pytest
from kvferry.connector.accounting import Accounting
from kvferry.connector.keeper import RetentionKeeper
from kvferry.connector.retention import EndReason, RetainedEntry, RetentionTable
from kvferry.connector.sidecar_link import BackgroundLoop, SidecarLink
from kvferry.pd.digest import block_digests
from kvferry.v1 import registry_service_pb2 as registry_pb2

from tests.fixtures.registry import RegistryHandle, unique
from tests.fixtures.sidecar import TEST_BLOCK_SIZE, SidecarFactory, SidecarHandle, StandInEngineFactory

pytestmark = pytest.mark.timeout(90)

GRACE = 1.0


@dataclass
class Connector:
    """The connector's scheduler-side retention machinery, on the session's event loop for checks."""

    table: RetentionTable
    keeper: RetentionKeeper
    loop: BackgroundLoop
    link: SidecarLink
    freed: list[RetainedEntry] = field(default_factory=list)

    def retain(self, request_id: str, tenant: str, conversation: str, turn: int, blocks: int = 3) -> None:
        tokens = [turn * 100 + i for i in range(blocks * TEST_BLOCK_SIZE)]
        self.table.add(
            request_id=request_id,
            tenant=tenant,
            conversation_id=conversation,
            turn=turn,
            block_ids=range(10 * turn, 10 * turn + blocks),
            num_tokens=len(tokens),
            block_digests=block_digests(tokens, TEST_BLOCK_SIZE),
        )
        self.table.evict_over_budget()
        self.link.poke()

    def free_due(self) -> None:
        """What the engine core does each step (and when the connector's timer wakes it)."""
        self.freed += self.keeper.collect_frees()

    def freed_ids(self) -> dict[str, bool]:
        return {entry.request_id: entry.confirmed for entry in self.freed}

    async def until(self, check: Callable[[], object], within: float = 20.0, what: str = "") -> None:
        deadline = time.monotonic() + within
        while True:
            self.free_due()
            if check():
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} not reached within {within} s")
            await asyncio.sleep(0.05)


@pytest.fixture
async def decode(
    sidecar_factory: SidecarFactory, stand_in_engine_factory: StandInEngineFactory
) -> AsyncIterator[tuple[SidecarHandle, Callable[..., Connector]]]:
    engine = await stand_in_engine_factory()
    sidecar = await sidecar_factory(engine_url=engine.url, engine_id=unique("decode"), role="decode")
    await sidecar.wait_registered()
    started: list[Connector] = []

    def connect(*, budget_blocks: int = 1000, max_retention_seconds: float = 60.0) -> Connector:
        table = RetentionTable(
            max_retention_seconds=max_retention_seconds, grace_seconds=GRACE, budget_blocks=budget_blocks
        )
        loop = BackgroundLoop("test-connector")
        holder: list[SidecarLink] = []
        keeper = RetentionKeeper(
            table,
            engine_id=sidecar.engine_id,
            lease_ttl_seconds=30,
            on_change=lambda: holder[0].poke() if holder else None,
        )
        accounting = Accounting(kv_bytes_per_token=4096)
        link = SidecarLink(
            loop=loop,
            address=sidecar.address,
            engine_id=sidecar.engine_id,
            listener=keeper,
            stats=lambda: (accounting.version, accounting.snapshot()),
            timeout_seconds=5.0,
            stats_interval_seconds=60.0,
        )
        holder.append(link)
        link.start()
        loop.start()
        connector = Connector(table, keeper, loop, link)
        started.append(connector)
        return connector

    yield sidecar, connect
    for connector in started:
        connector.loop.stop()


def _published(connector: Connector, request_id: str) -> bool:
    entry = connector.table.get(request_id)
    return entry is not None and entry.published


async def _served(registry: RegistryHandle, tenant: str, conversation: str) -> str | None:
    """The engine request the registry hands out for the conversation, or None."""
    try:
        found = await registry.stub().GetRetention(
            registry_pb2.GetRetentionRequest(tenant=tenant, conversation_id=conversation), timeout=5
        )
    except grpc.aio.AioRpcError as error:
        assert error.code() == grpc.StatusCode.NOT_FOUND, error
        return None
    return str(found.retention.engine_request_id)


async def test_two_turns_of_one_conversation_the_registry_keeps_one_and_d_frees_the_other(
    registry: RegistryHandle, decode: tuple[SidecarHandle, Callable[..., Connector]]
) -> None:
    """A retry, or two calls with the same conversation id: both decodes retain turn 3. The registry
    refuses the second publish; the connector must hear the refusal, free the second, and keep the
    first, which the registry goes on handing out."""
    _, connect = decode
    connector = connect()
    tenant, conversation = unique("tenant"), unique("conv")
    connector.retain("first", tenant, conversation, turn=3)
    await connector.until(lambda: _published(connector, "first"), what="first published")
    connector.retain("second", tenant, conversation, turn=3)
    await connector.until(lambda: "second" in connector.freed_ids(), what="the refused one freed")
    assert connector.freed_ids() == {"second": True}
    assert await _served(registry, tenant, conversation) == "first"
    first = connector.table.get("first")
    assert first is not None and first.live
    # Later: still held, still served.
    await asyncio.sleep(GRACE * 2)
    connector.free_due()
    assert "first" not in connector.freed_ids()
    assert await _served(registry, tenant, conversation) == "first"


async def test_a_newer_turn_here_ends_the_older_one_only_once_the_registry_replaced_it(
    registry: RegistryHandle, decode: tuple[SidecarHandle, Callable[..., Connector]]
) -> None:
    _, connect = decode
    connector = connect()
    tenant, conversation = unique("tenant"), unique("conv")
    connector.retain("turn-1", tenant, conversation, turn=1)
    await connector.until(lambda: _published(connector, "turn-1"), what="turn 1 published")
    connector.retain("turn-2", tenant, conversation, turn=2)
    await connector.until(lambda: "turn-1" in connector.freed_ids(), what="turn 1 freed")
    assert connector.freed_ids() == {"turn-1": True}
    assert await _served(registry, tenant, conversation) == "turn-2"


async def test_an_eviction_is_freed_only_after_the_registry_ended_it(
    registry: RegistryHandle, decode: tuple[SidecarHandle, Callable[..., Connector]]
) -> None:
    sidecar, connect = decode
    connector = connect(budget_blocks=3)
    tenant, old, new = unique("tenant"), unique("conv"), unique("conv")
    connector.retain("old", tenant, old, turn=1)
    await connector.until(lambda: _published(connector, "old"), what="old published")
    seen_while_held: list[str | None] = []

    async def watch() -> None:
        # Whenever the old one is still held, the registry may serve it; once freed, never again.
        while "old" not in connector.freed_ids():
            seen_while_held.append(await _served(registry, tenant, old))
            await asyncio.sleep(0.02)

    watcher = asyncio.ensure_future(watch())
    connector.retain("new", tenant, new, turn=1)  # over budget: "old" is evicted
    old_entry = connector.table.get("old")
    assert old_entry is not None and old_entry.end_reason is EndReason.EVICTED
    await connector.until(lambda: "old" in connector.freed_ids(), what="the eviction freed")
    await watcher
    assert connector.freed_ids() == {"old": True}
    assert await _served(registry, tenant, old) is None
    assert None in seen_while_held, "the registry ended it before the blocks were freed"
    assert await _served(registry, tenant, new) == "new"
    assert "old" not in sidecar.sidecar.book


async def test_at_the_hard_cap_the_registry_ends_the_record_before_the_blocks_go(
    registry: RegistryHandle, decode: tuple[SidecarHandle, Callable[..., Connector]]
) -> None:
    """No renewals come (no client heartbeats): the hard cap ends the retention. With the registry
    reachable the end is confirmed there first, so the record is not served once the blocks go."""
    _, connect = decode
    connector = connect(max_retention_seconds=2.0)
    tenant, conversation = unique("tenant"), unique("conv")
    connector.retain("capped", tenant, conversation, turn=1)
    await connector.until(lambda: _published(connector, "capped"), what="published")
    assert await _served(registry, tenant, conversation) == "capped"
    await connector.until(lambda: "capped" in connector.freed_ids(), within=60, what="the hard cap")
    assert connector.freed_ids() == {"capped": True}, "confirmed by the registry, not forced"
    assert await _served(registry, tenant, conversation) is None


async def test_without_the_sidecar_nothing_is_freed_before_the_hard_cap(
    decode: tuple[SidecarHandle, Callable[..., Connector]],
) -> None:
    sidecar, connect = decode
    await sidecar.stop()  # unreachable from now on
    connector = connect(budget_blocks=3, max_retention_seconds=3.0)
    tenant = unique("tenant")
    connector.retain("evicted", tenant, unique("conv"), turn=1)
    connector.retain("kept", tenant, unique("conv"), turn=1)
    started = time.monotonic()
    await connector.until(lambda: "evicted" in connector.freed_ids(), within=30, what="the hard cap")
    assert time.monotonic() - started >= 3.0 + GRACE - 0.5
    assert connector.freed_ids()["evicted"] is False, "freed unconfirmed, at the hard cap"
    assert connector.table.unconfirmed_frees >= 1
