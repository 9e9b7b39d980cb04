"""LangChain / LangGraph callback handlers that keep a kvferry conversation alive during tool calls.

One line in an existing agent (``pip install 'kvferry-sdk[langchain]'``)::

    # async runs (ainvoke, astream), with kvferry.sdk.Client
    await agent.ainvoke(inputs, config={"callbacks": [KvferryCallbackHandler(client, conversation_id)]})
    # synchronous runs (invoke, stream), with kvferry.sdk.SyncClient
    agent.invoke(inputs, config={"callbacks": [KvferrySyncCallbackHandler(sync_client, conversation_id)]})

While any tool runs the handler renews the conversation through the SDK's keep-alive, so a tool
slower than the lease does not cost the next turn its reuse. With ``close_on_end`` (the default) it
closes the conversation when the outermost run (the agent or graph invocation) ends, successful or
not; pass ``close_on_end=False`` to keep it across several invocations and call ``aclose`` (``close``
for the synchronous handler) at the end. The model's requests carry the conversation id themselves
(``ChatOpenAI(default_headers={"X-Conversation-Id": conversation_id})``).

The async handler renews on the run's event loop; LangChain runs an async handler's callbacks of a
synchronous run each on an event loop of its own, which ends with the callback, so there it renews
nothing (it says so once, naming the synchronous handler) rather than blocking the run. The
synchronous handler renews on the SyncClient's own loop thread, in synchronous and async runs alike.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from types import FrameType
from typing import Any
from uuid import UUID

from kvferry.sdk._sync import SyncClient, loop_and_client
from kvferry.sdk._tool_lease import ConversationLeases, LeaseAdapter
from langchain_core.callbacks import AsyncCallbackHandler, BaseCallbackHandler

_log = logging.getLogger("kvferry.sdk.adapters")


class _OutermostRuns:
    """The outermost runs (no parent) in flight: the conversation closes when the last one ends."""

    def __init__(self) -> None:
        self._runs: set[UUID] = set()

    def started(self, run_id: UUID, parent_run_id: UUID | None) -> None:
        if parent_run_id is None:
            self._runs.add(run_id)

    def ended(self, run_id: UUID) -> bool:
        """Whether ``run_id`` was the last outermost run in flight."""
        if run_id not in self._runs:
            return False
        self._runs.discard(run_id)
        return not self._runs


def _runs_on_a_loop_of_its_own(frame: FrameType | None) -> bool:
    """Whether the callback whose frame this is runs as the main task of its event loop: how LangChain
    runs an async handler's callbacks of a synchronous run (an async run awaits them inside its own
    coroutines)."""
    task = asyncio.current_task()
    return frame is not None and task is not None and getattr(task.get_coro(), "cr_frame", None) is frame


class KvferryCallbackHandler(LeaseAdapter, AsyncCallbackHandler):
    """Renews ``conversation_id`` while tools run in an async run; closes it when the outermost run ends."""

    # Awaited in order, before the tool starts (not gathered with other handlers).
    run_inline = True

    def __init__(
        self,
        client: ConversationLeases,
        conversation_id: str,
        *,
        close_on_end: bool = True,
        interval: float | None = None,
    ) -> None:
        self._start_lease(client, conversation_id, close_on_end=close_on_end, interval=interval)
        self._runs = _OutermostRuns()
        self._told_synchronous = False

    async def on_chain_start(
        self,
        serialized: dict[str, Any] | None,
        inputs: Any,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        **kwargs: Any,
    ) -> None:
        if self._synchronous(inspect.currentframe()):
            return
        self._runs.started(run_id, parent_run_id)

    async def on_chain_end(
        self, outputs: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        if not self._synchronous(inspect.currentframe()):
            await self._run_ended(run_id)

    async def on_chain_error(
        self, error: BaseException, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        if not self._synchronous(inspect.currentframe()):
            await self._run_ended(run_id)

    async def on_tool_start(
        self,
        serialized: dict[str, Any] | None,
        input_str: str,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        **kwargs: Any,
    ) -> None:
        if not self._synchronous(inspect.currentframe()):
            await self.lease.tool_started(run_id)

    async def on_tool_end(
        self, output: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        if not self._synchronous(inspect.currentframe()):
            await self.lease.tool_ended(run_id)

    async def on_tool_error(
        self, error: BaseException, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        if not self._synchronous(inspect.currentframe()):
            await self.lease.tool_ended(run_id)

    async def _run_ended(self, run_id: UUID) -> None:
        if self._runs.ended(run_id) and self.close_on_end:
            await self.lease.close()

    def _synchronous(self, frame: FrameType | None) -> bool:
        # Renewing there would start a keep-alive on a loop that ends with the callback (LangChain then
        # waits for it: the run would hang); the Client's channel belongs to the run's loop anyway.
        if not _runs_on_a_loop_of_its_own(frame):
            return False
        if not self._told_synchronous:
            self._told_synchronous = True
            _log.warning(
                "KvferryCallbackHandler renews only in async runs (ainvoke, astream); this run is "
                "synchronous, so the conversation is neither renewed nor closed by it: use "
                "KvferrySyncCallbackHandler with a kvferry.sdk.SyncClient",
                extra={"conversation_id": self.conversation_id},
            )
        return True


class KvferrySyncCallbackHandler(LeaseAdapter, BaseCallbackHandler):
    """Renews ``conversation_id`` while tools run, for synchronous runs (``invoke``, ``stream``; async
    runs work too): the renewals run on the SyncClient's loop thread while the tool runs."""

    # In async runs LangChain calls it in a worker thread: it waits for the SyncClient's thread.
    run_inline = False

    def __init__(
        self,
        client: SyncClient,
        conversation_id: str,
        *,
        close_on_end: bool = True,
        interval: float | None = None,
    ) -> None:
        self._runner, async_client = loop_and_client(client)
        self._start_lease(async_client, conversation_id, close_on_end=close_on_end, interval=interval)
        self._runs = _OutermostRuns()

    def on_chain_start(
        self,
        serialized: dict[str, Any] | None,
        inputs: Any,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        **kwargs: Any,
    ) -> None:
        self._runs.started(run_id, parent_run_id)

    def on_chain_end(
        self, outputs: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        self._run_ended(run_id)

    def on_chain_error(
        self, error: BaseException, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        self._run_ended(run_id)

    def on_tool_start(
        self,
        serialized: dict[str, Any] | None,
        input_str: str,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        **kwargs: Any,
    ) -> None:
        self._runner.run(self.lease.tool_started(run_id))

    def on_tool_end(
        self, output: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        self._runner.run(self.lease.tool_ended(run_id))

    def on_tool_error(
        self, error: BaseException, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        self._runner.run(self.lease.tool_ended(run_id))

    def close(self) -> None:
        """Stops renewing and closes the conversation (idempotent)."""
        self._runner.run(self.lease.close())

    def _run_ended(self, run_id: UUID) -> None:
        if self._runs.ended(run_id) and self.close_on_end:
            self.close()
