"""A LangChain / LangGraph callback handler that keeps a kvferry conversation alive during tool calls.

One line in an existing agent (``pip install 'kvferry-sdk[langchain]'``)::

    handler = KvferryCallbackHandler(client, conversation_id)
    await agent.ainvoke(inputs, config={"callbacks": [handler]})

While any tool runs the handler renews the conversation through the SDK's keep-alive, so a tool
slower than the lease does not cost the next turn its reuse. With ``close_on_end`` (the default) it
closes the conversation when the outermost run (the agent or graph invocation) ends, successful or
not; pass ``close_on_end=False`` to keep it across several invocations and call ``aclose`` at the end.
The model's requests carry the conversation id themselves (``ChatOpenAI(default_headers={
"X-Conversation-Id": conversation_id})``). Async runs only (``ainvoke``/``astream``): the keep-alive
renews on the running event loop.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

from kvferry.sdk._tool_lease import ConversationLeases, LeaseAdapter
from langchain_core.callbacks import AsyncCallbackHandler


class KvferryCallbackHandler(LeaseAdapter, AsyncCallbackHandler):
    """Renews ``conversation_id`` while tools run; closes it when the outermost run ends."""

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
        self._root_runs: set[UUID] = set()

    async def on_chain_start(
        self,
        serialized: dict[str, Any] | None,
        inputs: Any,
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        **kwargs: Any,
    ) -> None:
        if parent_run_id is None:
            self._root_runs.add(run_id)

    async def on_chain_end(
        self, outputs: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        await self._run_ended(run_id)

    async def on_chain_error(
        self, error: BaseException, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
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
        await self.lease.tool_started(run_id)

    async def on_tool_end(
        self, output: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        await self.lease.tool_ended(run_id)

    async def on_tool_error(
        self, error: BaseException, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        await self.lease.tool_ended(run_id)

    async def _run_ended(self, run_id: UUID) -> None:
        if run_id not in self._root_runs:
            return
        self._root_runs.discard(run_id)
        if self.close_on_end and not self._root_runs:
            await self.lease.close()
