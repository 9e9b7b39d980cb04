"""Time for the registry: an injectable clock, protobuf timestamps, and reconnect backoff."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from google.protobuf.timestamp_pb2 import Timestamp

# Seconds since the epoch; tests inject their own.
Clock = Callable[[], float]

_MAX_BACKOFF_SECONDS = 2.0


def timestamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


class Backoff:
    """Growing pauses between reconnect attempts (0.1 s doubling to a cap)."""

    def __init__(self, first: float = 0.1, cap: float = _MAX_BACKOFF_SECONDS) -> None:
        self._first = first
        self._cap = cap
        self._next = first

    def reset(self) -> None:
        self._next = self._first

    async def wait(self) -> None:
        await asyncio.sleep(self._next)
        self._next = min(self._next * 2, self._cap)
