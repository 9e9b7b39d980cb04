"""Retention events per engine: one etcd watch, fanned out to every WatchRetentions stream.

The watch covers ``retention/`` (live records and tombstones) with previous values, so each event
explains itself:

- DELETE of a live key, with a tombstone PUT in the same revision: ENDED with the tombstone's
  reason (RELEASED, EVICTED, ENGINE_GONE);
- DELETE of a live key without one: the lease ran out, ENDED with EXPIRED;
- PUT over a live key held by another lease: the older turn ENDED with SUPERSEDED;
- PUT over a live key under the same lease (a registry from before immutable records): RENEWED;
  renewals now write nothing (a lease keep-alive), so watchers never hear of them;
- PUT of a live key: PUBLISHED, the whole record, to streams of every engine only
  (WatchAllRetentions, which starts with a snapshot of every live retention).

Events are routed by the engine named in the (previous) record. The watch resumes from the last
revision it saw when etcd comes back, so no ending is lost across an outage. When etcd no longer
has that history (compacted), events are lost: every open stream is then cut off (HistoryLost),
and its client watches again and re-checks what it holds (the sidecar verifies its book).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvferry.registry.errors import EtcdFailure, EtcdUnavailable
from kvferry.registry.etcd import (
    RECONNECT_BACKOFF,
    EtcdGateway,
    EventType,
    RevisionCompacted,
    WatchEvent,
    prefix_end,
)
from kvferry.registry.keys import ConversationKey, KeyLayout
from kvferry.registry.metrics import RegistryMetrics
from kvferry.registry.records import decode_record, decode_tombstone
from kvferry.runtime.backoff import Backoff
from kvferry.runtime.clock import Clock
from kvferry.runtime.errors import Aborted, ResourceExhausted
from kvferry.v1 import registry_service_pb2 as registry
from kvferry.v1 import resources_pb2 as resources

log = logging.getLogger(__name__)

# Events buffered per stream before it is cut off as too slow (the client re-watches).
SUBSCRIBER_QUEUE_SIZE = 10_000
# The subscription key of streams that follow every engine (ids never are empty).
ALL_ENGINES = ""
# A stream of every engine buffers more: it waits while its snapshot is sent.
ALL_ENGINES_QUEUE_SIZE = 200_000


@dataclass(frozen=True)
class RetentionEvent:
    type: registry.RetentionEventType.ValueType
    retention: resources.Retention
    reason: resources.ReleaseReason.ValueType
    end_time: float
    revision: int


class SubscriberTooSlow(ResourceExhausted):
    """The stream's consumer fell more than SUBSCRIBER_QUEUE_SIZE events behind."""


class HistoryLost(Aborted):
    """The hub's etcd watch resumed past compacted history: events of this stream may be missing."""


@dataclass(eq=False)
class Subscription:
    engine_id: str
    queue: asyncio.Queue[RetentionEvent | None] = field(
        default_factory=lambda: asyncio.Queue(maxsize=SUBSCRIBER_QUEUE_SIZE)
    )
    overflowed: bool = False
    # Set when the hub lost events (compacted history): the stream must be re-watched.
    lost_history: str | None = None

    def lose_history(self, why: str) -> None:
        if self.lost_history is None:
            self.lost_history = why
            with contextlib.suppress(asyncio.QueueFull):
                self.queue.put_nowait(None)

    def offer(self, event: RetentionEvent) -> None:
        if self.overflowed:
            return
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            self.overflowed = True
            # Make room for the wake-up marker so the consumer notices at once.
            self.queue.get_nowait()
            self.queue.put_nowait(None)

    async def events(self) -> AsyncIterator[RetentionEvent]:
        while True:
            event = await self.queue.get()
            if self.lost_history is not None:
                raise HistoryLost(self.lost_history)
            if event is None or self.overflowed:
                raise SubscriberTooSlow(
                    f"the watch of engine {self.engine_id} fell {SUBSCRIBER_QUEUE_SIZE} events behind; "
                    "watch again"
                )
            yield event


