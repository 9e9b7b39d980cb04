"""The kit's error table and the gRPC edge that applies it, against a real grpc.aio server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from kvferry.runtime import errors
from kvferry.runtime.errors import (
    STATUS,
    ErrorKind,
    NotFound,
    ResourceExhausted,
    ServiceError,
    Unavailable,
    error_kind_of,
    error_of_kind,
    grpc_code,
    http_status,
)
from kvferry.runtime.grpc_server import start_server
from kvferry.v1 import resources_pb2
from kvferry.v1 import sidecar_service_pb2 as api
from kvferry.v1 import sidecar_service_pb2_grpc as api_grpc

pytestmark = pytest.mark.timeout(20)


def test_every_kind_has_a_grpc_code_and_an_http_status_and_maps_back() -> None:
    assert set(STATUS) == set(ErrorKind)
    assert {status.grpc for status in STATUS.values()} == set(grpc.StatusCode) - {grpc.StatusCode.OK}
    for kind, status in STATUS.items():
        assert error_kind_of(status.grpc) is kind
        assert 400 <= status.http < 600
        assert error_of_kind(kind, "m").kind is kind


@pytest.mark.parametrize(
    ("error", "code", "http"),
    [
        (NotFound("x"), grpc.StatusCode.NOT_FOUND, 404),
        (Unavailable("x"), grpc.StatusCode.UNAVAILABLE, 503),
        (ResourceExhausted("x"), grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (errors.Unauthenticated("x"), grpc.StatusCode.UNAUTHENTICATED, 401),
        (ServiceError("x"), grpc.StatusCode.INTERNAL, 500),
    ],
)
def test_an_error_has_one_status_per_protocol(error: ServiceError, code: grpc.StatusCode, http: int) -> None:
    assert (grpc_code(error), http_status(error)) == (code, http)


class Handlers(api_grpc.SidecarServiceServicer):  # type: ignore[misc]
    """Domain failures raised as domain errors; the decorators are the only translation."""

    def __init__(self) -> None:
        self.stream_closed = asyncio.Event()

    @errors.unary("test")
    async def ReportRetention(
        self, request: api.ReportRetentionRequest, context: grpc.aio.ServicerContext
    ) -> api.ReportRetentionResponse:
        if request.retention.conversation_id == "missing":
            raise NotFound("conversation 'missing' has nothing retained")
        if request.retention.conversation_id == "bug":
            raise KeyError("a bug")
        return api.ReportRetentionResponse(retention=request.retention)

    async def EvictRetention(
        self, request: api.EvictRetentionRequest, context: grpc.aio.ServicerContext
    ) -> api.EvictRetentionResponse:
        return api.EvictRetentionResponse()

    async def EndRetention(
        self, request: api.EndRetentionRequest, context: grpc.aio.ServicerContext
    ) -> api.EndRetentionResponse:
        return api.EndRetentionResponse()

    async def ReportEngineStats(
        self, request: api.ReportEngineStatsRequest, context: grpc.aio.ServicerContext
    ) -> api.ReportEngineStatsResponse:
        return api.ReportEngineStatsResponse()

    @errors.streaming("test")
    async def WatchReleases(
        self, request: api.WatchReleasesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[api.WatchReleasesResponse]:
        try:
            yield api.WatchReleasesResponse()
            if request.engine_id == "slow":
                raise ResourceExhausted("the watch fell behind; watch again")
            await asyncio.Event().wait()
        finally:
            self.stream_closed.set()


async def test_the_grpc_edge_turns_domain_errors_into_statuses_and_bugs_into_internal() -> None:
    handlers = Handlers()
    server, port, _ = await start_server(
        "127.0.0.1:0",
        [(api_grpc.add_SidecarServiceServicer_to_server, handlers, "kvferry.v1.SidecarService")],
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = api_grpc.SidecarServiceStub(channel)

            def report(conversation_id: str) -> api.ReportRetentionRequest:
                return api.ReportRetentionRequest(
                    retention=resources_pb2.Retention(conversation_id=conversation_id)
                )

            assert (await stub.ReportRetention(report("c"))).retention.conversation_id == "c"
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await stub.ReportRetention(report("missing"))
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND
            assert missing.value.details() == "conversation 'missing' has nothing retained"
            with pytest.raises(grpc.aio.AioRpcError) as bug:
                await stub.ReportRetention(report("bug"))
            assert bug.value.code() == grpc.StatusCode.INTERNAL
            assert "KeyError" in (bug.value.details() or "") and "log" in (bug.value.details() or "")

            slow = stub.WatchReleases(api.WatchReleasesRequest(engine_id="slow"))
            with pytest.raises(grpc.aio.AioRpcError) as behind:
                async for _ in slow:
                    pass
            assert behind.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

            handlers.stream_closed.clear()
            watch = stub.WatchReleases(api.WatchReleasesRequest(engine_id="e"))
            await watch.read()
            watch.cancel()
            # The handler's generator is closed when the client goes away, not at garbage collection.
            await asyncio.wait_for(handlers.stream_closed.wait(), 5)
    finally:
        await server.stop(None)
