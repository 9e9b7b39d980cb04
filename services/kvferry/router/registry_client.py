"""The router's view of the registry: retention lookups and renewals, the marks of turns in flight, and
the engine table kept from the registry's engine watch.

Every call carries a deadline. A registry that does not answer raises :class:`RegistryUnavailable`;
the turn logic then serves by recompute (rule 7 of docs/design.md) instead of failing the turn.

Renewals that arrive together (many conversations kept alive through one router) go to the
registry as one ``RenewRetentions`` call (:class:`RenewalBatcher`); a lone one goes out at once.
"""

from __future__ import annotations

import asyncio
import logging
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
from kvferry.pd.digest import PackedDigests
from kvferry.pd.reuse import max_read_window, read_window_fits
from kvferry.router.engines import EngineInfo, EngineTable, LoadTracker
from kvferry.runtime.backoff import Backoff, BackoffPolicy
from kvferry.runtime.errors import Aborted, Internal, InvalidArgument, ServiceError
from kvferry.v1 import registry_service_pb2 as registry_pb2
from kvferry.v1 import registry_service_pb2_grpc as registry_grpc
from kvferry.v1 import resources_pb2

log = logging.getLogger(__name__)

_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


class RegistryUnavailable(Exception):
    """The registry (or its etcd) did not answer in time."""


@dataclass(frozen=True)
class RetentionRecord:
    """A conversation's live retention, as the registry holds it."""

    tenant: str
    conversation_id: str
    engine_id: str
    engine_request_id: str
    block_ids: Sequence[int]
    num_tokens: int
    block_digests: Sequence[bytes]
    turn: int
    # Lease end, Unix seconds.
    expire_time: float
    # One per block id (empty: the holder does not fence pulls); handed to P with the pull.
    block_generations: Sequence[int] = ()
    # Where the blocks live on the holder (a ``MemoryTier`` value; 0: not said, its KV cache).
    tier: int = 0

    @classmethod
    def from_proto(cls, r: resources_pb2.Retention) -> RetentionRecord:
        """Packed (8 bytes per block id and generation, 16 per digest, against ~100 in tuples): the router's
        retention index holds one per live retention. The registry checked the digests' size."""
        return cls(
            tenant=r.tenant,
            conversation_id=r.conversation_id,
            engine_id=r.engine_id,
            engine_request_id=r.engine_request_id,
            block_ids=array("q", r.block_ids),
            num_tokens=r.num_tokens,
            block_digests=PackedDigests(r.block_digests),
            turn=r.turn,
            expire_time=r.expire_time.seconds + r.expire_time.nanos / 1e9,
            block_generations=array("Q", r.block_generations),
            tier=r.tier,
        )


@dataclass(frozen=True)
class BegunTurn:
    """A turn's mark, taken (or renewed) in the registry."""

    # The mark's lease: renew well within it.
    ttl_seconds: int
    # The conversation's retained turn when the mark was taken (0: none, a record the registry would not
    # serve, or a renewal) and that record's engine request id: a lookup made concurrently that found
    # another record is out of date.
    retained_turn: int
    retained_request_id: str = ""

    def confirms(self, found: RetentionRecord | None) -> bool:
        """Whether a lookup made beside the mark found what the registry held when the mark was taken
        (a registry older than the request id compares turns only)."""
        if found is None:
            return self.retained_turn == 0
        if found.turn != self.retained_turn:
            return False
        return not self.retained_request_id or found.engine_request_id == self.retained_request_id


@dataclass(frozen=True)
class EngineEvent:
    # "joined", "updated" or "left"
    kind: str
    engine: EngineInfo | None
    engine_id: str


class EngineSource(Protocol):
    """Where the engine table comes from (the registry's engine listing and watch)."""

    async def list_engines(self) -> list[EngineInfo]: ...

    def watch_engines(self) -> AsyncIterator[EngineEvent]: ...


class RegistryApi(EngineSource, Protocol):
    """What the router asks of the registry."""

    async def get_retention(self, tenant: str, conversation_id: str) -> RetentionRecord | None: ...

    async def renew_retention(self, tenant: str, conversation_id: str) -> float | None:
        """New lease end (Unix seconds), or None when no retention is live."""
        ...

    async def release_retention(self, tenant: str, conversation_id: str) -> bool:
        """True when a live retention was released."""
        ...

    async def begin_turn(
        self, tenant: str, conversation_id: str, request_id: str, *, holder: str, ttl_seconds: int
    ) -> BegunTurn:
        """Takes (or renews) the mark of a turn in flight; ``Aborted`` when another turn holds it."""
        ...

    async def end_turn(self, tenant: str, conversation_id: str, request_id: str) -> bool:
        """Clears the turn's mark; True when it held it."""
        ...


