"""Retentions in etcd: which decode engine holds a conversation's KV blocks, under their own lease.

A conversation has at most one live record (its latest turn). Every multi-key change is one
etcd transaction guarded by compares, so a concurrent change is never overwritten half-way:

- publishing turn N+1 writes the record and its engine-index entry and drops the older engine's
  entry, guarded by the record's revision and the engine's lease (its incarnation);
- a lookup or renewal holds only while the engine incarnation that published it is registered
  (rule 3), checked in the same transaction, so correctness never depends on the reaper;
- ending a retention writes a tombstone with the reason under the retention's lease and deletes
  the record and its index entry (``end_operations``, shared with the reaper);
- a record is written once and never rewritten: a renewal keeps its lease alive and writes the
  new expiry to the record's small renewal key (``records.encode_renewal``, no blocks), so its
  cost in etcd bytes and watch traffic does not grow with the conversation;
- a record is expired when its ``expire_time`` (the later of the record's and its renewal's) has
  passed (``is_expired``, the one definition); whichever call finds it so first ends it in etcd,
  so nothing renews it back to life;
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
from kvferry.registry.batching import TxnBatcher
from kvferry.registry.cache import RetentionCache
from kvferry.registry.config import TtlPolicy
from kvferry.registry.etcd import (
    Delete,
    EtcdGateway,
    Get,
    KeyValue,
    Lease,
    LeaseIs,
    LeaseNotFound,
    ModRevisionIs,
    Op,
    Put,
    TxnResult,
    prefix_end,
)
from kvferry.registry.keys import ConversationKey, KeyLayout
from kvferry.registry.metrics import RegistryMetrics
from kvferry.registry.records import (
    StoredRetention,
    decode_engine,
    decode_record,
    encode_incarnation,
    encode_record,
    encode_renewal,
    encode_tombstone,
    renewal_summary,
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
    """A live record as read (with its latest expiry): its lease, the revisions that wrote it and
    its renewal (0: never renewed), and the revision of the read."""

    stored: StoredRetention
    lease: int
    mod_revision: int
    renewal_revision: int
    revision: int


def with_renewal(stored: StoredRetention, lease: int, renewal: KeyValue | None) -> StoredRetention:
    """The record with the expiry its renewal key holds (a renewal of this record: same lease)."""
    if renewal is None or renewal.lease != lease:
        return stored
    renewed = decode_record(renewal.value).retention
    if renewed.expire_time.ToNanoseconds() <= stored.retention.expire_time.ToNanoseconds():
        return stored
    retention = resources.Retention()
    retention.CopyFrom(stored.retention)
    retention.expire_time.CopyFrom(renewed.expire_time)
    return StoredRetention(retention, stored.engine_incarnation)


def is_expired(retention: resources.Retention, now: float) -> bool:
    """The one definition of an expired retention: its ``expire_time`` has passed on the registry's clock.

    ``retention`` is the record as read with its renewal key (``with_renewal``): the latest expiry.

    The lease alone does not say it: etcd deletes an expired lease's keys up to ~0.5 s late, and an
    etcd restart or leader change restores leases with a fresh TTL. Lookups, renewals, releases and
    the sidecar's sweep (a lookup) all judge a record by this, and whichever finds it expired first
    ends it in etcd (EXPIRED): no later renewal brings it back.
    """
    return retention.expire_time.ToNanoseconds() <= now * 1e9


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
        Delete(layout.renewal(conversation)),
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
        self._reads = TxnBatcher(etcd)
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
        FAILED_PRECONDITION (the publish comes from a sidecar that missed a re-registration)."""
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
        renewal_key = self.layout.renewal(conversation)
        snapshot = await self._reads.txn(
            [], [Get(engine_key), Get(live_key), Get(ended_key), Get(renewal_key)]
        )
        engine_kv, live_kv = snapshot.range(0).first, snapshot.range(1).first
        if engine_kv is None:
            raise FailedPrecondition(
                f"engine {retention.engine_id} is not registered; register it (RegisterEngine) before "
                "publishing its retentions"
            )
        if snapshot.range(2).first is not None:
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
        if live_kv is not None:
            live_revision = live_kv.mod_revision
            current = with_renewal(decode_record(live_kv.value), live_kv.lease, snapshot.range(3).first)
            # An expired record is not live (is_expired: the one definition), though etcd may keep it a
            # while: a new request replaces it whatever its turn. Its own retry does not revive it.
            replaceable = is_expired(current.retention, self._clock.time()) and not _is_same_publish(
                current.retention, retention
            )
            if current.retention.turn >= retention.turn and not replaceable:
                if (
                    _is_same_publish(current.retention, retention)
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
        # The renewal key starts with the record (replacing an older turn's): renewals read it alone.
        operations.append(Put(renewal_key, encode_renewal(stored, incarnation), lease.id))
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
        """The conversation's live retention; NOT_FOUND unless its lease and its engine are both alive
        and it has not expired (an expired record found here is ended in etcd).

        One round trip when this registry knows the record: a transaction compares the record's
        revision and the engine's lease, and reads both only when either changed.
        """
        conversation = validation.conversation_key(tenant, conversation_id)
        for _ in range(_TXN_ATTEMPTS):
            record = await self._read_live(conversation)
            if not is_expired(record.stored.retention, self._clock.time()):
                retention = resources.Retention()
                retention.CopyFrom(record.stored.retention)
                return FoundRetention(retention, record.revision)
            if await self._end_expired(conversation, record):
                raise _no_retention(conversation)
        raise Aborted(f"conversation {conversation_id} changed concurrently while looking it up; retry")

    async def _read_live(self, conversation: ConversationKey) -> _LiveRecord:
        """The live record while its engine incarnation is registered; NotFound otherwise."""
        live_key = self.layout.live(conversation)
        renewal_key = self.layout.renewal(conversation)
        cached = self._cache.get(live_key)
        engine_kv: KeyValue | None = None
        if cached is not None:
            # The record never changes while it lives: only its (small) renewal is read.
            engine_key = self.layout.engine(cached.stored.retention.engine_id)
            checked = await self._reads.txn(
                [
                    ModRevisionIs(live_key, cached.mod_revision),
                    LeaseIs(engine_key, cached.stored.engine_incarnation),
                ],
                [Get(renewal_key)],
                [Get(live_key), Get(engine_key), Get(renewal_key)],
            )
            if checked.succeeded:
                renewal = checked.range(0).first
                return _LiveRecord(
                    with_renewal(cached.stored, cached.lease, renewal),
                    cached.lease,
                    cached.mod_revision,
                    renewal.mod_revision if renewal is not None else 0,
                    checked.revision,
                )
            live_kv, engine_kv, revision = checked.range(0).first, checked.range(1).first, checked.revision
            renewal = checked.range(2).first
        else:
            read = await self._reads.txn([], [Get(live_key), Get(renewal_key)])
            live_kv, renewal, revision = read.range(0).first, read.range(1).first, read.revision
        if live_kv is None:
            self._cache.drop(live_key)
            raise _no_retention(conversation)
        record = decode_record(live_kv.value)
        self._cache.put(live_key, record, live_kv.lease, live_kv.mod_revision, len(live_kv.value))
        stored = with_renewal(record, live_kv.lease, renewal)
        if cached is None or cached.stored.retention.engine_id != stored.retention.engine_id:
            # The engine this record names was not read yet.
            engine = await self._reads.txn([], [Get(self.layout.engine(stored.retention.engine_id))])
            engine_kv, revision = engine.range(0).first, engine.revision
        if engine_kv is None or engine_kv.lease != stored.engine_incarnation:
            raise NotFound(
                f"conversation {conversation.conversation_id} of tenant {conversation.tenant} was retained "
                f"on engine {stored.retention.engine_id}, which left the registry; recompute"
            )
        renewal_revision = renewal.mod_revision if renewal is not None else 0
        return _LiveRecord(stored, live_kv.lease, live_kv.mod_revision, renewal_revision, revision)

    async def _end_expired(self, conversation: ConversationKey, record: _LiveRecord) -> bool:
        """Ends a record found expired (EXPIRED), guarded by the revisions of the record and its
        renewal as read: a renewal that landed meanwhile (judged unexpired elsewhere) stands.

        True when the record is gone now; False when it changed since the read (judge it again).
        """
        live_key = self.layout.live(conversation)
        self._cache.drop(live_key)
        retention = record.stored.retention
        ending = end_operations(
            self.layout,
            conversation,
            retention.engine_id,
            record.lease,
            resources.RELEASE_REASON_EXPIRED,
            self._clock.time(),
        )
        try:
            committed = await self.etcd.txn(
                [
                    ModRevisionIs(live_key, record.mod_revision),
                    ModRevisionIs(self.layout.renewal(conversation), record.renewal_revision),
                ],
                ending,
            )
        except LeaseNotFound:
            return True  # its lease ran out meanwhile, and etcd deleted it
        if not committed.succeeded:
            return False
        self._metrics.released(resources.RELEASE_REASON_EXPIRED)
        log.info(
            "expired retention ended",
            extra={
                "tenant": conversation.tenant,
                "conversation_id": conversation.conversation_id,
                "engine_id": retention.engine_id,
                "engine_request_id": retention.engine_request_id,
            },
        )
        await self.etcd.revoke_quietly(record.lease, "expired retention")
        return True

    # --- renewal ----------------------------------------------------------------------------

    async def renew_retention(self, tenant: str, conversation_id: str) -> FoundRetention:
        """Extends the retention's lease and records the new expiry (watchers see RENEWED).

        The record itself is never read nor rewritten: a renewal reads and writes the record's
        small renewal key (holder, turn, expiry; no blocks), guarded by the record's lease, so it
        costs the same whatever the conversation's length. An expired record is not renewed
        (NOT_FOUND) but ended. One round trip (a keep-alive and a guarded put, sent together) when
        this registry knows the retention; a small read first otherwise.
        """
        conversation = validation.conversation_key(tenant, conversation_id)
        live_key = self.layout.live(conversation)
        cached = self._cache.get(live_key)
        if cached is not None:
            current = (
                cached.renewal if cached.renewal is not None else renewal_summary(cached.stored.retention)
            )
            # A renewal elsewhere only moves the expiry later: unexpired here is unexpired in etcd.
            if not is_expired(current, self._clock.time()):
                state = StoredRetention(current, cached.stored.engine_incarnation)
                renewed = await self._renew_once(conversation, state, cached.lease)
                if renewed is not None:
                    return renewed
        self._cache.drop(live_key)
        for _ in range(_TXN_ATTEMPTS):
            live, renewal = await self._renewal_state(conversation)
            if live is None:
                raise _no_retention(conversation)
            if renewal is not None and renewal.lease == live.lease:
                state = decode_record(renewal.value)
            else:  # a record from before renewal keys were written at publish: read it once
                record_kv = await self.etcd.get(live_key)
                if record_kv is None or record_kv.lease != live.lease:
                    continue
                record = decode_record(record_kv.value)
                state = StoredRetention(renewal_summary(record.retention), record.engine_incarnation)
            if is_expired(state.retention, self._clock.time()):
                renewal_revision = renewal.mod_revision if renewal is not None else 0
                expired = _LiveRecord(state, live.lease, live.mod_revision, renewal_revision, 0)
                if await self._end_expired(conversation, expired):
                    raise _no_retention(conversation)
                continue
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
        etcd calls shared (keep-alives on one stream, the puts batched into few transactions).

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

    async def _get_live(self, conversation: ConversationKey) -> tuple[KeyValue | None, KeyValue | None]:
        """The record and its renewal, read together."""
        read = await self._reads.txn(
            [], [Get(self.layout.live(conversation)), Get(self.layout.renewal(conversation))]
        )
        return read.range(0).first, read.range(1).first

    async def _renewal_state(self, conversation: ConversationKey) -> tuple[KeyValue | None, KeyValue | None]:
        """The record's key (its lease and revision, not its value) and its renewal, read together."""
        read = await self._reads.txn(
            [], [Get(self.layout.live(conversation), keys_only=True), Get(self.layout.renewal(conversation))]
        )
        return read.range(0).first, read.range(1).first

    async def _renew_once(
        self, conversation: ConversationKey, state: StoredRetention, lease: int
    ) -> FoundRetention | None:
        """Renews ``lease`` and writes the new expiry to the renewal key if the record still holds
        the conversation; else None. ``state`` is the renewal summary (``records.renewal_summary``).

        The guard is the record's lease: whoever ended the record (expiry included) deleted it first.
        """
        live_key = self.layout.live(conversation)
        summary = resources.Retention()
        summary.CopyFrom(state.retention)
        # A keep-alive restores the granted TTL; the renewal says so.
        summary.expire_time.CopyFrom(to_timestamp(self._clock.time() + summary.ttl_seconds))
        engine_key = self.layout.engine(summary.engine_id)
        renewal, update = await asyncio.gather(
            self.etcd.keep_alive_once(lease),
            self._writes.txn(
                [LeaseIs(live_key, lease), LeaseIs(engine_key, state.engine_incarnation)],
                [
                    Put(
                        self.layout.renewal(conversation),
                        encode_renewal(summary, state.engine_incarnation),
                        lease,
                    )
                ],
            ),
            return_exceptions=True,
        )
        for outcome in (renewal, update):
            if isinstance(outcome, LeaseNotFound):
                return None
            if isinstance(outcome, BaseException):
                raise outcome
        assert isinstance(update, TxnResult)  # failures were raised above
        if not update.succeeded:
            return None
        self._metrics.lease_renewed(LEASE_RETENTION)
        self._cache.renewed(live_key, summary)
        answer = resources.Retention()
        answer.CopyFrom(summary)
        answer.tenant, answer.conversation_id = conversation.tenant, conversation.conversation_id
        answer.name = conversation.name
        return FoundRetention(answer, update.revision)

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
        published after the check fails the transaction and is checked again, never released. An
        expired record is ended as EXPIRED and answers NOT_FOUND, as a lookup would.
        """
        reason = validation.release_reason(reason)
        conversation = validation.conversation_key(tenant, conversation_id)
        if engine_request_id:
            validation.require_id("engine_request_id", engine_request_id)
        live_key = self.layout.live(conversation)
        kv, renewal = await self._get_live(conversation)
        for _ in range(_TXN_ATTEMPTS):
            if kv is None:
                raise _no_retention(conversation)
            stored = with_renewal(decode_record(kv.value), kv.lease, renewal)
            if is_expired(stored.retention, self._clock.time()):
                renewal_revision = renewal.mod_revision if renewal is not None else 0
                record = _LiveRecord(stored, kv.lease, kv.mod_revision, renewal_revision, 0)
                if await self._end_expired(conversation, record):
                    raise _no_retention(conversation)
                kv, renewal = await self._get_live(conversation)
                continue
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
                    [Get(live_key), Get(self.layout.renewal(conversation))],
                )
            except LeaseNotFound:
                raise _no_retention(conversation) from None
            if committed.succeeded:
                self._cache.drop(live_key)
                self._metrics.released(reason)
                # The lease now holds only the tombstone; revoking it drops the tombstone too.
                await self.etcd.revoke_quietly(kv.lease, "released retention")
                return committed.revision
            kv, renewal = committed.range(0).first, committed.range(1).first
        raise Aborted(f"conversation {conversation_id} changed concurrently while releasing; retry")

    # --- every live retention ---------------------------------------------------------------

    async def snapshot(
        self, page_size: int = SNAPSHOT_PAGE
    ) -> AsyncIterator[tuple[list[resources.Retention], int]]:
        """Every live record with its latest expiry, in pages, each with the revision it was read at.

        Pages are separate reads: a change meanwhile may or may not show; a watch opened before the
        snapshot tells what changed since (WatchAllRetentions).
        """
        expiries: dict[bytes, KeyValue] = {}
        renewals = self.layout.renewals
        async for page in self.etcd.scan(renewals, prefix_end(renewals), page_size=SNAPSHOT_PAGE * 10):
            for kv in page.kvs:
                expiries[kv.key[len(renewals) :]] = kv
        live = self.layout.live_retentions
        async for page in self.etcd.scan(live, prefix_end(live), page_size=page_size):
            retentions = []
            for kv in page.kvs:
                try:
                    stored = decode_record(kv.value)
                except ValueError as error:  # includes protobuf's DecodeError
                    log.error("undecodable retention record skipped", extra={"error": str(error)})
                    continue
                renewal = expiries.get(kv.key[len(live) :])
                retentions.append(with_renewal(stored, kv.lease, renewal).retention)
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
