"""How engines, retention records and tombstones are encoded in etcd values.

An engine's value is its ``Engine`` message. A live record is the ``Retention`` message behind
a small header naming the engine incarnation (the engine's lease id when the retention was
published). A lookup accepts the record only while that same incarnation is registered: a
re-registered engine (a restart, whose KV blocks are gone) never serves retentions from before
(rule 3 of docs/design.md).

A record is immutable. Beside it the publish writes its holder: the same header and a summary of
the record (``holder_summary``: engine, request, turn, size, TTL, no blocks), which renewals read
instead of the record, a size bounded by the ids whatever the number of blocks.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvferry.v1 import resources_pb2 as resources

_RECORD_MAGIC = b"R1"
_RECORD_HEADER = struct.Struct(">2sq")
_TOMBSTONE = struct.Struct(">Bd")
_INCARNATION = struct.Struct(">q")


@dataclass(frozen=True)
class StoredRetention:
    retention: resources.Retention
    engine_incarnation: int


def encode_record(retention: resources.Retention, engine_incarnation: int) -> bytes:
    return _RECORD_HEADER.pack(_RECORD_MAGIC, engine_incarnation) + retention.SerializeToString()


def decode_record(value: bytes) -> StoredRetention:
    magic, incarnation = _RECORD_HEADER.unpack_from(value)
    if magic != _RECORD_MAGIC:
        raise ValueError(f"not a retention record (header {magic!r})")
    retention = resources.Retention()
    retention.ParseFromString(value[_RECORD_HEADER.size :])
    return StoredRetention(retention=retention, engine_incarnation=incarnation)


def encode_holder(retention: resources.Retention, engine_incarnation: int) -> bytes:
    """A holder value: what names the retention's holder and its lease's TTL, no blocks."""
    return encode_record(holder_summary(retention), engine_incarnation)


def holder_summary(retention: resources.Retention) -> resources.Retention:
    """What a renewal needs and answers: the holder (engine, request, turn), the size in tokens, the
    TTL and the first expiry. Tenant, conversation and name are in the key (``KeyLayout.holder``); a
    few dozen bytes whatever the number of blocks."""
    return resources.Retention(
        engine_id=retention.engine_id,
        engine_request_id=retention.engine_request_id,
        turn=retention.turn,
        num_tokens=retention.num_tokens,
        ttl_seconds=retention.ttl_seconds,
        expire_time=retention.expire_time,
    )


def encode_tombstone(reason: resources.ReleaseReason.ValueType, end_time: float) -> bytes:
    return _TOMBSTONE.pack(int(reason), end_time)


def decode_tombstone(value: bytes) -> tuple[resources.ReleaseReason.ValueType, float]:
    reason, end_time = _TOMBSTONE.unpack(value)
    return resources.ReleaseReason.ValueType(reason), float(end_time)


def encode_incarnation(engine_incarnation: int) -> bytes:
    return _INCARNATION.pack(engine_incarnation)


def decode_incarnation(value: bytes) -> int:
    return int(_INCARNATION.unpack(value)[0]) if len(value) == _INCARNATION.size else 0


def decode_engine(value: bytes) -> resources.Engine:
    engine = resources.Engine()
    engine.ParseFromString(value)
    return engine
