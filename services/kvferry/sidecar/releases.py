"""What the sidecar knows about its engine's live retentions, and the fan-out of their renewals and
ends to the connector's WatchReleases streams.

One registry WatchRetentions stream per engine feeds every subscriber. Each subscriber first gets
a SYNC listing the retentions the registry still holds (verified with GetRetention whenever the
stream is (re)opened), followed by one RENEWED per live retention carrying its current expiry,
then the RENEWED/ENDED events as they come. Events are idempotent: a connector may see ENDED
for a request it never held, or twice.

Every event carries a registry revision. A SYNC carries the highest revision the sidecar has seen
when it is built; a retention is in the book from before its publish is sent, so every publish
that committed at or below that revision is listed unless it ended since. The connector therefore
never ends a retention acknowledged at a later revision because an older SYNC lacks it.

Renewals write nothing in the registry, so its stream never tells of them: a sweep re-checks each
retention once its lease's end as last known has passed. One still live comes back with its current
end (RENEWED to the connectors: the engine keeps its blocks and hears from the registry at least once
a lease); one gone is ENDED (an event missed while the stream was being reopened). So the book never
keeps a retention the registry dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvferry.runtime.backoff import Backoff, BackoffPolicy
from kvferry.runtime.clock import Clock
from kvferry.runtime.errors import ErrorKind
from kvferry.runtime.timestamps import from_timestamp, to_timestamp
from kvferry.sidecar.metrics import SidecarMetrics
from kvferry.sidecar.registry_link import RegistryApi, RegistryError, RetentionStream
from kvferry.v1 import registry_service_pb2 as registry_pb2
from kvferry.v1 import resources_pb2
from kvferry.v1 import sidecar_service_pb2 as sidecar_pb2

log = logging.getLogger("kvferry.sidecar.releases")

Event = sidecar_pb2.WatchReleasesResponse
SYNC = sidecar_pb2.RELEASE_EVENT_TYPE_SYNC
RENEWED = sidecar_pb2.RELEASE_EVENT_TYPE_RENEWED
ENDED = sidecar_pb2.RELEASE_EVENT_TYPE_ENDED


@dataclass
class TrackedRetention:
    tenant: str
    conversation_id: str
    engine_request_id: str
    num_blocks: int
    # Wall-clock seconds; None until the registry confirmed it (a publish whose outcome is unknown).
    expire_time: float | None
    # Publishes of it in flight: until they settle, no lookup may judge it gone.
    publishing: int = 0


class RetentionBook:
    """Live retentions of one engine by engine request id, plus a memory of recent ends."""

    def __init__(
        self, on_change: Callable[[], None] = lambda: None, ended_memory: int = 10_000, witnesses: int = 16
    ) -> None:
        self._entries: dict[str, TrackedRetention] = {}
        # Ends seen recently, with their revision: a late RENEWED must not bring one back, nor a
        # second ENDED repeat it.
        self._ended: OrderedDict[str, int] = OrderedDict()
        self._ended_memory = ended_memory
        # The latest ends of tracked retentions, whole: after an outage the registry must not serve
        # any of them again (etcd restored from an older snapshot would).
        self._witnesses: deque[registry_pb2.EndedRetention] = deque(maxlen=witnesses)
        self._on_change = on_change

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, engine_request_id: object) -> bool:
        return engine_request_id in self._entries

    def get(self, engine_request_id: str) -> TrackedRetention | None:
        return self._entries.get(engine_request_id)

    def entries(self) -> list[TrackedRetention]:
        return list(self._entries.values())

    @property
    def retained_blocks(self) -> int:
        return sum(entry.num_blocks for entry in self._entries.values())

    def has_ended(self, engine_request_id: str) -> bool:
        return engine_request_id in self._ended

    def track(
        self, retention: resources_pb2.Retention, *, confirmed: bool = True, publishing: bool = False
    ) -> TrackedRetention:
        """Tracks a retention the registry holds (or, unconfirmed, may hold).

        Tracking always wins over a remembered end: a request id published again is live again,
        and keeping too much only delays a free until the sweep, never frees early.
        """
        request_id = retention.engine_request_id
        self._ended.pop(request_id, None)
        expire = (
            from_timestamp(retention.expire_time) if confirmed and retention.HasField("expire_time") else None
        )
        entry = self._entries.get(request_id)
        if entry is None:
            entry = TrackedRetention(
                tenant=retention.tenant,
                conversation_id=retention.conversation_id,
                engine_request_id=request_id,
                num_blocks=len(retention.block_ids),
                expire_time=expire,
            )
            self._entries[request_id] = entry
        elif expire is not None:
            entry.expire_time = expire
        if publishing:
            entry.publishing += 1
        self._on_change()
        return entry

    def published(
        self,
        engine_request_id: str,
        stored: resources_pb2.Retention | None,
        *,
        revision: int = 0,
        may_have_landed: bool = False,
    ) -> None:
        """A publish of it settled: ``stored`` as the registry holds it; None when it was refused, or
        when its outcome is unknown (``may_have_landed``: kept, unconfirmed, until a sweep settles it)."""
        entry = self._entries.get(engine_request_id)
        if entry is None:
            # It ended while its publish was under way; a publish that landed after that end
            # (``revision`` newer) made it live again.
            if stored is not None and self._ended.get(engine_request_id, 0) < revision:
                self.track(stored)
            return
        entry.publishing = max(0, entry.publishing - 1)
        if stored is not None:
            self.track(stored)
        elif not may_have_landed and entry.publishing == 0 and entry.expire_time is None:
            # Refused, and never confirmed: the registry does not hold it.
            self._entries.pop(engine_request_id)
            self._on_change()

    def end(self, engine_request_id: str, revision: int = 0) -> TrackedRetention | None:
        """Forgets a retention that ended (at registry ``revision``); returns what was tracked, if any."""
        self._ended[engine_request_id] = revision
        self._ended.move_to_end(engine_request_id)
        while len(self._ended) > self._ended_memory:
            self._ended.popitem(last=False)
        entry = self._entries.pop(engine_request_id, None)
        if entry is not None:
            if revision > 0:
                self._witnesses.append(
                    registry_pb2.EndedRetention(
                        tenant=entry.tenant,
                        conversation_id=entry.conversation_id,
                        engine_request_id=engine_request_id,
                        end_revision=revision,
                    )
                )
            self._on_change()
        return entry

    def recent_ends(self) -> list[registry_pb2.EndedRetention]:
        """The latest ends of retentions this book tracked (at most ``witnesses``), newest last."""
        return list(self._witnesses)

    def drop_recent_end(self, ended: registry_pb2.EndedRetention) -> None:
        """Forgets ``ended`` as a witness: once used as evidence it is not used again."""
        if ended in self._witnesses:
            self._witnesses.remove(ended)

    def snapshot(self, revision: int) -> list[Event]:
        """SYNC with every live id (as of registry ``revision``), then a RENEWED per confirmed one
        carrying its expiry."""
        ids = sorted(self._entries)
        events = [Event(type=SYNC, live_engine_request_ids=ids, revision=revision)]
        for request_id in ids:
            expire = self._entries[request_id].expire_time
            if expire is not None:
                events.append(
                    Event(
                        type=RENEWED,
                        engine_request_id=request_id,
                        expire_time=to_timestamp(expire),
                        revision=revision,
                    )
                )
        return events


class Subscription:
    """One WatchReleases stream's queue. Past ``limit`` queued events (a stuck reader) the queue is
    replaced by a fresh snapshot: SYNC plus RENEWED says everything the dropped events said."""

    def __init__(self, limit: int, snapshot: Callable[[], list[Event] | None]) -> None:
        self._limit = limit
        self._snapshot = snapshot
        self._items: deque[Event] = deque()
        self._ready = asyncio.Event()
        self._closed = False
        self.compactions = 0

    def push(self, events: Iterable[Event]) -> None:
        if self._closed:
            return
        self._items.extend(events)
        if len(self._items) > self._limit:
            fresh = self._snapshot()
            self._items.clear()
            if fresh is not None:
                self._items.extend(fresh)
            self.compactions += 1
        self._ready.set()

    def close(self) -> None:
        self._closed = True
        self._ready.set()

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        while not self._items:
            if self._closed:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()


class RegistrationView(Protocol):
    """What the fan-out needs from the engine's registration."""

    async def wait_registered(self) -> int: ...

    async def wait_lapsed(self, generation: int) -> None: ...

    def served_after_end(self, ended: registry_pb2.EndedRetention) -> None:
        """The registry serves a retention the engine ended: etcd went back in time."""


