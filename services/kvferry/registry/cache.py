"""What this registry last read or wrote for each conversation, to spare etcd round trips.

Never trusted on its own: every use checks, in the same etcd read or transaction, that the key
was not written since (its mod revision or lease) and that the engine's lease is the same, so a
stale entry only costs the round trip it was meant to save.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvferry.registry.records import StoredRetention

# Per-entry bookkeeping beyond the record bytes (dict slot, key, small objects).
_OVERHEAD_BYTES = 256


@dataclass(frozen=True)
class CachedRetention:
    stored: StoredRetention
    # The etcd lease holding the record and the revision it was last written at.
    lease: int
    mod_revision: int
    size: int


class RetentionCache:
    """Least-recently-used records, bounded by their total size."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, CachedRetention] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def get(self, key: bytes) -> CachedRetention | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(
        self, key: bytes, stored: StoredRetention, lease: int, mod_revision: int, encoded_size: int
    ) -> None:
        self.drop(key)
        size = encoded_size + len(key) + _OVERHEAD_BYTES
        if size > self.max_bytes:
            return
        self._entries[key] = CachedRetention(stored, lease, mod_revision, size)
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.size

    def drop(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.size
