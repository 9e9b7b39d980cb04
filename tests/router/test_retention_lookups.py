"""A turn's retention lookup through the router's retention index (RetentionLookups, TurnRunner with an
index): served in process while the index is serving, whether it holds the conversation or not (also after
it saw the retention end), from the registry while it is not synced or its stream is broken; a stale hit or
miss is caught by the turn's mark; a turn's publication seen in the index; the setting that turns the index
off. No servers: the index is fed by an in-memory stream; the same paths against the real registry and
router are in test_router_index.py."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
from array import array
from collections.abc import AsyncIterator

import pytest
from kvferry.pd.digest import DIGEST_BYTES, PackedDigests
from kvferry.pd.engine_api import DecodeRequest
from kvferry.pd.kvferry_params import ConversationMark
from kvferry.router.cli import config_from_args, configure
from kvferry.router.cost import Reuse
from kvferry.router.registry_client import RetentionRecord
from kvferry.router.retention_index import RetentionIndex, RetentionLookups
from kvferry.router.server import RouterConfig
from kvferry.router.turns import PreparedTurn, TurnResult
from kvferry.runtime.errors import Aborted
from kvferry.runtime.timestamps import to_timestamp
from kvferry.v1 import registry_service_pb2 as api
from kvferry.v1 import resources_pb2 as resources

from tests.fixtures.polling import eventually
from tests.pd.fake_engine import FakeEngine
from tests.router.test_turns import NOW, PROMPT, TENANT, Cluster, FakeRegistry

pytestmark = pytest.mark.timeout(20)

PUBLISHED, ENDED, SYNCED = (
    api.RETENTION_EVENT_TYPE_PUBLISHED,
    api.RETENTION_EVENT_TYPE_ENDED,
    api.RETENTION_EVENT_TYPE_SYNCED,
)


class Watch:
    """AN IN-MEMORY STAND-IN for WatchAllRetentions: the test sends the events; an exception sent
    breaks the stream (the next call opens a new one)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[api.WatchAllRetentionsResponse | Exception] = asyncio.Queue()
        self.opened = 0
        self.revision = 0

    async def __call__(self) -> AsyncIterator[api.WatchAllRetentionsResponse]:
        self.opened += 1
        while True:
            item = await self.queue.get()
            if isinstance(item, Exception):
                raise item
            yield item

    def send(self, kind: api.RetentionEventType.ValueType, record: RetentionRecord | None = None) -> None:
        self.revision += 1
        self.queue.put_nowait(
            api.WatchAllRetentionsResponse(
                header=resources.ResponseHeader(revision=self.revision),
                type=kind,
                retention=as_proto(record) if record is not None else None,
            )
        )


def as_proto(record: RetentionRecord) -> resources.Retention:
    proto = resources.Retention(
        tenant=record.tenant,
        conversation_id=record.conversation_id,
        engine_id=record.engine_id,
        engine_request_id=record.engine_request_id,
        block_ids=record.block_ids,
        num_tokens=record.num_tokens,
        block_digests=record.block_digests,
        turn=record.turn,
        block_generations=record.block_generations,
    )
    proto.expire_time.CopyFrom(to_timestamp(record.expire_time))
    return proto


def record(conversation_id: str = "c1", *, turn: int = 1, expire_time: float = NOW + 120) -> RetentionRecord:
    """As the index holds it (packed, RetentionRecord.from_proto)."""
    return RetentionRecord.from_proto(as_proto(_record(conversation_id, turn, expire_time)))


def _record(conversation_id: str, turn: int, expire_time: float) -> RetentionRecord:
    return RetentionRecord(
        tenant=TENANT.name,
        conversation_id=conversation_id,
        engine_id="d1",
        engine_request_id=f"r-{conversation_id}-{turn}",
        block_ids=(7, 8, 9),
        num_tokens=12,
        block_digests=(b"a" * DIGEST_BYTES, b"b" * DIGEST_BYTES, b"c" * DIGEST_BYTES),
        turn=turn,
        expire_time=expire_time,
        block_generations=(1, 1, 2),
    )


@contextlib.asynccontextmanager
async def following(index: RetentionIndex) -> AsyncIterator[RetentionIndex]:
    task = asyncio.create_task(index.run())
    try:
        yield index
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def synced(watch: Watch, index: RetentionIndex, *records: RetentionRecord) -> None:
    for held in records:
        watch.send(PUBLISHED, held)
    watch.send(SYNCED)
    await eventually(lambda: index.serving)


