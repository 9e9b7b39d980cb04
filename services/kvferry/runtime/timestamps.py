"""``google.protobuf.Timestamp`` to and from float seconds since the Unix epoch."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp


def to_timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def from_timestamp(stamp: Timestamp) -> float:
    return stamp.ToNanoseconds() / 1e9
