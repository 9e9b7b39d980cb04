"""The SidecarService gRPC handlers: thin adapters from protos to the sidecar's logic."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import grpc
from kvferry.runtime import errors
from kvferry.runtime.errors import InvalidArgument
from kvferry.sidecar.metrics import SidecarMetrics
from kvferry.sidecar.registration import EngineRegistration
from kvferry.sidecar.releases import ReleaseFanout
from kvferry.sidecar.retentions import RetentionPublisher
from kvferry.v1 import resources_pb2
from kvferry.v1 import sidecar_service_pb2 as sidecar_pb2
from kvferry.v1 import sidecar_service_pb2_grpc as sidecar_grpc

SERVICE_NAME: str = sidecar_pb2.DESCRIPTOR.services_by_name["SidecarService"].full_name

unary = errors.unary("sidecar")
streaming = errors.streaming("sidecar")


class SidecarServicer(sidecar_grpc.SidecarServiceServicer):  # type: ignore[misc]
    def __init__(
        self,
        engine_id: str,
        publisher: RetentionPublisher,
        fanout: ReleaseFanout,
        registration: EngineRegistration,
        metrics: SidecarMetrics,
    ) -> None:
        self._engine_id = engine_id
        self._publisher = publisher
        self._fanout = fanout
        self._registration = registration
        self._metrics = metrics

    @unary
    async def ReportRetention(
        self, request: sidecar_pb2.ReportRetentionRequest, context: grpc.aio.ServicerContext
    ) -> sidecar_pb2.ReportRetentionResponse:
        reported = await self._publisher.report(request.retention)
        return sidecar_pb2.ReportRetentionResponse(retention=reported.retention, revision=reported.revision)

    @unary
    async def EvictRetention(
        self, request: sidecar_pb2.EvictRetentionRequest, context: grpc.aio.ServicerContext
    ) -> sidecar_pb2.EvictRetentionResponse:
        await self._publisher.end(
            request.tenant,
            request.conversation_id,
            request.engine_request_id,
            resources_pb2.RELEASE_REASON_EVICTED,
        )
        return sidecar_pb2.EvictRetentionResponse()

    @unary
    async def EndRetention(
        self, request: sidecar_pb2.EndRetentionRequest, context: grpc.aio.ServicerContext
    ) -> sidecar_pb2.EndRetentionResponse:
        ended = await self._publisher.end(
            request.tenant, request.conversation_id, request.engine_request_id, request.reason
        )
        return sidecar_pb2.EndRetentionResponse(ended=ended.ended, revision=ended.revision)

    async def ReportEngineStats(
        self, request: sidecar_pb2.ReportEngineStatsRequest, context: grpc.aio.ServicerContext
    ) -> sidecar_pb2.ReportEngineStatsResponse:
        self._registration.update_stats(request.stats)
        self._metrics.engine_stats(request.stats)
        return sidecar_pb2.ReportEngineStatsResponse()

    @streaming
    async def WatchReleases(
        self, request: sidecar_pb2.WatchReleasesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[sidecar_pb2.WatchReleasesResponse]:
        if request.engine_id and request.engine_id != self._engine_id:
            raise InvalidArgument(
                f"this sidecar serves engine {self._engine_id!r}, not {request.engine_id!r}; "
                "point the connector at its own engine's sidecar",
            )
        grace = request.release_grace_seconds
        if not math.isfinite(grace) or grace < 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"release_grace_seconds is {grace}; give the connector's release_grace_seconds (> 0)",
            )
        if grace > 0:
            self._registration.set_release_grace(grace)
        subscription = self._fanout.subscribe()
        try:
            async for event in subscription:
                yield event
        finally:
            self._fanout.unsubscribe(subscription)