Renewal = tuple[str, str]
# What one renewal came to: the new lease end, None (nothing live to renew), or the error to raise.
RenewalOutcome = float | None | Exception
# Renewals one RenewRetentions call carries (the registry's limit).
MAX_RENEWAL_BATCH = 1000


class RenewalBatcher:
    """Concurrent renewals sent as one call: while a call is in flight, new renewals queue, and the
    next call carries them all (up to ``max_batch``). A lone renewal goes out at once, unchanged,
    so an idle router pays no delay.
    """

    def __init__(
        self,
        send_one: Callable[[Renewal], Awaitable[float | None]],
        send_many: Callable[[Sequence[Renewal]], Awaitable[list[RenewalOutcome]]],
        max_batch: int = MAX_RENEWAL_BATCH,
    ) -> None:
        self._send_one = send_one
        self._send_many = send_many
        self._max_batch = max_batch
        self._pending: list[tuple[Renewal, asyncio.Future[float | None]]] = []
        self._drainer: asyncio.Task[None] | None = None

    async def renew(self, tenant: str, conversation_id: str) -> float | None:
        future: asyncio.Future[float | None] = asyncio.get_running_loop().create_future()
        self._pending.append(((tenant, conversation_id), future))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain(), name="registry-renewal-batcher")
        return await future

    async def _drain(self) -> None:
        while self._pending:
            batch, self._pending = self._pending[: self._max_batch], self._pending[self._max_batch :]
            await self._send(batch)

    async def _send(self, batch: list[tuple[Renewal, asyncio.Future[float | None]]]) -> None:
        outcomes: list[RenewalOutcome]
        try:
            if len(batch) == 1:
                outcomes = [await self._send_one(batch[0][0])]
            else:
                outcomes = await self._send_many([renewal for renewal, _ in batch])
        except Exception as error:
            outcomes = [error] * len(batch)
        for (_, future), outcome in zip(batch, outcomes, strict=True):
            if future.done():
                continue  # its caller gave up
            if isinstance(outcome, Exception):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)


