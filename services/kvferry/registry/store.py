"""The registry's domain logic over etcd: engines under engine leases, retentions under their own.

Plain Python with typed methods; the gRPC handlers only translate messages. Every multi-key
change is one etcd transaction, guarded by compares so a concurrent change is never
overwritten half-way. The release reason survives the deletion of a retention's key as a
tombstone written in the same transaction (see ``keys`` and ``events``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp
from kvferry.common.ids import check_id
from kvferry.registry import validation
from kvferry.registry.batching import TxnBatcher, TxnResult
from kvferry.registry.cache import RetentionCache
from kvferry.registry.config import TtlPolicy
from kvferry.registry.errors import (
    Conflict,
    EtcdFailure,
    EtcdUnavailable,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    RegistryError,
)
from kvferry.registry.etcd import (
    EVENT_DELETE,
    EVENT_PUT,
    EtcdGateway,
    LeaseNotFound,
    RevisionCompacted,
    cmp_lease,
    cmp_mod_revision,
    op_delete,
    op_put,
    op_range,
    op_txn,
    prefix_end,
)
from kvferry.registry.keys import ConversationKey, KeyLayout
from kvferry.registry.metrics import LEASE_ENGINE, LEASE_RETENTION, RegistryMetrics
from kvferry.registry.records import (
    StoredRetention,
    decode_incarnation,
    decode_record,
    encode_incarnation,
    encode_record,
    encode_tombstone,
)
from kvferry.v1 import registry_service_pb2 as registry
from kvferry.v1 import resources_pb2 as resources

log = logging.getLogger(__name__)

Clock = Callable[[], float]

# Optimistic transactions retry this often before answering ABORTED.
_TXN_ATTEMPTS = 4
# Retentions ended per reaping transaction (each is a nested transaction of 3 operations;
# etcd allows 128 operations per level by default).
_REAP_BATCH = 32
_REAP_PAGE = 512
_MAX_BACKOFF_SECONDS = 2.0
# Records kept in memory to answer lookups and renewals in one etcd round trip.
DEFAULT_CACHE_BYTES = 64 * 1024 * 1024


def timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def _role_matches(wanted: resources.EngineRole.ValueType, role: resources.EngineRole.ValueType) -> bool:
    if wanted == resources.ENGINE_ROLE_UNSPECIFIED or wanted == role:
        return True
    return role == resources.ENGINE_ROLE_BOTH and wanted in (
        resources.ENGINE_ROLE_PREFILL,
        resources.ENGINE_ROLE_DECODE,
    )


def _parse_engine(value: bytes) -> resources.Engine:
    engine = resources.Engine()
    engine.ParseFromString(value)
    return engine


def encode_page_token(engine_id: str) -> str:
    return base64.urlsafe_b64encode(engine_id.encode()).decode()


def decode_page_token(token: str) -> str:
    try:
        engine_id = base64.urlsafe_b64decode(token.encode()).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        engine_id = ""
    if check_id("page_token", engine_id) is not None:
        raise InvalidArgument("page_token is not one this registry issued; list again without it")
    return engine_id


@dataclass(frozen=True)
class RegisteredEngine:
    engine: resources.Engine
    ttl_seconds: int
    revision: int


@dataclass(frozen=True)
class EnginePage:
    engines: list[resources.Engine]
    next_page_token: str
    revision: int


@dataclass(frozen=True)
class EngineEvent:
    type: registry.EngineEventType.ValueType
    engine: resources.Engine
    revision: int


@dataclass(frozen=True)
class PublishedRetention:
    retention: resources.Retention
    superseded_turn: int
    revision: int
    # The lease holding it (0 when an identical retry returned the stored retention).
    lease: int = 0


@dataclass(frozen=True)
class FoundRetention:
    retention: resources.Retention
    revision: int


class Backoff:
    """Growing pauses between reconnect attempts (0.1 s doubling to a cap)."""

    def __init__(self, first: float = 0.1, cap: float = _MAX_BACKOFF_SECONDS) -> None:
        self._first = first
        self._cap = cap
        self._next = first

    def reset(self) -> None:
        self._next = self._first

    async def wait(self) -> None:
        await asyncio.sleep(self._next)
        self._next = min(self._next * 2, self._cap)


class RegistryStore:
    """Engines and retentions in etcd, with the registry's rules."""

    def __init__(
        self,
        etcd: EtcdGateway,
        layout: KeyLayout,
        ttl: TtlPolicy,
        *,
        clock: Clock = time.time,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        metrics: RegistryMetrics | None = None,
    ) -> None:
        self.etcd = etcd
        self.layout = layout
        self.ttl = ttl
        self._clock = clock
        self._metrics = metrics if metrics is not None else RegistryMetrics()
        self._cache = RetentionCache(cache_bytes)
        # The hot paths (publish, lookup, renew) share etcd calls when they arrive together.
        self._reads = TxnBatcher(etcd)
        self._writes = TxnBatcher(etcd)

    # --- engines ----------------------------------------------------------------------------

    async def register_engine(self, engine: resources.Engine, ttl_seconds: int) -> RegisteredEngine:
        """Stores ``engine`` under a fresh lease; a previous incarnation's retentions end."""
        validation.validate_engine(engine)
        ttl = validation.engine_ttl(ttl_seconds, self.ttl)
        lease, granted = await self.etcd.grant(ttl)
        stored = resources.Engine()
        stored.CopyFrom(engine)
        stored.name = f"engines/{engine.engine_id}"
        stored.register_time.CopyFrom(timestamp(self._clock()))
        key = self.layout.engine(engine.engine_id)
        response = await self.etcd.txn([], [op_put(key, stored.SerializeToString(), lease, prev_kv=True)])
        previous = response.responses[0].response_put.prev_kv
        log.info(
            "engine registered",
            extra={
                "engine_id": engine.engine_id,
                "ttl_seconds": granted,
                "re_registered": bool(previous.key),
            },
        )
        if previous.key and previous.lease != lease:
            # A new incarnation (e.g. the engine restarted): what the old one retained is gone.
            await self._best_effort(self.etcd.revoke(previous.lease), "revoke old engine lease")
            await self._best_effort(self.reap_engine(engine.engine_id), "reap old incarnation")
        return RegisteredEngine(stored, granted, int(response.header.revision))

    async def heartbeat_engine(self, engine_id: str, stats: resources.EngineStats | None) -> tuple[int, int]:
        """Renews the engine's lease (and stores fresh stats): (TTL left, revision)."""
        validation.require_id("engine_id", engine_id)
        key = self.layout.engine(engine_id)
        response = await self.etcd.range(key)
        if not response.kvs:
            raise self._engine_not_registered(engine_id)
        kv = response.kvs[0]
        try:
            ttl_left, revision = await self.etcd.keep_alive_once(kv.lease)
        except LeaseNotFound:
            raise self._engine_not_registered(engine_id) from None
        self._metrics.lease_renewed(LEASE_ENGINE)
        if stats is not None:
            engine = _parse_engine(kv.value)
            engine.stats.CopyFrom(stats)
            try:
                update = await self.etcd.txn(
                    [cmp_lease(key, kv.lease)], [op_put(key, engine.SerializeToString(), kv.lease)]
                )
            except LeaseNotFound:
                raise self._engine_not_registered(engine_id) from None
            if not update.succeeded:
                raise self._engine_not_registered(engine_id)
            revision = int(update.header.revision)
        return ttl_left, revision

    async def deregister_engine(self, engine_id: str) -> int:
        """Removes the engine now; its retentions end with ENGINE_GONE before this returns."""
        validation.require_id("engine_id", engine_id)
        key = self.layout.engine(engine_id)
        response = await self.etcd.range(key)
        if not response.kvs:
            raise self._engine_not_registered(engine_id)
        lease = response.kvs[0].lease
        deleted = await self.etcd.txn([cmp_lease(key, lease)], [op_delete(key)])
        if not deleted.succeeded:
            raise Conflict(f"engine {engine_id} re-registered while it was being removed; deregister again")
        await self._best_effort(self.etcd.revoke(lease), "revoke engine lease")
        await self.reap_engine(engine_id)
        log.info("engine deregistered", extra={"engine_id": engine_id})
        return int(deleted.header.revision)

    async def list_engines(
        self, role: resources.EngineRole.ValueType, page_size: int, page_token: str
    ) -> EnginePage:
        size = validation.page_size(page_size)
        start = self.layout.engines
        if page_token:
            start = self.layout.engine(decode_page_token(page_token)) + b"\0"
        end = prefix_end(self.layout.engines)
        matches: list[resources.Engine] = []
        revision = 0
        while len(matches) <= size:
            response = await self.etcd.range(start, end, limit=size + 1)
            revision = revision or int(response.header.revision)
            for kv in response.kvs:
                engine = _parse_engine(kv.value)
                if _role_matches(role, engine.role):
                    matches.append(engine)
            if not response.more or not response.kvs:
                break
            start = response.kvs[-1].key + b"\0"
        page = matches[:size]
        token = encode_page_token(page[-1].engine_id) if len(matches) > size else ""
        return EnginePage(page, token, revision)

    async def watch_engines(self) -> AsyncIterator[EngineEvent]:
        """The live engines as JOINED, then every change; survives etcd outages by resuming."""
        known: dict[str, int] = {}
        revision = 0
        listing = await self._list_all_engines()
        for engine, lease, revision in listing:
            known[engine.engine_id] = lease
            yield EngineEvent(registry.ENGINE_EVENT_TYPE_JOINED, engine, revision)
        if not listing:
            revision = await self.etcd.current_revision()
        backoff = Backoff()
        while True:
            try:
                async for response in self.etcd.watch(
                    self.layout.engines, prefix_end(self.layout.engines), start_revision=revision + 1
                ):
                    backoff.reset()
                    for event in response.events:
                        revision = int(event.kv.mod_revision)
                        yield self._engine_event(event, known, revision)
            except (EtcdUnavailable, EtcdFailure) as error:
                # A restarting etcd can also fail a watch with INTERNAL; resuming is always safe.
                log.warning(
                    "engine watch lost etcd; resuming", extra={"error": str(error), "revision": revision}
                )
                await backoff.wait()
            except RevisionCompacted:
                async for event in self._resync_engines(known):
                    revision = event.revision
                    yield event
                revision = revision or await self.etcd.current_revision()

    def _engine_event(self, event: Any, known: dict[str, int], revision: int) -> EngineEvent:
        engine_id = self.layout.engine_id_of(event.kv.key)
        if event.type == EVENT_DELETE:
            known.pop(engine_id, None)
            engine = (
                _parse_engine(event.prev_kv.value)
                if event.prev_kv.key
                else resources.Engine(engine_id=engine_id)
            )
            engine.name = f"engines/{engine_id}"
            return EngineEvent(registry.ENGINE_EVENT_TYPE_LEFT, engine, revision)
        previous_lease = known.get(engine_id)
        known[engine_id] = int(event.kv.lease)
        kind = (
            registry.ENGINE_EVENT_TYPE_UPDATED
            if previous_lease == event.kv.lease
            else registry.ENGINE_EVENT_TYPE_JOINED
        )
        return EngineEvent(kind, _parse_engine(event.kv.value), revision)

    async def _resync_engines(self, known: dict[str, int]) -> AsyncIterator[EngineEvent]:
        listing = await self._list_all_engines()
        live = {engine.engine_id: (engine, lease, revision) for engine, lease, revision in listing}
        revision = listing[0][2] if listing else await self.etcd.current_revision()
        for engine_id in sorted(set(known) - set(live)):
            known.pop(engine_id)
            yield EngineEvent(
                registry.ENGINE_EVENT_TYPE_LEFT,
                resources.Engine(engine_id=engine_id, name=f"engines/{engine_id}"),
                revision,
            )
        for engine_id, (engine, lease, _) in live.items():
            if known.get(engine_id) != lease:
                known[engine_id] = lease
                yield EngineEvent(registry.ENGINE_EVENT_TYPE_JOINED, engine, revision)

    async def _list_all_engines(self) -> list[tuple[resources.Engine, int, int]]:
        response = await self.etcd.range(self.layout.engines, prefix_end(self.layout.engines))
        revision = int(response.header.revision)
        return [(_parse_engine(kv.value), int(kv.lease), revision) for kv in response.kvs]

    @staticmethod
    def _engine_not_registered(engine_id: str) -> NotFound:
        return NotFound(
            f"engine {engine_id} is not registered (its lease ended or it left); call RegisterEngine again"
        )

    # --- retentions -------------------------------------------------------------------------

    async def publish_retention(self, retention: resources.Retention) -> PublishedRetention:
        """Stores a conversation's retention under its own lease, superseding an older turn atomically."""
        conversation = validation.validate_retention_shape(retention)
        ttl = validation.retention_ttl(retention.ttl_seconds, self.ttl)
        # The lease is granted while the current state is read: one round trip less per publish.
        grant = asyncio.ensure_future(self.etcd.grant(ttl))
        published: PublishedRetention | None = None
        try:
            for _ in range(_TXN_ATTEMPTS):
                published = await self._try_publish(retention, conversation, grant)
                if published is not None:
                    if published.superseded_turn:
                        self._metrics.released(resources.RELEASE_REASON_SUPERSEDED)
                    return published
        finally:
            await self._drop_unused_lease(grant, published)
        raise Conflict(
            f"conversation {conversation.conversation_id} changed concurrently {_TXN_ATTEMPTS} times while "
            "publishing; retry"
        )

    async def _drop_unused_lease(
        self, grant: asyncio.Future[tuple[int, int]], published: PublishedRetention | None
    ) -> None:
        if not grant.done():
            grant.cancel()
            with contextlib.suppress(asyncio.CancelledError, RegistryError):
                await grant
            return
        if grant.cancelled() or grant.exception() is not None:
            return
        lease, _ = grant.result()
        if published is None or published.lease != lease:
            await self._best_effort(self.etcd.revoke(lease), "revoke unused lease")

    async def _try_publish(
        self,
        retention: resources.Retention,
        conversation: ConversationKey,
        grant: asyncio.Future[tuple[int, int]],
    ) -> PublishedRetention | None:
        """One optimistic attempt; None when a concurrent change won and the caller should retry."""
        engine_key = self.layout.engine(retention.engine_id)
        live_key = self.layout.live(conversation)
        snapshot = await self._reads.txn([], [op_range(engine_key), op_range(live_key)])
        engine_kvs = snapshot.responses[0].response_range.kvs
        live_kvs = snapshot.responses[1].response_range.kvs
        if not engine_kvs:
            raise FailedPrecondition(
                f"engine {retention.engine_id} is not registered; register it (RegisterEngine) before "
                "publishing its retentions"
            )
        engine_kv = engine_kvs[0]
        incarnation = int(engine_kv.lease)
        validation.validate_against_engine(retention, _parse_engine(engine_kv.value))
        superseded_turn = 0
        operations = []
        live_revision = 0
        if live_kvs:
            live_revision = int(live_kvs[0].mod_revision)
            current = decode_record(live_kvs[0].value)
            if current.retention.turn >= retention.turn:
                if (
                    self._is_same_publish(current.retention, retention)
                    and current.engine_incarnation == incarnation
                ):
                    return PublishedRetention(current.retention, 0, snapshot.revision)
                raise FailedPrecondition(
                    f"conversation {conversation.conversation_id} of tenant {conversation.tenant} "
                    f"already retains turn {current.retention.turn} "
                    f"(engine {current.retention.engine_id}); turn {retention.turn} is not newer. "
                    "Publish turns in increasing order; a retry of the same turn must repeat its "
                    "engine_id and engine_request_id"
                )
            superseded_turn = int(current.retention.turn)
            if current.retention.engine_id != retention.engine_id:
                operations.append(
                    op_delete(self.layout.engine_index(current.retention.engine_id, conversation))
                )
        lease, granted = await grant
        now = self._clock()
        stored = resources.Retention()
        stored.CopyFrom(retention)
        stored.name = conversation.name
        stored.ttl_seconds = granted
        stored.publish_time.CopyFrom(timestamp(now))
        stored.expire_time.CopyFrom(timestamp(now + granted))
        index_key = self.layout.engine_index(retention.engine_id, conversation)
        operations[:0] = [
            op_put(live_key, encode_record(stored, incarnation), lease),
            op_put(index_key, encode_incarnation(incarnation), lease),
        ]
        committed = await self._writes.txn(
            [cmp_lease(engine_key, incarnation), cmp_mod_revision(live_key, live_revision)], operations
        )
        if not committed.succeeded:
            return None
        revision = committed.revision
        self._cache.put(
            live_key,
            StoredRetention(stored, incarnation),
            lease,
            revision,
            len(operations[0].request_put.value),
        )
        return PublishedRetention(stored, superseded_turn, revision, lease)

    @staticmethod
    def _is_same_publish(current: resources.Retention, incoming: resources.Retention) -> bool:
        return (
            current.turn == incoming.turn
            and current.engine_id == incoming.engine_id
            and current.engine_request_id == incoming.engine_request_id
        )

    async def get_retention(self, tenant: str, conversation_id: str) -> FoundRetention:
        """The conversation's live retention; NOT_FOUND unless its lease and its engine are both alive.

        One round trip when this registry knows the record: a transaction compares the record's
        revision and the engine's lease, and reads both only when either changed.
        """
        conversation = validation.conversation_key(tenant, conversation_id)
        live_key = self.layout.live(conversation)
        cached = self._cache.get(live_key)
        if cached is not None:
            engine_key = self.layout.engine(cached.stored.retention.engine_id)
            checked = await self._reads.txn(
                [
                    cmp_mod_revision(live_key, cached.mod_revision),
                    cmp_lease(engine_key, cached.stored.engine_incarnation),
                ],
                [],
                [op_range(live_key), op_range(engine_key)],
            )
            if checked.succeeded:
                return self._unexpired(conversation, cached.stored, checked.revision)
            live_kvs = checked.responses[0].response_range.kvs
            engine_kvs = checked.responses[1].response_range.kvs
            revision = checked.revision
        else:
            read = await self._reads.txn([], [op_range(live_key)])
            live_kvs, engine_kvs, revision = read.responses[0].response_range.kvs, None, read.revision
        if not live_kvs:
            self._cache.drop(live_key)
            raise self._no_retention(conversation)
        live_kv = live_kvs[0]
        stored = decode_record(live_kv.value)
        self._cache.put(live_key, stored, int(live_kv.lease), int(live_kv.mod_revision), len(live_kv.value))
        if (
            engine_kvs is None
            or cached is None
            or cached.stored.retention.engine_id != stored.retention.engine_id
        ):
            engine = await self._reads.txn([], [op_range(self.layout.engine(stored.retention.engine_id))])
            engine_kvs, revision = engine.responses[0].response_range.kvs, engine.revision
        if not engine_kvs or engine_kvs[0].lease != stored.engine_incarnation:
            raise NotFound(
                f"conversation {conversation_id} of tenant {tenant} was retained on engine "
                f"{stored.retention.engine_id}, which left the registry; recompute"
            )
        return self._unexpired(conversation, stored, revision)

    def _unexpired(
        self, conversation: ConversationKey, stored: StoredRetention, revision: int
    ) -> FoundRetention:
        # etcd deletes an expired lease's keys up to ~0.5 s late; never hand out one past its end.
        if stored.retention.expire_time.ToNanoseconds() <= self._clock() * 1e9:
            raise self._no_retention(conversation)
        retention = resources.Retention()
        retention.CopyFrom(stored.retention)
        return FoundRetention(retention, revision)

    async def renew_retention(self, tenant: str, conversation_id: str) -> FoundRetention:
        """Extends the retention's lease and records the new expiry (watchers see RENEWED).

        One round trip (a keep-alive and a guarded re-put, sent together) when this registry
        knows the record; a read first otherwise.
        """
        conversation = validation.conversation_key(tenant, conversation_id)
        live_key = self.layout.live(conversation)
        cached = self._cache.get(live_key)
        if cached is not None:
            renewed = await self._renew_once(conversation, live_key, cached.stored, cached.lease)
            if renewed is not None:
                return renewed
            self._cache.drop(live_key)
        response = await self.etcd.range(live_key)
        if not response.kvs:
            raise self._no_retention(conversation)
        kv = response.kvs[0]
        renewed = await self._renew_once(conversation, live_key, decode_record(kv.value), int(kv.lease))
        if renewed is None:
            raise NotFound(
                f"conversation {conversation_id} of tenant {tenant} has no retention to renew: it was "
                "superseded, released, or its engine left; recompute"
            )
        return renewed

    async def _renew_once(
        self, conversation: ConversationKey, live_key: bytes, stored: StoredRetention, lease: int
    ) -> FoundRetention | None:
        """Renews ``lease`` and re-puts the record if it still holds the conversation; else None."""
        retention = resources.Retention()
        retention.CopyFrom(stored.retention)
        # A keep-alive restores the granted TTL; the record says so.
        retention.expire_time.CopyFrom(timestamp(self._clock() + retention.ttl_seconds))
        engine_key = self.layout.engine(retention.engine_id)
        record = encode_record(retention, stored.engine_incarnation)
        outcomes: tuple[Any, ...] = await asyncio.gather(
            self.etcd.keep_alive_once(lease),
            self._writes.txn(
                [cmp_lease(live_key, lease), cmp_lease(engine_key, stored.engine_incarnation)],
                [op_put(live_key, record, lease)],
            ),
            return_exceptions=True,
        )
        for outcome in outcomes:
            if isinstance(outcome, LeaseNotFound):
                return None
            if isinstance(outcome, BaseException):
                raise outcome
        update: TxnResult = outcomes[1]
        if not update.succeeded:
            return None
        self._metrics.lease_renewed(LEASE_RETENTION)
        revision = update.revision
        self._cache.put(
            live_key, StoredRetention(retention, stored.engine_incarnation), lease, revision, len(record)
        )
        return FoundRetention(retention, revision)

    async def release_retention(
        self,
        tenant: str,
        conversation_id: str,
        reason: resources.ReleaseReason.ValueType,
        engine_request_id: str = "",
    ) -> int:
        """Ends the retention now (watchers see ENDED with ``reason``); returns the revision.

        With ``engine_request_id``, only if the live record is that request (else FailedPrecondition):
        the record is checked here and the deletion is guarded by that record's revision, so a turn
        published after the check fails the transaction and is checked again, never released.
        """
        reason = validation.release_reason(reason)
        conversation = validation.conversation_key(tenant, conversation_id)
        if engine_request_id:
            validation.require_id("engine_request_id", engine_request_id)
        live_key = self.layout.live(conversation)
        response = await self.etcd.range(live_key)
        live_kvs = response.kvs
        for _ in range(_TXN_ATTEMPTS):
            if not live_kvs:
                raise self._no_retention(conversation)
            kv = live_kvs[0]
            stored = decode_record(kv.value)
            if engine_request_id and stored.retention.engine_request_id != engine_request_id:
                raise self._other_request_live(conversation, stored.retention, engine_request_id)
            try:
                committed = await self.etcd.txn(
                    [cmp_mod_revision(live_key, kv.mod_revision)],
                    self._end_operations(conversation, stored.retention.engine_id, kv.lease, reason),
                    # Lost the race (a renewal, a newer turn): judge the record that won, no extra read.
                    [op_range(live_key)],
                )
            except LeaseNotFound:
                raise self._no_retention(conversation) from None
            if committed.succeeded:
                self._cache.drop(live_key)
                self._metrics.released(reason)
                # The lease now holds only the tombstone; revoking it drops the tombstone too.
                await self._best_effort(self.etcd.revoke(kv.lease), "revoke released lease")
                return int(committed.header.revision)
            live_kvs = committed.responses[0].response_range.kvs
        raise Conflict(f"conversation {conversation_id} changed concurrently while releasing; retry")

    @staticmethod
    def _other_request_live(
        conversation: ConversationKey, live: resources.Retention, engine_request_id: str
    ) -> FailedPrecondition:
        return FailedPrecondition(
            f"conversation {conversation.conversation_id} of tenant {conversation.tenant} now retains "
            f"engine request {live.engine_request_id} (turn {live.turn} on engine {live.engine_id}), not "
            f"{engine_request_id}; nothing was released. A newer turn replaced the one you meant: leave it, "
            "or release without engine_request_id to end whatever turn is live"
        )

    def _end_operations(
        self,
        conversation: ConversationKey,
        engine_id: str,
        lease: int,
        reason: resources.ReleaseReason.ValueType,
    ) -> list[Any]:
        # The tombstone goes first: a watcher sees the reason before the deletion it explains.
        return [
            op_put(self.layout.tombstone(conversation), encode_tombstone(reason, self._clock()), lease),
            op_delete(self.layout.live(conversation)),
            op_delete(self.layout.engine_index(engine_id, conversation)),
        ]

    @staticmethod
    def _no_retention(conversation: ConversationKey) -> NotFound:
        return NotFound(
            f"no live retention for conversation {conversation.conversation_id} of tenant "
            f"{conversation.tenant} (never published, released, superseded or expired); recompute"
        )

    # --- engine loss ------------------------------------------------------------------------

    async def reap_engine(self, engine_id: str) -> int:
        """Ends (ENGINE_GONE) every retention of ``engine_id`` not from its live incarnation."""
        engine = await self.etcd.range(self.layout.engine(engine_id))
        live_incarnation = int(engine.kvs[0].lease) if engine.kvs else 0
        start = self.layout.engine_index_prefix(engine_id)
        end = prefix_end(start)
        reaped = 0
        while True:
            page = await self.etcd.range(start, end, limit=_REAP_PAGE)
            stale = [kv for kv in page.kvs if decode_incarnation(kv.value) != live_incarnation]
            for first in range(0, len(stale), _REAP_BATCH):
                reaped += await self._end_engine_gone(stale[first : first + _REAP_BATCH])
            if not page.more or not page.kvs:
                break
            start = page.kvs[-1].key + b"\0"
        if reaped:
            log.info("retentions of a departed engine ended", extra={"engine_id": engine_id, "count": reaped})
        return reaped

    async def _end_engine_gone(self, index_kvs: Sequence[Any]) -> int:
        entries = [(kv, *self.layout.index_entry_of(kv.key)) for kv in index_kvs]

        def nested(kv: Any, engine_id: str, conversation: ConversationKey) -> Any:
            return op_txn(
                [cmp_lease(self.layout.live(conversation), kv.lease)],
                self._end_operations(conversation, engine_id, kv.lease, resources.RELEASE_REASON_ENGINE_GONE),
            )

        try:
            response = await self.etcd.txn([], [nested(*entry) for entry in entries])
            results = [r.response_txn.succeeded for r in response.responses]
        except LeaseNotFound:
            # One lease expired meanwhile and failed the whole batch: go one by one.
            results = []
            for entry in entries:
                try:
                    single = await self.etcd.txn([], [nested(*entry)])
                    results.append(single.responses[0].response_txn.succeeded)
                except LeaseNotFound:
                    results.append(False)
        ended = [kv.lease for (kv, _, _), ok in zip(entries, results, strict=True) if ok]
        self._metrics.released(resources.RELEASE_REASON_ENGINE_GONE, len(ended))
        await asyncio.gather(
            *(self._best_effort(self.etcd.revoke(lease), "revoke reaped lease") for lease in ended)
        )
        return len(ended)

    async def sweep_orphans(self) -> int:
        """Reaps every engine whose index holds retentions of a dead incarnation (startup, resync)."""
        engines = await self._list_all_engines()
        live = {engine.engine_id: lease for engine, lease, _ in engines}
        start = self.layout.engine_indexes
        end = prefix_end(start)
        orphaned: set[str] = set()
        while True:
            page = await self.etcd.range(start, end, limit=_REAP_PAGE * 4)
            for kv in page.kvs:
                engine_id, _ = self.layout.index_entry_of(kv.key)
                if decode_incarnation(kv.value) != live.get(engine_id, 0):
                    orphaned.add(engine_id)
            if not page.more or not page.kvs:
                break
            start = page.kvs[-1].key + b"\0"
        reaped = 0
        for engine_id in sorted(orphaned):
            reaped += await self.reap_engine(engine_id)
        return reaped

    async def run_reaper(self) -> None:
        """Follows engine deletions and re-registrations and ends their retentions (ENGINE_GONE).

        Lookups check engine liveness themselves, so this only makes endings prompt and
        visible to watchers; it runs until cancelled and survives etcd outages.
        """
        backoff = Backoff()
        revision = 0
        needs_sweep = True
        while True:
            try:
                if needs_sweep:
                    revision = await self.etcd.current_revision()
                    await self.sweep_orphans()
                    needs_sweep = False
                async for response in self.etcd.watch(
                    self.layout.engines, prefix_end(self.layout.engines), start_revision=revision + 1
                ):
                    backoff.reset()
                    for event in response.events:
                        revision = int(event.kv.mod_revision)
                        gone = event.type == EVENT_DELETE
                        replaced = (
                            event.type == EVENT_PUT
                            and event.prev_kv.key
                            and event.prev_kv.lease != event.kv.lease
                        )
                        if gone or replaced:
                            await self.reap_engine(self.layout.engine_id_of(event.kv.key))
            except (EtcdUnavailable, EtcdFailure) as error:
                log.warning(
                    "engine reaper lost etcd; resuming", extra={"error": str(error), "revision": revision}
                )
                # A reap may have been cut short: check every engine again once etcd answers.
                needs_sweep = True
                await backoff.wait()
            except RevisionCompacted:
                needs_sweep = True
            except Exception:
                # A bug must not stop reaping for good: log it and start over with a sweep.
                log.exception("engine reaper failed; resuming", extra={"revision": revision})
                needs_sweep = True
                await backoff.wait()

    async def _best_effort(self, operation: Any, what: str) -> None:
        try:
            await operation
        except (RegistryError, LeaseNotFound) as error:
            log.warning("best-effort step failed", extra={"step": what, "error": str(error)})
