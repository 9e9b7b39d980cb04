"""The SDK over a real grpc.aio connection to the STAND-IN RouterService (tests/sdk/standin_router.py):
streaming, history, retries before the first token only, deadlines, auth metadata, keep-alive, close."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from kvferry.sdk import (
    ChatMessage,
    Client,
    DeadlineExceededError,
    Deadlines,
    InternalError,
    NotFoundError,
    RetryPolicy,
    ReuseDecision,
    UnauthenticatedError,
    UnavailableError,
)
from kvferry.stack.etcd_process import free_port
from opentelemetry.sdk.trace import TracerProvider

from tests.sdk.conftest import API_KEY, OTHER_API_KEY
from tests.sdk.standin_router import StandInRouter

FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff_seconds=0.05, max_backoff_seconds=0.2)


@pytest.fixture
async def client(standin_router: StandInRouter) -> AsyncIterator[Client]:
    async with await Client.connect(
        standin_router.address, api_key=API_KEY, retry=FAST_RETRY, environ={}
    ) as connected:
        yield connected


async def test_streams_chunks_then_summary_and_keeps_chat_history(
    client: Client, standin_router: StandInRouter
) -> None:
    conversation = client.conversation(history=[ChatMessage.system("be brief")])
    assert conversation.id.startswith("conv-")
    stream = conversation.send(ChatMessage.user("hi"), max_tokens=16, temperature=0.5)
    chunks = [chunk async for chunk in stream]
    assert [c.text for c in chunks] == ["Hel", "lo", " there"]
    assert chunks[0].token_ids == tuple(ord(c) for c in "Hel")
    summary = stream.summary
    assert summary.reuse is ReuseDecision.NONE and summary.turn == 1
    assert summary.prompt_tokens == summary.recomputed_tokens > 0
    assert summary.decode_engine_id == "standin-decode"
    assert conversation.messages == [
        ChatMessage.system("be brief"),
        ChatMessage.user("hi"),
        ChatMessage.assistant("Hello there"),
    ]

    reply = await conversation.complete(ChatMessage.user("and now?"))
    assert reply.text == "Hello there"
    assert reply.summary.reuse is ReuseDecision.PULL and reply.summary.turn == 2
    assert reply.summary.pulled_tokens > 0

    first, second = standin_router.record.generate_requests
    assert first.conversation_id == second.conversation_id == conversation.id
    assert first.sampling.max_tokens == 16 and first.sampling.temperature == 0.5
    assert [m.content for m in second.chat.messages] == ["be brief", "hi", "Hello there", "and now?"]
    assert not first.HasField("retain")
    metadata = standin_router.record.generate_metadata[0]
    assert metadata["authorization"] == f"Bearer {API_KEY}"
    assert metadata["user-agent"].startswith("kvferry-sdk-python/")


async def test_token_and_text_histories_extend_the_retained_sequence(client: Client) -> None:
    tokens = client.conversation()
    await tokens.complete([1, 2, 3])
    reply = await tokens.complete([4, 5])
    assert reply.summary.reuse is ReuseDecision.PULL
    reply_ids = tuple(ord(c) for c in "Hello there")
    assert tokens.history == (1, 2, 3, *reply_ids, 4, 5, *reply_ids)

    text = client.conversation()
    await text.complete("Q: one\nA:")
    reply = await text.complete("\nQ: two\nA:")
    assert reply.summary.reuse is ReuseDecision.PULL
    assert text.history == "Q: one\nA:Hello there\nQ: two\nA:Hello there"


async def test_unavailable_before_first_token_is_retried(
    client: Client, standin_router: StandInRouter
) -> None:
    standin_router.script.unavailable_before_first_token = 2
    stream = client.conversation().send("hello")
    reply = await stream.collect()
    assert reply.text == "Hello there"
    assert stream.attempts == 3
    assert len(standin_router.record.generate_requests) == 3


async def test_retries_give_up_after_max_attempts(client: Client, standin_router: StandInRouter) -> None:
    standin_router.script.unavailable_before_first_token = 100
    conversation = client.conversation()
    with pytest.raises(UnavailableError) as raised:
        await conversation.complete("hello")
    assert raised.value.chunks_received == 0
    assert len(standin_router.record.generate_requests) == FAST_RETRY.max_attempts
    assert conversation.history is None


async def test_never_retries_mid_stream(client: Client, standin_router: StandInRouter) -> None:
    standin_router.script.unavailable_after_chunks = 1
    conversation = client.conversation()
    stream = conversation.send("hello")
    received = []
    with pytest.raises(UnavailableError) as raised:
        async for chunk in stream:
            received.append(chunk.text)
    assert received == ["Hel"]
    assert raised.value.chunks_received == 1 and not raised.value.retryable
    assert len(standin_router.record.generate_requests) == 1
    assert conversation.history is None  # the failed turn left no trace; resending it is safe
    with pytest.raises(RuntimeError, match="not finished"):
        _ = stream.summary

    standin_router.script.unavailable_after_chunks = None
    assert (await conversation.complete("hello")).summary.turn == 1


async def test_generate_deadline_bounds_the_whole_turn(client: Client, standin_router: StandInRouter) -> None:
    standin_router.script.first_token_delay_seconds = 3.0
    started = time.monotonic()
    with pytest.raises(DeadlineExceededError):
        await client.conversation().complete("hello", deadline_seconds=0.3)
    assert time.monotonic() - started < 2.0
    assert len(standin_router.record.generate_requests) == 1


async def test_control_calls_have_deadlines(standin_router: StandInRouter) -> None:
    async with await Client.connect(
        standin_router.address, api_key=API_KEY, deadlines=Deadlines(control_seconds=0.3), environ={}
    ) as client:
        conversation = client.conversation()
        await conversation.complete("hello")
        standin_router.script.control_delay_seconds = 3.0
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            await conversation.renew()
        assert time.monotonic() - started < 2.0


async def test_api_key_is_required_and_scopes_conversations(standin_router: StandInRouter) -> None:
    async with await Client.connect(standin_router.address, retry=FAST_RETRY, environ={}) as anonymous:
        with pytest.raises(UnauthenticatedError, match="API key"):
            await anonymous.conversation().complete("hello")
    assert len(standin_router.record.generate_requests) == 1  # not retried

    env = {"KVFERRY_ADDRESS": standin_router.address, "KVFERRY_API_KEY": API_KEY}
    async with (
        await Client.connect(environ=env) as tenant_a,
        await Client.connect(standin_router.address, api_key=OTHER_API_KEY, environ={}) as tenant_b,
    ):
        conversation = tenant_a.conversation("shared-name")
        await conversation.complete("hello")
        assert (await conversation.info()).turn == 1
        with pytest.raises(NotFoundError):
            await tenant_b.get_conversation("shared-name")


async def test_stream_without_summary_is_an_error(client: Client, standin_router: StandInRouter) -> None:
    standin_router.script.omit_summary = True
    conversation = client.conversation()
    with pytest.raises(InternalError, match="TurnSummary"):
        await conversation.complete("hello")
    assert conversation.history is None


async def test_unreachable_router_fails_after_retries() -> None:
    address = f"127.0.0.1:{free_port()}"
    async with await Client.connect(address, retry=FAST_RETRY, environ={}) as client:
        stream = client.conversation().send("hello")
        with pytest.raises(UnavailableError):
            await stream.collect()
        assert stream.attempts == FAST_RETRY.max_attempts
    with pytest.raises(UnavailableError, match="is it running"):
        await Client.connect(address, environ={}, wait_ready_seconds=0.3)


async def test_keep_alive_holds_the_retention_past_its_ttl(
    client: Client, standin_router: StandInRouter
) -> None:
    standin_router.script.ttl_seconds = 1.0
    conversation = client.conversation()
    await conversation.complete("hello")
    async with conversation.keep_alive() as keep_alive:
        await asyncio.sleep(2.5)  # the "tool call", 2.5x the TTL
    assert keep_alive.error is None
    # A third of a 1 s lease: renewals at ~0, 0.33, 0.67 ... s.
    assert 5 <= keep_alive.renewals <= 10
    assert (await conversation.info()).turn == 1
    reply = await conversation.complete(" again")
    assert reply.summary.reuse is ReuseDecision.PULL

    renewals = len(standin_router.record.renewals)
    await asyncio.sleep(1.3)  # no keep-alive: the lease runs out
    assert len(standin_router.record.renewals) == renewals
    with pytest.raises(NotFoundError):
        await conversation.info()
    assert (await conversation.complete(" more")).summary.reuse is ReuseDecision.NONE


async def test_keep_alive_reports_a_lost_retention(client: Client) -> None:
    conversation = client.conversation()  # nothing sent: nothing retained
    async with conversation.keep_alive() as keep_alive:
        await asyncio.sleep(0.2)
    assert keep_alive.lost and keep_alive.renewals == 0


async def test_close_releases_at_once_and_stops_keep_alive(
    client: Client, standin_router: StandInRouter
) -> None:
    async with client.conversation() as conversation:
        await conversation.complete("hello")
        keep_alive = await conversation.keep_alive(interval=0.05).__aenter__()
        await asyncio.sleep(0.1)
        await conversation.close()
        assert not keep_alive.running
        assert conversation.closed
        with pytest.raises(NotFoundError):
            await client.get_conversation(conversation.id)
        with pytest.raises(RuntimeError, match="closed"):
            conversation.send("more")
    # Leaving the block closed again: idempotent, and a NOT_FOUND from the router is not an error.
    assert standin_router.record.closes == [conversation.id]


async def test_leaving_a_stream_early_cancels_it(client: Client) -> None:
    conversation = client.conversation()
    async with conversation.send("hello") as stream:
        async for _ in stream:
            break
    assert not stream.finished and conversation.history is None
    # (The stand-in may have finished the cancelled turn server-side already: turn numbers vary.)
    assert (await conversation.complete("hello")).text == "Hello there"
    # A new send cancels an unfinished previous turn instead of failing.
    abandoned = conversation.send(" one")
    await abandoned.__anext__()
    await conversation.complete(" two")
    assert not abandoned.active
    assert conversation.history == "hello" + "Hello there" + " two" + "Hello there"


async def test_trace_context_travels_in_metadata(client: Client, standin_router: StandInRouter) -> None:
    tracer = TracerProvider().get_tracer("agent")
    with tracer.start_as_current_span("agent-turn") as span:
        await client.conversation().complete("hello")
    trace_id = format(span.get_span_context().trace_id, "032x")
    assert trace_id in standin_router.record.generate_metadata[0]["traceparent"]