@dataclass(frozen=True)
class FanoutSettings:
    backoff: BackoffPolicy = field(default_factory=BackoffPolicy)
    # Seconds between sweeps of retentions past their expiry without news.
    sweep_interval_seconds: float = 5.0
    # Slack after expiry before a retention counts as "past expiry without news".
    sweep_grace_seconds: float = 1.0
    # Queued events per subscriber before its queue is compacted into a snapshot.
    subscriber_queue_limit: int = 10_000
    # Concurrent GetRetention calls when verifying the book.
    verify_concurrency: int = 32


class ReleaseFanout:
    """Keeps one WatchRetentions stream for the engine and relays it to every subscriber."""

    def __init__(
        self,
        engine_id: str,
        registry: RegistryApi,
        registration: RegistrationView,
        book: RetentionBook,
        clock: Clock,
        metrics: SidecarMetrics,
        settings: FanoutSettings,
    ) -> None:
        self.engine_id = engine_id
        self._registry = registry
        self._registration = registration
        self.book = book
        self._clock = clock
        self._metrics = metrics
        self._settings = settings
        self._subscribers: set[Subscription] = set()
        self.synced = False
        self._verify_lock = asyncio.Lock()
        self._outage_logged = False

    # ---- subscribers -------------------------------------------------------------------------

    def subscribe(self) -> Subscription:
        subscription = Subscription(self._settings.subscriber_queue_limit, self._snapshot_if_synced)
        self._subscribers.add(subscription)
        self._metrics.release_subscribers.set(len(self._subscribers))
        if self.synced:
            subscription.push(self._snapshot())
        # Otherwise the SYNC comes when the stream to the registry is (re)established.
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        subscription.close()
        self._subscribers.discard(subscription)
        self._metrics.release_subscribers.set(len(self._subscribers))

    def close_all(self) -> None:
        for subscription in list(self._subscribers):
            self.unsubscribe(subscription)

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)

    def _snapshot(self) -> list[Event]:
        return self.book.snapshot(self._registry.revision)

    def _snapshot_if_synced(self) -> list[Event] | None:
        return self._snapshot() if self.synced else None

    def _broadcast(self, events: Sequence[Event]) -> None:
        for subscription in self._subscribers:
            subscription.push(events)

    # ---- what other parts tell the fan-out -----------------------------------------------------

    def engine_gone(self) -> None:
        """The engine was deregistered: every retention it had ended with ENGINE_GONE."""
        reason = resources_pb2.RELEASE_REASON_ENGINE_GONE
        revision = self._registry.revision
        events = []
        for entry in self.book.entries():
            self.book.end(entry.engine_request_id, revision)
            self._metrics.release(reason)
            events.append(
                Event(type=ENDED, engine_request_id=entry.engine_request_id, reason=reason, revision=revision)
            )
        if events:
            log.info("engine gone: ended its retentions", extra={"count": len(events)})
        self._broadcast(events)

    # ---- the stream --------------------------------------------------------------------------

    async def run(self) -> None:
        backoff = Backoff(self._settings.backoff)
        while True:
            generation = await self._registration.wait_registered()
            stream = self._registry.watch_retentions(self.engine_id)
            self._metrics.watch_reconnects.inc()
            relay = asyncio.create_task(self._relay(stream, backoff), name="kvferry-sidecar-relay")
            lapse = asyncio.create_task(
                self._registration.wait_lapsed(generation), name="kvferry-sidecar-lapse"
            )
            try:
                await asyncio.wait({relay, lapse}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                self.synced = False
                for task in (relay, lapse):
                    task.cancel()
                stream.cancel()
                await asyncio.gather(relay, lapse, return_exceptions=True)
            if lapse.done() and not lapse.cancelled():
                log.info("registration changed: re-syncing releases", extra={"engine_id": self.engine_id})
                continue
            error = relay.exception() if relay.done() and not relay.cancelled() else None
            delay = backoff.next_delay()
            # One warning per outage; the retries in between only at debug level.
            log.log(
                logging.DEBUG if self._outage_logged else logging.WARNING,
                "registry WatchRetentions stream broke; reconnecting",
                extra={"engine_id": self.engine_id, "error": str(error), "retry_in_seconds": round(delay, 3)},
            )
            self._outage_logged = True
            await self._clock.sleep(delay)

    async def _relay(self, stream: RetentionStream, backoff: Backoff) -> None:
        events = aiter(stream)
        # Verify only once the watch is in place, so no ending falls between the two.
        await stream.ready()
        await self.verify(self.book.entries(), announce=False)
        await self._check_recent_ends()
        self.synced = True
        self._broadcast(self._snapshot())
        log.info(
            "releases in sync with the registry", extra={"engine_id": self.engine_id, "live": len(self.book)}
        )
        self._outage_logged = False
        backoff.reset()
        async for event in events:
            self.apply(event)

    def apply(self, event: registry_pb2.WatchRetentionsResponse) -> None:
        retention = event.retention
        request_id = retention.engine_request_id
        if retention.engine_id and retention.engine_id != self.engine_id:
            return
        revision = event.header.revision
        if event.type == registry_pb2.RETENTION_EVENT_TYPE_RENEWED:
            if self.book.has_ended(request_id):
                return  # a renewal that raced the end
            self.book.track(retention)
            self._broadcast(
                [
                    Event(
                        type=RENEWED,
                        engine_request_id=request_id,
                        expire_time=retention.expire_time,
                        revision=revision,
                    )
                ]
            )
        elif event.type == registry_pb2.RETENTION_EVENT_TYPE_ENDED:
            self.end(request_id, event.reason, revision)

    def end(self, request_id: str, reason: resources_pb2.ReleaseReason.ValueType, revision: int) -> None:
        """The registry ended ``request_id`` at ``revision``: forget it and tell every connector once."""
        if self.book.has_ended(request_id):
            return  # already told (e.g. ENGINE_GONE the sidecar announced itself)
        self.book.end(request_id, revision)
        self._metrics.release(reason)
        self._broadcast([Event(type=ENDED, engine_request_id=request_id, reason=reason, revision=revision)])

    # ---- verification ------------------------------------------------------------------------

    async def verify(self, entries: Sequence[TrackedRetention], *, announce: bool) -> None:
        """Asks the registry about each entry; drops the ones it no longer holds.

        ``announce`` sends ENDED/RENEWED for what changed (the sweep); a re-sync does not need to,
        since the SYNC that follows it says the same. Transient errors raise RegistryError.
        """
        semaphore = asyncio.Semaphore(self._settings.verify_concurrency)

        async def check(entry: TrackedRetention) -> None:
            async with semaphore:
                await self._verify_one(entry, announce)

        async with self._verify_lock:
            # A retention whose publish is in flight may not be in the registry yet: not judged.
            await asyncio.gather(*(check(entry) for entry in entries if not entry.publishing))

    async def _verify_one(self, entry: TrackedRetention, announce: bool) -> None:
        try:
            found = await self._registry.get_retention(entry.tenant, entry.conversation_id)
        except RegistryError as err:
            if err.kind is not ErrorKind.NOT_FOUND:
                raise
            live, revision = None, self._registry.revision
        else:
            live, revision = found.retention, found.header.revision
        if self.book.get(entry.engine_request_id) is not entry or entry.publishing:
            return  # an event or a publish of it came meanwhile; that is newer news
        if live is not None and live.engine_request_id == entry.engine_request_id:
            renewed = live.HasField("expire_time") and entry.expire_time != from_timestamp(live.expire_time)
            self.book.track(live)
            if announce and renewed:
                self._broadcast(
                    [
                        Event(
                            type=RENEWED,
                            engine_request_id=entry.engine_request_id,
                            expire_time=live.expire_time,
                            revision=revision,
                        )
                    ]
                )
            return
        if live is not None:
            reason = resources_pb2.RELEASE_REASON_SUPERSEDED
        elif entry.expire_time is not None and entry.expire_time <= self._clock.time():
            reason = resources_pb2.RELEASE_REASON_EXPIRED
        else:
            reason = resources_pb2.RELEASE_REASON_UNSPECIFIED
        if announce:
            self.end(entry.engine_request_id, reason, revision)
        else:
            self.book.end(entry.engine_request_id, revision)
            self._metrics.release(reason)

    async def _check_recent_ends(self) -> None:
        """After (re)connecting: asks for the latest retentions this engine ended (at once, as ``verify``
        does). The registry serving one again means etcd went back in time (restored), even where its
        revision has since moved past everything this sidecar saw; the registration takes it from there."""
        semaphore = asyncio.Semaphore(self._settings.verify_concurrency)

        async def served_again(ended: registry_pb2.EndedRetention) -> bool:
            async with semaphore:
                try:
                    found = await self._registry.get_retention(ended.tenant, ended.conversation_id)
                except RegistryError as err:
                    if err.kind is not ErrorKind.NOT_FOUND:
                        raise
                    return False
            live = found.retention
            return live.engine_id == self.engine_id and live.engine_request_id == ended.engine_request_id

        recent = self.book.recent_ends()
        answers = await asyncio.gather(*(served_again(ended) for ended in recent))
        for ended, again in zip(recent, answers, strict=True):
            if again:
                self.book.drop_recent_end(ended)
                self._registration.served_after_end(ended)
                return

    async def sweep_forever(self) -> None:
        while True:
            await self._clock.sleep(self._settings.sweep_interval_seconds)
            try:
                await self.sweep()
            except RegistryError as err:
                log.info("sweep deferred: registry unreachable", extra={"error": str(err)})

    async def sweep(self) -> int:
        """Verifies retentions past their expiry (or never confirmed); returns how many it checked."""
        if not self.synced:
            return 0
        cutoff = self._clock.time() - self._settings.sweep_grace_seconds
        stale = [e for e in self.book.entries() if e.expire_time is None or e.expire_time < cutoff]
        if stale:
            await self.verify(stale, announce=True)
        return len(stale)
