"""Unit tests of the sidecar's logic without servers: pure pieces, and the loops driven by an
IN-MEMORY STAND-IN registry (tests/sidecar/fakes.py) where the real one cannot be made to misbehave
on cue. The same paths run against the real registry in test_sidecar.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from kvferry.runtime.clock import SystemClock
from kvferry.runtime.errors import ErrorKind, ServiceError
from kvferry.sidecar.app import Sidecar
from kvferry.sidecar.engine import (
    EngineFacts,
    EngineMonitor,
    EngineMonitorSettings,
    EngineState,
    ProbeResult,
    _cache_facts,
)
from kvferry.sidecar.registration import EngineIdentity, Phase, RegistrationRejected, describe_engine
from kvferry.sidecar.releases import ENDED, RENEWED, SYNC, Event, RetentionBook, Subscription
from kvferry.v1 import registry_service_pb2 as registry_pb2
from kvferry.v1 import resources_pb2

from tests.fixtures.polling import eventually
from tests.fixtures.sidecar import sidecar_test_config
from tests.sidecar.fakes import FakeRegistry, ScriptedProbe
from tests.sidecar.helpers import retention

pytestmark = pytest.mark.timeout(30)


# --- pure pieces ----------------------------------------------------------------------------------


VLLM_METRICS_EXCERPT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",\
gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="2730",swap_space="0"} 1.0
"""


def test_cache_facts_come_from_the_metrics() -> None:
    # The model's facts come from /v1/models: tests/sidecar/test_engine_probe.py.
    assert _cache_facts(VLLM_METRICS_EXCERPT) == (16, 2730)
    assert _cache_facts("# nothing\n") == (None, None)


def _identity(**kwargs: object) -> EngineIdentity:
    fields: dict[str, object] = {
        "engine_id": "e1",
        "role": resources_pb2.ENGINE_ROLE_DECODE,
        "http_endpoint": "http://127.0.0.1:1",
        "nixl_host": "127.0.0.1",
        "nixl_port": 5600,
        "kv_compatibility_hash": "h",
    }
    fields.update(kwargs)
    return EngineIdentity(**fields)  # type: ignore[arg-type]


def test_describe_engine_prefers_flags_and_names_the_missing_flag() -> None:
    facts = EngineFacts(model="reported", max_model_len=2048, block_size=16, kv_capacity_blocks=100)
    engine = describe_engine(_identity(block_size=32), facts)
    assert (engine.model, engine.block_size, engine.kv_capacity_blocks, engine.max_model_len) == (
        "reported",
        32,
        100,
        2048,
    )
    with pytest.raises(RegistrationRejected, match="--kv-capacity-blocks"):
        describe_engine(_identity(), EngineFacts(model="m", max_model_len=1, block_size=16))


def _retention(request_id: str, expire: float | None = None, blocks: int = 2) -> resources_pb2.Retention:
    item = resources_pb2.Retention(
        tenant="t", conversation_id=f"c-{request_id}", engine_request_id=request_id, block_ids=range(blocks)
    )
    if expire is not None:
        item.expire_time.FromNanoseconds(int(expire * 1e9))
    return item


def test_book_tracks_ends_and_snapshots() -> None:
    book = RetentionBook()
    book.track(_retention("b", expire=200.0))
    book.track(_retention("a", expire=100.0, blocks=3))
    book.track(_retention("u"), confirmed=False)
    assert (len(book), book.retained_blocks) == (3, 7)
    snapshot = book.snapshot(revision=7)
    assert (snapshot[0].type, snapshot[0].revision) == (SYNC, 7)
    assert list(snapshot[0].live_engine_request_ids) == ["a", "b", "u"]
    # Expiries follow for confirmed ones only.
    assert [(e.type, e.engine_request_id) for e in snapshot[1:]] == [(RENEWED, "a"), (RENEWED, "b")]

    assert book.end("a") is not None
    assert book.has_ended("a") and "a" not in book
    assert book.end("a") is None
    # Published again: live again.
    book.track(_retention("a", expire=300.0))
    assert "a" in book and not book.has_ended("a")


async def test_a_stuck_subscriber_gets_a_snapshot_instead_of_an_unbounded_queue() -> None:
    book = RetentionBook()
    book.track(_retention("live", expire=100.0))
    subscription = Subscription(limit=3, snapshot=lambda: book.snapshot(revision=1))
    for i in range(5):
        subscription.push([Event(type=ENDED, engine_request_id=f"gone-{i}")])
    assert subscription.compactions == 1
    first = await anext(aiter(subscription))
    assert first.type == SYNC and list(first.live_engine_request_ids) == ["live"]
    subscription.close()
    rest = [event async for event in subscription]
    # The snapshot's expiry, then what came after the compaction.
    assert [(e.type, e.engine_request_id) for e in rest] == [(RENEWED, "live"), (ENDED, "gone-4")]


