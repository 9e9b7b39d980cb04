"""finish_within: await something for at most so long; on timeout, an error naming what hung."""

from __future__ import annotations

import asyncio

import pytest
from kvferry.runtime.deadline import finish_within

pytestmark = pytest.mark.timeout(30)


async def test_returns_the_result_or_raises_the_error_of_what_finished_in_time() -> None:
    async def answer() -> int:
        return 42

    async def broken() -> None:
        raise RuntimeError("broke")

    assert await finish_within(answer(), 1.0, "answer hung") == 42
    with pytest.raises(RuntimeError, match="broke"):
        await finish_within(broken(), 1.0, "broken hung")


async def test_on_timeout_raises_naming_what_hung_and_cancels_it_unless_told_not_to() -> None:
    hung = asyncio.ensure_future(asyncio.Event().wait())
    with pytest.raises(TimeoutError, match=r"^the thing hung$"):
        await finish_within(hung, 0.05, "the thing hung")
    await asyncio.sleep(0)
    assert hung.cancelled()

    left = asyncio.ensure_future(asyncio.Event().wait())
    with pytest.raises(TimeoutError):
        await finish_within(left, 0.05, "left running", cancel=False)
    await asyncio.sleep(0)
    assert not left.done()
    left.cancel()


async def test_one_that_swallows_its_cancellation_does_not_hang_the_caller() -> None:
    release = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await release.wait()

    task = asyncio.ensure_future(stubborn())
    with pytest.raises(TimeoutError):
        await finish_within(task, 0.05, "stubborn hung")
    release.set()
    await task
