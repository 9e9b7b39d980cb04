"""The router's local retention index: every live retention, fed by one registry watch.

``WatchAllRetentions`` sends a snapshot (one PUBLISHED per live retention, then SYNCED), then every
publish and end. A retention lives until its end (its lease running out is one: ENDED, EXPIRED);
renewals write nothing and send nothing, so the index keeps no expiry of its own. The index answers
a lookup in process (a dict read); it is a hint, never the authority: the registry stays
authoritative and the pull-time generation fence catches a stale record (a stale miss costs a
recompute). Each router replica keeps its own; ``ready`` is set once the first snapshot is complete
(report ready only then), and a broken stream is opened again, its snapshot replacing the index when
complete. While the stream is broken (until the new snapshot is
complete) the index is not ``serving``: lookups go to the registry.

:class:`RetentionLookups` is a turn's lookup: the index when it is serving and holds the conversation,
else the registry's ``GetRetention`` (a miss too: the record may be newer than the index). How a turn
confirms what the index said: docs/router.md, "The registry: renewals and the local retention index".

Events are judged by revision: each entry remembers the revision it reflects, and an event at or
below it is old news (the snapshot is read after the watch starts, so some events repeat it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from kvferry.router.registry_client import RetentionRecord
from kvferry.runtime.backoff import Backoff, BackoffPolicy
from kvferry.v1 import registry_service_pb2 as registry_pb2
from kvferry.v1 import resources_pb2

log = logging.getLogger(__name__)

RESYNC_BACKOFF = BackoffPolicy(initial_seconds=0.2, max_seconds=5.0)


@dataclass(slots=True)
class IndexEntry:
    # The whole record, converted when it arrives (off the turn's path: converting a 128k-token record's
    # block ids and digests takes around a millisecond).
    record: RetentionRecord
    # The registry revision this entry reflects.
    revision: int
    # The revision of the event that published it.
    published: int


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
        try:
            record = RetentionRecord.from_proto(retention)
        except (ValueError, OverflowError) as error:
            # Not a record the registry lets in (it checks digests' size): left to the registry's lookup.
            entries.pop(key, None)
            log.error(
                "retention index skipped a record it cannot hold",
                extra={"tenant": key[0], "conversation_id": key[1], "error": str(error)},
            )
            return
        entries[key] = IndexEntry(record, revision, revision)
        return
    if entry is None or entry.record.engine_request_id != retention.engine_request_id:
        return  # not the turn the index holds (an older one, or one it never saw)
    if event.type == registry_pb2.RETENTION_EVENT_TYPE_RENEWED:
        entry.revision = revision  # from a registry that still wrote renewals: nothing to change
    elif event.type == registry_pb2.RETENTION_EVENT_TYPE_ENDED:
        del entries[key]


class RetentionIndex:
    """Every live retention, kept from ``watch()`` (a factory of WatchAllRetentions streams)."""

    def __init__(self, watch: Callable[[], AsyncIterator[registry_pb2.WatchAllRetentionsResponse]]) -> None:
        self._watch = watch
        self._entries: dict[tuple[str, str], IndexEntry] = {}
        # Set once the first snapshot is complete (and stays set): report ready only then.
        self.ready = asyncio.Event()
        # Synced and following: the stream is up and its snapshot was complete.
        self.serving = False
        self.revision = 0

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, tenant: str, conversation_id: str) -> RetentionRecord | None:
        """The live retention the index knows for the conversation (its record as published: its
        ``expire_time`` is the lease's first end, not moved by renewals); None when it knows none."""
        entry = self._entries.get((tenant, conversation_id))
        return entry.record if entry is not None else None

    def turn_since(self, tenant: str, conversation_id: str, after_revision: int) -> int:
        """The conversation's live turn if it was published after registry revision ``after_revision``
        (as the index saw it), else 0."""
        entry = self._entries.get((tenant, conversation_id))
        if entry is None or entry.published <= after_revision:
            return 0
        return entry.record.turn

    async def run(self) -> None:
        """Follows the registry until cancelled, opening the stream again when it breaks."""
        backoff = Backoff(RESYNC_BACKOFF)
        try:
            while True:
                try:
                    await self._follow_once(backoff)
                    error = "the registry ended the stream"
                except asyncio.CancelledError:
                    raise
                except Exception as failure:
                    error = str(failure)
                self.serving = False
                delay = backoff.next_delay()
                log.warning(
                    "retention index stream broke; lookups go to the registry until it is synced again",
                    extra={
                        "error": error,
                        "entries": len(self._entries),
                        "revision": self.revision,
                        "retry_in_s": round(delay, 3),
                    },
                )
                await asyncio.sleep(delay)
        finally:
            self.serving = False

    async def _follow_once(self, backoff: Backoff) -> None:
        building: dict[tuple[str, str], IndexEntry] = {}
        synced = False
        started = time.monotonic()
        async for event in self._watch():
            if not synced:
                if event.type == registry_pb2.RETENTION_EVENT_TYPE_SYNCED:
                    # The new snapshot replaces the index at once; the old one served until now.
                    self._entries, building, synced = building, {}, True
                    self.revision = event.header.revision
                    self.serving = True
                    self.ready.set()
                    backoff.reset()
                    log.info(
                        "retention index synced",
                        extra={
                            "entries": len(self._entries),
                            "revision": self.revision,
                            "seconds": round(time.monotonic() - started, 3),
                        },
                    )
                else:
                    apply_event(building, event)
                continue
            apply_event(self._entries, event)
            self.revision = max(self.revision, event.header.revision)


class RetentionSource(Protocol):
    """The registry's lookup (:class:`~kvferry.router.registry_client.GrpcRegistry`; fakes in tests)."""

    async def get_retention(self, tenant: str, conversation_id: str) -> RetentionRecord | None: ...


# Where a lookup was answered: "index" (in process: it holds the conversation's record) or "miss" (in process:
# it holds none), else the registry and why (the index was not serving, is turned off, or the caller asked the
# registry).
LookupPath = Literal["index", "miss", "not_synced", "off", "registry"]


@dataclass(frozen=True, slots=True)
class Lookup:
    retention: RetentionRecord | None
    path: LookupPath


class RetentionLookups:
    """A turn's retention lookup: read from ``index`` while it is serving, else ``GetRetention``.

    What the index says, a record or none, is a hint the turn confirms: the turn's mark reads the registry's
    record in its own transaction, and the turn asks the registry when the two differ (a record published
    or ended since the index heard of it). A miss is thus answered in process too, so a conversation's first
    turn asks the registry nothing beside its mark. ``index`` None: always the registry.
    """

    def __init__(self, registry: RetentionSource, index: RetentionIndex | None) -> None:
        self._registry = registry
        self.index = index

    async def lookup(self, tenant: str, conversation_id: str, *, from_registry: bool = False) -> Lookup:
        """The conversation's retention; ``from_registry``: skip the index. Raises what the registry
        raises (``RegistryUnavailable``) when it is asked."""
        path: LookupPath
        if from_registry:
            path = "registry"
        elif self.index is None:
            path = "off"
        elif not self.index.serving:
            path = "not_synced"
        else:
            found = self.index.find(tenant, conversation_id)
            return Lookup(found, "index" if found is not None else "miss")
        return Lookup(await self._registry.get_retention(tenant, conversation_id), path)

    def indexed_turn(self, tenant: str, conversation_id: str, after_revision: int) -> int | None:
        """The conversation's live turn in the index if its entry is newer than ``after_revision`` (else
        0); None when the index is off or not serving."""
        if self.index is None or not self.index.serving:
            return None
        return self.index.turn_since(tenant, conversation_id, after_revision)
