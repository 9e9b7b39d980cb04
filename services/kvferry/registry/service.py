"""The gRPC RegistryService: thin handlers over the engine store, the retention store, the turn store and
the retention event hub (the reaper runs beside them, started by ``server``).

Each handler translates messages; errors become statuses through the kit's table
(``kvferry.runtime.errors``). Watch streams send their initial metadata once the watch is in place,
so a client that awaits ``call.initial_metadata()`` knows later changes will reach it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TypeVar

import grpc
from kvferry.registry import access, validation
from kvferry.registry.engines import EngineStore
from kvferry.registry.events import ALL_ENGINES, RetentionEvent, RetentionEventHub
from kvferry.registry.retentions import RetentionStore
from kvferry.registry.turns import TurnStore
from kvferry.runtime import errors
from kvferry.runtime.timestamps import to_timestamp
from kvferry.v1 import registry_service_pb2 as registry
from kvferry.v1 import registry_service_pb2_grpc as registry_grpc
from kvferry.v1 import resources_pb2 as resources


def _header(revision: int) -> resources.ResponseHeader:
    return resources.ResponseHeader(revision=revision)


unary = errors.unary("registry")
streaming = errors.streaming("registry")


# The two watch responses carry the same fields.
_EventResponse = TypeVar(
    "_EventResponse", registry.WatchRetentionsResponse, registry.WatchAllRetentionsResponse
)


def _retention_event(event: RetentionEvent, response_type: type[_EventResponse]) -> _EventResponse:
    response = response_type(
        header=_header(event.revision), type=event.type, retention=event.retention, reason=event.reason
    )
    if event.type == registry.RETENTION_EVENT_TYPE_ENDED:
        response.end_time.CopyFrom(to_timestamp(event.end_time))
    return response


class RegistryServicer(registry_grpc.RegistryServiceServicer):
    """``mutual_tls``: callers present certificates, and each call is checked against the rules of
    ``kvferry.registry.access`` for the identity its certificate names; without it every call is served."""

    def __init__(
        self,
        engines: EngineStore,
        retentions: RetentionStore,
        hub: RetentionEventHub,
        turns: TurnStore,
        *,
        mutual_tls: bool = False,
    ) -> None:
        self._engines = engines
        self._retentions = retentions
        self._hub = hub
        self._turns = turns
        self._mutual_tls = mutual_tls

    def _admit(
        self, context: grpc.aio.ServicerContext, method: str, request: object
    ) -> access.Identity | None:
        """The caller's identity (None without TLS), once the rules allow it ``method`` with ``request``."""
        caller = access.identity_from_auth_context(context.auth_context()) if self._mutual_tls else None
        access.authorize(caller, method, request)
        return caller

    @unary
    async def RegisterEngine(
        self, request: registry.RegisterEngineRequest, context: grpc.aio.ServicerContext
    ) -> registry.RegisterEngineResponse:
        self._admit(context, "RegisterEngine", request)
        result = await self._engines.register_engine(
            request.engine,
            request.ttl_seconds,
            seen_revision=request.seen_revision,
            seen_epoch=request.seen_epoch,
            ended=request.ended_retention if request.HasField("ended_retention") else None,
        )
        return registry.RegisterEngineResponse(
            header=_header(result.revision),
            engine=result.engine,
            ttl_seconds=result.ttl_seconds,
            epoch=result.epoch,
            incarnation=result.incarnation,
        )

    @unary
    async def HeartbeatEngine(
        self, request: registry.HeartbeatEngineRequest, context: grpc.aio.ServicerContext
    ) -> registry.HeartbeatEngineResponse:
        self._admit(context, "HeartbeatEngine", request)
        stats = request.stats if request.HasField("stats") else None
        renewal = await self._engines.heartbeat_engine(
            request.engine_id,
            stats,
            request.incarnation,
            release_grace_seconds=request.release_grace_seconds,
        )
        return registry.HeartbeatEngineResponse(
            header=_header(renewal.revision), ttl_seconds=renewal.ttl_seconds
        )

    @unary
    async def DeregisterEngine(
        self, request: registry.DeregisterEngineRequest, context: grpc.aio.ServicerContext
    ) -> registry.DeregisterEngineResponse:
        self._admit(context, "DeregisterEngine", request)
        revision = await self._engines.deregister_engine(request.engine_id)
        return registry.DeregisterEngineResponse(header=_header(revision))

    @unary
    async def ListEngines(
        self, request: registry.ListEnginesRequest, context: grpc.aio.ServicerContext
    ) -> registry.ListEnginesResponse:
        self._admit(context, "ListEngines", request)
        page = await self._engines.list_engines(request.role, request.page_size, request.page_token)
        return registry.ListEnginesResponse(
            header=_header(page.revision), engines=page.engines, next_page_token=page.next_page_token
        )

    @streaming
    async def WatchEngines(
        self, request: registry.WatchEnginesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[registry.WatchEnginesResponse]:
        self._admit(context, "WatchEngines", request)
        # Whatever changes after this point reaches the stream (in the listing or as an event).
        await context.send_initial_metadata(())
        events = self._engines.watch_engines()
        try:
            async for event in events:
                yield registry.WatchEnginesResponse(
                    header=_header(event.revision), type=event.type, engine=event.engine
                )
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    @unary
    async def PublishRetention(
        self, request: registry.PublishRetentionRequest, context: grpc.aio.ServicerContext
    ) -> registry.PublishRetentionResponse:
        self._admit(context, "PublishRetention", request)
        result = await self._retentions.publish_retention(request.retention, request.incarnation)
        return registry.PublishRetentionResponse(
            header=_header(result.revision),
            retention=result.retention,
            superseded_turn=result.superseded_turn,
        )

    @unary
    async def GetRetention(
        self, request: registry.GetRetentionRequest, context: grpc.aio.ServicerContext
    ) -> registry.GetRetentionResponse:
        caller = self._admit(context, "GetRetention", request)
        found = await self._retentions.get_retention(request.tenant, request.conversation_id)
        retention = access.visible_retention(caller, found.retention)
        return registry.GetRetentionResponse(header=_header(found.revision), retention=retention)

    @unary
    async def RenewRetention(
        self, request: registry.RenewRetentionRequest, context: grpc.aio.ServicerContext
    ) -> registry.RenewRetentionResponse:
        self._admit(context, "RenewRetention", request)
        renewed = await self._retentions.renew_retention(request.tenant, request.conversation_id)
        return registry.RenewRetentionResponse(
            header=_header(renewed.revision),
            expire_time=renewed.retention.expire_time,
            ttl_seconds=renewed.retention.ttl_seconds,
        )

    @unary
    async def RenewRetentions(
        self, request: registry.RenewRetentionsRequest, context: grpc.aio.ServicerContext
    ) -> registry.RenewRetentionsResponse:
        self._admit(context, "RenewRetentions", request)
        validation.renewal_batch(len(request.renewals))
        wanted = [(renewal.tenant, renewal.conversation_id) for renewal in request.renewals]
        outcomes = await self._retentions.renew_retentions(wanted)
        response = registry.RenewRetentionsResponse()
        revision = 0
        for (tenant, conversation_id), outcome in zip(wanted, outcomes, strict=True):
            answer = response.renewals.add(tenant=tenant, conversation_id=conversation_id)
            if isinstance(outcome, errors.ServiceError):
                answer.code = errors.STATUS[outcome.kind].grpc.value[0]
                answer.message = outcome.message
                continue
            answer.expire_time.CopyFrom(outcome.retention.expire_time)
            answer.ttl_seconds = outcome.retention.ttl_seconds
            revision = max(revision, outcome.revision)
        response.header.CopyFrom(_header(revision))
        return response

    @unary
    async def ReleaseRetention(
        self, request: registry.ReleaseRetentionRequest, context: grpc.aio.ServicerContext
    ) -> registry.ReleaseRetentionResponse:
        self._admit(context, "ReleaseRetention", request)
        revision = await self._retentions.release_retention(
            request.tenant, request.conversation_id, request.reason, request.engine_request_id
        )
        return registry.ReleaseRetentionResponse(header=_header(revision))

    @unary
    async def EndEngineRetention(
        self, request: registry.EndEngineRetentionRequest, context: grpc.aio.ServicerContext
    ) -> registry.EndEngineRetentionResponse:
        self._admit(context, "EndEngineRetention", request)
        end = await self._retentions.end_engine_retention(
            request.tenant,
            request.conversation_id,
            request.engine_id,
            request.engine_request_id,
            request.reason,
        )
        return registry.EndEngineRetentionResponse(header=_header(end.revision), ended=end.ended)

    @streaming
    async def WatchAllRetentions(
        self, request: registry.WatchAllRetentionsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[registry.WatchAllRetentionsResponse]:
        self._admit(context, "WatchAllRetentions", request)
        # Subscribed before the snapshot is read, so nothing that happens meanwhile is missed (what
        # the snapshot already shows comes again as an event: the client judges by revision).
        async with self._hub.subscribe(ALL_ENGINES) as subscription:
            await context.send_initial_metadata(())
            revision = 0
            async for page, page_revision in self._retentions.snapshot():
                revision = max(revision, page_revision)
                for retention in page:
                    yield registry.WatchAllRetentionsResponse(
                        header=_header(page_revision),
                        type=registry.RETENTION_EVENT_TYPE_PUBLISHED,
                        retention=retention,
                    )
            yield registry.WatchAllRetentionsResponse(
                header=_header(revision), type=registry.RETENTION_EVENT_TYPE_SYNCED
            )
            async for event in subscription.events():
                yield _retention_event(event, registry.WatchAllRetentionsResponse)

    @streaming
    async def WatchRetentions(
        self, request: registry.WatchRetentionsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[registry.WatchRetentionsResponse]:
        self._admit(context, "WatchRetentions", request)
        engine_id = validation.require_id("engine_id", request.engine_id)
        async with self._hub.subscribe(engine_id) as subscription:
            await context.send_initial_metadata(())
            async for event in subscription.events():
                yield _retention_event(event, registry.WatchRetentionsResponse)

    @unary
    async def BeginTurn(
        self, request: registry.BeginTurnRequest, context: grpc.aio.ServicerContext
    ) -> registry.BeginTurnResponse:
        self._admit(context, "BeginTurn", request)
        begun = await self._turns.begin_turn(
            request.tenant, request.conversation_id, request.request_id, request.holder, request.ttl_seconds
        )
        return registry.BeginTurnResponse(
            header=_header(begun.revision),
            ttl_seconds=begun.ttl_seconds,
            retained_turn=begun.retained_turn,
            turn=begun.turn,
            retained_engine_request_id=begun.retained_request_id,
        )

    @unary
    async def EndTurn(
        self, request: registry.EndTurnRequest, context: grpc.aio.ServicerContext
    ) -> registry.EndTurnResponse:
        self._admit(context, "EndTurn", request)
        ended = await self._turns.end_turn(request.tenant, request.conversation_id, request.request_id)
        return registry.EndTurnResponse(header=_header(ended.revision), ended=ended.ended)