async def test_a_hit_is_served_from_the_index_without_asking_the_registry() -> None:
    registry, watch = FakeRegistry(), Watch()
    index = RetentionIndex(watch)
    lookups = RetentionLookups(registry, index)
    async with following(index):
        await synced(watch, index, record())
        found = await lookups.lookup(TENANT.name, "c1")
    assert found.path == "index" and found.retention == record()
    assert registry.lookups == 0


async def test_the_index_holds_records_packed_and_skips_one_it_cannot_hold() -> None:
    registry, watch = FakeRegistry(), Watch()
    index = RetentionIndex(watch)
    lookups = RetentionLookups(registry, index)
    bad = dataclasses.replace(record("c2"), block_digests=(b"x" * 32,) * 3)
    async with following(index):
        await synced(watch, index, record(), bad)
        found = await lookups.lookup(TENANT.name, "c1")
        skipped = await lookups.lookup(TENANT.name, "c2")
    assert found.path == "index" and found.retention is not None
    assert isinstance(found.retention.block_digests, PackedDigests)
    assert found.retention.block_ids == array("q", (7, 8, 9))
    assert skipped.path == "miss"  # the index keeps serving; the turn's mark finds the record
    assert registry.lookups == 0


async def test_a_miss_is_answered_by_the_index_without_asking_the_registry() -> None:
    registry, watch = FakeRegistry(), Watch()
    # Published a moment ago: the registry has it, the index not yet (the turn's mark finds it: below).
    registry.retentions[TENANT.name, "c1"] = record()
    index = RetentionIndex(watch)
    lookups = RetentionLookups(registry, index)
    async with following(index):
        await synced(watch, index)
        found = await lookups.lookup(TENANT.name, "c1")
    assert found.path == "miss" and found.retention is None
    assert registry.lookups == 0


async def test_before_the_snapshot_and_while_the_stream_is_broken_lookups_ask_the_registry() -> None:
    registry, watch = FakeRegistry(), Watch()
    registry.retentions[TENANT.name, "c1"] = record(turn=2)
    index = RetentionIndex(watch)
    lookups = RetentionLookups(registry, index)
    async with following(index):
        watch.send(PUBLISHED, record(turn=1))  # the snapshot, not complete yet
        await asyncio.sleep(0.01)
        found = await lookups.lookup(TENANT.name, "c1")
        assert (found.path, found.retention) == ("not_synced", record(turn=2))
        assert not index.ready.is_set()

        watch.send(SYNCED)
        await eventually(lambda: index.serving)
        assert (await lookups.lookup(TENANT.name, "c1")).path == "index"

        watch.queue.put_nowait(ConnectionError("stream cut"))
        await eventually(lambda: not index.serving)
        found = await lookups.lookup(TENANT.name, "c1")
        assert (found.path, found.retention) == ("not_synced", record(turn=2))
        assert index.ready.is_set()  # once synced, the router stays ready

        # The new stream's snapshot replaces the index.
        await eventually(lambda: watch.opened == 2)
        await synced(watch, index, record(turn=2))
        found = await lookups.lookup(TENANT.name, "c1")
        assert (found.path, found.retention) == ("index", record(turn=2))
    assert registry.lookups == 2


async def test_an_ended_retention_is_a_miss_and_one_past_its_first_lease_end_a_hit() -> None:
    """Renewals write nothing, so the index never hears of them: a record past the lease end it was
    published with is still live until its end comes (the lease running out is one: ENDED, EXPIRED)."""
    registry, watch = FakeRegistry(), Watch()
    index = RetentionIndex(watch)
    lookups = RetentionLookups(registry, index)
    async with following(index):
        await synced(watch, index, record("c1"), record("c2", expire_time=NOW - 5))
        assert (await lookups.lookup(TENANT.name, "c1")).path == "index"
        watch.send(ENDED, record("c1"))
        await eventually(lambda: index.find(TENANT.name, "c1") is None)
        found = await lookups.lookup(TENANT.name, "c1")
        assert (found.path, found.retention) == ("miss", None)
        found = await lookups.lookup(TENANT.name, "c2")
        assert (found.path, found.retention) == ("index", record("c2", expire_time=NOW - 5))
    assert registry.lookups == 0


