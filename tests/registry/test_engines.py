"""Engines against a real registry on a real etcd: leases, heartbeats, listing, the engine watch."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from kvferry.v1 import registry_service_pb2 as api
from kvferry.v1 import registry_service_pb2_grpc as registry_grpc
from kvferry.v1 import resources_pb2 as resources

from tests.fixtures.registry import RegistryHandle, unique
from tests.registry.builders import EventStream, engine, publish, register, retention, status_of

pytestmark = pytest.mark.timeout(60)


async def test_register_then_heartbeat_with_stats_then_deregister(registry: RegistryHandle) -> None:
    stub = registry.stub()
    engine_id = unique("engine")
    registered = await register(stub, engine_id, ttl_seconds=30)
    assert registered.header.revision > 0
    assert registered.ttl_seconds == 30
    assert registered.engine.name == f"engines/{engine_id}"
    assert registered.engine.register_time.seconds > 0

    stats = resources.EngineStats(prefill_tokens_per_second=1234.5, running_requests=3, retained_blocks=17)
    beat = await stub.HeartbeatEngine(api.HeartbeatEngineRequest(engine_id=engine_id, stats=stats), timeout=5)
    assert 0 < beat.ttl_seconds <= 30
    assert beat.header.revision > registered.header.revision
    listed = await stub.ListEngines(api.ListEnginesRequest(page_size=1000), timeout=5)
    mine = [e for e in listed.engines if e.engine_id == engine_id]
    assert len(mine) == 1 and mine[0].stats == stats

    gone = await stub.DeregisterEngine(api.DeregisterEngineRequest(engine_id=engine_id), timeout=5)
    assert gone.header.revision > beat.header.revision
    heartbeat = stub.HeartbeatEngine(api.HeartbeatEngineRequest(engine_id=engine_id), timeout=5)
    assert await status_of(heartbeat) == grpc.StatusCode.NOT_FOUND
    again = stub.DeregisterEngine(api.DeregisterEngineRequest(engine_id=engine_id), timeout=5)
    assert await status_of(again) == grpc.StatusCode.NOT_FOUND


async def test_the_release_grace_is_registered_or_published_by_a_heartbeat(registry: RegistryHandle) -> None:
    stub = registry.stub()
    with_grace = engine(unique("engine"))
    with_grace.release_grace_seconds = 30.0
    registered = await stub.RegisterEngine(api.RegisterEngineRequest(engine=with_grace), timeout=5)
    assert registered.engine.release_grace_seconds == 30.0

    engine_id = unique("engine")
    await register(stub, engine_id)  # its connector had said nothing yet
    await stub.HeartbeatEngine(api.HeartbeatEngineRequest(engine_id=engine_id), timeout=5)
    assert (await _listed(stub, engine_id)).release_grace_seconds == 0.0
    beat = await stub.HeartbeatEngine(
        api.HeartbeatEngineRequest(engine_id=engine_id, release_grace_seconds=12.5), timeout=5
    )
    assert beat.ttl_seconds > 0
    assert (await _listed(stub, engine_id)).release_grace_seconds == 12.5
    # 0 leaves it as it is (a heartbeat with only stats).
    stats = resources.EngineStats(running_requests=2)
    await stub.HeartbeatEngine(api.HeartbeatEngineRequest(engine_id=engine_id, stats=stats), timeout=5)
    listed = await _listed(stub, engine_id)
    assert listed.release_grace_seconds == 12.5 and listed.stats == stats


@pytest.mark.parametrize("grace", [-1.0, float("nan"), float("inf")])
async def test_a_release_grace_that_is_not_a_duration_is_invalid(
    registry: RegistryHandle, grace: float
) -> None:
    stub = registry.stub()
    bad = engine(unique("engine"))
    bad.release_grace_seconds = grace
    refused = stub.RegisterEngine(api.RegisterEngineRequest(engine=bad), timeout=5)
    assert await status_of(refused) == grpc.StatusCode.INVALID_ARGUMENT
    engine_id = unique("engine")
    await register(stub, engine_id)
    beat = stub.HeartbeatEngine(api.HeartbeatEngineRequest(engine_id=engine_id, release_grace_seconds=grace))
    assert await status_of(beat) == grpc.StatusCode.INVALID_ARGUMENT


async def _listed(stub: registry_grpc.RegistryServiceStub, engine_id: str) -> resources.Engine:
    listed = await stub.ListEngines(api.ListEnginesRequest(page_size=1000), timeout=5)
    [mine] = [e for e in listed.engines if e.engine_id == engine_id]
    return mine  # type: ignore[no-any-return]


async def test_heartbeat_after_the_lease_ran_out_says_not_found_and_re_registering_works(
    registry: RegistryHandle,
) -> None:
    stub = registry.stub()
    engine_id = unique("engine")
    await register(stub, engine_id, ttl_seconds=2)
    await asyncio.sleep(3.5)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.HeartbeatEngine(api.HeartbeatEngineRequest(engine_id=engine_id), timeout=5)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert "RegisterEngine" in (caught.value.details() or "")
    await register(stub, engine_id, ttl_seconds=2)
    beat = await stub.HeartbeatEngine(api.HeartbeatEngineRequest(engine_id=engine_id), timeout=5)
    assert beat.ttl_seconds > 0


async def test_list_pages_through_every_engine_in_id_order(isolated_registry: RegistryHandle) -> None:
    stub = isolated_registry.stub()
    ids = sorted(f"engine-{n:02d}" for n in range(7))
    await asyncio.gather(*(register(stub, engine_id) for engine_id in ids))
    seen: list[str] = []
    token = ""
    pages = 0
    while True:
        page = await stub.ListEngines(api.ListEnginesRequest(page_size=3, page_token=token), timeout=5)
        assert page.header.revision > 0
        assert len(page.engines) <= 3
        seen += [e.engine_id for e in page.engines]
        pages += 1
        token = page.next_page_token
        if not token:
            break
    assert seen == ids
    assert pages == 3


async def test_list_filters_by_role_with_both_matching_either(isolated_registry: RegistryHandle) -> None:
    stub = isolated_registry.stub()
    roles = {
        "p-1": resources.ENGINE_ROLE_PREFILL,
        "d-1": resources.ENGINE_ROLE_DECODE,
        "b-1": resources.ENGINE_ROLE_BOTH,
        "p-2": resources.ENGINE_ROLE_PREFILL,
    }
    for engine_id, role in roles.items():
        await stub.RegisterEngine(api.RegisterEngineRequest(engine=engine(engine_id, role)), timeout=5)

    async def ids(role: resources.EngineRole.ValueType, page_size: int = 1) -> list[str]:
        found: list[str] = []
        token = ""
        while True:
            page = await stub.ListEngines(
                api.ListEnginesRequest(role=role, page_size=page_size, page_token=token), timeout=5
            )
            found += [e.engine_id for e in page.engines]
            token = page.next_page_token
            if not token:
                return found

    assert await ids(resources.ENGINE_ROLE_PREFILL) == ["b-1", "p-1", "p-2"]
    assert await ids(resources.ENGINE_ROLE_DECODE) == ["b-1", "d-1"]
    assert await ids(resources.ENGINE_ROLE_BOTH) == ["b-1"]
    assert await ids(resources.ENGINE_ROLE_UNSPECIFIED, page_size=0) == ["b-1", "d-1", "p-1", "p-2"]


async def test_watch_engines_starts_with_the_live_set_then_streams_changes(
    isolated_registry: RegistryHandle,
) -> None:
    stub = isolated_registry.stub()
    await register(stub, "early")
    async with await EventStream.open(stub.WatchEngines(api.WatchEnginesRequest())) as watch:
        first = await watch.next()
        assert (first.type, first.engine.engine_id) == (api.ENGINE_EVENT_TYPE_JOINED, "early")
        assert first.header.revision > 0

        await register(stub, "late")
        joined = await watch.next()
        assert (joined.type, joined.engine.engine_id) == (api.ENGINE_EVENT_TYPE_JOINED, "late")

        stats = resources.EngineStats(inflight_prefill_tokens=99)
        await stub.HeartbeatEngine(api.HeartbeatEngineRequest(engine_id="late", stats=stats), timeout=5)
        updated = await watch.next()
        assert updated.type == api.ENGINE_EVENT_TYPE_UPDATED
        assert updated.engine.stats.inflight_prefill_tokens == 99

        await stub.DeregisterEngine(api.DeregisterEngineRequest(engine_id="early"), timeout=5)
        left = await watch.next()
        assert (left.type, left.engine.engine_id) == (api.ENGINE_EVENT_TYPE_LEFT, "early")
        assert left.header.revision > updated.header.revision


async def test_bad_page_token_is_invalid_argument(registry: RegistryHandle) -> None:
    listing = registry.stub().ListEngines(api.ListEnginesRequest(page_token="!!not-a-token"), timeout=5)
    assert await status_of(listing) == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_registration_naming_a_retention_it_ended_that_etcd_still_holds_starts_a_new_epoch(
    isolated_registry: RegistryHandle,
) -> None:
    """etcd restored from a snapshot taken before the end, its revision since moved past the sidecar's:
    the record is stored as written before the end the engine names. Nothing else is evidence."""
    stub = isolated_registry.stub()
    engine_id = unique("engine")

    async def registered_with_evidence(
        *, end_after_write: int, other_request: bool = False
    ) -> tuple[str, str]:
        """The epoch before, and after a registration naming a retention published just before."""
        before = await register(stub, engine_id)
        item = retention(unique("tenant"), unique("conv"), engine_id)
        written = (await publish(stub, item)).header.revision
        evidence = api.EndedRetention(
            tenant=item.tenant,
            conversation_id=item.conversation_id,
            engine_request_id="req-another" if other_request else item.engine_request_id,
            end_revision=written + end_after_write,
        )
        after = await stub.RegisterEngine(
            api.RegisterEngineRequest(
                engine=engine(engine_id), seen_epoch=before.epoch, ended_retention=evidence
            ),
            timeout=5,
        )
        return before.epoch, after.epoch

    # The record was written at the end's revision (published again since), or names another retention.
    before, after = await registered_with_evidence(end_after_write=0)
    assert after == before
    before, after = await registered_with_evidence(end_after_write=3, other_request=True)
    assert after == before
    before, after = await registered_with_evidence(end_after_write=3)
    assert after != before

    bad = stub.RegisterEngine(
        api.RegisterEngineRequest(
            engine=engine(engine_id), ended_retention=api.EndedRetention(conversation_id="c", end_revision=9)
        ),
        timeout=5,
    )
    assert await status_of(bad) == grpc.StatusCode.INVALID_ARGUMENT
