"""The SDK against the REAL router (kvferry.router, real registry on real etcd), with the router tests'
fast stand-in engines behind it (tests/fixtures/router.py). The same checks on real vLLM engines
live in test_real_engines.py."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from kvferry.router.server import RunningRouter
from kvferry.sdk import (
    ChatMessage,
    Client,
    NotFoundError,
    ReuseDecision,
    UnauthenticatedError,
)

from tests.fixtures.router import ROUTER_API_KEYS, RouterFactory, StandInFactory

API_KEY, OTHER_KEY = list(ROUTER_API_KEYS)[:2]
RETENTION_TTL_SECONDS = 6
# Long enough (a byte per token) that pulling beats recomputing in the router's cost model.
SYSTEM_PROMPT = "You are a careful research agent working through a long task. " * 12


@dataclass
class Stack:
    router: RunningRouter
    model: str
    decode_engine_id: str


@pytest.fixture
async def stack(router_factory: RouterFactory, standin_factory: StandInFactory) -> AsyncIterator[Stack]:
    model = f"sdk-model-{uuid.uuid4().hex[:8]}"
    prefill = await standin_factory("prefill", model=model, retention_ttl_seconds=RETENTION_TTL_SECONDS)
    decode = await standin_factory("decode", model=model, retention_ttl_seconds=RETENTION_TTL_SECONDS)
    router = await router_factory()
    assert prefill.engine_id
    yield Stack(router, model, decode.engine_id)


@pytest.fixture
async def client(stack: Stack) -> AsyncIterator[Client]:
    async with await Client.connect(stack.router.grpc_address, api_key=API_KEY, environ={}) as connected:
        yield connected


async def test_multi_turn_chat_reuses_the_retained_history(client: Client, stack: Stack) -> None:
    conversation = client.conversation(model=stack.model, history=[ChatMessage.system(SYSTEM_PROMPT)])
    stream = conversation.send(ChatMessage.user("first question"), max_tokens=12)
    chunks = [chunk async for chunk in stream]
    assert chunks and "".join(c.text for c in chunks) == stream.text
    first = stream.summary
    assert first.turn == 1 and first.reuse is ReuseDecision.NONE
    assert first.completion_tokens == 12 and first.decode_engine_id == stack.decode_engine_id

    second = await conversation.complete(ChatMessage.user("second question"), max_tokens=12)
    assert second.summary.turn == 2
    assert second.summary.reuse is ReuseDecision.PULL
    assert second.summary.pulled_tokens > first.prompt_tokens // 2
    assert second.summary.pulled_tokens + second.summary.recomputed_tokens == second.summary.prompt_tokens
    assert [m.role for m in conversation.messages] == ["system", "user", "assistant", "user", "assistant"]

    info = await conversation.info()
    assert info.turn == 2 and info.engine_id == stack.decode_engine_id and info.expire_time is not None
    await conversation.close()


async def test_keep_alive_past_the_base_ttl_keeps_reuse(client: Client, stack: Stack) -> None:
    async def agent(keep_alive: bool) -> ReuseDecision:
        conversation = client.conversation(model=stack.model, history=[ChatMessage.system(SYSTEM_PROMPT)])
        await conversation.complete(ChatMessage.user("look this up"), max_tokens=8)
        tool_seconds = RETENTION_TTL_SECONDS + 2.0
        if keep_alive:
            async with conversation.keep_alive() as renewer:
                await asyncio.sleep(tool_seconds)
            assert renewer.error is None and renewer.renewals >= 3
        else:
            await asyncio.sleep(tool_seconds)
        reply = await conversation.complete(ChatMessage.tool("the tool's result"), max_tokens=8)
        await conversation.close()
        return reply.summary.reuse

    kept, unkept = await asyncio.gather(agent(keep_alive=True), agent(keep_alive=False))
    assert kept is ReuseDecision.PULL
    assert unkept is ReuseDecision.NONE


async def test_close_releases_at_once(client: Client, stack: Stack) -> None:
    conversation = client.conversation(model=stack.model)
    await conversation.complete([11, 12, 13] * 40, max_tokens=8)
    assert (await conversation.info()).turn == 1
    await conversation.close()
    with pytest.raises(NotFoundError):
        await client.get_conversation(conversation.id)
    again = client.conversation(conversation.id, model=stack.model, history=conversation.history)
    assert (await again.complete([14], max_tokens=8)).summary.reuse is ReuseDecision.NONE
    await again.close()
    await again.close()  # idempotent


async def test_api_key_and_tenant_scope(stack: Stack) -> None:
    async with await Client.connect(stack.router.grpc_address, api_key="wrong", environ={}) as stranger:
        with pytest.raises(UnauthenticatedError):
            await stranger.conversation(model=stack.model).complete("hello", max_tokens=4)
    async with (
        await Client.connect(stack.router.grpc_address, api_key=API_KEY, environ={}) as owner,
        await Client.connect(stack.router.grpc_address, api_key=OTHER_KEY, environ={}) as other,
    ):
        conversation = owner.conversation(model=stack.model)
        await conversation.complete("hello " * 30, max_tokens=4)
        with pytest.raises(NotFoundError):
            await other.get_conversation(conversation.id)
        with pytest.raises(NotFoundError):
            await other.renew_conversation(conversation.id)
        await other.close_conversation(conversation.id)  # another tenant's close touches nothing
        assert (await conversation.info()).turn == 1
        await conversation.close()