async def test_without_an_index_and_when_asked_every_lookup_goes_to_the_registry() -> None:
    registry = FakeRegistry()
    registry.retentions[TENANT.name, "c1"] = record()
    assert (await RetentionLookups(registry, None).lookup(TENANT.name, "c1")).path == "off"
    watch = Watch()
    index = RetentionIndex(watch)
    async with following(index):
        await synced(watch, index, record())
        lookups = RetentionLookups(registry, index)
        assert (await lookups.lookup(TENANT.name, "c1", from_registry=True)).path == "registry"
    assert registry.lookups == 2


# -- the turn ----------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _synced_cluster() -> AsyncIterator[tuple[Cluster, Watch]]:
    """A cluster whose router reads a retention index, followed and synced while the block runs."""
    watch = Watch()
    cluster = Cluster(index=RetentionIndex(watch))
    assert cluster.index is not None
    async with following(cluster.index):
        await synced(watch, cluster.index)
        yield cluster, watch
    await cluster.background()


async def _turn_one_indexed(cluster: Cluster, watch: Watch) -> TurnResult:
    """Turn 1 of conversation c1, its publication then heard by the index."""
    _, first = await cluster.turn(PROMPT)
    watch.send(PUBLISHED, cluster.registry.retentions[TENANT.name, "c1"])
    await eventually(lambda: cluster.index is not None and len(cluster.index) == 1)
    return first


async def test_a_turn_s_lookup_is_read_from_the_index_and_confirmed_by_its_mark() -> None:
    async with _synced_cluster() as (cluster, watch):
        first = await _turn_one_indexed(cluster, watch)
        before = cluster.registry.lookups
        _, second = await cluster.turn([*PROMPT, 101, 102, 103, 7])
    assert (first.turn, second.turn, second.reuse) == (1, 2, Reuse.PULL)
    assert second.pulled_tokens == len(PROMPT)
    # Only the publication wait asked the registry (the index never heard of turn 2 here): the lookup was
    # the index's.
    assert cluster.registry.lookups == before + 1


async def test_a_turn_s_publication_is_seen_in_the_index_without_polling_the_registry() -> None:
    async with _synced_cluster() as (cluster, watch):

        def publish(engine: FakeEngine, request: DecodeRequest) -> None:
            # What etcd's watch does after the sidecar's publish: the index hears of it.
            cluster.registry.publish(engine, request)
            mark = request.mark
            if isinstance(mark, ConversationMark):
                watch.send(PUBLISHED, cluster.registry.retentions[mark.tenant, mark.conversation_id])

        for fake in cluster.fakes.values():
            fake.on_finished = publish
        _, first = await cluster.turn(PROMPT)
        _, second = await cluster.turn([*PROMPT, 101, 102, 103, 7])
    assert (first.turn, second.turn, second.reuse) == (1, 2, Reuse.PULL)
    # Turn 1's lookup missed (nothing retained yet) and its mark confirmed that: nothing asked the registry.
    assert cluster.registry.lookups == 0


async def test_a_stale_hit_is_caught_by_the_mark_and_looked_up_in_the_registry() -> None:
    async with _synced_cluster() as (cluster, watch):
        await _turn_one_indexed(cluster, watch)
        # The registry ended the retention; the index has not heard yet.
        del cluster.registry.retentions[TENANT.name, "c1"]
        before = cluster.registry.lookups
        _, second = await cluster.turn([*PROMPT, 101, 102, 103, 7])
    # The mark read no retained turn, unlike the index: the registry was asked, and it holds none.
    assert (second.reuse, second.pulled_tokens, second.turn) == (Reuse.NONE, 0, 1)
    assert cluster.registry.lookups == before + 1 + 1  # the recheck, the publication poll


@contextlib.asynccontextmanager
async def _turn_two_beside_a_slow_mark(
    prompt: list[int],
) -> AsyncIterator[tuple[Cluster, asyncio.Event, PreparedTurn]]:
    """Turn 1 of c1, heard by the index; then turn 2 (``prompt``) prepared while its mark waits for the
    returned gate."""
    async with _synced_cluster() as (cluster, watch):
        await _turn_one_indexed(cluster, watch)
        cluster.registry.mark_gate = gate = asyncio.Event()
        prepared = await cluster.prepare(prompt)
        assert prepared.marking is not None and prepared.retention_from_index
        yield cluster, gate, prepared


