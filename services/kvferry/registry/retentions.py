"""Retentions in etcd: which decode engine holds a conversation's KV blocks, under their own lease.

A conversation has at most one live record (its latest turn). Every multi-key change is one
etcd transaction guarded by compares, so a concurrent change is never overwritten half-way:

- publishing turn N+1 writes the record and its engine-index entry and drops the older engine's
  entry, guarded by the record's revision and the engine's lease (its incarnation); a relocation
  (``relocates_engine_request_id``: the holding engine moved the turn's KV to another tier, new block
  ids) replaces the live record of the same turn the same way, only while that record is the request it
  names, published by the same engine incarnation, with the same tokens and digests;
- a lookup or renewal holds only while the engine incarnation that published it is registered
  (rule 3), checked in the same read, so correctness never depends on the reaper;
- ending a retention writes a tombstone with the reason under the retention's lease and deletes
  the record, its holder and its index entry (``end_operations``, shared with the reaper);
- a record and its holder (``records.encode_holder``: the record without its blocks) are written
  once and never rewritten. A renewal is a lease keep-alive plus a read that the lease still holds
  the record: etcd writes nothing (neither is a raft entry), watchers see nothing, whatever the
  conversation's length;
- a retention lives exactly as long as its record: the lease running out is etcd deleting the
  record (watchers see ENDED, EXPIRED). No clock judges expiry; ``expire_time`` in an answer is when
  the lease runs out unless renewed (etcd's count), a figure for clients. An etcd leader change or
  restart gives leases a fresh TTL: retentions then live longer, never again once deleted;
- an engine ending its own retention (``end_engine_retention``) also leaves a marker that refuses
  any later publish of that engine request, so a publish still in flight cannot bring it back.

Plain Python over the etcd gateway; the gRPC handlers only translate messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from kvferry.registry import validation
from kvferry.registry.batching import ReadBatcher, TxnBatcher
from kvferry.registry.cache import RetentionCache
from kvferry.registry.config import TtlPolicy
from kvferry.registry.etcd import (
    Delete,
    EtcdGateway,
    Get,
    Lease,
    LeaseIs,
    LeaseNotFound,
    LeaseRenewal,
    ModRevisionIs,
    Op,
    Put,
    prefix_end,
)
from kvferry.registry.keys import ConversationKey, KeyLayout
from kvferry.registry.metrics import RegistryMetrics
from kvferry.registry.records import (
    StoredRetention,
    decode_engine,
    decode_record,
    encode_holder,
    encode_incarnation,
    encode_record,
    encode_tombstone,
    holder_summary,
)
from kvferry.registry.txn_retry import TXN_ATTEMPTS as _TXN_ATTEMPTS
from kvferry.registry.txn_retry import until_settled
from kvferry.runtime.clock import Clock, SystemClock
from kvferry.runtime.errors import Aborted, FailedPrecondition, NotFound, ServiceError
from kvferry.runtime.metrics import LEASE_RETENTION
from kvferry.runtime.timestamps import to_timestamp
from kvferry.v1 import resources_pb2 as resources

log = logging.getLogger(__name__)

# Records per snapshot read (a 128k-token record is ~170 KB: a page stays under ~35 MB).
SNAPSHOT_PAGE = 200
# Records kept in memory to answer lookups and renewals in one etcd round trip.
DEFAULT_CACHE_BYTES = 64 * 1024 * 1024
# How long an engine request its engine ended stays unpublishable. A publish of it can only be in
# flight for as long as a sidecar's registry call lasts (5 s by default) plus etcd's commit.
END_MARKER_SECONDS = 300


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


@dataclass(frozen=True)
class EngineEnd:
    """What ``end_engine_retention`` did: ended the live record or found it not live; at ``revision``."""

    ended: bool
    revision: int


@dataclass(frozen=True)
class _LiveRecord:
    """A live record as read: its lease, the revision that wrote it, and the revision of the read."""

    stored: StoredRetention
    lease: int
    mod_revision: int
    revision: int


def end_operations(
    layout: KeyLayout,
    conversation: ConversationKey,
    engine_id: str,
    lease: int,
    reason: resources.ReleaseReason.ValueType,
    end_time: float,
) -> list[Op]:
    """What ending a retention writes: its tombstone (the reason, under ``lease``), then the deletions.

    The tombstone goes first: a watcher sees the reason before the deletion it explains.
    """
    return [
        Put(layout.tombstone(conversation), encode_tombstone(reason, end_time), lease),
        Delete(layout.live(conversation)),
        Delete(layout.holder(conversation)),
        Delete(layout.engine_index(engine_id, conversation)),
    ]


def _no_retention(conversation: ConversationKey) -> NotFound:
    return NotFound(
        f"no live retention for conversation {conversation.conversation_id} of tenant "
        f"{conversation.tenant} (never published, released, superseded or expired); recompute"
    )


def _other_request_live(
    conversation: ConversationKey, live: resources.Retention, engine_request_id: str
) -> FailedPrecondition:
    return FailedPrecondition(
        f"conversation {conversation.conversation_id} of tenant {conversation.tenant} now retains "
        f"engine request {live.engine_request_id} (turn {live.turn} on engine {live.engine_id}), not "
        f"{engine_request_id}; nothing was released. A newer turn replaced the one you meant: leave it, "
        "or release without engine_request_id to end whatever turn is live"
    )


def _ended_by_engine(retention: resources.Retention) -> FailedPrecondition:
    return FailedPrecondition(
        f"engine {retention.engine_id} ended its request {retention.engine_request_id} (it freed or is "
        "freeing those blocks); it is never published again. Report the engine's newer retentions instead"
    )


_FREE_MOVED = "free the moved blocks instead (the retention they held is over)"


def _relocated_gone(conversation: ConversationKey, relocation: resources.Retention) -> FailedPrecondition:
    return FailedPrecondition(
        f"engine request {relocation.engine_request_id} relocates {relocation.relocates_engine_request_id}, "
        f"but conversation {conversation.conversation_id} of tenant {conversation.tenant} retains nothing "
        "now (that retention was released, evicted, superseded or expired); a relocation never brings an "
        f"ended retention back: {_FREE_MOVED}"
    )


def _check_relocation(
    conversation: ConversationKey, current: StoredRetention, relocation: resources.Retention, incarnation: int
) -> None:
    """Raises FailedPrecondition unless ``relocation`` moves the live record ``current`` to other blocks:
    the record it names, on the same engine incarnation, of the same turn, tokens and digests."""
    live, relocates = current.retention, relocation.relocates_engine_request_id
    what = f"engine request {relocation.engine_request_id} relocates {relocates}, but conversation " + (
        f"{conversation.conversation_id} of tenant {conversation.tenant}"
    )
    if live.engine_request_id != relocates:
        raise FailedPrecondition(
            f"{what} now retains engine request {live.engine_request_id} (turn {live.turn} on engine "
            f"{live.engine_id}): {relocates} ended or was replaced (a newer turn, or another relocation); "
            f"{_FREE_MOVED}"
        )
    if live.engine_id != relocation.engine_id:
        raise FailedPrecondition(
            f"{what} is retained on engine {live.engine_id}, not {relocation.engine_id}; only the engine "
            "holding a retention relocates it"
        )
    if current.engine_incarnation != incarnation:
        raise FailedPrecondition(
            f"{what} was published by an earlier registration of engine {live.engine_id} (incarnation "
            f"{current.engine_incarnation:x}, now {incarnation:x}): its blocks went with it; "
            f"{_FREE_MOVED}"
        )
    differences = []
    if live.turn != relocation.turn:
        differences.append(f"turn {relocation.turn}, not {live.turn}")
    if live.num_tokens != relocation.num_tokens:
        differences.append(f"num_tokens {relocation.num_tokens}, not {live.num_tokens}")
    if list(live.block_digests) != list(relocation.block_digests):
        first = next(
            (
                index
                for index, (ours, theirs) in enumerate(
                    zip(relocation.block_digests, live.block_digests, strict=False)
                )
                if ours != theirs
            ),
            min(len(live.block_digests), len(relocation.block_digests)),
        )
        differences.append(f"block_digests differing from block {first} on")
    if differences:
        raise FailedPrecondition(
            f"{what} retains turn {live.turn} of {live.num_tokens} tokens and the relocation has "
            f"{'; '.join(differences)}. A relocation moves the same turn's KV (same turn, tokens and "
            "digests; new block ids, generations and tier): publish a new turn as a new turn"
        )


def _is_same_publish(current: resources.Retention, incoming: resources.Retention) -> bool:
    return (
        current.turn == incoming.turn
        and current.engine_id == incoming.engine_id
        and current.engine_request_id == incoming.engine_request_id
    )


class RetentionStore:
    """Publishes, looks up, renews and releases retentions."""

    def __init__(
        self,
        etcd: EtcdGateway,
        layout: KeyLayout,
        ttl: TtlPolicy,
        *,
        clock: Clock | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        metrics: RegistryMetrics | None = None,
    ) -> None:
        self.etcd = etcd
        self.layout = layout
        self.ttl = ttl
        self._clock: Clock = clock if clock is not None else SystemClock()
        self._metrics = metrics if metrics is not None else RegistryMetrics()
        self._cache = RetentionCache(cache_bytes)
        # The hot paths (publish, lookup, renew) share etcd calls when they arrive together.
        self._reads = ReadBatcher(etcd)
        self._writes = TxnBatcher(etcd)

    @property
    def cache(self) -> RetentionCache:
        """The records this store last read or wrote; the turns' marks share it (``TurnStore``)."""
        return self._cache

    # --- publish ----------------------------------------------------------------------------

    async def publish_retention(
        self, retention: resources.Retention, incarnation: int = 0
    ) -> PublishedRetention:
        """Stores a conversation's retention under its own lease, superseding an older turn atomically.

        With ``incarnation``, only for that registration of the engine: another one live is
        FAILED_PRECONDITION (the publish comes from a sidecar that missed a re-registration).

        A relocation (``relocates_engine_request_id`` set) replaces only the live record it names, of the
        same engine incarnation, turn, tokens and digests (``_check_relocation``): the answer's
        ``superseded_turn`` is that turn, and watchers see the named request end as SUPERSEDED. It never
        publishes over nothing: an ended retention stays ended."""
        conversation = validation.validate_retention_shape(retention)
        ttl = validation.retention_ttl(retention.ttl_seconds, self.ttl)
        # The lease is granted while the current state is read: one round trip less per publish.
        grant = asyncio.ensure_future(self.etcd.grant(ttl))
        published: PublishedRetention | None = None
        try:
            published = await until_settled(
                lambda: self._try_publish(retention, conversation, grant, incarnation),
                changed=f"conversation {conversation.conversation_id}",
                doing=" while publishing",
            )
            if published.superseded_turn:
                self._metrics.released(resources.RELEASE_REASON_SUPERSEDED)
            return published
        finally:
            await self._drop_unused_lease(grant, published.lease if published is not None else 0)

    async def _drop_unused_lease(self, grant: asyncio.Future[Lease], used: int) -> None:
        """Revokes the lease ``grant`` gave unless it is ``used`` (or cancels the grant)."""
        if not grant.done():
            grant.cancel()
            with contextlib.suppress(asyncio.CancelledError, ServiceError):
                await grant
            return
        if grant.cancelled() or grant.exception() is not None:
            return
        lease = grant.result()
        if lease.id != used:
            await self.etcd.revoke_quietly(lease.id, "unused lease")

    async def _try_publish(
        self,
        retention: resources.Retention,
        conversation: ConversationKey,
        grant: asyncio.Future[Lease],
        expected_incarnation: int,
    ) -> PublishedRetention | None:
        """One optimistic attempt; None when a concurrent change won and the caller should retry."""
        engine_key = self.layout.engine(retention.engine_id)
        live_key = self.layout.live(conversation)
        ended_key = self.layout.ended_request(retention.engine_id, retention.engine_request_id)
        engine_read, live_read, ended_read = await self._reads.read(
            Get(engine_key), Get(live_key), Get(ended_key, keys_only=True)
        )
        engine_kv, live_kv = engine_read.first, live_read.first
        if engine_kv is None:
            raise FailedPrecondition(
                f"engine {retention.engine_id} is not registered; register it (RegisterEngine) before "
                "publishing its retentions"
            )
        if ended_read.first is not None:
            raise _ended_by_engine(retention)
        incarnation = engine_kv.lease
        if expected_incarnation and expected_incarnation != incarnation:
            raise FailedPrecondition(
                f"engine {retention.engine_id} is registered under incarnation {incarnation:x}, not "
                f"{expected_incarnation:x} (it registered again); publish under the current registration"
            )
        validation.validate_against_engine(retention, decode_engine(engine_kv.value))
        superseded_turn = 0
        operations: list[Op] = []
        live_revision = 0
        relocates = retention.relocates_engine_request_id
        if live_kv is None:
            if relocates:
                raise _relocated_gone(conversation, retention)
        else:
            live_revision = live_kv.mod_revision
            current = decode_record(live_kv.value)
            if (
                _is_same_publish(current.retention, retention)
                and current.engine_incarnation == incarnation
                and (not relocates or current.retention.relocates_engine_request_id == relocates)
            ):
                return PublishedRetention(current.retention, 0, live_read.revision)
            if relocates:
                # Replaces the live record of the same turn, as a newer turn would (below).
                _check_relocation(conversation, current, retention, incarnation)
            elif current.retention.turn >= retention.turn:
                raise FailedPrecondition(
                    f"conversation {conversation.conversation_id} of tenant {conversation.tenant} "
                    f"already retains turn {current.retention.turn} "
                    f"(engine {current.retention.engine_id}); turn {retention.turn} is not newer. "
                    "Publish turns in increasing order; a retry of the same turn must repeat its "
                    "engine_id and engine_request_id"
                )
            superseded_turn = int(current.retention.turn)
            if current.retention.engine_id != retention.engine_id:
                operations.append(Delete(self.layout.engine_index(current.retention.engine_id, conversation)))
        lease = await grant
        now = self._clock.time()
        stored = resources.Retention()
        stored.CopyFrom(retention)
        stored.name = conversation.name
        stored.ttl_seconds = lease.ttl_seconds
        stored.publish_time.CopyFrom(to_timestamp(now))
        stored.expire_time.CopyFrom(to_timestamp(now + lease.ttl_seconds))
        record = encode_record(stored, incarnation)
        index_key = self.layout.engine_index(retention.engine_id, conversation)
        operations[:0] = [
            Put(live_key, record, lease.id),
            Put(index_key, encode_incarnation(incarnation), lease.id),
        ]
        # The holder goes with the record (replacing an older turn's): renewals read it alone.
        operations.append(Put(self.layout.holder(conversation), encode_holder(stored, incarnation), lease.id))
        committed = await self._writes.txn(
            [
                LeaseIs(engine_key, incarnation),
                ModRevisionIs(live_key, live_revision),
                # The engine did not end this request meanwhile (end_engine_retention).
                ModRevisionIs(ended_key, 0),
            ],
            operations,
        )
        if not committed.succeeded:
            return None
        self._cache.put(
            live_key, StoredRetention(stored, incarnation), lease.id, committed.revision, len(record)
        )
        return PublishedRetention(stored, superseded_turn, committed.revision, lease.id)

    # --- lookup ---------------------------------------------------------------------------

    async def get_retention(self, tenant: str, conversation_id: str) -> FoundRetention:
        """The conversation's live retention, its ``expire_time`` when its lease runs out unless renewed;
        NOT_FOUND unless its record exists (its lease alive) and its engine incarnation is registered.

        Reads only (etcd writes nothing): the record's and engine's keys in one read when this registry
        knows the record, sent with a query of the lease's time to live.
        """
        conversation = validation.conversation_key(tenant, conversation_id)
        cached = self._cache.get(self.layout.live(conversation))
        if cached is not None:
            # The lease this registry knows is asked about with the read; again if the read found another.
            record, seconds_left = await asyncio.gather(
                self._read_live(conversation), self._seconds_left(cached.lease)
            )
            if record.lease != cached.lease:
                seconds_left = await self._seconds_left(record.lease)
        else:
            record = await self._read_live(conversation)
            seconds_left = await self._seconds_left(record.lease)
        if seconds_left is None:
            # The lease ran out after the read: etcd is deleting the record (watchers see EXPIRED).
            self._cache.drop(self.layout.live(conversation))
            raise _no_retention(conversation)
        retention = resources.Retention()
        retention.CopyFrom(record.stored.retention)
        retention.expire_time.CopyFrom(to_timestamp(self._clock.time() + seconds_left))
        return FoundRetention(retention, record.revision)

    async def _seconds_left(self, lease: int) -> int | None:
        """The lease's time to live; None once it is gone."""
        try:
            return await self.etcd.time_to_live(lease)
        except LeaseNotFound:
            return None

    async def _read_live(self, conversation: ConversationKey) -> _LiveRecord:
        """The live record while its engine incarnation is registered; NotFound otherwise."""
        live_key = self.layout.live(conversation)
        cached = self._cache.get(live_key)
        if cached is not None:
            # The record never changes while it lives: its revision and the engine's lease are read alone.
            engine_key = self.layout.engine(cached.stored.retention.engine_id)
            live_read, engine_read = await self._reads.read(
                Get(live_key, keys_only=True), Get(engine_key, keys_only=True)
            )
            live_kv, engine_kv = live_read.first, engine_read.first
            if (
                live_kv is not None
                and live_kv.mod_revision == cached.mod_revision
                and engine_kv is not None
                and engine_kv.lease == cached.stored.engine_incarnation
            ):
                return _LiveRecord(cached.stored, cached.lease, cached.mod_revision, live_read.revision)
        (live_read,) = await self._reads.read(Get(live_key))
        live_kv = live_read.first
        if live_kv is None:
            self._cache.drop(live_key)
            raise _no_retention(conversation)
        stored = decode_record(live_kv.value)
        self._cache.put(live_key, stored, live_kv.lease, live_kv.mod_revision, len(live_kv.value))
        (engine_read,) = await self._reads.read(
            Get(self.layout.engine(stored.retention.engine_id), keys_only=True)
        )
        engine_kv = engine_read.first
        if engine_kv is None or engine_kv.lease != stored.engine_incarnation:
            raise NotFound(
                f"conversation {conversation.conversation_id} of tenant {conversation.tenant} was retained "
                f"on engine {stored.retention.engine_id}, which left the registry; recompute"
            )
        return _LiveRecord(stored, live_kv.lease, live_kv.mod_revision, engine_read.revision)

    # --- renewal ----------------------------------------------------------------------------

    async def renew_retention(self, tenant: str, conversation_id: str) -> FoundRetention:
        """Keeps the retention's lease alive; the answer's ``expire_time`` is when it runs out now.

        Nothing is written to etcd nor shipped to watchers, whatever the conversation's length: a
        lease keep-alive (not a raft entry) sent with a read that the lease still holds the record and
        that the engine incarnation which published it is registered; NOT_FOUND otherwise. One round
        trip when this registry knows the record; a small read of its holder first otherwise.
        """
        conversation = validation.conversation_key(tenant, conversation_id)
        live_key = self.layout.live(conversation)
        cached = self._cache.get(live_key)
        if cached is not None:
            state = StoredRetention(holder_summary(cached.stored.retention), cached.stored.engine_incarnation)
            renewed = await self._renew_once(conversation, state, cached.lease)
            if renewed is not None:
                return renewed
            self._cache.drop(live_key)
        for _ in range(_TXN_ATTEMPTS):
            live_read, holder_read = await self._reads.read(
                Get(live_key, keys_only=True), Get(self.layout.holder(conversation))
            )
            live, holder = live_read.first, holder_read.first
            if live is None:
                raise _no_retention(conversation)
            if holder is not None and holder.lease == live.lease:
                state = decode_record(holder.value)
            else:  # a record published by a registry from before holders: read it once
                record_kv = await self.etcd.get(live_key)
                if record_kv is None or record_kv.lease != live.lease:
                    continue
                record = decode_record(record_kv.value)
                state = StoredRetention(holder_summary(record.retention), record.engine_incarnation)
            renewed = await self._renew_once(conversation, state, live.lease)
            if renewed is None:
                raise NotFound(
                    f"conversation {conversation_id} of tenant {tenant} has no retention to renew: it was "
                    "superseded, released, or its engine left; recompute"
                )
            return renewed
        raise Aborted(f"conversation {conversation_id} changed concurrently while renewing; retry")

    async def renew_retentions(
        self, conversations: Sequence[tuple[str, str]]
    ) -> list[FoundRetention | ServiceError]:
        """Renews many conversations at once (one client's batch): each as ``renew_retention``, the
        etcd calls shared (keep-alives on few streams, the reads batched into few read-only calls).

        Answers in order, a failure per conversation as its error (the others still renew).
        """
        outcomes = await asyncio.gather(
            *(self.renew_retention(tenant, conversation_id) for tenant, conversation_id in conversations),
            return_exceptions=True,
        )
        answers: list[FoundRetention | ServiceError] = []
        for outcome in outcomes:
            if isinstance(outcome, (FoundRetention, ServiceError)):
                answers.append(outcome)
            else:
                raise outcome
        return answers

    async def _renew_once(
        self, conversation: ConversationKey, state: StoredRetention, lease: int
    ) -> FoundRetention | None:
        """Renews ``lease`` if it still holds the conversation's record and the engine incarnation of
        ``state`` (the holder) is registered; else None."""
        live_key = self.layout.live(conversation)
        engine_key = self.layout.engine(state.retention.engine_id)
        kept, read = await asyncio.gather(
            self.etcd.keep_alive_once(lease),
            self._reads.read(Get(live_key, keys_only=True), Get(engine_key, keys_only=True)),
            return_exceptions=True,
        )
        for outcome in (kept, read):
            if isinstance(outcome, LeaseNotFound):
                return None
            if isinstance(outcome, BaseException):
                raise outcome
        assert isinstance(kept, LeaseRenewal) and isinstance(read, list)  # failures were raised above
        live_kv, engine_kv = read[0].first, read[1].first
        if live_kv is None or live_kv.lease != lease:
            return None
        if engine_kv is None or engine_kv.lease != state.engine_incarnation:
            return None
        self._metrics.lease_renewed(LEASE_RETENTION)
        answer = resources.Retention()
        answer.CopyFrom(state.retention)
        answer.expire_time.CopyFrom(to_timestamp(self._clock.time() + kept.ttl_seconds))
        answer.tenant, answer.conversation_id = conversation.tenant, conversation.conversation_id
        answer.name = conversation.name
        return FoundRetention(answer, read[0].revision)

    # --- release ----------------------------------------------------------------------------

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
        (live_read,) = await self._reads.read(Get(live_key))
        kv = live_read.first
        for _ in range(_TXN_ATTEMPTS):
            if kv is None:
                raise _no_retention(conversation)
            stored = decode_record(kv.value)
            if engine_request_id and stored.retention.engine_request_id != engine_request_id:
                raise _other_request_live(conversation, stored.retention, engine_request_id)
            ending = end_operations(
                self.layout, conversation, stored.retention.engine_id, kv.lease, reason, self._clock.time()
            )
            try:
                committed = await self.etcd.txn(
                    [ModRevisionIs(live_key, kv.mod_revision)],
                    ending,
                    # Lost the race (a newer turn): judge the record that won, no extra read.
                    [Get(live_key)],
                )
            except LeaseNotFound:
                raise _no_retention(conversation) from None
            if committed.succeeded:
                self._cache.drop(live_key)
                self._metrics.released(reason)
                # The lease now holds only the tombstone; revoking it drops the tombstone too.
                await self.etcd.revoke_quietly(kv.lease, "released retention")
                return committed.revision
            kv = committed.range(0).first
        raise Aborted(f"conversation {conversation_id} changed concurrently while releasing; retry")

    # --- every live retention ---------------------------------------------------------------

    async def snapshot(
        self, page_size: int = SNAPSHOT_PAGE
    ) -> AsyncIterator[tuple[list[resources.Retention], int]]:
        """Every live record as published (``expire_time``: its lease's first end; renewals do not
        change records), in pages, each with the revision it was read at.

        Pages are separate reads: a change meanwhile may or may not show; a watch opened before the
        snapshot tells what changed since (WatchAllRetentions).
        """
        live = self.layout.live_retentions
        async for page in self.etcd.scan(live, prefix_end(live), page_size=page_size):
            retentions = []
            for kv in page.kvs:
                try:
                    stored = decode_record(kv.value)
                except ValueError as error:  # includes protobuf's DecodeError
                    log.error("undecodable retention record skipped", extra={"error": str(error)})
                    continue
                retentions.append(stored.retention)
            yield retentions, page.revision

    # --- an engine ending its own retention ----------------------------------------------------

    async def end_engine_retention(
        self,
        tenant: str,
        conversation_id: str,
        engine_id: str,
        engine_request_id: str,
        reason: resources.ReleaseReason.ValueType,
    ) -> EngineEnd:
        """Ends the record if it names ``engine_id`` + ``engine_request_id``, and makes sure that request
        is never published again (a marker under a lease of its own, checked by every publish).

        One transaction, guarded by the record's revision as read: a turn published or renewed
        meanwhile is judged again, never ended. Success means the request is not served from the
        returned revision on, whether this call ended it or it was not live.
        """
        reason = validation.engine_end_reason(reason)
        conversation = validation.conversation_key(tenant, conversation_id)
        validation.require_id("engine_id", engine_id)
        validation.require_id("engine_request_id", engine_request_id)
        live_key = self.layout.live(conversation)
        ended_key = self.layout.ended_request(engine_id, engine_request_id)
        # The marker's lease is granted while the record is read.
        grant = asyncio.ensure_future(self.etcd.grant(END_MARKER_SECONDS))
        used = 0
        try:
            kv = await self.etcd.get(live_key)
            marker_lease = await grant
            for _ in range(_TXN_ATTEMPTS):
                live = decode_record(kv.value).retention if kv is not None else None
                mine = (
                    live is not None
                    and live.engine_id == engine_id
                    and live.engine_request_id == engine_request_id
                )
                now = self._clock.time()
                operations: list[Op] = [Put(ended_key, encode_tombstone(reason, now), marker_lease.id)]
                if kv is not None and mine:
                    operations[:0] = end_operations(
                        self.layout, conversation, engine_id, kv.lease, reason, now
                    )
                try:
                    committed = await self.etcd.txn(
                        [ModRevisionIs(live_key, kv.mod_revision if kv is not None else 0)],
                        operations,
                        [Get(live_key)],
                    )
                except LeaseNotFound:
                    # The record's lease ran out between the read and the transaction: look again.
                    kv = await self.etcd.get(live_key)
                    continue
                if not committed.succeeded:
                    kv = committed.range(0).first
                    continue
                used = marker_lease.id
                if kv is not None and mine:
                    self._cache.drop(live_key)
                    self._metrics.released(reason)
                    await self.etcd.revoke_quietly(kv.lease, "retention ended by its engine")
                log.info(
                    "engine ended its retention",
                    extra={
                        "tenant": tenant,
                        "conversation_id": conversation_id,
                        "engine_id": engine_id,
                        "engine_request_id": engine_request_id,
                        "reason": resources.ReleaseReason.Name(reason),
                        "was_live": mine,
                        "revision": committed.revision,
                    },
                )
                return EngineEnd(mine, committed.revision)
        finally:
            await self._drop_unused_lease(grant, used)
        raise Aborted(
            f"conversation {conversation_id} changed concurrently {_TXN_ATTEMPTS} times while its engine "
            "ended a retention; retry"
        )
