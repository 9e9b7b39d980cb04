"""The sidecar's view of the registry: the calls it makes, behind a Protocol so its logic can be
driven by an in-memory registry in unit tests and by the real gRPC service everywhere else.

The link also keeps the highest registry revision any answer carried (``revision``): the revision a
SYNC snapshot of the sidecar's book covers (releases.py). The registry answers linearizably, so an
answer older than one seen before its call was sent means etcd went back in time (restored from an
older snapshot): the link then calls ``on_rewind(seen_revision, revision)``, and the sidecar
registers its engine again with that evidence (kvferry.registry.epochs).

Revisions the sidecar passes on (answers' headers, watch events) stay one increasing sequence
across such a rewind: the link adds an offset to every revision it hands out, raised at each
rewind, so the connector never takes news from after a restore for news older than what it has."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

import grpc
from kvferry.runtime.errors import ErrorKind, error_kind_of
from kvferry.runtime.tls import TlsFiles, open_channel
from kvferry.v1 import registry_service_pb2 as registry_pb2
from kvferry.v1 import registry_service_pb2_grpc as registry_grpc
from kvferry.v1 import resources_pb2

# Kinds of failure after which the same call may succeed later without anyone changing anything.
TRANSIENT_KINDS = frozenset(
    {
        ErrorKind.UNAVAILABLE,
        ErrorKind.DEADLINE_EXCEEDED,
        ErrorKind.RESOURCE_EXHAUSTED,
        ErrorKind.ABORTED,
        ErrorKind.INTERNAL,
        ErrorKind.UNKNOWN,
        ErrorKind.CANCELLED,
    }
)

# Kinds where a mutating call may or may not have taken effect.
AMBIGUOUS_KINDS = frozenset({ErrorKind.UNAVAILABLE, ErrorKind.DEADLINE_EXCEEDED})


class RegistryError(Exception):
    """A registry call failed as ``kind``; ``message`` is the registry's own explanation."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(f"{kind.name}: {message}")
        self.kind = kind
        self.message = message

    @classmethod
    def from_rpc(cls, error: grpc.aio.AioRpcError) -> RegistryError:
        return cls(error_kind_of(error.code()), error.details() or "")

    @property
    def transient(self) -> bool:
        return self.kind in TRANSIENT_KINDS


class RetentionStream(Protocol):
    """An open WatchRetentions stream; iteration raises RegistryError when it breaks."""

    async def ready(self) -> None:
        """Returns once the registry's watch is in place (later changes will reach the stream)."""
        ...

    def __aiter__(self) -> AsyncIterator[registry_pb2.WatchRetentionsResponse]: ...

    def cancel(self) -> None: ...


class RegistryApi(Protocol):
    """The registry calls the sidecar makes. Every failure raises RegistryError."""

    @property
    def revision(self) -> int:
        """The highest registry revision any answer (or watch event) carried so far."""
        ...

    async def register_engine(
        self,
        engine: resources_pb2.Engine,
        ttl_seconds: int,
        *,
        seen_revision: int = 0,
        seen_epoch: str = "",
        ended: registry_pb2.EndedRetention | None = None,
    ) -> registry_pb2.RegisterEngineResponse: ...

    async def heartbeat_engine(
        self,
        engine_id: str,
        stats: resources_pb2.EngineStats | None,
        incarnation: int = 0,
        *,
        release_grace_seconds: float = 0.0,
    ) -> registry_pb2.HeartbeatEngineResponse: ...

    async def deregister_engine(self, engine_id: str) -> None: ...

    async def publish_retention(
        self, retention: resources_pb2.Retention, incarnation: int = 0
    ) -> registry_pb2.PublishRetentionResponse:
        """Publishes ``retention``; with ``incarnation``, only while the engine is that registration."""
        ...

    async def get_retention(self, tenant: str, conversation_id: str) -> registry_pb2.GetRetentionResponse: ...

    async def end_engine_retention(
        self,
        tenant: str,
        conversation_id: str,
        engine_id: str,
        engine_request_id: str,
        reason: resources_pb2.ReleaseReason.ValueType,
    ) -> registry_pb2.EndEngineRetentionResponse:
        """Ends the retention if it is still that engine request, and keeps it from being published
        again; succeeds whether or not it was live."""
        ...

    def watch_retentions(self, engine_id: str) -> RetentionStream: ...


class _GrpcRetentionStream:
    def __init__(
        self,
        call: grpc.aio.UnaryStreamCall,
        on_error: Callable[[str], None],
        observe: Callable[[resources_pb2.ResponseHeader], None],
    ) -> None:
        self._call = call
        self._on_error = on_error
        self._observe = observe

    async def _events(self) -> AsyncIterator[registry_pb2.WatchRetentionsResponse]:
        try:
            async for event in self._call:
                self._observe(event.header)
                yield event
        except grpc.aio.AioRpcError as err:
            self._on_error("watch_retentions")
            raise RegistryError.from_rpc(err) from None
        # The registry never ends a watch on its own; an end is a broken link.
        raise RegistryError(ErrorKind.UNAVAILABLE, "registry closed the WatchRetentions stream")

    def __aiter__(self) -> AsyncIterator[registry_pb2.WatchRetentionsResponse]:
        return self._events()

    async def ready(self) -> None:
        # The registry sends initial metadata once its watch is in place.
        try:
            await self._call.initial_metadata()
        except grpc.aio.AioRpcError as err:
            self._on_error("watch_retentions")
            raise RegistryError.from_rpc(err) from None

    def cancel(self) -> None:
        self._call.cancel()


