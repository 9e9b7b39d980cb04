"""Ends the engine starts, confirmed by the registry; SYNCs that never end a newer acknowledgement.
A real sidecar, a real registry on a real etcd.

The registry link here is the real gRPC one with one seam: a test can hold a publish back right
before it is sent to the registry (the connector already gave up on it: its deadline is shorter
than the sidecar's registry calls), and let it go after something else happened.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from kvferry.sidecar.app import Sidecar
from kvferry.sidecar.registry_link import GrpcRegistry
from kvferry.v1 import registry_service_pb2 as registry_pb2
from kvferry.v1 import resources_pb2
from kvferry.v1 import sidecar_service_pb2 as sidecar_pb2
from kvferry.v1 import sidecar_service_pb2_grpc as sidecar_grpc

from tests.fixtures.polling import eventually
from tests.fixtures.registry import RegistryHandle, unique
from tests.fixtures.sidecar import SidecarHandle, StandInEngineFactory, sidecar_test_config
from tests.sidecar.helpers import SYNC, Releases, retention, status_of

pytestmark = pytest.mark.timeout(60)


class HoldingRegistry(GrpcRegistry):
    """The real registry link; while ``hold`` is set, publishes wait for it to be cleared."""

    def __init__(self, address: str) -> None:
        super().__init__(address, timeout_seconds=5.0)
        self.hold: asyncio.Event | None = None
        self.held = asyncio.Event()

    async def publish_retention(
        self, retention: resources_pb2.Retention, incarnation: int = 0
    ) -> registry_pb2.PublishRetentionResponse:
        if self.hold is not None:
            self.held.set()
            await self.hold.wait()
        return await super().publish_retention(retention)


@pytest.fixture
async def holding(
    registry: RegistryHandle, stand_in_engine_factory: StandInEngineFactory
) -> AsyncIterator[tuple[SidecarHandle, HoldingRegistry]]:
    link = HoldingRegistry(registry.address)
    engine = await stand_in_engine_factory()
    config = sidecar_test_config(
        registry_address=registry.address, engine_url=engine.url, engine_id=unique("engine")
    )
    sidecar = Sidecar(config, registry=link)
    await sidecar.start()
    handle = SidecarHandle(sidecar)
    try:
        await handle.wait_registered()
        await handle.wait_for(lambda: sidecar.fanout.synced, what="synced")
        yield handle, link
    finally:
        await handle.stop()
        await link.close()


async def _report(
    stub: sidecar_grpc.SidecarServiceStub, item: resources_pb2.Retention
) -> sidecar_pb2.ReportRetentionResponse:
    response: sidecar_pb2.ReportRetentionResponse = await stub.ReportRetention(
        sidecar_pb2.ReportRetentionRequest(retention=item), timeout=5
    )
    return response


async def _end(
    stub: sidecar_grpc.SidecarServiceStub,
    item: resources_pb2.Retention,
    reason: resources_pb2.ReleaseReason.ValueType = resources_pb2.RELEASE_REASON_EVICTED,
) -> sidecar_pb2.EndRetentionResponse:
    response: sidecar_pb2.EndRetentionResponse = await stub.EndRetention(
        sidecar_pb2.EndRetentionRequest(
            tenant=item.tenant,
            conversation_id=item.conversation_id,
            engine_request_id=item.engine_request_id,
            reason=reason,
        ),
        timeout=5,
    )
    return response


async def _live(registry: RegistryHandle, item: resources_pb2.Retention) -> str | None:
    try:
        found = await registry.stub().GetRetention(
            registry_pb2.GetRetentionRequest(tenant=item.tenant, conversation_id=item.conversation_id),
            timeout=5,
        )
    except grpc.aio.AioRpcError as error:
        assert error.code() == grpc.StatusCode.NOT_FOUND
        return None
    return str(found.retention.engine_request_id)


async def test_an_end_the_engine_starts_is_confirmed_by_the_registry(
    registry: RegistryHandle, holding: tuple[SidecarHandle, HoldingRegistry]
) -> None:
    sidecar, _ = holding
    stub = sidecar.stub()
    item = retention(unique("tenant"), unique("conv"))
    reported = await _report(stub, item)
    releases = Releases(stub, sidecar.engine_id)
    try:
        assert await releases.next_sync() == {item.engine_request_id}
        ended = await _end(stub, item, resources_pb2.RELEASE_REASON_HARD_CAP)
        event = await releases.ended(item.engine_request_id)
    finally:
        await releases.close()
    assert ended.ended and ended.revision > reported.revision
    assert (event.reason, event.revision) == (resources_pb2.RELEASE_REASON_HARD_CAP, ended.revision)
    assert await _live(registry, item) is None
    assert item.engine_request_id not in sidecar.sidecar.book
    # Never published again: a report of it (a connector retrying) is refused.
    assert await status_of(_report(stub, item)) == grpc.StatusCode.FAILED_PRECONDITION
    # Ending it again still confirms.
    assert not (await _end(stub, item)).ended


async def test_an_end_never_ends_a_newer_turn(
    registry: RegistryHandle, holding: tuple[SidecarHandle, HoldingRegistry]
) -> None:
    sidecar, _ = holding
    stub = sidecar.stub()
    tenant, conversation = unique("tenant"), unique("conv")
    old = retention(tenant, conversation, turn=1)
    newer = retention(tenant, conversation, turn=2)
    await _report(stub, old)
    await _report(stub, newer)
    # EvictRetention is EndRetention with EVICTED.
    await stub.EvictRetention(
        sidecar_pb2.EvictRetentionRequest(
            tenant=tenant, conversation_id=conversation, engine_request_id=old.engine_request_id
        ),
        timeout=5,
    )
    assert not (await _end(stub, old)).ended
    assert await _live(registry, old) == newer.engine_request_id
    assert newer.engine_request_id in sidecar.sidecar.book


async def test_a_publish_still_in_flight_after_the_end_never_lands(
    registry: RegistryHandle, holding: tuple[SidecarHandle, HoldingRegistry]
) -> None:
    """The connector's report times out while the sidecar's publish is still on its way (the
    connector's deadline is shorter than the sidecar's registry calls); its budget then evicts the
    retention and the end is confirmed. The publish arriving afterwards must not make it live."""
    sidecar, link = holding
    stub = sidecar.stub()
    item = retention(unique("tenant"), unique("conv"))
    link.hold = asyncio.Event()
    report = asyncio.ensure_future(_report(stub, item))
    await asyncio.wait_for(link.held.wait(), 5)
    ended = await _end(stub, item)
    assert not ended.ended  # not live (yet)
    link.hold.set()
    assert await status_of(report) == grpc.StatusCode.FAILED_PRECONDITION
    assert await _live(registry, item) is None
    assert item.engine_request_id not in sidecar.sidecar.book


async def test_a_sync_read_before_a_publish_is_older_than_its_acknowledgement(
    holding: tuple[SidecarHandle, HoldingRegistry],
) -> None:
    """The connector may read a SYNC after the answer to a report that SYNC does not list (the two
    travel apart): the SYNC's revision must then be older than the answer's, so the connector keeps
    the retention."""
    sidecar, _ = holding
    stub = sidecar.stub()
    item = retention(unique("tenant"), unique("conv"))
    releases = Releases(stub, sidecar.engine_id)
    try:
        stale = await releases.next_matching(lambda e: e.type == SYNC)
        reported = await _report(stub, item)
        assert item.engine_request_id not in stale.live_engine_request_ids
        assert 0 < stale.revision < reported.revision
        # Every SYNC from now on lists it (a fresh subscriber gets one at once).
        fresh = Releases(stub, sidecar.engine_id)
        try:
            current = await fresh.next_matching(lambda e: e.type == SYNC)
        finally:
            await fresh.close()
        assert item.engine_request_id in current.live_engine_request_ids
        assert current.revision >= reported.revision
    finally:
        await releases.close()


async def test_a_resync_while_a_publish_is_in_flight_lists_it(
    registry: RegistryHandle, holding: tuple[SidecarHandle, HoldingRegistry]
) -> None:
    """A SYNC built while a publish is on its way lists it: the publish may land at any revision."""
    sidecar, link = holding
    stub = sidecar.stub()
    item = retention(unique("tenant"), unique("conv"))
    link.hold = asyncio.Event()
    report = asyncio.ensure_future(_report(stub, item))
    await asyncio.wait_for(link.held.wait(), 5)
    releases = Releases(stub, sidecar.engine_id)
    try:
        assert item.engine_request_id in await releases.next_sync()
        # A verification (the stream to the registry re-established) does not judge it gone.
        await sidecar.sidecar.fanout.verify(sidecar.sidecar.book.entries(), announce=True)
        assert item.engine_request_id in sidecar.sidecar.book
        link.hold.set()
        reported = await report
        assert reported.retention.engine_request_id == item.engine_request_id
        await eventually(lambda: _live(registry, item), what="published")
    finally:
        await releases.close()