class GrpcRegistry:
    """:class:`RegistryApi` over the registry's gRPC API."""

    def __init__(self, channel: grpc.aio.Channel, *, timeout_seconds: float) -> None:
        self._stub = registry_grpc.RegistryServiceStub(channel)
        self._timeout = timeout_seconds
        self._renewals = RenewalBatcher(self._renew_one, self._renew_many)

    @staticmethod
    def _fail(error: grpc.aio.AioRpcError, what: str) -> Exception:
        if error.code() in _UNREACHABLE:
            return RegistryUnavailable(
                f"registry did not answer {what}: {error.code().name} {error.details()}"
            )
        if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
            return InvalidArgument(error.details() or what)
        if error.code() == grpc.StatusCode.ABORTED:
            return Aborted(error.details() or what)
        return Internal(f"registry failed {what}: {error.code().name} {error.details()}")

    async def get_retention(self, tenant: str, conversation_id: str) -> RetentionRecord | None:
        try:
            response = await self._stub.GetRetention(
                registry_pb2.GetRetentionRequest(tenant=tenant, conversation_id=conversation_id),
                timeout=self._timeout,
            )
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise self._fail(error, "GetRetention") from None
        return RetentionRecord.from_proto(response.retention)

    async def renew_retention(self, tenant: str, conversation_id: str) -> float | None:
        return await self._renewals.renew(tenant, conversation_id)

    async def _renew_many(self, renewals: Sequence[Renewal]) -> list[RenewalOutcome]:
        request = registry_pb2.RenewRetentionsRequest(
            renewals=[
                registry_pb2.RenewRetentionRequest(tenant=tenant, conversation_id=conversation_id)
                for tenant, conversation_id in renewals
            ]
        )
        try:
            response = await self._stub.RenewRetentions(request, timeout=self._timeout)
        except grpc.aio.AioRpcError as error:
            raise self._fail(error, "RenewRetentions") from None
        outcomes: list[RenewalOutcome] = []
        for answer in response.renewals:
            code = grpc.StatusCode.OK
            for status in grpc.StatusCode:
                if status.value[0] == answer.code:
                    code = status
            if code == grpc.StatusCode.OK:
                outcomes.append(answer.expire_time.seconds + answer.expire_time.nanos / 1e9)
            elif code == grpc.StatusCode.NOT_FOUND:
                outcomes.append(None)
            elif code in _UNREACHABLE:
                outcomes.append(RegistryUnavailable(f"registry did not renew: {code.name} {answer.message}"))
            elif code == grpc.StatusCode.INVALID_ARGUMENT:
                outcomes.append(InvalidArgument(answer.message))
            else:
                outcomes.append(Internal(f"registry failed RenewRetentions: {code.name} {answer.message}"))
        return outcomes

    async def _renew_one(self, renewal: Renewal) -> float | None:
        tenant, conversation_id = renewal
        try:
            response = await self._stub.RenewRetention(
                registry_pb2.RenewRetentionRequest(tenant=tenant, conversation_id=conversation_id),
                timeout=self._timeout,
            )
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise self._fail(error, "RenewRetention") from None
        return float(response.expire_time.seconds + response.expire_time.nanos / 1e9)

    async def release_retention(self, tenant: str, conversation_id: str) -> bool:
        try:
            await self._stub.ReleaseRetention(
                registry_pb2.ReleaseRetentionRequest(
                    tenant=tenant,
                    conversation_id=conversation_id,
                    reason=resources_pb2.RELEASE_REASON_RELEASED,
                ),
                timeout=self._timeout,
            )
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                return False
            raise self._fail(error, "ReleaseRetention") from None
        return True

    async def begin_turn(
        self, tenant: str, conversation_id: str, request_id: str, *, holder: str, ttl_seconds: int
    ) -> BegunTurn:
        try:
            response = await self._stub.BeginTurn(
                registry_pb2.BeginTurnRequest(
                    tenant=tenant,
                    conversation_id=conversation_id,
                    request_id=request_id,
                    holder=holder,
                    ttl_seconds=ttl_seconds,
                ),
                timeout=self._timeout,
            )
        except grpc.aio.AioRpcError as error:
            raise self._fail(error, "BeginTurn") from None
        return BegunTurn(
            ttl_seconds=response.ttl_seconds,
            retained_turn=response.retained_turn,
            retained_request_id=response.retained_engine_request_id,
        )

    async def end_turn(self, tenant: str, conversation_id: str, request_id: str) -> bool:
        try:
            response = await self._stub.EndTurn(
                registry_pb2.EndTurnRequest(
                    tenant=tenant, conversation_id=conversation_id, request_id=request_id
                ),
                timeout=self._timeout,
            )
        except grpc.aio.AioRpcError as error:
            raise self._fail(error, "EndTurn") from None
        return bool(response.ended)

    async def list_engines(self) -> list[EngineInfo]:
        return [EngineInfo.from_proto(engine) for engine in await self.list_engine_records()]

    async def list_engine_records(self) -> list[resources_pb2.Engine]:
        """ListEngines, every page: the registered engines as the registry stores them."""
        engines: list[resources_pb2.Engine] = []
        page_token = ""
        while True:
            try:
                response = await self._stub.ListEngines(
                    registry_pb2.ListEnginesRequest(page_size=1000, page_token=page_token),
                    timeout=self._timeout,
                )
            except grpc.aio.AioRpcError as error:
                raise self._fail(error, "ListEngines") from None
            engines.extend(response.engines)
            page_token = response.next_page_token
            if not page_token:
                return engines

    async def watch_all_retentions(self) -> AsyncIterator[registry_pb2.WatchAllRetentionsResponse]:
        """WatchAllRetentions: the snapshot, SYNCED, then every change (feeds ``RetentionIndex``)."""
        call = self._stub.WatchAllRetentions(registry_pb2.WatchAllRetentionsRequest())
        try:
            async for event in call:
                yield event
        except grpc.aio.AioRpcError as error:
            raise self._fail(error, "WatchAllRetentions") from None
        finally:
            call.cancel()

    async def watch_engines(self) -> AsyncIterator[EngineEvent]:
        call = self._stub.WatchEngines(registry_pb2.WatchEnginesRequest())
        try:
            async for event in call:
                if event.type == registry_pb2.ENGINE_EVENT_TYPE_LEFT:
                    yield EngineEvent("left", None, event.engine.engine_id)
                elif event.type in (
                    registry_pb2.ENGINE_EVENT_TYPE_JOINED,
                    registry_pb2.ENGINE_EVENT_TYPE_UPDATED,
                ):
                    kind = "joined" if event.type == registry_pb2.ENGINE_EVENT_TYPE_JOINED else "updated"
                    yield EngineEvent(kind, EngineInfo.from_proto(event.engine), event.engine.engine_id)
        except grpc.aio.AioRpcError as error:
            raise self._fail(error, "WatchEngines") from None
        finally:
            call.cancel()