async def test_a_record_the_index_found_is_pulled_only_after_the_mark_confirmed_it() -> None:
    """The index may hold a record of an engine incarnation that is gone (an engine restarted: its block ids
    now hold other requests' KV), which the registry would not serve: no P request pulls it before the
    turn's mark answered."""
    async with _turn_two_beside_a_slow_mark([*PROMPT, 101, 102, 103, 7]) as (cluster, gate, prepared):
        running = asyncio.ensure_future(cluster.run(prepared))
        await asyncio.sleep(0.05)
        assert not running.done() and len(cluster.fakes["p1"].prefills) == 1
        gate.set()
        _, second = await running
    assert (second.reuse, second.pulled_tokens, second.turn) == (Reuse.PULL, len(PROMPT), 2)
    assert [p.request_id for p in cluster.fakes["p1"].prefills[1:]] == [f"{prepared.request_id}-1-p"]


async def test_a_stale_hit_planned_to_pull_is_planned_again_before_any_request() -> None:
    """The mark, answered before P's request, does not confirm the index's record: the turn is planned on
    the registry's answer, and its request is the turn's first (nothing was sent or dropped)."""
    async with _turn_two_beside_a_slow_mark([*PROMPT, 101, 102, 103, 7]) as (cluster, gate, prepared):
        running = asyncio.ensure_future(cluster.run(prepared))
        await asyncio.sleep(0.05)
        del cluster.registry.retentions[TENANT.name, "c1"]
        gate.set()
        _, second = await running
    assert (second.reuse, second.pulled_tokens, second.turn) == (Reuse.NONE, 0, 1)
    sent = cluster.fakes["p1"].prefills[1:]
    assert [p.request_id for p in sent] == [f"{prepared.request_id}-1-p"] and sent[0].reuse is None
    assert cluster.fakes["p1"].prefills_cancelled == []


async def test_a_mark_refused_before_an_index_pull_sends_p_nothing() -> None:
    async with _turn_two_beside_a_slow_mark([*PROMPT, 101, 102, 103, 7]) as (cluster, gate, prepared):
        running = asyncio.ensure_future(cluster.run(prepared))
        cluster.registry.marks[TENANT.name, "c1"] = "kvf-another-turn"
        gate.set()
        with pytest.raises(Aborted, match="kvf-another-turn"):
            await running
    assert len(cluster.fakes["p1"].prefills) == 1 and len(cluster.fakes["d1"].decodes) == 1
    assert cluster.registry.marks == {(TENANT.name, "c1"): "kvf-another-turn"} and cluster.idle()


async def test_an_index_hit_the_turn_does_not_pull_sends_p_s_request_beside_the_mark() -> None:
    """A turn that pulls nothing of the record its index found (here: the prompt does not continue it, so
    the plan recomputes) needs no answer from the mark before P's request."""
    async with _turn_two_beside_a_slow_mark([5, *PROMPT]) as (cluster, gate, prepared):
        running = asyncio.ensure_future(cluster.run(prepared))
        await eventually(lambda: len(cluster.fakes["p1"].prefills) == 2)
        assert cluster.fakes["p1"].prefills[-1].reuse is None and not running.done()
        assert len(cluster.fakes["d1"].decodes) == 1
        gate.set()
        _, second = await running
    assert (second.reuse, second.pulled_tokens, second.turn) == (Reuse.NONE, 0, 2)
    assert cluster.fakes["p1"].prefills_cancelled == []


async def test_a_stale_miss_is_caught_by_the_mark_and_looked_up_in_the_registry() -> None:
    async with _synced_cluster() as (cluster, _):
        # Turn 1 is published in the registry; the index has not heard yet (another router's turn, a lagging
        # watch).
        await cluster.turn(PROMPT)
        before = cluster.registry.lookups
        _, second = await cluster.turn([*PROMPT, 101, 102, 103, 7])
    # The index held none; the mark read turn 1: the registry was asked, and the turn pulled it.
    assert (second.reuse, second.pulled_tokens, second.turn) == (Reuse.PULL, len(PROMPT), 2)
    assert cluster.registry.lookups == before + 1 + 1  # the recheck, the publication poll


def _router_config(argv: list[str], environ: dict[str, str]) -> RouterConfig:
    parser = argparse.ArgumentParser()
    configure(parser, environ)
    return config_from_args(parser.parse_args(argv))


def test_the_index_is_on_by_default_and_turned_off_by_flag_or_environment() -> None:
    assert _router_config([], {}).retention_index
    assert not _router_config(["--retention-index", "off"], {}).retention_index
    assert not _router_config([], {"KVFERRY_ROUTER_RETENTION_INDEX": "off"}).retention_index
    flag_wins = _router_config(["--retention-index", "on"], {"KVFERRY_ROUTER_RETENTION_INDEX": "off"})
    assert flag_wins.retention_index