async def test_monitor_gives_up_on_a_failing_engine_only_after_the_grace() -> None:
    probe = ScriptedProbe()
    monitor = EngineMonitor(probe, SystemClock(), EngineMonitorSettings(down_after_seconds=0.3))
    assert await monitor.probe_once() is EngineState.UP
    probe.result = ProbeResult.FAILING
    assert await monitor.probe_once() is EngineState.DEGRADED
    await asyncio.sleep(0.35)
    assert await monitor.probe_once() is EngineState.DOWN
    probe.result = ProbeResult.OK
    assert await monitor.probe_once() is EngineState.UP
    probe.result = ProbeResult.UNREACHABLE  # nothing listens: down at once
    assert await monitor.probe_once() is EngineState.DOWN


# --- loops against the in-memory stand-in registry ------------------------------------------------


@pytest.fixture
async def fake() -> FakeRegistry:
    return FakeRegistry()


@pytest.fixture
async def probe() -> ScriptedProbe:
    return ScriptedProbe()


@pytest.fixture
async def sidecar(fake: FakeRegistry, probe: ScriptedProbe) -> AsyncIterator[Sidecar]:
    config = sidecar_test_config(
        registry_address="127.0.0.1:1", engine_url="http://127.0.0.1:1", engine_id="e1"
    )
    running = Sidecar(config, registry=fake, probe=probe)
    await running.start()
    yield running
    await running.stop()


async def test_registration_retries_a_registry_that_is_down(fake: FakeRegistry, probe: ScriptedProbe) -> None:
    fake.script("register_engine", ErrorKind.UNAVAILABLE, ErrorKind.DEADLINE_EXCEEDED)
    config = sidecar_test_config(
        registry_address="127.0.0.1:1", engine_url="http://127.0.0.1:1", engine_id="e1"
    )
    running = Sidecar(config, registry=fake, probe=probe)
    await running.start()
    try:
        await eventually(lambda: running.registration.registered, what="registered")
        assert fake.calls.count("register_engine") == 3
        assert not running.failed.done()
    finally:
        await running.stop()


async def test_registration_refused_for_bad_config_fails_the_sidecar(
    fake: FakeRegistry, probe: ScriptedProbe
) -> None:
    fake.script("register_engine", ErrorKind.INVALID_ARGUMENT)
    config = sidecar_test_config(
        registry_address="127.0.0.1:1", engine_url="http://127.0.0.1:1", engine_id="e1"
    )
    running = Sidecar(config, registry=fake, probe=probe)
    await running.start()
    try:
        failure = await asyncio.wait_for(running.failed, 5)
        assert isinstance(failure, RegistrationRejected)
        assert "INVALID_ARGUMENT" in str(failure)
    finally:
        await running.stop()


async def test_a_broken_stream_resyncs_and_drops_what_ended_meanwhile(
    sidecar: Sidecar, fake: FakeRegistry
) -> None:
    await eventually(lambda: sidecar.fanout.synced, what="synced")
    kept = (await sidecar.publisher.report(retention("t", "kept"))).retention
    lost = (await sidecar.publisher.report(retention("t", "lost"))).retention
    subscription = sidecar.fanout.subscribe()
    events = aiter(subscription)
    first = await anext(events)
    assert first.type == SYNC
    assert set(first.live_engine_request_ids) == {kept.engine_request_id, lost.engine_request_id}

    # The stream breaks; meanwhile one retention ends without any event reaching the sidecar.
    fake.unavailable = True
    fake.break_streams()
    await eventually(lambda: not sidecar.fanout.synced, what="unsynced")
    del fake.retentions[("t", "lost")]
    fake.unavailable = False

    sync = await asyncio.wait_for(_next_of_type(events, SYNC), 5)
    assert set(sync.live_engine_request_ids) == {kept.engine_request_id}
    assert lost.engine_request_id not in sidecar.book
    sidecar.fanout.unsubscribe(subscription)


async def _next_of_type(events: AsyncIterator[Event], kind: int) -> Event:
    while True:
        event = await anext(events)
        if event.type == kind:
            return event


async def test_the_sweep_ends_a_retention_whose_end_was_missed(sidecar: Sidecar, fake: FakeRegistry) -> None:
    await eventually(lambda: sidecar.fanout.synced, what="synced")
    stored = (await sidecar.publisher.report(retention("t", "c"))).retention
    subscription = sidecar.fanout.subscribe()
    events = aiter(subscription)
    await _next_of_type(events, SYNC)
    # Its expiry passes and the registry forgets it, but no ENDED ever comes.
    sidecar.book.get(stored.engine_request_id).expire_time = time.time() - 5  # type: ignore[union-attr]
    del fake.retentions[("t", "c")]
    ended = await asyncio.wait_for(_next_of_type(events, ENDED), 5)
    assert ended.engine_request_id == stored.engine_request_id
    assert ended.reason == resources_pb2.RELEASE_REASON_EXPIRED
    sidecar.fanout.unsubscribe(subscription)