# Re-watching a registry that went away: 0.1 s doubling to 5 s, each delay within +-50 %.
WATCH_BACKOFF = BackoffPolicy(initial_seconds=0.1, max_seconds=5.0, jitter=0.5)


class EngineWatcher:
    """Keeps an :class:`EngineTable` equal to the registry's live engines.

    On every (re)connect it lists the engines (a snapshot that also drops engines that left while
    the watch was down), then applies the watch's events; an engine that leaves is dropped at once.
    While the registry is away the last known table stays in use, and it reconnects with backoff.
    """

    def __init__(
        self,
        registry: EngineSource,
        table: EngineTable,
        load: LoadTracker,
        *,
        resync_seconds: float = 30.0,
        backoff: BackoffPolicy = WATCH_BACKOFF,
        on_left: Callable[[str], None] | None = None,
        read_window_seconds: float | None = None,
    ) -> None:
        self._on_left = on_left
        # Engines joining with a release grace too short for it are named in a warning.
        self._read_window_seconds = read_window_seconds
        self._registry = registry
        self._table = table
        self._load = load
        self._resync_seconds = resync_seconds
        self._backoff = backoff
        self.synced = asyncio.Event()
        self.connected = False
        # One set per snapshot in flight: engines whose LEFT arrived while its list was being read.
        self._left_during_snapshots: list[set[str]] = []

    async def run(self) -> None:
        resync = asyncio.create_task(self._resync_forever(), name="engine-table-resync")
        try:
            backoff = Backoff(self._backoff)
            while True:
                try:
                    await self._watch_once()
                    backoff.reset()
                except (RegistryUnavailable, ServiceError) as error:
                    if self.connected:
                        log.warning(
                            "lost the registry's engine watch; keeping the last known engines",
                            extra={"error": str(error)},
                        )
                    self.connected = False
                await backoff.wait()
        finally:
            resync.cancel()

    async def _watch_once(self) -> None:
        """One connected period: a snapshot, then the watch's events until the stream breaks."""
        await self._snapshot()
        self.connected = True
        self.synced.set()
        log.info("engine table synced", extra={"engines": sorted(e.engine_id for e in self._table.all())})
        events = self._registry.watch_engines()
        async for event in events:
            self._apply(event)
        raise RegistryUnavailable("the registry ended the engine watch")

    async def _resync_forever(self) -> None:
        while True:
            await asyncio.sleep(self._resync_seconds)
            if self.connected:
                try:
                    await self._snapshot()
                except (RegistryUnavailable, ServiceError) as error:
                    log.warning("engine table resync failed", extra={"error": str(error)})

    async def _snapshot(self) -> None:
        left: set[str] = set()
        self._left_during_snapshots.append(left)
        try:
            engines = await self._registry.list_engines()
        finally:
            self._left_during_snapshots.remove(left)
        # An engine whose LEFT event arrived while the list was in flight stays gone.
        engines = [e for e in engines if e.engine_id not in left]
        gone = {e.engine_id for e in self._table.all()} - {e.engine_id for e in engines}
        self._table.replace_all(engines)
        for engine_id in gone:
            self._forget(engine_id)

    def _check_grace(self, engine: EngineInfo) -> None:
        window = self._read_window_seconds
        if window is None or not engine.can_decode or read_window_fits(window, engine.release_grace_seconds):
            return
        log.warning(
            "a decode engine's release grace is too short for the read window (or not published yet): "
            "its retentions are recomputed, never pulled",
            extra={
                "engine_id": engine.engine_id,
                "release_grace_seconds": engine.release_grace_seconds,
                "read_window_seconds": window,
                "longest_read_window_seconds": max_read_window(engine.release_grace_seconds),
            },
        )

    def _forget(self, engine_id: str) -> None:
        log.info("engine left", extra={"engine_id": engine_id})
        self._load.forget(engine_id)
        if self._on_left is not None:
            self._on_left(engine_id)

    def _apply(self, event: EngineEvent) -> None:
        if event.kind == "left":
            if self._table.remove(event.engine_id) is not None:
                self._forget(event.engine_id)
            for left in self._left_during_snapshots:
                left.add(event.engine_id)
        elif event.engine is not None:
            known = self._table.get(event.engine_id)
            if known is None:
                log.info(
                    "engine joined",
                    extra={
                        "engine_id": event.engine_id,
                        "endpoint": event.engine.http_endpoint,
                        "release_grace_seconds": event.engine.release_grace_seconds,
                    },
                )
            if known is None or known.release_grace_seconds != event.engine.release_grace_seconds:
                self._check_grace(event.engine)
            self._table.upsert(event.engine)
