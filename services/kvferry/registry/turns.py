"""Turns in flight: at most one per conversation at a time, whichever router serves it (design rule 1b).

A turn takes a mark before it runs, ``{prefix}turns/{tenant}/{conversation_id}`` (a ``RunningTurn``), under
a short lease of its own; another turn of the conversation finds the mark and is refused
(:class:`TurnInFlight`, ABORTED, naming the running turn). The router renews the mark while its turn runs
(BeginTurn again with the same request id) and clears it when the turn ends (EndTurn revokes the lease); a
router that dies stops renewing, and etcd drops the mark within the lease.

Taking a mark is one transaction that writes the mark only if no mark exists, under a lease granted ahead
(:class:`LeasePool`: a grant is an etcd write of its own, which would double the time a turn waits), and
reads the conversation's retention record (its holder: engine, incarnation, turn and request in a
few dozen bytes, not the record's blocks) and its engine's registration at the same revision: the
record's turn and request (``retained_turn``, ``retained_request_id``) tell the caller whether a lookup it
made concurrently is still current. A record counts only while the engine incarnation that published it
is registered (rule 3), as for every lookup: a record whose engine left (or a record etcd brought back
from an older snapshot, before the registry's new epoch voided its engine) is reported as none, so a
caller that found it elsewhere (the router's retention index) asks the registry, which refuses it.
Renewing a mark this registry took is a lease keep-alive plus a check that the mark still lives under
that lease, together.

Plain Python over the etcd gateway; the gRPC handlers only translate messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict, deque
from dataclasses import dataclass

from kvferry.registry import validation
from kvferry.registry.batching import TxnBatcher
from kvferry.registry.cache import RetentionCache
from kvferry.registry.config import TtlPolicy
from kvferry.registry.errors import TurnInFlight
from kvferry.registry.etcd import (
    EtcdGateway,
    Get,
    KeyValue,
    Lease,
    LeaseIs,
    LeaseNotFound,
    ModRevisionIs,
    Put,
    TxnResult,
)
from kvferry.registry.keys import ConversationKey, KeyLayout
from kvferry.registry.metrics import RegistryMetrics
from kvferry.registry.records import StoredRetention, decode_record
from kvferry.registry.txn_retry import until_settled
from kvferry.runtime.clock import Clock, SystemClock
from kvferry.runtime.errors import ServiceError
from kvferry.runtime.metrics import LEASE_TURN
from kvferry.runtime.timestamps import to_timestamp
from kvferry.v1 import resources_pb2 as resources

log = logging.getLogger(__name__)

# Marks this registry took, remembered to renew and clear them in one round trip (oldest forgotten first:
# a forgotten one costs a read more, nothing else).
_HELD_MARKS = 65_536


@dataclass(frozen=True)
class BegunTurn:
    turn: resources.RunningTurn
    ttl_seconds: int
    revision: int
    # The conversation's servable retained turn when the mark was taken (0: none, a record whose engine
    # incarnation is not registered, or the mark was renewed), and that record's engine request id.
    retained_turn: int = 0
    retained_request_id: str = ""


@dataclass(frozen=True)
class EndedTurn:
    ended: bool
    revision: int


@dataclass(frozen=True)
class _Held:
    request_id: str
    lease: int
    turn: resources.RunningTurn


def _in_flight(running: resources.RunningTurn, now: float) -> TurnInFlight:
    running_for = max(0.0, now - running.start_time.ToNanoseconds() / 1e9)
    return TurnInFlight(
        f"conversation {running.conversation_id} of tenant {running.tenant} has a turn in flight: request "
        f"{running.request_id} (on {running.holder or 'an unnamed router'}, started {running_for:.1f} s "
        "ago); one turn runs at a time per conversation: send this one again once that one has finished"
    )


class LeasePool:
    """Leases of one TTL granted ahead of need, so that taking a mark is a single etcd write.

    A lease waits at most a third of its TTL in the pool: the mark it carries keeps two thirds, and its
    holder renews it a third of the TTL after taking it. Each lease taken is replaced in the background;
    an idle registry grants nothing (spares that aged out are left to expire: they hold no keys).
    """

    def __init__(self, etcd: EtcdGateway, ttl_seconds: int, *, clock: Clock, spares: int = 8) -> None:
        self._etcd = etcd
        self._ttl = ttl_seconds
        self._target = spares
        self._clock = clock
        self._spares: deque[tuple[float, Lease]] = deque()
        self._filling: asyncio.Task[None] | None = None

    async def take(self) -> Lease:
        """A lease with at least two thirds of its TTL left; call :meth:`fill` once it is used."""
        now = self._clock.monotonic()
        while self._spares:
            granted_at, spare = self._spares.popleft()
            if now - granted_at < spare.ttl_seconds / 3:
                return spare
        return await self._etcd.grant(self._ttl)

    def fill(self) -> None:
        """Grants spares in the background, after the write that used one (not beside it: etcd serves the
        write sooner alone)."""
        if self._filling is None or self._filling.done():
            self._filling = asyncio.create_task(self._grant_spares(), name="turn-lease-pool")

    async def _grant_spares(self) -> None:
        while len(self._spares) < self._target:
            try:
                lease = await self._etcd.grant(self._ttl)
            except ServiceError as error:
                log.warning("could not grant spare turn leases", extra={"error": str(error)})
                return
            self._spares.append((self._clock.monotonic(), lease))

    async def close(self) -> None:
        if self._filling is not None:
            self._filling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._filling


class TurnStore:
    """Begins, renews and ends the turns in flight.

    ``records`` is the registry's cache of retention records (``RetentionStore.cache``): the engine the
    cached record names is the mark's guess, read in its transaction (a conversation seldom moves; a
    wrong or missing guess costs a read more), and a record the mark reads is cached there.
    """

    def __init__(
        self,
        etcd: EtcdGateway,
        layout: KeyLayout,
        ttl: TtlPolicy,
        *,
        records: RetentionCache,
        clock: Clock | None = None,
        metrics: RegistryMetrics | None = None,
    ) -> None:
        self.etcd = etcd
        self.layout = layout
        self.ttl = ttl
        self._clock: Clock = clock if clock is not None else SystemClock()
        self._metrics = metrics if metrics is not None else RegistryMetrics()
        self._writes = TxnBatcher(etcd)
        self._held: OrderedDict[bytes, _Held] = OrderedDict()
        self._records = records
        self._leases: dict[int, LeasePool] = {}

    async def begin_turn(
        self, tenant: str, conversation_id: str, request_id: str, holder: str, ttl_seconds: int
    ) -> BegunTurn:
        """Takes the conversation's mark for ``request_id``, or renews it when that request holds it;
        :class:`TurnInFlight` when another request does."""
        conversation = validation.conversation_key(tenant, conversation_id)
        validation.require_id("request_id", request_id)
        if holder:
            validation.require_id("holder", holder)
        ttl = validation.turn_ttl(ttl_seconds, self.ttl)
        key = self.layout.turn(conversation)
        held = self._held.get(key)
        if held is not None and held.request_id == request_id:
            renewed = await self._renew_held(key, held)
            if renewed is not None:
                return renewed
        return await until_settled(
            lambda: self._try_begin(conversation, key, request_id, holder, ttl),
            changed=f"the turn mark of conversation {conversation_id}",
        )

    async def _try_begin(
        self, conversation: ConversationKey, key: bytes, request_id: str, holder: str, ttl: int
    ) -> BegunTurn | None:
        """One attempt: the mark written (or renewed, or refused); None when it vanished under the call."""
        pool = self._leases.get(ttl)
        if pool is None:
            pool = self._leases[ttl] = LeasePool(self.etcd, ttl, clock=self._clock)
        lease = await pool.take()
        running = resources.RunningTurn(
            tenant=conversation.tenant,
            conversation_id=conversation.conversation_id,
            request_id=request_id,
            holder=holder,
            start_time=to_timestamp(self._clock.time()),
        )
        cached = self._records.get(self.layout.live(conversation))
        engine_guess = cached.stored.retention.engine_id if cached is not None else None
        # The record's key without its value (up to ~170 KB at 128k tokens) and its holder, which holds
        # all the answer needs (engine, incarnation, turn, request) in a few dozen bytes.
        reads = [Get(self.layout.live(conversation), keys_only=True), Get(self.layout.holder(conversation))]
        if engine_guess is not None:
            reads.append(Get(self.layout.engine(engine_guess)))
        try:
            written = await self._writes.txn(
                [ModRevisionIs(key, 0)], [Put(key, running.SerializeToString(), lease.id), *reads], [Get(key)]
            )
        except LeaseNotFound:
            return None  # the lease was gone before the write (an etcd leader change): again
        except BaseException:
            await self.etcd.revoke_quietly(lease.id, "turn mark not written")
            raise
        finally:
            pool.fill()
        if written.succeeded:
            self._remember(key, _Held(request_id, lease.id, running))
            retained = await self._servable_record(conversation, written, engine_guess, request_id)
            if retained is None:
                return BegunTurn(running, lease.ttl_seconds, written.revision)
            return BegunTurn(
                running, lease.ttl_seconds, written.revision, int(retained.turn), retained.engine_request_id
            )
        await self.etcd.revoke_quietly(lease.id, "turn mark taken meanwhile")
        existing = written.range(0).first
        if existing is None:
            return None
        current = _decode(existing)
        if current.request_id != request_id:
            self._metrics.turn_refused()
            raise _in_flight(current, self._clock.time())
        # This request's own mark, taken through another replica (or an answer that was lost): renew it.
        try:
            renewal = await self.etcd.keep_alive_once(existing.lease)
        except LeaseNotFound:
            return None
        self._metrics.lease_renewed(LEASE_TURN)
        self._remember(key, _Held(request_id, existing.lease, current))
        return BegunTurn(current, renewal.ttl_seconds, max(renewal.revision, written.revision))

    async def _servable_record(
        self, conversation: ConversationKey, written: TxnResult, engine_guess: str | None, request_id: str
    ) -> resources.Retention | None:
        """The conversation's record as the mark's transaction saw it (its holder: engine, turn,
        request), or None: no record, its engine incarnation not registered (rule 3), or what the
        transaction did not read cannot be read now."""
        live = written.range(1).first
        if live is None:
            return None
        holder = written.range(2).first
        # Written with the record, under its lease; a record from before holders were has none.
        summary = decode_record(holder.value) if holder is not None and holder.lease == live.lease else None
        if summary is not None and summary.retention.engine_id == engine_guess:
            engine = written.range(3).first
        else:
            try:
                summary, engine = await self._read_after_mark(conversation, live, summary)
            except ServiceError as error:
                # The mark is taken: keep it (failing now would leave it to block the conversation's next
                # turn until its lease ends) and report no record, so the caller asks the registry again.
                log.warning(
                    "a turn's mark could not read its record or its engine; reporting no record",
                    extra={"request_id": request_id, "error": str(error)},
                )
                return None
        if summary is None or engine is None or engine.lease != summary.engine_incarnation:
            return None
        return summary.retention

    async def _read_after_mark(
        self, conversation: ConversationKey, live: KeyValue, summary: StoredRetention | None
    ) -> tuple[StoredRetention | None, KeyValue | None]:
        """What the mark's transaction did not guess: the registration of the engine ``summary`` names, and
        the record, cached so that the next mark guesses its engine (and a lookup here takes one round trip).

        Read after the mark: an incarnation registered now was registered at the mark's revision too (one that
        ended never comes back; an etcd gone back in time is refused by the gateway). Without ``summary`` (a
        record with no holder), the record read now stands for it if it is the one the mark saw (same
        revision: a record is never rewritten), and its engine is read next.
        """
        live_key = self.layout.live(conversation)
        engine_key = self.layout.engine(summary.retention.engine_id) if summary is not None else None
        read = await self.etcd.txn(
            [], [Get(live_key)] if engine_key is None else [Get(live_key), Get(engine_key)]
        )
        record = read.range(0).first
        if record is not None:
            stored = decode_record(record.value)
            cached = self._records.get(live_key)
            if cached is None or cached.mod_revision != record.mod_revision:
                self._records.put(live_key, stored, record.lease, record.mod_revision, len(record.value))
            if summary is None and record.mod_revision == live.mod_revision:
                summary = stored
        if summary is None:
            return None, None
        if engine_key is not None:
            return summary, read.range(1).first
        return summary, (await self.etcd.range(self.layout.engine(summary.retention.engine_id))).first

    async def _renew_held(self, key: bytes, held: _Held) -> BegunTurn | None:
        """Renews a mark this registry took; None when it is gone (expired or cleared)."""
        renewal, check = await asyncio.gather(
            self.etcd.keep_alive_once(held.lease),
            self.etcd.txn([LeaseIs(key, held.lease)], []),
            return_exceptions=True,
        )
        for outcome in (renewal, check):
            if isinstance(outcome, BaseException) and not isinstance(outcome, LeaseNotFound):
                raise outcome
        if isinstance(renewal, BaseException) or isinstance(check, BaseException) or not check.succeeded:
            self._held.pop(key, None)
            log.warning(
                "a turn's mark lapsed before it was renewed; taking it again",
                extra={"request_id": held.request_id, "holder": held.turn.holder},
            )
            return None
        self._metrics.lease_renewed(LEASE_TURN)
        return BegunTurn(held.turn, renewal.ttl_seconds, max(renewal.revision, check.revision))

    async def end_turn(self, tenant: str, conversation_id: str, request_id: str) -> EndedTurn:
        """Clears the conversation's mark if ``request_id`` holds it (revokes its lease)."""
        conversation = validation.conversation_key(tenant, conversation_id)
        validation.require_id("request_id", request_id)
        key = self.layout.turn(conversation)
        held = self._held.get(key)
        if held is not None and held.request_id == request_id:
            del self._held[key]
            # Revoking a lease that already ended is a no-op: nothing of a later turn lives under it.
            revision = await self.etcd.revoke(held.lease)
            return EndedTurn(revision > 0, revision)
        read = await self.etcd.range(key)
        existing = read.first
        if existing is None or _decode(existing).request_id != request_id:
            return EndedTurn(False, read.revision)
        revision = await self.etcd.revoke(existing.lease)
        return EndedTurn(revision > 0, revision or read.revision)

    async def close(self) -> None:
        for pool in self._leases.values():
            await pool.close()

    def _remember(self, key: bytes, held: _Held) -> None:
        self._held[key] = held
        self._held.move_to_end(key)
        while len(self._held) > _HELD_MARKS:
            self._held.popitem(last=False)


def _decode(kv: KeyValue) -> resources.RunningTurn:
    running = resources.RunningTurn()
    running.ParseFromString(kv.value)
    return running