async def test_a_publish_whose_answer_was_lost_is_found_and_kept(
    sidecar: Sidecar, fake: FakeRegistry
) -> None:
    await eventually(lambda: sidecar.registration.registered, what="registered")
    fake.lose_publish_answer = True
    stored = (await sidecar.publisher.report(retention("t", "c"))).retention
    assert stored.engine_id == "e1" and stored.engine_request_id in sidecar.book

    # If the registry cannot even be asked, the retention is kept unconfirmed: a SYNC lists it.
    fake.script("get_retention", ErrorKind.UNAVAILABLE)
    with pytest.raises(ServiceError) as failed:
        await sidecar.publisher.report(retention("t", "d"))
    assert failed.value.kind is ErrorKind.UNAVAILABLE
    entry = sidecar.book.get("req-d-1")
    assert entry is not None and entry.expire_time is None


async def test_lease_loss_seen_by_a_publish_triggers_reregistration(
    sidecar: Sidecar, fake: FakeRegistry
) -> None:
    await eventually(lambda: sidecar.registration.registered, what="registered")
    del fake.engines["e1"]  # the registry lost the engine
    with pytest.raises(ServiceError) as failed:
        await sidecar.publisher.report(retention("t", "c"))
    assert failed.value.kind is ErrorKind.UNAVAILABLE
    # The refused publish made the sidecar check its lease at once, and re-register.
    await eventually(lambda: sidecar.registration.generation == 2, within=0.5, what="re-registered")
    assert sidecar.registration.phase is Phase.REGISTERED


async def test_renewals_pass_through_and_late_renewals_of_ended_ones_do_not(
    sidecar: Sidecar, fake: FakeRegistry
) -> None:
    await eventually(lambda: sidecar.fanout.synced, what="synced")
    stored = (await sidecar.publisher.report(retention("t", "c"))).retention
    subscription = sidecar.fanout.subscribe()
    events = aiter(subscription)
    await _next_of_type(events, SYNC)
    renewed = resources_pb2.Retention()
    renewed.CopyFrom(stored)
    renewed.expire_time.seconds += 100
    fake.emit(
        registry_pb2.WatchRetentionsResponse(
            type=registry_pb2.RETENTION_EVENT_TYPE_RENEWED, retention=renewed
        )
    )
    snapshot_expiry = await asyncio.wait_for(_next_of_type(events, RENEWED), 5)
    assert snapshot_expiry.expire_time == stored.expire_time
    event = await asyncio.wait_for(_next_of_type(events, RENEWED), 5)
    assert event.expire_time == renewed.expire_time

    ended = registry_pb2.WatchRetentionsResponse(
        type=registry_pb2.RETENTION_EVENT_TYPE_ENDED,
        retention=stored,
        reason=resources_pb2.RELEASE_REASON_RELEASED,
    )
    fake.emit(ended)
    fake.emit(ended)  # a duplicate
    fake.emit(
        registry_pb2.WatchRetentionsResponse(
            type=registry_pb2.RETENTION_EVENT_TYPE_RENEWED, retention=renewed
        )
    )
    assert (await asyncio.wait_for(anext(events), 5)).type == ENDED
    await asyncio.sleep(0.1)
    subscription.close()
    assert [e async for e in subscription] == []
    assert stored.engine_request_id not in sidecar.book
    sidecar.fanout.unsubscribe(subscription)


async def test_a_retention_it_ended_served_again_after_an_outage_registers_the_engine_again_with_it(
    sidecar: Sidecar, fake: FakeRegistry
) -> None:
    """etcd restored from a snapshot older than the end, its revision already past the sidecar's (others
    wrote first): only the record served again shows it."""
    await eventually(lambda: sidecar.fanout.synced, what="synced")
    stored = (await sidecar.publisher.report(retention("t", "c"))).retention
    ended = await sidecar.publisher.end(
        "t", "c", stored.engine_request_id, resources_pb2.RELEASE_REASON_EVICTED
    )
    assert ended.ended

    # An outage that changes nothing: the stream resyncs, the engine stays registered as it was.
    watches = fake.calls.count("watch_retentions")
    fake.break_streams()
    await eventually(
        lambda: fake.calls.count("watch_retentions") > watches and sidecar.fanout.synced, what="synced again"
    )
    assert fake.calls.count("get_retention") >= 1  # it asked
    assert sidecar.registration.generation == 1

    # The restore brings the ended retention back; the revision moved on meanwhile.
    fake.retentions[("t", "c")] = stored
    fake.store_revision += 100
    fake.break_streams()
    await eventually(lambda: sidecar.registration.generation == 2, what="registered again")
    seen_revision, evidence = fake.restore_evidence[-1]
    assert seen_revision == 0
    assert evidence is not None
    assert (evidence.tenant, evidence.conversation_id, evidence.engine_request_id) == (
        "t",
        "c",
        stored.engine_request_id,
    )
    assert evidence.end_revision == ended.revision
    # Evidence once: the next resync (the new registration's) does not register the engine again.
    await eventually(lambda: sidecar.fanout.synced, what="synced in the new registration")
    assert sidecar.registration.generation == 2
