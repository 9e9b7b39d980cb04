"""An OpenAI Agents SDK run hook that keeps a kvferry conversation alive during tool calls.

One line in an existing agent (``pip install 'kvferry-sdk[openai-agents]'``)::

    result = await Runner.run(agent, task, hooks=KvferryRunHooks(client, conversation_id))

While any local tool runs the hook renews the conversation through the SDK's keep-alive, so a tool
slower than the lease does not cost the next model call its reuse. With ``close_on_end`` (the
default) it closes the conversation when the run's final output is produced; a run that raises
produces none, so close it yourself then (``await hooks.aclose()``, idempotent), as a multi-run
conversation does with ``close_on_end=False``. The model's requests carry the conversation id
themselves (``ModelSettings(extra_headers={"X-Conversation-Id": conversation_id})``).
"""

from __future__ import annotations

from typing import Any

from agents import RunHooks
from agents.run_context import RunContextWrapper
from agents.tool import Tool
from kvferry.sdk._tool_lease import ConversationLeases, LeaseAdapter


class KvferryRunHooks(LeaseAdapter, RunHooks[Any]):
    """Renews ``conversation_id`` while tools run; closes it when the run's final output is produced."""

    def __init__(
        self,
        client: ConversationLeases,
        conversation_id: str,
        *,
        close_on_end: bool = True,
        interval: float | None = None,
    ) -> None:
        self._start_lease(client, conversation_id, close_on_end=close_on_end, interval=interval)

    async def on_tool_start(self, context: RunContextWrapper[Any], agent: Any, tool: Tool) -> None:
        await self.lease.tool_started(_tool_key(context, tool))

    async def on_tool_end(
        self, context: RunContextWrapper[Any], agent: Any, tool: Tool, result: object
    ) -> None:
        await self.lease.tool_ended(_tool_key(context, tool))

    async def on_agent_end(self, context: RunContextWrapper[Any], agent: Any, output: Any) -> None:
        if self.close_on_end:
            await self.lease.close()


def _tool_key(context: RunContextWrapper[Any], tool: Tool) -> object:
    # A function tool's context is a ToolContext naming the call: parallel calls of one tool stay apart.
    return getattr(context, "tool_call_id", None) or tool.name