class GrpcRegistry:
    """RegistryApi over a grpc.aio channel (mutual TLS with ``tls``); every unary call carries
    ``timeout_seconds``."""

    def __init__(
        self,
        address: str,
        *,
        timeout_seconds: float = 5.0,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        on_error: Callable[[str], None] = lambda op: None,
        on_rewind: Callable[[int, int], None] = lambda seen, revision: None,
        tls: TlsFiles | None = None,
    ) -> None:
        self.address = address
        self._timeout = timeout_seconds
        self._on_error = on_error
        self.on_rewind = on_rewind
        self._channel = open_channel(address, tls, interceptors=interceptors)
        self._stub = registry_grpc.RegistryServiceStub(self._channel)
        # The highest revision the registry sent, and what is added to the ones handed out.
        self._raw_revision = 0
        self._offset = 0

    @property
    def revision(self) -> int:
        return self._raw_revision + self._offset

    def _observe(self, header: resources_pb2.ResponseHeader, seen: int | None = None) -> None:
        """Notes ``header.revision`` (and a rewind, when it is below ``seen``, the highest revision seen
        before the call was sent), then rewrites it as handed out."""
        raw = header.revision
        if raw <= 0:
            return
        if seen is not None and raw < seen:
            self._offset += seen - raw + 1
            self._raw_revision = raw
            self.on_rewind(seen, raw)
        elif raw > self._raw_revision:
            self._raw_revision = raw
        header.revision = raw + self._offset

    async def close(self) -> None:
        await self._channel.close()

    async def register_engine(
        self,
        engine: resources_pb2.Engine,
        ttl_seconds: int,
        *,
        seen_revision: int = 0,
        seen_epoch: str = "",
        ended: registry_pb2.EndedRetention | None = None,
    ) -> registry_pb2.RegisterEngineResponse:
        if ended is not None and self._offset:
            # Back to etcd's own numbering, which the registry compares it with. Taking today's offset is
            # safe: one raised after the end only lowers the revision, and then a new epoch already began.
            raw = registry_pb2.EndedRetention()
            raw.CopyFrom(ended)
            raw.end_revision = max(0, ended.end_revision - self._offset)
            ended = raw
        request = registry_pb2.RegisterEngineRequest(
            engine=engine,
            ttl_seconds=ttl_seconds,
            seen_revision=seen_revision,
            seen_epoch=seen_epoch,
            ended_retention=ended,
        )
        response: registry_pb2.RegisterEngineResponse = await self._call(
            "register_engine", self._stub.RegisterEngine, request
        )
        return response

    async def heartbeat_engine(
        self,
        engine_id: str,
        stats: resources_pb2.EngineStats | None,
        incarnation: int = 0,
        *,
        release_grace_seconds: float = 0.0,
    ) -> registry_pb2.HeartbeatEngineResponse:
        request = registry_pb2.HeartbeatEngineRequest(
            engine_id=engine_id,
            stats=stats,
            incarnation=incarnation,
            release_grace_seconds=release_grace_seconds,
        )
        response: registry_pb2.HeartbeatEngineResponse = await self._call(
            "heartbeat_engine", self._stub.HeartbeatEngine, request
        )
        return response

    async def deregister_engine(self, engine_id: str) -> None:
        await self._call(
            "deregister_engine",
            self._stub.DeregisterEngine,
            registry_pb2.DeregisterEngineRequest(engine_id=engine_id),
        )

    async def publish_retention(
        self, retention: resources_pb2.Retention, incarnation: int = 0
    ) -> registry_pb2.PublishRetentionResponse:
        request = registry_pb2.PublishRetentionRequest(retention=retention, incarnation=incarnation)
        response: registry_pb2.PublishRetentionResponse = await self._call(
            "publish_retention", self._stub.PublishRetention, request
        )
        return response

    async def get_retention(self, tenant: str, conversation_id: str) -> registry_pb2.GetRetentionResponse:
        request = registry_pb2.GetRetentionRequest(tenant=tenant, conversation_id=conversation_id)
        response: registry_pb2.GetRetentionResponse = await self._call(
            "get_retention", self._stub.GetRetention, request
        )
        return response

    async def end_engine_retention(
        self,
        tenant: str,
        conversation_id: str,
        engine_id: str,
        engine_request_id: str,
        reason: resources_pb2.ReleaseReason.ValueType,
    ) -> registry_pb2.EndEngineRetentionResponse:
        request = registry_pb2.EndEngineRetentionRequest(
            tenant=tenant,
            conversation_id=conversation_id,
            engine_id=engine_id,
            engine_request_id=engine_request_id,
            reason=reason,
        )
        response: registry_pb2.EndEngineRetentionResponse = await self._call(
            "end_engine_retention", self._stub.EndEngineRetention, request
        )
        return response

    def watch_retentions(self, engine_id: str) -> RetentionStream:
        call = self._stub.WatchRetentions(registry_pb2.WatchRetentionsRequest(engine_id=engine_id))
        return _GrpcRetentionStream(call, self._on_error, self._observe)

    async def _call(self, op: str, method: grpc.aio.UnaryUnaryMultiCallable, request: object) -> Any:
        seen = self._raw_revision
        try:
            response = await method(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as err:
            self._on_error(op)
            raise RegistryError.from_rpc(err) from None
        if response.HasField("header"):
            self._observe(response.header, seen)
        return response
