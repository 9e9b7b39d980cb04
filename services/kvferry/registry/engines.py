"""Engines in etcd: each registered engine is one key under its own lease (its incarnation).

``RegisterEngine`` grants a fresh lease every time, so a re-registered engine is a new
incarnation and the reaper ends what the old one retained; heartbeats keep the lease alive
(only the incarnation they name, when they name one); when it ends, the key goes and the engine
has left. A registration carrying evidence that etcd went back in time (a revision above etcd's, or a
retention the engine ended stored as written before that end) starts a new epoch first
(kvferry.registry.epochs). Plain Python over the etcd gateway; the gRPC handlers only translate
messages.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvferry.registry import validation
from kvferry.registry.config import TtlPolicy
from kvferry.registry.epochs import NO_EPOCH, Epoch, EpochKeeper
from kvferry.registry.errors import EtcdFailure, EtcdUnavailable
from kvferry.registry.etcd import (
    RECONNECT_BACKOFF,
    Delete,
    EtcdGateway,
    EventType,
    Get,
    LeaseIs,
    LeaseNotFound,
    LeaseRenewal,
    Put,
    RevisionCompacted,
    WatchEvent,
    prefix_end,
)
from kvferry.registry.keys import KeyLayout
from kvferry.registry.metrics import RegistryMetrics
from kvferry.registry.reaper import EngineReaper
from kvferry.registry.records import decode_engine, decode_record
from kvferry.runtime.backoff import Backoff
from kvferry.runtime.clock import Clock, SystemClock
from kvferry.runtime.errors import Aborted, NotFound, ServiceError
from kvferry.runtime.metrics import LEASE_ENGINE
from kvferry.runtime.timestamps import to_timestamp
from kvferry.v1 import registry_service_pb2 as registry
from kvferry.v1 import resources_pb2 as resources

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RegisteredEngine:
    engine: resources.Engine
    ttl_seconds: int
    revision: int
    # The registration's lease (its incarnation), and the registry's epoch at registration.
    incarnation: int = 0
    epoch: str = ""


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


def _role_matches(wanted: resources.EngineRole.ValueType, role: resources.EngineRole.ValueType) -> bool:
    if wanted == resources.ENGINE_ROLE_UNSPECIFIED or wanted == role:
        return True
    return role == resources.ENGINE_ROLE_BOTH and wanted in (
        resources.ENGINE_ROLE_PREFILL,
        resources.ENGINE_ROLE_DECODE,
    )


def _not_registered(engine_id: str) -> NotFound:
    return NotFound(
        f"engine {engine_id} is not registered (its lease ended or it left); call RegisterEngine again"
    )


class EngineStore:
    """Registers, renews, lists and watches engines; a departing incarnation is handed to the reaper."""

    def __init__(
        self,
        etcd: EtcdGateway,
        layout: KeyLayout,
        ttl: TtlPolicy,
        reaper: EngineReaper,
        *,
        epochs: EpochKeeper | None = None,
        clock: Clock | None = None,
        metrics: RegistryMetrics | None = None,
    ) -> None:
        self.etcd = etcd
        self.layout = layout
        self.ttl = ttl
        self._reaper = reaper
        self.epochs = epochs if epochs is not None else EpochKeeper(etcd, layout, metrics=metrics)
        self._clock: Clock = clock if clock is not None else SystemClock()
        self._metrics = metrics if metrics is not None else RegistryMetrics()

    async def register_engine(
        self,
        engine: resources.Engine,
        ttl_seconds: int,
        *,
        seen_revision: int = 0,
        seen_epoch: str = "",
        ended: registry.EndedRetention | None = None,
    ) -> RegisteredEngine:
        """Stores ``engine`` under a fresh lease; a previous incarnation's retentions end.

        Evidence that etcd went back in time since the caller's previous registration (in
        ``seen_epoch``) starts a new epoch first: ``seen_revision`` above etcd's current revision, or
        ``ended``, a retention of this engine that it ended, still stored as written before that end.
        """
        validation.validate_engine(engine)
        ttl = validation.engine_ttl(ttl_seconds, self.ttl)
        evidence = await self._restore_evidence(engine.engine_id, seen_revision, seen_epoch, ended)
        if evidence:
            await self.epochs.restored(Epoch.parse(seen_epoch) or NO_EPOCH, evidence)
        lease = await self.etcd.grant(ttl)
        stored = resources.Engine()
        stored.CopyFrom(engine)
        stored.name = f"engines/{engine.engine_id}"
        stored.register_time.CopyFrom(to_timestamp(self._clock.time()))
        key = self.layout.engine(engine.engine_id)
        written = await self.etcd.txn(
            [], [Put(key, stored.SerializeToString(), lease.id, prev_kv=True), Get(self.layout.epoch)]
        )
        previous = written.put(0).previous
        epoch_kv = written.range(1).first
        epoch = self.epochs.saw(epoch_kv.value if epoch_kv is not None else None)
        log.info(
            "engine registered",
            extra={
                "engine_id": engine.engine_id,
                "ttl_seconds": lease.ttl_seconds,
                "re_registered": previous is not None,
            },
        )
        if previous is not None and previous.lease != lease.id:
            # A new incarnation (e.g. the engine restarted): what the old one retained is gone.
            await self.etcd.revoke_quietly(previous.lease, "old engine incarnation")
            try:
                await self._reaper.reap_engine(engine.engine_id)
            except (ServiceError, LeaseNotFound) as error:
                # The reaper's own watch and sweeps end them later; lookups refuse them already.
                log.warning(
                    "old incarnation not reaped yet",
                    extra={"engine_id": engine.engine_id, "error": str(error)},
                )
        return RegisteredEngine(stored, lease.ttl_seconds, written.revision, lease.id, str(epoch))

    async def _restore_evidence(
        self, engine_id: str, seen_revision: int, seen_epoch: str, ended: registry.EndedRetention | None
    ) -> str:
        """Why etcd must have gone back in time, by what the caller saw; empty when nothing shows it."""
        if seen_revision > 0:
            current = await self.etcd.current_revision()
            if seen_revision > current:
                return (
                    f"engine {engine_id} saw revision {seen_revision} in epoch {seen_epoch or '?'}, "
                    f"etcd is at {current}"
                )
        if ended is None or ended.end_revision <= 0:
            return ""
        # Others' writes since the restore may have carried the revision past anything the caller saw;
        # a record never changes while it lives, so one written before its confirmed end is a copy
        # from before that end.
        conversation = validation.conversation_key(ended.tenant, ended.conversation_id)
        kv = await self.etcd.get(self.layout.live(conversation))
        if kv is None or kv.mod_revision >= ended.end_revision:
            return ""
        record = decode_record(kv.value).retention
        if record.engine_id != engine_id or record.engine_request_id != ended.engine_request_id:
            return ""
        return (
            f"engine {engine_id} ended retention {ended.engine_request_id} at revision {ended.end_revision}; "
            f"etcd holds it as written at revision {kv.mod_revision}"
        )

    async def heartbeat_engine(
        self,
        engine_id: str,
        stats: resources.EngineStats | None,
        incarnation: int = 0,
        *,
        release_grace_seconds: float = 0.0,
    ) -> LeaseRenewal:
        """Renews the engine's lease (and stores fresh stats, and a release grace its connector said after
        the registration; 0: unchanged): the TTL left, and the revision.

        With ``incarnation``, only that registration: another one live is NOT_FOUND (register again).
        """
        validation.require_id("engine_id", engine_id)
        validation.release_grace(release_grace_seconds, "release_grace_seconds")
        if stats is not None:
            validation.engine_stats(stats, "stats")
        key = self.layout.engine(engine_id)
        read = await self.etcd.range(key)
        kv = read.first
        if kv is None:
            raise _not_registered(engine_id)
        if incarnation and kv.lease != incarnation:
            raise NotFound(
                f"engine {engine_id} is registered under another incarnation than {incarnation:x} "
                "(registered again elsewhere, or etcd was restored from an older snapshot); call "
                "RegisterEngine again"
            )
        try:
            renewal = await self.etcd.keep_alive_once(kv.lease)
        except LeaseNotFound:
            raise _not_registered(engine_id) from None
        self._metrics.lease_renewed(LEASE_ENGINE)
        engine = decode_engine(kv.value)
        grace_changed = bool(release_grace_seconds) and release_grace_seconds != engine.release_grace_seconds
        if stats is None and not grace_changed:
            # The keep-alive's revision comes from etcd's leader, which may apply a little behind the
            # member that served the read; callers compare revisions, so never answer below the read.
            return LeaseRenewal(renewal.ttl_seconds, max(renewal.revision, read.revision))
        if stats is not None:
            engine.stats.CopyFrom(stats)
        if grace_changed:
            engine.release_grace_seconds = release_grace_seconds
        try:
            update = await self.etcd.txn(
                [LeaseIs(key, kv.lease)], [Put(key, engine.SerializeToString(), kv.lease)]
            )
        except LeaseNotFound:
            raise _not_registered(engine_id) from None
        if not update.succeeded:
            raise _not_registered(engine_id)
        return LeaseRenewal(renewal.ttl_seconds, update.revision)

    async def deregister_engine(self, engine_id: str) -> int:
        """Removes the engine now; its retentions end with ENGINE_GONE before this returns."""
        validation.require_id("engine_id", engine_id)
        key = self.layout.engine(engine_id)
        kv = await self.etcd.get(key)
        if kv is None:
            raise _not_registered(engine_id)
        deleted = await self.etcd.txn([LeaseIs(key, kv.lease)], [Delete(key)])
        if not deleted.succeeded:
            raise Aborted(f"engine {engine_id} re-registered while it was being removed; deregister again")
        await self.etcd.revoke_quietly(kv.lease, "deregistered engine")
        await self._reaper.reap_engine(engine_id)
        log.info("engine deregistered", extra={"engine_id": engine_id})
        return deleted.revision

    async def list_engines(
        self, role: resources.EngineRole.ValueType, page_size: int, page_token: str
    ) -> EnginePage:
        size = validation.page_size(page_size)
        start = self.layout.engines
        if page_token:
            start = self.layout.engine(validation.decode_page_token(page_token)) + b"\0"
        matches: list[resources.Engine] = []
        revision = 0
        # One more than a page: whether it exists says if there is a next page.
        pages = self.etcd.scan(start, prefix_end(self.layout.engines), page_size=size + 1)
        async with contextlib.aclosing(pages):
            async for response in pages:
                revision = revision or response.revision
                for kv in response.kvs:
                    engine = decode_engine(kv.value)
                    if _role_matches(role, engine.role):
                        matches.append(engine)
                if len(matches) > size:
                    break
        page = matches[:size]
        token = validation.encode_page_token(page[-1].engine_id) if len(matches) > size else ""
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
        backoff = Backoff(RECONNECT_BACKOFF)
        while True:
            try:
                async for events in self.etcd.watch(
                    self.layout.engines, prefix_end(self.layout.engines), start_revision=revision + 1
                ):
                    backoff.reset()
                    for event in events:
                        revision = event.revision
                        yield self._engine_event(event, known)
            except (EtcdUnavailable, EtcdFailure) as error:
                # A restarting etcd can also fail a watch with INTERNAL; resuming is always safe.
                log.warning(
                    "engine watch lost etcd; resuming", extra={"error": str(error), "revision": revision}
                )
                await backoff.wait()
            except RevisionCompacted:
                async for resynced in self._resync_engines(known):
                    revision = resynced.revision
                    yield resynced
                revision = revision or await self.etcd.current_revision()

    def _engine_event(self, event: WatchEvent, known: dict[str, int]) -> EngineEvent:
        engine_id = self.layout.engine_id_of(event.kv.key)
        if event.type is EventType.DELETE:
            known.pop(engine_id, None)
            engine = (
                decode_engine(event.previous.value)
                if event.previous is not None
                else resources.Engine(engine_id=engine_id)
            )
            engine.name = f"engines/{engine_id}"
            return EngineEvent(registry.ENGINE_EVENT_TYPE_LEFT, engine, event.revision)
        previous_lease = known.get(engine_id)
        known[engine_id] = event.kv.lease
        kind = (
            registry.ENGINE_EVENT_TYPE_UPDATED
            if previous_lease == event.kv.lease
            else registry.ENGINE_EVENT_TYPE_JOINED
        )
        return EngineEvent(kind, decode_engine(event.kv.value), event.revision)

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
        """Every live engine with its lease, and the revision of the read."""
        response = await self.etcd.range(self.layout.engines, prefix_end(self.layout.engines))
        return [(decode_engine(kv.value), kv.lease, response.revision) for kv in response.kvs]
