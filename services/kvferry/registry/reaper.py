"""The reaper: ends the retentions of engine incarnations that are gone, with ENGINE_GONE.

An incarnation is gone when its engine's key is deleted (lease expiry, DeregisterEngine) or
written again under another lease (a re-registration: the registry cannot tell a sidecar
restart from an engine restart whose KV blocks are gone). Lookups and renewals check the
engine's lease themselves (rule 3), so correctness never depends on the reaper: it makes
endings prompt, reported to watchers with their reason, and frees the records.

It follows ``engines/`` in etcd, and sweeps the per-engine index at start and after any etcd
outage, so ends missed while no registry was watching are reported too. Every ending is a
transaction guarded by the record's lease, so several registries reaping at once end each
retention once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from kvferry.registry.errors import EtcdFailure, EtcdUnavailable
from kvferry.registry.etcd import (
    RECONNECT_BACKOFF,
    EtcdGateway,
    EventType,
    KeyValue,
    LeaseIs,
    LeaseNotFound,
    RevisionCompacted,
    Txn,
    prefix_end,
)
from kvferry.registry.keys import ConversationKey, KeyLayout
from kvferry.registry.metrics import RegistryMetrics
from kvferry.registry.records import decode_incarnation
from kvferry.registry.retentions import end_operations
from kvferry.runtime.backoff import Backoff
from kvferry.runtime.clock import Clock, SystemClock
from kvferry.v1 import resources_pb2 as resources

log = logging.getLogger(__name__)

# Retentions ended per reaping transaction (each is a nested transaction of 3 operations;
# etcd allows 128 operations per level by default).
_REAP_BATCH = 32
_REAP_PAGE = 512


class EngineReaper:
    def __init__(
        self,
        etcd: EtcdGateway,
        layout: KeyLayout,
        *,
        clock: Clock | None = None,
        metrics: RegistryMetrics | None = None,
    ) -> None:
        self.etcd = etcd
        self.layout = layout
        self._clock: Clock = clock if clock is not None else SystemClock()
        self._metrics = metrics if metrics is not None else RegistryMetrics()

    async def reap_engine(self, engine_id: str) -> int:
        """Ends (ENGINE_GONE) every retention of ``engine_id`` not from its live incarnation."""
        engine = await self.etcd.get(self.layout.engine(engine_id))
        live_incarnation = engine.lease if engine is not None else 0
        start = self.layout.engine_index_prefix(engine_id)
        reaped = 0
        async for page in self.etcd.scan(start, prefix_end(start), page_size=_REAP_PAGE):
            stale = [kv for kv in page.kvs if decode_incarnation(kv.value) != live_incarnation]
            for first in range(0, len(stale), _REAP_BATCH):
                reaped += await self._end_engine_gone(stale[first : first + _REAP_BATCH])
        if reaped:
            log.info("retentions of a departed engine ended", extra={"engine_id": engine_id, "count": reaped})
        return reaped

    async def _end_engine_gone(self, index_kvs: Sequence[KeyValue]) -> int:
        entries = [(kv, *self.layout.index_entry_of(kv.key)) for kv in index_kvs]

        def nested(kv: KeyValue, engine_id: str, conversation: ConversationKey) -> Txn:
            reason = resources.RELEASE_REASON_ENGINE_GONE
            return Txn(
                [LeaseIs(self.layout.live(conversation), kv.lease)],
                end_operations(self.layout, conversation, engine_id, kv.lease, reason, self._clock.time()),
            )

        try:
            response = await self.etcd.txn([], [nested(*entry) for entry in entries])
            results = [response.txn(index).succeeded for index in range(len(entries))]
        except LeaseNotFound:
            # One lease expired meanwhile and failed the whole batch: go one by one.
            results = []
            for entry in entries:
                try:
                    single = await self.etcd.txn([], [nested(*entry)])
                    results.append(single.txn(0).succeeded)
                except LeaseNotFound:
                    results.append(False)
        ended = [kv.lease for (kv, _, _), ok in zip(entries, results, strict=True) if ok]
        self._metrics.released(resources.RELEASE_REASON_ENGINE_GONE, len(ended))
        # Each lease now holds only its tombstone; revoking it drops the tombstone too.
        await asyncio.gather(*(self.etcd.revoke_quietly(lease, "reaped retention") for lease in ended))
        return len(ended)

    async def sweep_orphans(self) -> int:
        """Reaps every engine whose index holds retentions of a dead incarnation (startup, resync)."""
        engines = await self.etcd.range(self.layout.engines, prefix_end(self.layout.engines))
        live = {self.layout.engine_id_of(kv.key): kv.lease for kv in engines.kvs}
        start = self.layout.engine_indexes
        orphaned: set[str] = set()
        async for page in self.etcd.scan(start, prefix_end(start), page_size=_REAP_PAGE * 4):
            for kv in page.kvs:
                engine_id, _ = self.layout.index_entry_of(kv.key)
                if decode_incarnation(kv.value) != live.get(engine_id, 0):
                    orphaned.add(engine_id)
        reaped = 0
        for engine_id in sorted(orphaned):
            reaped += await self.reap_engine(engine_id)
        return reaped

    async def run(self) -> None:
        """Follows engine deletions and re-registrations and reaps them, until cancelled.

        Survives etcd outages: after one (or a compaction that skipped events) it sweeps again.
        """
        backoff = Backoff(RECONNECT_BACKOFF)
        revision = 0
        needs_sweep = True
        while True:
            try:
                if needs_sweep:
                    revision = await self.etcd.current_revision()
                    await self.sweep_orphans()
                    needs_sweep = False
                async for events in self.etcd.watch(
                    self.layout.engines, prefix_end(self.layout.engines), start_revision=revision + 1
                ):
                    backoff.reset()
                    for event in events:
                        revision = event.revision
                        gone = event.type is EventType.DELETE
                        replaced = (
                            event.type is EventType.PUT
                            and event.previous is not None
                            and event.previous.lease != event.kv.lease
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
