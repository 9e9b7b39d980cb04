"""The router's local retention index: every live retention, fed by one registry watch.

``WatchAllRetentions`` sends a snapshot (one PUBLISHED per live retention, then SYNCED), then every
publish, renewal and end. The index answers a lookup in process (a dict read); it is a hint, never
the authority: the registry stays authoritative and the pull-time generation fence catches a stale
record (a stale miss costs a recompute). Each router replica keeps its own; ``ready`` is set once the
first snapshot is complete (report ready only then), and a broken stream is opened again, its
snapshot replacing the index when complete.

Events are judged by revision: each entry remembers the revision it reflects, and an event at or
below it is old news (the snapshot is read after the watch starts, so some events repeat it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from kvferry.runtime.backoff import Backoff, BackoffPolicy
from kvferry.v1 import registry_service_pb2 as registry_pb2
from kvferry.v1 import resources_pb2

log = logging.getLogger(__name__)

RESYNC_BACKOFF = BackoffPolicy(initial_seconds=0.2, max_seconds=5.0)


@dataclass(slots=True)
class IndexEntry:
    # The whole record as the registry sent it (protobuf keeps block ids and digests compactly).
    retention: resources_pb2.Retention
    # Lease end, Unix nanoseconds (moved by renewals).
    expire_ns: int
    # The registry revision this entry reflects.
    revision: int


def _key(retention: resources_pb2.Retention) -> tuple[str, str]:
    return retention.tenant, retention.conversation_id


def apply_event(
    entries: dict[tuple[str, str], IndexEntry], event: registry_pb2.WatchAllRetentionsResponse
) -> None:
    """Applies one PUBLISHED, RENEWED or ENDED event to ``entries`` (idempotent, judged by revision)."""
    retention, revision = event.retention, event.header.revision
    key = _key(retention)
    entry = entries.get(key)
    if entry is not None and revision <= entry.revision:
        return  # what the entry already reflects
    if event.type == registry_pb2.RETENTION_EVENT_TYPE_PUBLISHED:
        entries[key] = IndexEntry(retention, retention.expire_time.ToNanoseconds(), revision)
        return
    if entry is None or entry.retention.engine_request_id != retention.engine_request_id:
        return  # not the turn the index holds (an older one, or one it never saw)
    if event.type == registry_pb2.RETENTION_EVENT_TYPE_RENEWED:
        entry.expire_ns = max(entry.expire_ns, retention.expire_time.ToNanoseconds())
        entry.revision = revision
    elif event.type == registry_pb2.RETENTION_EVENT_TYPE_ENDED:
        del entries[key]


class RetentionIndex:
    """Every live retention, kept from ``watch()`` (a factory of WatchAllRetentions streams)."""

    def __init__(self, watch: Callable[[], AsyncIterator[registry_pb2.WatchAllRetentionsResponse]]) -> None:
        self._watch = watch
        self._entries: dict[tuple[str, str], IndexEntry] = {}
        self.ready = asyncio.Event()
        self.revision = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, tenant: str, conversation_id: str, now: float) -> resources_pb2.Retention | None:
        """The live retention the index knows for the conversation (unexpired at ``now``), or None."""
        entry = self._entries.get((tenant, conversation_id))
        if entry is None or entry.expire_ns <= now * 1e9:
            return None
        return entry.retention

    async def run(self) -> None:
        """Follows the registry until cancelled, opening the stream again when it breaks."""
        backoff = Backoff(RESYNC_BACKOFF)
        while True:
            try:
                await self._follow_once(backoff)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.warning(
                    "retention index stream broke; resyncing",
                    extra={"error": str(error), "entries": len(self._entries), "revision": self.revision},
                )
            await backoff.wait()

    async def _follow_once(self, backoff: Backoff) -> None:
        building: dict[tuple[str, str], IndexEntry] = {}
        synced = False
        async for event in self._watch():
            if not synced:
                if event.type == registry_pb2.RETENTION_EVENT_TYPE_SYNCED:
                    # The new snapshot replaces the index at once; the old one served until now.
                    self._entries, building, synced = building, {}, True
                    self.revision = event.header.revision
                    self.ready.set()
                    backoff.reset()
                    log.info("retention index synced", extra={"entries": len(self._entries)})
                else:
                    apply_event(building, event)
                continue
            apply_event(self._entries, event)
            self.revision = max(self.revision, event.header.revision)
