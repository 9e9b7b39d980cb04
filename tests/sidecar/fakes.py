"""An IN-MEMORY STAND-IN for the registry (RegistryApi) and a scripted engine probe, for unit tests
of the sidecar's logic. Each path they drive also runs against the real registry in test_sidecar.py."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator

from google.protobuf import timestamp_pb2
from kvferry.runtime.errors import ErrorKind
from kvferry.sidecar.engine import EngineFacts, ProbeResult
from kvferry.sidecar.registry_link import RegistryError
from kvferry.v1 import registry_service_pb2 as registry_pb2
from kvferry.v1 import resources_pb2


def _ts(seconds: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


class FakeStream:
    def __init__(self, owner: FakeRegistry) -> None:
        self.queue: asyncio.Queue[registry_pb2.WatchRetentionsResponse | RegistryError] = asyncio.Queue()
        self._owner = owner
        self.cancelled = False

    async def ready(self) -> None:
        if self._owner.unavailable:
            raise RegistryError(ErrorKind.UNAVAILABLE, "fake registry down")

    async def _events(self) -> AsyncIterator[registry_pb2.WatchRetentionsResponse]:
        while True:
            item = await self.queue.get()
            if isinstance(item, RegistryError):
                raise item
            yield item

    def __aiter__(self) -> AsyncIterator[registry_pb2.WatchRetentionsResponse]:
        return self._events()

    def cancel(self) -> None:
        self.cancelled = True
        self._owner.streams.discard(self)


class FakeRegistry:
    """Engines and retentions in dicts; ``unavailable`` fails every call; ``scripted`` fails the
    next calls of one operation with the given kinds of failure."""

    def __init__(self) -> None:
        self.engines: dict[str, resources_pb2.Engine] = {}
        self.incarnations: dict[str, int] = {}
        self.retentions: dict[tuple[str, str], resources_pb2.Retention] = {}
        # Engine requests their engine ended: never published again (as the real registry keeps them).
        self.ended_requests: set[tuple[str, str]] = set()
        # The store revision: every change bumps it, every answer carries it.
        self.store_revision = 1
        self.seen_revision = 0
        self.streams: set[FakeStream] = set()
        self.unavailable = False
        self.scripted: dict[str, deque[ErrorKind]] = {}
        self.calls: list[str] = []
        # Stores the publish, then fails it (an answer lost on the way back).
        self.lose_publish_answer = False
        # Each registration's evidence that etcd went back: (seen_revision, ended_retention).
        self.restore_evidence: list[tuple[int, registry_pb2.EndedRetention | None]] = []

    def script(self, op: str, *kinds: ErrorKind) -> None:
        self.scripted.setdefault(op, deque()).extend(kinds)

    def _enter(self, op: str) -> None:
        self.calls.append(op)
        if self.unavailable:
            raise RegistryError(ErrorKind.UNAVAILABLE, "fake registry down")
        queued = self.scripted.get(op)
        if queued:
            raise RegistryError(queued.popleft(), f"scripted failure of {op}")

    @property
    def revision(self) -> int:
        return self.seen_revision

    def _header(self, *, write: bool = False) -> resources_pb2.ResponseHeader:
        if write:
            self.store_revision += 1
        self.seen_revision = max(self.seen_revision, self.store_revision)
        return resources_pb2.ResponseHeader(revision=self.store_revision)

    def emit(self, event: registry_pb2.WatchRetentionsResponse) -> None:
        if not event.header.revision:
            event.header.CopyFrom(self._header(write=True))
        for stream in list(self.streams):
            stream.queue.put_nowait(event)

    def break_streams(self) -> None:
        for stream in list(self.streams):
            stream.queue.put_nowait(RegistryError(ErrorKind.UNAVAILABLE, "fake stream broke"))

    async def register_engine(
        self,
        engine: resources_pb2.Engine,
        ttl_seconds: int,
        *,
        seen_revision: int = 0,
        seen_epoch: str = "",
        ended: registry_pb2.EndedRetention | None = None,
    ) -> registry_pb2.RegisterEngineResponse:
        self._enter("register_engine")
        self.restore_evidence.append((seen_revision, ended))
        self.engines[engine.engine_id] = engine
        self.incarnations[engine.engine_id] = self.incarnations.get(engine.engine_id, 0) + 1
        return registry_pb2.RegisterEngineResponse(
            header=self._header(write=True),
            engine=engine,
            ttl_seconds=ttl_seconds or 10,
            epoch="1.0",
            incarnation=self.incarnations[engine.engine_id],
        )

    async def heartbeat_engine(
        self,
        engine_id: str,
        stats: resources_pb2.EngineStats | None,
        incarnation: int = 0,
        *,
        release_grace_seconds: float = 0.0,
    ) -> registry_pb2.HeartbeatEngineResponse:
        self._enter("heartbeat_engine")
        if engine_id not in self.engines:
            raise RegistryError(ErrorKind.NOT_FOUND, f"engine {engine_id} is not registered")
        if incarnation and incarnation != self.incarnations.get(engine_id):
            raise RegistryError(ErrorKind.NOT_FOUND, f"engine {engine_id} registered again")
        if release_grace_seconds:
            self.engines[engine_id].release_grace_seconds = release_grace_seconds
        return registry_pb2.HeartbeatEngineResponse(header=self._header(), ttl_seconds=10)

    async def deregister_engine(self, engine_id: str) -> None:
        self._enter("deregister_engine")
        if self.engines.pop(engine_id, None) is None:
            raise RegistryError(ErrorKind.NOT_FOUND, f"engine {engine_id} is not registered")

    async def publish_retention(
        self, retention: resources_pb2.Retention, incarnation: int = 0
    ) -> registry_pb2.PublishRetentionResponse:
        self._enter("publish_retention")
        if retention.engine_id not in self.engines:
            # The real registry's answer (kvferry.registry.retentions.RetentionStore.publish_retention).
            raise RegistryError(
                ErrorKind.FAILED_PRECONDITION,
                f"engine {retention.engine_id} is not registered; register it (RegisterEngine) before "
                "publishing its retentions",
            )
        if (retention.engine_id, retention.engine_request_id) in self.ended_requests:
            raise RegistryError(ErrorKind.FAILED_PRECONDITION, "ended by its engine; never published again")
        stored = resources_pb2.Retention()
        stored.CopyFrom(retention)
        stored.expire_time.CopyFrom(_ts(time.time() + (retention.ttl_seconds or 60)))
        self.retentions[(retention.tenant, retention.conversation_id)] = stored
        header = self._header(write=True)
        if self.lose_publish_answer:
            raise RegistryError(ErrorKind.DEADLINE_EXCEEDED, "answer lost")
        return registry_pb2.PublishRetentionResponse(header=header, retention=stored)

    async def get_retention(self, tenant: str, conversation_id: str) -> registry_pb2.GetRetentionResponse:
        self._enter("get_retention")
        found = self.retentions.get((tenant, conversation_id))
        if found is None:
            raise RegistryError(ErrorKind.NOT_FOUND, "no live retention")
        return registry_pb2.GetRetentionResponse(header=self._header(), retention=found)

    async def end_engine_retention(
        self,
        tenant: str,
        conversation_id: str,
        engine_id: str,
        engine_request_id: str,
        reason: resources_pb2.ReleaseReason.ValueType,
    ) -> registry_pb2.EndEngineRetentionResponse:
        self._enter("end_engine_retention")
        self.ended_requests.add((engine_id, engine_request_id))
        found = self.retentions.get((tenant, conversation_id))
        mine = (
            found is not None
            and found.engine_id == engine_id
            and found.engine_request_id == engine_request_id
        )
        header = self._header(write=True)
        if found is not None and mine:
            del self.retentions[(tenant, conversation_id)]
            self.emit(
                registry_pb2.WatchRetentionsResponse(
                    header=header,
                    type=registry_pb2.RETENTION_EVENT_TYPE_ENDED,
                    retention=found,
                    reason=reason,
                )
            )
        return registry_pb2.EndEngineRetentionResponse(header=header, ended=mine)

    def watch_retentions(self, engine_id: str) -> FakeStream:
        self.calls.append("watch_retentions")
        stream = FakeStream(self)
        self.streams.add(stream)
        return stream


class ScriptedProbe:
    """An engine probe answering what the test sets."""

    def __init__(self, result: ProbeResult = ProbeResult.OK, facts: EngineFacts | None = None) -> None:
        self.result = result
        self.facts = facts or EngineFacts(model="m", max_model_len=1024, block_size=16, kv_capacity_blocks=64)

    async def check_health(self) -> ProbeResult:
        return self.result

    async def read_facts(self) -> EngineFacts:
        return self.facts
