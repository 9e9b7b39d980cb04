"""The framework adapters with the frameworks' real classes and no network: a LangChain tool run
through a chain with ``KvferryCallbackHandler``, an OpenAI Agents SDK run (a scripted model that calls a
function tool) with ``KvferryRunHooks``; renewals during the tool, none after it, close at the end.
The same adapters against the real router: tests/sdk/test_examples.py."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from agents import Agent, FunctionTool, ModelResponse, RunConfig, Runner, Usage, function_tool
from agents.models.interface import Model
from kvferry.sdk import ChatMessage, ErrorCode, KeepAlive, KeepAliveSettings, SyncClient
from kvferry.sdk._errors import make_error
from kvferry.sdk._tool_lease import ToolLease
from kvferry.sdk.adapters.langchain import KvferryCallbackHandler, KvferrySyncCallbackHandler
from kvferry.sdk.adapters.openai_agents import KvferryRunHooks
from langchain_core.runnables import RunnableLambda
from langchain_core.tools import tool
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText

from tests.sdk.conftest import API_KEY
from tests.sdk.standin_router import StandInRouter

TOOL_SECONDS = 0.3
INTERVAL = 0.05


class CountingLeases:
    """The Client's keep-alive and close, against a lease that renewals extend (no server)."""

    def __init__(self, *, lost: bool = False) -> None:
        self.renewed_at: list[float] = []
        self.closed: list[str] = []
        self.lost = lost

    async def _renew(self, deadline_seconds: float | None) -> datetime:
        if self.lost:
            raise make_error(ErrorCode.NOT_FOUND, "nothing retained")
        self.renewed_at.append(asyncio.get_running_loop().time())
        return datetime.now(UTC) + timedelta(seconds=5)

    def keep_alive(self, conversation_id: str, *, interval: float | None = None) -> KeepAlive:
        return KeepAlive(conversation_id, self._renew, settings=KeepAliveSettings(), interval=interval)

    async def close_conversation(self, conversation_id: str) -> None:
        self.closed.append(conversation_id)
        if self.lost:
            raise make_error(ErrorCode.NOT_FOUND, "nothing retained")


async def test_tool_lease_renews_while_any_tool_runs() -> None:
    leases = CountingLeases()
    lease = ToolLease(leases, "conv-1", interval=INTERVAL)
    await lease.tool_started("a")
    await lease.tool_started("b")  # parallel tool calls share one keep-alive
    await asyncio.sleep(TOOL_SECONDS / 2)
    await lease.tool_ended("a")
    assert lease.renewing
    await asyncio.sleep(TOOL_SECONDS / 2)
    await lease.tool_ended("b")
    assert not lease.renewing and lease.renewals == len(leases.renewed_at) >= 4
    renewed = len(leases.renewed_at)
    await asyncio.sleep(3 * INTERVAL)
    assert len(leases.renewed_at) == renewed  # nothing between tools
    await lease.close()
    await lease.close()
    await lease.tool_started("late")  # a tool after close renews nothing
    assert leases.closed == ["conv-1"] and not lease.renewing


async def test_tool_lease_survives_a_lost_retention() -> None:
    leases = CountingLeases(lost=True)
    lease = ToolLease(leases, "conv-2", interval=INTERVAL)
    await lease.tool_started("a")
    await asyncio.sleep(2 * INTERVAL)
    await lease.tool_ended("a")
    assert lease.error is not None and lease.error.code is ErrorCode.NOT_FOUND and lease.renewals == 0
    await lease.close()  # NOT_FOUND on close: nothing retained, not an error
    assert leases.closed == ["conv-2"]


@tool
async def slow_search(query: str) -> str:
    """Looks something up, slowly."""
    await asyncio.sleep(TOOL_SECONDS)
    return f"results for {query}"


async def test_langchain_handler_renews_during_tools_and_closes_after_the_run() -> None:
    leases = CountingLeases()
    handler = KvferryCallbackHandler(leases, "conv-lc", interval=INTERVAL)
    renewals_seen_by_tool: list[int] = []

    async def agent_step(query: str) -> str:
        result = await slow_search.ainvoke(query)
        renewals_seen_by_tool.append(len(leases.renewed_at))
        return str(result)

    output = await RunnableLambda(agent_step).ainvoke("basel rivers", config={"callbacks": [handler]})
    assert output == "results for basel rivers"
    assert renewals_seen_by_tool[0] >= 3  # renewed while the tool slept
    assert handler.renewals == renewals_seen_by_tool[0] and handler.error is None
    assert leases.closed == ["conv-lc"]  # the outermost run ended


async def test_langchain_handler_keeps_the_conversation_across_runs_when_asked() -> None:
    leases = CountingLeases()
    handler = KvferryCallbackHandler(leases, "conv-lc2", close_on_end=False, interval=INTERVAL)
    for query in ("first", "second"):
        await slow_search.ainvoke(query, config={"callbacks": [handler]})
    assert handler.renewals >= 6 and leases.closed == []
    await handler.aclose()
    assert leases.closed == ["conv-lc2"]


