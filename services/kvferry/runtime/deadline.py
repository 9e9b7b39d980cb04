"""Awaiting something for at most so long, and on timeout an error that names what hung."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def finish_within(awaitable: Awaitable[T], seconds: float, hung: str, *, cancel: bool = True) -> T:
    """Awaits ``awaitable`` for at most ``seconds``: its result, or its error. If it has not finished by
    then, raises ``TimeoutError(hung)`` (``hung`` names what did not finish) and cancels it, or with
    ``cancel`` False leaves it running. It is awaited as a task of its own, so one that swallows a
    cancellation cannot hang the caller; a cancellation of the caller propagates and leaves it running."""
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if not done:
        if cancel:
            task.cancel()
        raise TimeoutError(hung)
    return task.result()
