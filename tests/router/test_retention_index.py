"""The router's retention index: its event rules, then fed by the real registry (real etcd)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from kvferry.router.registry_client import GrpcRegistry
from kvferry.router.retention_index import IndexEntry, RetentionIndex, apply_event
from kvferry.runtime.timestamps import to_timestamp
from kvferry.v1 import registry_service_pb2 as api
from kvferry.v1 import resources_pb2 as resources

from tests.fixtures.polling import eventually
from tests.fixtures.registry import RegistryHandle, unique
from tests.registry.builders import publish, register, retention

pytestmark = pytest.mark.timeout(60)

PUBLISHED, RENEWED, ENDED = (
    api.RETENTION_EVENT_TYPE_PUBLISHED,
    api.RETENTION_EVENT_TYPE_RENEWED,
    api.RETENTION_EVENT_TYPE_ENDED,
)


def _event(
    kind: api.RetentionEventType.ValueType,
    request: str,
    revision: int,
    *,
    turn: int = 1,
    expire: float = 100.0,
) -> api.WatchAllRetentionsResponse:
    held = resources.Retention(tenant="t", conversation_id="c", engine_request_id=request, turn=turn)
    held.expire_time.CopyFrom(to_timestamp(expire))
    return api.WatchAllRetentionsResponse(
        header=resources.ResponseHeader(revision=revision), type=kind, retention=held
    )


def test_events_are_judged_by_revision_and_by_the_turn_held() -> None:
    entries: dict[tuple[str, str], IndexEntry] = {}
    apply_event(entries, _event(PUBLISHED, "r1", 10))
    # A registry that still wrote renewals: the entry reflects the revision, the record stays as published.
    apply_event(entries, _event(RENEWED, "r1", 12, expire=200.0))
    assert entries["t", "c"].record.expire_time == 100.0
    apply_event(entries, _event(PUBLISHED, "r1", 9))  # older than what the entry reflects
    assert entries["t", "c"].revision == 12
    apply_event(entries, _event(PUBLISHED, "r2", 15, turn=2))  # a newer turn
    apply_event(entries, _event(ENDED, "r1", 15))  # the older turn's end, same revision: old news
    apply_event(entries, _event(ENDED, "r1", 16))  # not the turn held
    assert entries["t", "c"].record.engine_request_id == "r2"
    apply_event(entries, _event(ENDED, "r2", 17))
    assert not entries


@contextlib.asynccontextmanager
async def _running(index: RetentionIndex) -> AsyncIterator[RetentionIndex]:
    task = asyncio.create_task(index.run())
    try:
        await asyncio.wait_for(index.ready.wait(), 20)
        yield index
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_the_index_follows_the_registry_and_rebuilds_from_its_snapshot(
    registry: RegistryHandle,
) -> None:
    stub = registry.stub()
    tenant, engine_id = unique("tenant"), unique("engine")
    await register(stub, engine_id)
    await publish(stub, retention(tenant, "before", engine_id, num_tokens=64))
    client = GrpcRegistry(registry.channel(), timeout_seconds=5)

    async with _running(RetentionIndex(client.watch_all_retentions)) as index:
        found = index.find(tenant, "before")  # from the snapshot
        assert found is not None and len(found.block_ids) == 4

        await publish(stub, retention(tenant, "after", engine_id, turn=1))
        await publish(stub, retention(tenant, "before", engine_id, turn=2, num_tokens=80))

        def turn_held(conversation_id: str) -> int:
            found = index.find(tenant, conversation_id)
            return found.turn if found is not None else 0

        await eventually(lambda: turn_held("before") == 2)
        assert index.find(tenant, "after") is not None

        # A renewal changes nothing the index holds (it writes nothing, sends nothing): the entry lives on
        # until its end, whatever its first lease end says.
        held = index._entries[tenant, "after"]
        await stub.RenewRetention(
            api.RenewRetentionRequest(tenant=tenant, conversation_id="after"), timeout=5
        )
        assert index._entries[tenant, "after"] is held and index.find(tenant, "after") is held.record

        await stub.ReleaseRetention(
            api.ReleaseRetentionRequest(
                tenant=tenant, conversation_id="after", reason=resources.RELEASE_REASON_RELEASED
            ),
            timeout=5,
        )
        await eventually(lambda: index.find(tenant, "after") is None)

    # A restarted router rebuilds the index from the snapshot before it is ready.
    async with _running(RetentionIndex(client.watch_all_retentions)) as fresh:
        rebuilt = fresh.find(tenant, "before")
        assert rebuilt is not None and rebuilt.turn == 2 and len(rebuilt.block_ids) == 5
        assert fresh.find(tenant, "after") is None


async def test_the_index_follows_a_relocation_to_the_host_tier(registry: RegistryHandle) -> None:
    """A relocation (issue 19) replaces the entry: the new request, its block ids and its tier; the old
    request's end, at the same revision, is old news."""
    stub = registry.stub()
    tenant, engine_id, conversation = unique("tenant"), unique("engine"), unique("conv")
    await register(stub, engine_id)
    held = retention(tenant, conversation, engine_id)
    await publish(stub, held)
    moved = resources.Retention()
    moved.CopyFrom(held)
    moved.engine_request_id = f"{held.engine_request_id}:host"
    moved.relocates_engine_request_id = held.engine_request_id
    moved.tier = resources.MEMORY_TIER_HOST
    del moved.block_ids[:]
    moved.block_ids.extend(range(5000, 5000 + len(held.block_ids)))
    client = GrpcRegistry(registry.channel(), timeout_seconds=5)

    async with _running(RetentionIndex(client.watch_all_retentions)) as index:
        found = index.find(tenant, conversation)
        assert found is not None and found.tier == resources.MEMORY_TIER_UNSPECIFIED
        await publish(stub, moved)

        def request_held() -> str:
            found = index.find(tenant, conversation)
            return found.engine_request_id if found is not None else ""

        await eventually(lambda: request_held() == moved.engine_request_id)
        # Events arrive in order: once a later publish shows, the old request's end has been applied.
        await publish(stub, retention(tenant, "later", engine_id))
        await eventually(lambda: index.find(tenant, "later") is not None)
        found = index.find(tenant, conversation)
        assert found is not None
        assert (found.tier, found.turn, list(found.block_ids)) == (
            resources.MEMORY_TIER_HOST,
            1,
            list(moved.block_ids),
        )