async def test_langchain_handler_stops_renewing_when_a_tool_fails() -> None:
    leases = CountingLeases()
    handler = KvferryCallbackHandler(leases, "conv-lc3", interval=INTERVAL)

    @tool
    async def broken(query: str) -> str:
        """Fails after a while."""
        await asyncio.sleep(TOOL_SECONDS)
        raise RuntimeError("tool failed")

    async def agent_step(query: str) -> str:
        try:
            await broken.ainvoke(query)
        except RuntimeError:
            pass
        assert not handler.lease.renewing
        return "done"

    await RunnableLambda(agent_step).ainvoke("x", config={"callbacks": [handler]})
    assert handler.renewals >= 3 and leases.closed == ["conv-lc3"]


@tool
def blocking_search(query: str) -> str:
    """Looks something up, slowly, blocking its thread."""
    time.sleep(TOOL_SECONDS)
    return f"results for {query}"


def test_the_async_handler_in_a_synchronous_run_says_so_and_does_not_block_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # LangChain runs an async handler's callbacks of a synchronous run each on a loop of its own; a
    # keep-alive started there would hold the run forever (it did, before the handler checked).
    leases = CountingLeases()
    handler = KvferryCallbackHandler(leases, "conv-sync", interval=INTERVAL)
    chain = RunnableLambda(lambda query: blocking_search.invoke(query))
    with caplog.at_level(logging.WARNING, logger="kvferry.sdk.adapters"):
        assert chain.invoke("a", config={"callbacks": [handler]}) == "results for a"
        assert chain.invoke("b", config={"callbacks": [handler]}) == "results for b"
    said = [r.getMessage() for r in caplog.records if "KvferrySyncCallbackHandler" in r.getMessage()]
    assert len(said) == 1  # once per handler
    assert handler.renewals == 0 and leases.renewed_at == [] and leases.closed == []


def test_the_sync_handler_renews_during_a_blocking_tool_and_closes_after_the_run(
    standin_router: StandInRouter,
) -> None:
    standin_router.script.ttl_seconds = 1.0
    with SyncClient.connect(standin_router.address, api_key=API_KEY, environ={}) as client:
        conversation = client.conversation()
        conversation.complete(ChatMessage.user("hi"))
        handler = KvferrySyncCallbackHandler(client, conversation.id, interval=0.2)

        @tool
        def slow_lookup(query: str) -> str:
            """Longer than the conversation's 1 s lease."""
            time.sleep(1.5)
            return f"found {query}"

        chain = RunnableLambda(lambda query: slow_lookup.invoke(query))
        assert chain.invoke("rivers", config={"callbacks": [handler]}) == "found rivers"
        assert handler.renewals >= 3 and handler.error is None
        assert [c for c, _ in standin_router.record.renewals] == [conversation.id] * handler.renewals
        assert standin_router.record.closes == [conversation.id]  # the outermost run ended


class ScriptedModel(Model):
    """Calls ``slow_lookup`` once, then answers: the Agents SDK's loop without a network."""

    def __init__(self) -> None:
        self.calls = 0

    async def get_response(self, *args: Any, **kwargs: Any) -> ModelResponse:
        self.calls += 1
        if self.calls == 1:
            item: Any = ResponseFunctionToolCall(
                type="function_call", call_id="call-1", name="slow_lookup", arguments='{"query": "basel"}'
            )
        else:
            item = ResponseOutputMessage(
                id="msg-1",
                type="message",
                role="assistant",
                status="completed",
                content=[ResponseOutputText(type="output_text", text="done", annotations=[])],
            )
        return ModelResponse(output=[item], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise NotImplementedError


async def test_openai_agents_hooks_renew_during_the_tool_and_close_at_the_end() -> None:
    leases = CountingLeases()
    hooks = KvferryRunHooks(leases, "conv-agents", interval=INTERVAL)
    renewing_in_tool: list[bool] = []

    @function_tool
    async def slow_lookup(query: str) -> str:
        """Looks something up, slowly."""
        await asyncio.sleep(TOOL_SECONDS)
        renewing_in_tool.append(hooks.lease.renewing)
        return f"results for {query}"

    assert isinstance(slow_lookup, FunctionTool)
    model = ScriptedModel()
    agent = Agent(name="researcher", instructions="Look things up.", tools=[slow_lookup], model=model)
    # No trace export: nothing leaves the machine.
    run_config = RunConfig(tracing_disabled=True)
    result = await Runner.run(agent, "Which rivers cross Basel?", hooks=hooks, run_config=run_config)
    assert result.final_output == "done" and model.calls == 2
    assert renewing_in_tool == [True]
    assert hooks.renewals >= 3 and hooks.error is None
    assert leases.closed == ["conv-agents"]