class RetentionEventHub:
    """Starts its etcd watch with the first subscriber and keeps it until closed."""

    def __init__(
        self, etcd: EtcdGateway, layout: KeyLayout, clock: Clock, *, metrics: RegistryMetrics | None = None
    ) -> None:
        self._etcd = etcd
        self._layout = layout
        self._clock = clock
        self._metrics = metrics if metrics is not None else RegistryMetrics()
        self._subscribers: dict[str, set[Subscription]] = {}
        self._task: asyncio.Task[None] | None = None
        self._start_lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def subscribe(self, engine_id: str) -> AsyncIterator[Subscription]:
        """Events of ``engine_id`` from now on. Raises EtcdUnavailable when etcd cannot be reached."""
        async with self._start_lock:
            if self._task is None or self._task.done():
                start = await self._etcd.current_revision() + 1
                self._task = asyncio.create_task(self._follow(start), name="retention-event-hub")
        async with self.attach(engine_id) as subscription:
            yield subscription

    @contextlib.asynccontextmanager
    async def attach(self, engine_id: str) -> AsyncIterator[Subscription]:
        """Receives what the hub dispatches for ``engine_id``, without starting its etcd watch."""
        size = ALL_ENGINES_QUEUE_SIZE if engine_id == ALL_ENGINES else SUBSCRIBER_QUEUE_SIZE
        subscription = Subscription(engine_id, asyncio.Queue(maxsize=size))
        self._subscribers.setdefault(engine_id, set()).add(subscription)
        try:
            yield subscription
        finally:
            peers = self._subscribers.get(engine_id)
            if peers is not None:
                peers.discard(subscription)
                if not peers:
                    del self._subscribers[engine_id]

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _follow(self, start_revision: int) -> None:
        revision = start_revision - 1
        backoff = Backoff(RECONNECT_BACKOFF)
        prefix = self._layout.retention_events
        while True:
            try:
                async for events in self._etcd.watch(prefix, prefix_end(prefix), start_revision=revision + 1):
                    backoff.reset()
                    revision = self._dispatch(events, revision)
            except (EtcdUnavailable, EtcdFailure) as error:
                log.warning(
                    "retention watch lost etcd; resuming", extra={"error": str(error), "revision": revision}
                )
                await backoff.wait()
            except RevisionCompacted as compacted:
                log.warning(
                    "retention watch resumed past compacted history; cutting off every stream to resync",
                    extra={"compact_revision": compacted.compact_revision, "revision": revision},
                )
                missed_from = revision + 1
                revision = await self._current_revision_or(revision)
                self._lose_history(
                    f"the registry's etcd watch lost history (compacted up to revision "
                    f"{compacted.compact_revision}; events from revision {missed_from} on may be missing): "
                    "watch again and re-check the retentions you hold"
                )
            except Exception:
                # A bug must not silence every watcher for good: log it and follow on.
                log.exception("retention watch failed; resuming", extra={"revision": revision})
                await backoff.wait()

    def _lose_history(self, why: str) -> None:
        for subscriptions in self._subscribers.values():
            for subscription in subscriptions:
                subscription.lose_history(why)

    async def _current_revision_or(self, fallback: int) -> int:
        try:
            return await self._etcd.current_revision()
        except EtcdUnavailable:
            return fallback

    def _dispatch(self, events: list[WatchEvent], revision: int) -> int:
        # A whole revision arrives in one response, the tombstone before the deletion it explains.
        tombstones: dict[tuple[ConversationKey, int], tuple[resources.ReleaseReason.ValueType, float]] = {}
        for event in events:
            revision = event.revision
            try:
                self._dispatch_one(event, revision, tombstones)
            except ValueError as error:  # includes protobuf's DecodeError
                log.error("undecodable retention record skipped", extra={"error": str(error)})
        return revision

    def _dispatch_one(
        self,
        event: WatchEvent,
        revision: int,
        tombstones: dict[tuple[ConversationKey, int], tuple[resources.ReleaseReason.ValueType, float]],
    ) -> None:
        layout = self._layout
        kv, prev_kv = event.kv, event.previous
        key = kv.key
        if key.startswith(layout.tombstones):
            if event.type is EventType.PUT:
                tombstones[(layout.conversation_of_tombstone(key), revision)] = decode_tombstone(kv.value)
            return
        if not key.startswith(layout.live_retentions):
            return
        if event.type is EventType.PUT and ALL_ENGINES in self._subscribers:
            published = decode_record(kv.value).retention
            unspecified = resources.RELEASE_REASON_UNSPECIFIED
            event_type = registry.RETENTION_EVENT_TYPE_PUBLISHED
            self._publish(RetentionEvent(event_type, published, unspecified, 0.0, revision), engines=False)
        if prev_kv is None:
            return  # a first publish: nothing ended, nothing renewed
        previous = decode_record(prev_kv.value).retention
        if event.type is EventType.DELETE:
            tombstone = tombstones.get((layout.conversation_of_live(key), revision))
            if tombstone is None:
                reason, end_time = resources.RELEASE_REASON_EXPIRED, self._clock.time()
                # No replica's transaction ended it (etcd did): the replica telling the engine counts it.
                if previous.engine_id in self._subscribers:
                    self._metrics.released(reason)
            else:
                reason, end_time = tombstone
            self._publish(
                RetentionEvent(registry.RETENTION_EVENT_TYPE_ENDED, previous, reason, end_time, revision)
            )
        elif prev_kv.lease == kv.lease:
            renewed = decode_record(kv.value).retention
            unspecified = resources.RELEASE_REASON_UNSPECIFIED
            self._publish(
                RetentionEvent(registry.RETENTION_EVENT_TYPE_RENEWED, renewed, unspecified, 0.0, revision)
            )
        else:
            successor = decode_record(kv.value).retention
            end_time = successor.publish_time.ToNanoseconds() / 1e9
            superseded = resources.RELEASE_REASON_SUPERSEDED
            self._publish(
                RetentionEvent(registry.RETENTION_EVENT_TYPE_ENDED, previous, superseded, end_time, revision)
            )

    def _publish(self, event: RetentionEvent, *, engines: bool = True) -> None:
        """To the streams of the retention's engine (unless not ``engines``) and of every engine."""
        if engines:
            for subscription in self._subscribers.get(event.retention.engine_id, ()):
                subscription.offer(event)
        for subscription in self._subscribers.get(ALL_ENGINES, ()):
            subscription.offer(event)
