"""What the sidecar tests share: retentions as a connector would report them, a WatchReleases reader,
and registry lookups."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import grpc
from kvferry.pd.digest import block_digests
from kvferry.v1 import registry_service_pb2 as registry_pb2
from kvferry.v1 import registry_service_pb2_grpc as registry_grpc
from kvferry.v1 import resources_pb2
from kvferry.v1 import sidecar_service_pb2 as sidecar_pb2
from kvferry.v1 import sidecar_service_pb2_grpc as sidecar_grpc

from tests.fixtures.sidecar import TEST_BLOCK_SIZE

SYNC = sidecar_pb2.RELEASE_EVENT_TYPE_SYNC
RENEWED = sidecar_pb2.RELEASE_EVENT_TYPE_RENEWED
ENDED = sidecar_pb2.RELEASE_EVENT_TYPE_ENDED


def retention(
    tenant: str,
    conversation_id: str,
    *,
    turn: int = 1,
    num_tokens: int = 40,
    ttl_seconds: int = 0,
    engine_id: str = "",
    request_id: str | None = None,
) -> resources_pb2.Retention:
    """A retention as the connector reports it (engine id left for the sidecar to fill)."""
    tokens = [7 * turn + i for i in range(num_tokens)]
    blocks = -(-num_tokens // TEST_BLOCK_SIZE)
    return resources_pb2.Retention(
        tenant=tenant,
        conversation_id=conversation_id,
        engine_id=engine_id,
        engine_request_id=request_id or f"req-{conversation_id}-{turn}",
        block_ids=list(range(10 * turn, 10 * turn + blocks)),
        num_tokens=num_tokens,
        block_digests=block_digests(tokens, TEST_BLOCK_SIZE),
        turn=turn,
        ttl_seconds=ttl_seconds,
    )


async def report(
    stub: sidecar_grpc.SidecarServiceStub, item: resources_pb2.Retention
) -> resources_pb2.Retention:
    response = await stub.ReportRetention(sidecar_pb2.ReportRetentionRequest(retention=item), timeout=5)
    return response.retention  # type: ignore[no-any-return]


async def status_of(call: Any) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return error.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


async def find_engine(stub: registry_grpc.RegistryServiceStub, engine_id: str) -> resources_pb2.Engine | None:
    """The engine as the registry lists it, or None."""
    token = ""
    while True:
        page = await stub.ListEngines(
            registry_pb2.ListEnginesRequest(page_size=1000, page_token=token), timeout=5
        )
        for engine in page.engines:
            if engine.engine_id == engine_id:
                return engine  # type: ignore[no-any-return]
        token = page.next_page_token
        if not token:
            return None


class Releases:
    """A WatchReleases stream read in the background, as the connector would read it (saying its
    ``release_grace_seconds`` when given)."""

    def __init__(
        self, stub: sidecar_grpc.SidecarServiceStub, engine_id: str, release_grace_seconds: float = 0.0
    ) -> None:
        self.call = stub.WatchReleases(
            sidecar_pb2.WatchReleasesRequest(engine_id=engine_id, release_grace_seconds=release_grace_seconds)
        )
        self.events: asyncio.Queue[sidecar_pb2.WatchReleasesResponse | None] = asyncio.Queue()
        self.error: grpc.aio.AioRpcError | None = None
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for item in self.call:
                await self.events.put(item)
        except grpc.aio.AioRpcError as error:
            self.error = error
        await self.events.put(None)  # the stream ended

    async def next(self, within: float = 10.0) -> sidecar_pb2.WatchReleasesResponse | None:
        return await asyncio.wait_for(self.events.get(), within)

    async def next_matching(
        self, predicate: Callable[[sidecar_pb2.WatchReleasesResponse], bool], within: float = 10.0
    ) -> sidecar_pb2.WatchReleasesResponse:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while True:
            item = await self.next(max(0.01, deadline - loop.time()))
            if item is None:
                raise AssertionError(f"stream ended ({self.error}) before the expected event")
            if predicate(item):
                return item

    async def next_sync(self, within: float = 10.0) -> set[str]:
        event = await self.next_matching(lambda e: e.type == SYNC, within)
        return set(event.live_engine_request_ids)

    async def ended(self, request_id: str, within: float = 10.0) -> sidecar_pb2.WatchReleasesResponse:
        return await self.next_matching(
            lambda e: e.type == ENDED and e.engine_request_id == request_id, within
        )

    async def close(self) -> None:
        self.call.cancel()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader
