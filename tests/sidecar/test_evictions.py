"""EvictRetention never ends a newer turn: a real sidecar, a real registry on a real etcd.

The registry link here is the real gRPC one with one seam: a test can act right after the
sidecar's lookup and before its release, where a newer turn used to be evicted by mistake.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest
from kvferry.sidecar.app import Sidecar
from kvferry.sidecar.errors import SidecarError
from kvferry.sidecar.metrics import SidecarMetrics
from kvferry.sidecar.registry_link import GrpcRegistry
from kvferry.sidecar.releases import RetentionBook
from kvferry.sidecar.retentions import RetentionPublisher
from kvferry.v1 import registry_service_pb2 as registry_pb2
from kvferry.v1 import resources_pb2
from kvferry.v1 import sidecar_service_pb2 as sidecar_pb2
from kvferry.v1 import sidecar_service_pb2_grpc as sidecar_grpc

from tests.fixtures.registry import RegistryHandle, unique
from tests.fixtures.sidecar import SidecarHandle, StandInEngineFactory, sidecar_test_config
from tests.sidecar.fakes import FakeRegistry
from tests.sidecar.helpers import Releases, report, retention

pytestmark = pytest.mark.timeout(60)


class InterleavingRegistry(GrpcRegistry):
    """The real registry link; ``after_next_lookup`` runs once, after a GetRetention answered."""

    after_next_lookup: Callable[[], Awaitable[None]] | None = None

    async def get_retention(self, tenant: str, conversation_id: str) -> resources_pb2.Retention:
        found = await super().get_retention(tenant, conversation_id)
        hook, self.after_next_lookup = self.after_next_lookup, None
        if hook is not None:
            await hook()
        return found


@pytest.fixture
async def interleaved(
    registry: RegistryHandle, stand_in_engine_factory: StandInEngineFactory
) -> AsyncIterator[tuple[SidecarHandle, InterleavingRegistry]]:
    link = InterleavingRegistry(registry.address, timeout_seconds=2.0)
    engine = await stand_in_engine_factory()
    config = sidecar_test_config(
        registry_address=registry.address, engine_url=engine.url, engine_id=unique("engine")
    )
    sidecar = Sidecar(config, registry=link)
    await sidecar.start()
    handle = SidecarHandle(sidecar)
    try:
        await handle.wait_registered()
        yield handle, link
    finally:
        await handle.stop()
        await link.close()


async def _evict(stub: sidecar_grpc.SidecarServiceStub, item: resources_pb2.Retention) -> None:
    await stub.EvictRetention(
        sidecar_pb2.EvictRetentionRequest(
            tenant=item.tenant, conversation_id=item.conversation_id, engine_request_id=item.engine_request_id
        ),
        timeout=5,
    )


async def test_a_turn_published_between_lookup_and_release_is_not_evicted(
    registry: RegistryHandle, interleaved: tuple[SidecarHandle, InterleavingRegistry]
) -> None:
    sidecar, link = interleaved
    stub = sidecar.stub()
    tenant, conversation = unique("tenant"), unique("conv")
    old = await report(stub, retention(tenant, conversation, turn=1))
    newer: list[resources_pb2.Retention] = []

    async def connector_reports_the_next_turn() -> None:
        newer.append(await report(stub, retention(tenant, conversation, turn=2)))

    releases = Releases(stub, sidecar.engine_id)
    try:
        assert await releases.next_sync() == {old.engine_request_id}
        # The sidecar finds turn 1 live, then turn 2 lands, then the sidecar asks for the release.
        link.after_next_lookup = connector_reports_the_next_turn
        await _evict(stub, old)  # a no-op, not an error
        assert link.after_next_lookup is None and newer, "the interleaving ran"
        ended = await releases.ended(old.engine_request_id)
        assert ended.reason == resources_pb2.RELEASE_REASON_SUPERSEDED  # turn 1 ended by turn 2, not evicted
    finally:
        await releases.close()
    found = await registry.stub().GetRetention(
        registry_pb2.GetRetentionRequest(tenant=tenant, conversation_id=conversation), timeout=5
    )
    assert found.retention.engine_request_id == newer[0].engine_request_id
    assert newer[0].engine_request_id in sidecar.sidecar.book
    evicted = sidecar.sidecar.metrics.registry.get_sample_value(
        "kvferry_releases_total", {"reason": "evicted"}
    )
    assert not evicted


class _Registered:
    registered = True
    generation = 1

    def check_lease(self, generation: int) -> None:
        pass


async def test_the_publisher_treats_a_refused_guard_as_nothing_to_evict() -> None:
    """The same path with the IN-MEMORY STAND-IN registry (tests/sidecar/fakes.py), which guards too."""
    fake = FakeRegistry()
    fake.engines["e1"] = resources_pb2.Engine(engine_id="e1")
    publisher = RetentionPublisher("e1", fake, _Registered(), RetentionBook(), SidecarMetrics("e1"))
    old = await publisher.report(retention("t", "c", turn=1))
    original_get = fake.get_retention

    async def get_then_newer_turn(tenant: str, conversation_id: str) -> resources_pb2.Retention:
        found = await original_get(tenant, conversation_id)
        await publisher.report(retention("t", "c", turn=2))
        return found

    fake.get_retention = get_then_newer_turn  # type: ignore[method-assign]
    assert await publisher.evict("t", "c", old.engine_request_id) is False
    assert fake.retentions[("t", "c")].turn == 2
    fake.get_retention = original_get  # type: ignore[method-assign]
    assert await publisher.evict("t", "c", "req-c-2") is True
    assert ("t", "c") not in fake.retentions
    assert fake.calls.count("release_retention") == 2


async def test_other_registry_refusals_of_an_eviction_still_fail_it() -> None:

    fake = FakeRegistry()
    fake.engines["e1"] = resources_pb2.Engine(engine_id="e1")
    publisher = RetentionPublisher("e1", fake, _Registered(), RetentionBook(), SidecarMetrics("e1"))
    item = await publisher.report(retention("t", "c", turn=1))
    fake.script("release_retention", grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(SidecarError) as failed:
        await publisher.evict("t", "c", item.engine_request_id)
    assert failed.value.code is grpc.StatusCode.INVALID_ARGUMENT
    fake.script("release_retention", grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(SidecarError) as unreachable:
        await publisher.evict("t", "c", item.engine_request_id)
    assert unreachable.value.code is grpc.StatusCode.UNAVAILABLE
