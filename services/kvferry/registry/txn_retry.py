"""Optimistic etcd transactions, retried: an attempt reads, then writes guarded by what it read; a guard that
fails (the keys changed under the call) means try again, up to :data:`TXN_ATTEMPTS` times, then ABORTED."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from kvferry.runtime.errors import Aborted

# Optimistic transactions retry this often before answering ABORTED.
TXN_ATTEMPTS = 4

_Result = TypeVar("_Result")


async def until_settled(
    attempt: Callable[[], Awaitable[_Result | None]], *, changed: str, doing: str = ""
) -> _Result:
    """The first result of ``attempt()`` that is not None (None: what it read changed under it); after
    :data:`TXN_ATTEMPTS` Nones, ``Aborted("{changed} changed concurrently N times{doing}; retry")``."""
    for _ in range(TXN_ATTEMPTS):
        result = await attempt()
        if result is not None:
            return result
    raise Aborted(f"{changed} changed concurrently {TXN_ATTEMPTS} times{doing}; retry")
