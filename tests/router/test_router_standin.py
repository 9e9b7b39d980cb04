"""The router against the real registry (real etcd) with FAST STAND-IN engines
(kvferry.testing.standin_engine.StandInEngine): the router's own logic - turns, reuse bookkeeping, retries,
auth, tenants, bad input - over its real gRPC and HTTP servers. The same paths with real vLLM engines
are in test_router_engines.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys
import uuid

import grpc
import httpx
import openai
import pytest
from kvferry.registry.config import RegistryConfig
from kvferry.registry.server import create_registry
from kvferry.stack.etcd_process import EtcdProcess, free_port
from kvferry.testing.fault_proxy import FaultProxy
from kvferry.testing.standin_engine import (
    StandInEngine,
    standin_detokenize,
    standin_generate,
    standin_render_chat,
    standin_tokenize,
)
from kvferry.v1 import resources_pb2
from kvferry.v1 import router_service_pb2 as router_pb2
from kvferry.v1 import router_service_pb2_grpc as router_grpc

from tests.fixtures.polling import eventually
from tests.fixtures.router import (
    LIMITED_API_KEY,
    LIMITED_MODEL,
    RouterFactory,
    Stack,
    StandInFactory,
    metadata,
    wait_for_engines,
)

pytestmark = pytest.mark.timeout(60)

ACME = "key-acme"
GLOBEX = "key-globex"


@pytest.fixture
def stack(standin_stack: Stack) -> Stack:
    return standin_stack


async def generate(
    stub: router_grpc.RouterServiceStub, request: router_pb2.GenerateRequest, key: str = ACME
) -> tuple[str, list[int], router_pb2.TurnSummary]:
    text, tokens = [], []
    summary = None
    async for event in stub.Generate(request, metadata=metadata(key), timeout=20):
        if event.HasField("delta"):
            text.append(event.delta.text)
            tokens.extend(event.delta.token_ids)
        else:
            summary = event.summary
    assert summary is not None
    return "".join(text), tokens, summary


def chat_request(
    conv: str, model: str, messages: list[tuple[str, str]], max_tokens: int = 8
) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        conversation_id=conv,
        model=model,
        chat=router_pb2.ChatPrompt(messages=[router_pb2.ChatMessage(role=r, content=c) for r, c in messages]),
        sampling=router_pb2.SamplingParams(max_tokens=max_tokens),
    )


# -- multi-turn and reuse -------------------------------------------------------------------------


async def test_grpc_multi_turn_pulls_the_retained_prefix(stack: Stack) -> None:
    stub = stack.grpc_stub()
    conv = f"c-{uuid.uuid4().hex[:8]}"
    history: list[tuple[str, str]] = [
        ("system", "You are terse. " * 10),
        ("user", "Tell me about KV caches. " * 8),
    ]
    summaries = []
    for turn in range(1, 4):
        text, tokens, summary = await generate(stub, chat_request(conv, stack.model, history))
        prompt_ids = standin_tokenize(standin_render_chat([{"role": r, "content": c} for r, c in history]))
        assert tokens == standin_generate(prompt_ids, 8)
        assert text == standin_detokenize(tokens)
        assert summary.prompt_tokens == len(prompt_ids)
        assert summary.turn == turn
        assert summary.decode_engine_id == stack.decode.engine_id
        summaries.append(summary)
        history += [("assistant", text), ("user", f"And what about turn {turn}? " * 4)]
    assert summaries[0].reuse == router_pb2.REUSE_DECISION_NONE
    assert summaries[0].pulled_tokens == 0
    for summary in summaries[1:]:
        assert summary.reuse == router_pb2.REUSE_DECISION_PULL
        assert summary.pulled_tokens > 0
        assert summary.pulled_tokens % stack.decode.block_size == 0
        assert summary.pulled_tokens + summary.recomputed_tokens == summary.prompt_tokens
    # The engine saw the pulls the summaries report.
    assert stack.prefill.counters.pulled_tokens == sum(s.pulled_tokens for s in summaries)
    # The prefill that pulled named the decode engine's retained blocks and the mark with the lease.
    params = stack.prefill.counters.prefill_params[-1]
    assert params["remote_engine_id"] == stack.decode.engine_id
    assert params["kvferry"]["conversation_id"] == conv
    assert 0 < params["kvferry_read_ms"] <= 10_000
    # Every decode carried the mark for the next turn.
    marks = [p["kvferry"]["turn"] for p in stack.decode.counters.decode_params]
    assert marks == [1, 2, 3]
    got = await stack.grpc_stub().GetConversation(
        router_pb2.GetConversationRequest(conversation_id=conv), metadata=metadata(ACME)
    )
    assert got.turn == 3 and got.engine_id == stack.decode.engine_id and got.num_tokens > 0


async def test_openai_client_multi_turn_streaming_and_not(stack: Stack) -> None:
    client = stack.openai()
    conv = f"oa-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "user", "content": "Explain prefill and decode disaggregation. " * 6}]
    first = await client.chat.completions.create(
        model=stack.model,
        messages=messages,
        max_tokens=6,
        temperature=0,
        extra_headers={"X-Conversation-Id": conv},
    )
    text = first.choices[0].message.content
    assert text and first.usage is not None
    assert first.usage.model_extra and first.usage.model_extra["pulled_tokens"] == 0
    assert first.usage.model_extra["kvferry"]["turn"] == 1
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Go on. " * 10}]
    stream = await client.chat.completions.create(
        model=stack.model,
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"conversation_id": conv},
    )
    pieces, usage = [], None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert len(pieces) == 6
    assert usage is not None and usage.model_extra is not None
    assert usage.model_extra["pulled_tokens"] > 0
    assert (
        usage.prompt_tokens_details is not None
        and usage.prompt_tokens_details.cached_tokens == usage.model_extra["pulled_tokens"]
    )
    assert usage.model_extra["kvferry"]["turn"] == 2
    # /v1/completions with token ids, both modes.
    completion = await client.completions.create(model=stack.model, prompt=[11, 12, 13, 14], max_tokens=3)
    assert completion.choices[0].text == standin_detokenize(standin_generate([11, 12, 13, 14], 3))
    streamed = await client.completions.create(
        model=stack.model, prompt="hello there", max_tokens=3, stream=True
    )
    texts = [c.choices[0].text async for c in streamed if c.choices]
    assert "".join(texts) == standin_detokenize(standin_generate(standin_tokenize("hello there"), 3))
    models = await client.models.list()
    assert stack.model in [m.id for m in models.data]


async def test_two_router_replicas_alternate_turns_with_reuse(
    stack: Stack, router_factory: RouterFactory
) -> None:
    other = await router_factory()
    await wait_for_engines(other, {stack.prefill.engine_id, stack.decode.engine_id})
    stubs = [stack.grpc_stub(), router_grpc.RouterServiceStub(grpc.aio.insecure_channel(other.grpc_address))]
    conv = f"rep-{uuid.uuid4().hex[:8]}"
    history = [("user", "A long opening question about routers. " * 6)]
    for turn in range(1, 5):
        text, _, summary = await generate(stubs[turn % 2], chat_request(conv, stack.model, history))
        assert summary.turn == turn
        if turn > 1:
            assert summary.reuse == router_pb2.REUSE_DECISION_PULL and summary.pulled_tokens > 0
        history += [("assistant", text), ("user", "next " * 5)]


async def test_router_restart_loses_nothing(stack: Stack, router_factory: RouterFactory) -> None:
    conv = f"rs-{uuid.uuid4().hex[:8]}"
    history = [("user", "Before the restart. " * 8)]
    text, _, _ = await generate(stack.grpc_stub(), chat_request(conv, stack.model, history))
    await stack.router.stop()
    fresh = await router_factory()
    await wait_for_engines(fresh, {stack.prefill.engine_id, stack.decode.engine_id})
    history += [("assistant", text), ("user", "After it. " * 4)]
    stub = router_grpc.RouterServiceStub(grpc.aio.insecure_channel(fresh.grpc_address))
    _, _, summary = await generate(stub, chat_request(conv, stack.model, history))
    assert summary.turn == 2 and summary.reuse == router_pb2.REUSE_DECISION_PULL


async def test_edited_history_reuses_only_what_still_matches(stack: Stack) -> None:
    stub = stack.grpc_stub()
    conv = f"ed-{uuid.uuid4().hex[:8]}"
    system = ("system", "S" * 100)
    history = [system, ("user", "first question " * 10)]
    text, _, _ = await generate(stub, chat_request(conv, stack.model, history))
    edited = [system, ("user", "FIRST question " * 10), ("assistant", text), ("user", "second")]
    _out, tokens, summary = await generate(stub, chat_request(conv, stack.model, edited))
    # Only the blocks before the edit (inside the system message) match.
    prompt_ids = standin_tokenize(standin_render_chat([{"role": r, "content": c} for r, c in edited]))
    edit_at = standin_render_chat([{"role": r, "content": c} for r, c in edited]).index("FIRST")
    assert 0 < summary.pulled_tokens <= edit_at
    assert summary.pulled_tokens == edit_at // stack.decode.block_size * stack.decode.block_size
    # Output equals a from-scratch computation of the edited prompt.
    assert tokens == standin_generate(prompt_ids, 8)
    assert summary.turn == 2


async def test_small_match_below_threshold_recomputes(stack: Stack) -> None:
    stub = stack.grpc_stub()
    conv = f"th-{uuid.uuid4().hex[:8]}"
    request = router_pb2.GenerateRequest(
        conversation_id=conv, model=stack.model, tokens=router_pb2.TokenPrompt(token_ids=list(range(20, 60)))
    )
    request.sampling.max_tokens = 2
    await generate(stub, request)
    request.tokens.token_ids.extend(range(60, 70))
    _, _, summary = await generate(stub, request)
    assert summary.reuse == router_pb2.REUSE_DECISION_RECOMPUTE and summary.pulled_tokens == 0


async def test_an_unretained_turn_s_pull_carries_its_read_window(stack: Stack) -> None:
    stub = stack.grpc_stub()
    conv = f"nrp-{uuid.uuid4().hex[:8]}"
    history = [("user", "Tell me about KV caches. " * 8)]
    text, _, _ = await generate(stub, chat_request(conv, stack.model, history))
    request = chat_request(conv, stack.model, [*history, ("assistant", text), ("user", "and more? " * 4)])
    request.retain = False
    _, _, summary = await generate(stub, request)
    assert summary.reuse == router_pb2.REUSE_DECISION_PULL and summary.turn == 0
    params = stack.prefill.counters.prefill_params[-1]
    assert params["remote_engine_id"] == stack.decode.engine_id and "kvferry" not in params
    assert 0 < params["kvferry_read_ms"] <= 10_000


async def test_a_holder_whose_release_grace_is_too_short_is_recomputed(
    router_factory: RouterFactory, standin_factory: StandInFactory
) -> None:
    model = f"standin-{uuid.uuid4().hex[:6]}"
    prefill = await standin_factory("prefill", model=model)
    # A 10 s read window (the default) needs a grace of 20 s at least.
    decode = await standin_factory("decode", model=model, release_grace_seconds=19.0)
    router = await router_factory()
    await wait_for_engines(router, {prefill.engine_id, decode.engine_id})
    stub = Stack(model, prefill, decode, router).grpc_stub()
    conv = f"g-{uuid.uuid4().hex[:8]}"
    history = [("user", "Tell me about KV caches. " * 8)]
    text, _, first = await generate(stub, chat_request(conv, model, history))
    assert first.turn == 1
    _, _, second = await generate(
        stub, chat_request(conv, model, [*history, ("assistant", text), ("user", "more? " * 4)])
    )
    assert second.reuse == router_pb2.REUSE_DECISION_RECOMPUTE and second.pulled_tokens == 0
    assert "remote_engine_id" not in prefill.counters.prefill_params[-1]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"read_window_seconds": 20.0},
            r"--read-window 20 s is not safely under .* at most half of it, 15 s",
        ),
        ({"read_window_seconds": 3.0, "min_release_grace_seconds": 4.0}, r"at most half of it, 2 s"),
        ({"min_release_grace_seconds": 0.0}, r"--min-release-grace is 0 s"),
        ({"read_window_seconds": 0.0}, r"--read-window is 0 s"),
    ],
)
async def test_start_refuses_a_read_window_not_safely_under_the_release_grace(
    router_factory: RouterFactory, overrides: dict[str, float], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        await router_factory(**overrides)


async def test_retain_false_and_no_conversation_id_retain_nothing(stack: Stack) -> None:
    stub = stack.grpc_stub()
    conv = f"nr-{uuid.uuid4().hex[:8]}"
    request = chat_request(conv, stack.model, [("user", "x" * 50)])
    request.retain = False
    _, _, summary = await generate(stub, request)
    assert summary.turn == 0
    # The decode engine is told to free the turn's blocks as it finishes (no vLLM TTL hold).
    assert stack.decode.counters.decode_params[-1]["kvferry"] == {"retain": False}
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await stub.GetConversation(
            router_pb2.GetConversationRequest(conversation_id=conv), metadata=metadata(ACME)
        )
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    # HTTP without a conversation id: a one-off turn.
    answer = await stack.openai().chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert answer.usage is not None and answer.usage.model_extra is not None
    assert answer.usage.model_extra["kvferry"]["turn"] == 0
    assert stack.decode.counters.decode_params[-1]["kvferry"] == {"retain": False}


# -- renew, close, tenants ------------------------------------------------------------------------


async def test_renew_close_and_tenant_isolation(stack: Stack) -> None:
    stub = stack.grpc_stub()
    conv = f"ten-{uuid.uuid4().hex[:8]}"
    history = [("user", "secret of acme " * 10)]
    text, _, _ = await generate(stub, chat_request(conv, stack.model, history), key=ACME)
    renewed = await stub.RenewConversation(
        router_pb2.RenewConversationRequest(conversation_id=conv), metadata=metadata(ACME)
    )
    assert renewed.expire_time.seconds > 0
    # Another tenant sees nothing under the same conversation id, and cannot renew or close it.
    for call, request in (
        (stub.GetConversation, router_pb2.GetConversationRequest(conversation_id=conv)),
        (stub.RenewConversation, router_pb2.RenewConversationRequest(conversation_id=conv)),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await call(request, metadata=metadata(GLOBEX))
        assert denied.value.code() == grpc.StatusCode.NOT_FOUND
    await stub.CloseConversation(
        router_pb2.CloseConversationRequest(conversation_id=conv), metadata=metadata(GLOBEX)
    )
    still = await stub.GetConversation(
        router_pb2.GetConversationRequest(conversation_id=conv), metadata=metadata(ACME)
    )
    assert still.turn == 1
    # Globex's turn under the same id does not reuse acme's KV.
    history += [("assistant", text), ("user", "more")]
    _, _, summary = await generate(stub, chat_request(conv, stack.model, history), key=GLOBEX)
    assert summary.reuse == router_pb2.REUSE_DECISION_NONE and summary.turn == 1
    # Close releases at once; closing again is fine.
    for _ in range(2):
        await stub.CloseConversation(
            router_pb2.CloseConversationRequest(conversation_id=conv), metadata=metadata(ACME)
        )
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        await stub.GetConversation(
            router_pb2.GetConversationRequest(conversation_id=conv), metadata=metadata(ACME)
        )
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    assert "nothing retained" in (gone.value.details() or "")


async def test_grpc_auth_errors(stack: Stack) -> None:
    stub = stack.grpc_stub()
    request = chat_request("c-auth", stack.model, [("user", "hi")])
    cases = [
        ((), "missing API key"),
        (metadata("nope"), "unknown API key"),
        ((("authorization", "Basic x"),), "Bearer"),
    ]
    for md, message in cases:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await generate_raw(stub, request, md)
        assert failed.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert message in (failed.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as denied:
        await generate_raw(stub, request, metadata(LIMITED_API_KEY))
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert LIMITED_MODEL in (denied.value.details() or "")


async def generate_raw(
    stub: router_grpc.RouterServiceStub, request: router_pb2.GenerateRequest, md: tuple[tuple[str, str], ...]
) -> None:
    async for _ in stub.Generate(request, metadata=md, timeout=10):
        pass


async def test_http_auth_errors(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.router.http_url) as http:
        body = {"model": stack.model, "messages": [{"role": "user", "content": "hi"}]}
        missing = await http.post("/v1/chat/completions", json=body)
        assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
        wrong = await http.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        denied = await http.post(
            "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {LIMITED_API_KEY}"}
        )
        assert denied.status_code == 403 and denied.json()["error"]["param"] == "model"
        assert (await http.get("/v1/models")).status_code == 401
        health = await http.get("/health")
        assert health.status_code == 200 and health.json()["engines"]["decode"] >= 1
    with pytest.raises(openai.AuthenticationError):
        await stack.openai("nope").chat.completions.create(
            model=stack.model, messages=[{"role": "user", "content": "x"}]
        )


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"", 400, "body is empty"),
        (b"[]", 400, "must be a JSON object"),
        (b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400, "NaN"),
        (b'{"model": "M", "messages": "hi"}', 400, "messages"),
        (b'{"model": "M", "messages": []}', 400, "messages: List should have at least 1 item"),
        (b'{"model": "M", "messages": [{"role": "wizard", "content": "x"}]}', 400, "role"),
        (b'{"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}', 404, "not served"),
        (
            b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
            400,
            "max_tokens",
        ),
        (
            b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "n": 3}',
            400,
            "n=3 is not supported",
        ),
        (
            b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "nn": 3}',
            400,
            "unknown field 'nn'",
        ),
        (
            b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "logprobs": "true"}',
            400,
            "logprobs: Input should be a valid boolean",
        ),
        (
            b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1}',
            400,
            "prompt_logprobs is not supported by kvferry",
        ),
        (
            b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "temperature": -1}',
            400,
            "temperature",
        ),
        (
            b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "conversation_id": "bad id!"}',
            400,
            "outside",
        ),
        (
            b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "conversation_id": "'
            + b"a" * 200
            + b'"}',
            400,
            "at most 128",
        ),
        (
            b'{"model": "M", "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}',
            400,
            "lower max_tokens",
        ),
        (
            b'{"model": "M", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
            400,
            "messages[0].content[0] is a 'image_url' part: kvferry serves text",
        ),
    ],
)
async def test_http_bad_input(stack: Stack, body: bytes, status: int, fragment: str) -> None:
    async with httpx.AsyncClient(base_url=stack.router.http_url) as http:
        answer = await http.post(
            "/v1/chat/completions",
            content=body.replace(b'"M"', f'"{stack.model}"'.encode()),
            headers={"Authorization": f"Bearer {ACME}", "Content-Type": "application/json"},
        )
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert fragment in error["message"], error
    if status == 404:
        assert error["code"] == "model_not_found"


async def test_http_prompt_over_max_model_len_and_oversized_body(
    stack: Stack, router_factory: RouterFactory
) -> None:
    async with httpx.AsyncClient(base_url=stack.router.http_url, timeout=20) as http:
        headers = {"Authorization": f"Bearer {ACME}"}
        too_long = await http.post(
            "/v1/completions",
            json={"model": stack.model, "prompt": list(range(20, 20 + stack.decode.max_model_len + 5))},
            headers=headers,
        )
        assert (
            too_long.status_code == 400 and "shorten the conversation" in too_long.json()["error"]["message"]
        )
        batch = await http.post(
            "/v1/completions", json={"model": stack.model, "prompt": ["a", "b"]}, headers=headers
        )
        assert batch.status_code == 400 and "batched" in batch.json()["error"]["message"]
        differ = await http.post(
            "/v1/completions",
            json={"model": stack.model, "prompt": "x", "conversation_id": "a"},
            headers={**headers, "X-Conversation-Id": "b"},
        )
        assert differ.status_code == 400
    small = await router_factory(max_body_bytes=1000)
    async with httpx.AsyncClient(base_url=small.http_url) as http:
        big = await http.post(
            "/v1/completions",
            json={"model": stack.model, "prompt": "x" * 5000},
            headers={"Authorization": f"Bearer {ACME}"},
        )
    assert big.status_code == 413 and "at most 1000" in big.json()["error"]["message"]


async def test_grpc_bad_input(stack: Stack) -> None:
    stub = stack.grpc_stub()
    good = chat_request("c-ok", stack.model, [("user", "hi")])
    cases: list[tuple[router_pb2.GenerateRequest, grpc.StatusCode, str]] = []
    no_prompt = router_pb2.GenerateRequest(conversation_id="c", model=stack.model)
    cases.append((no_prompt, grpc.StatusCode.INVALID_ARGUMENT, "prompt is missing"))
    bad_id = router_pb2.GenerateRequest()
    bad_id.CopyFrom(good)
    bad_id.conversation_id = "x" * 129
    cases.append((bad_id, grpc.StatusCode.INVALID_ARGUMENT, "at most 128"))
    empty_id = router_pb2.GenerateRequest()
    empty_id.CopyFrom(good)
    empty_id.conversation_id = ""
    cases.append((empty_id, grpc.StatusCode.INVALID_ARGUMENT, "conversation_id is required"))
    unknown_model = router_pb2.GenerateRequest()
    unknown_model.CopyFrom(good)
    unknown_model.model = "nope"
    cases.append((unknown_model, grpc.StatusCode.NOT_FOUND, "not served"))
    negative = router_pb2.GenerateRequest(
        conversation_id="c", model=stack.model, tokens=router_pb2.TokenPrompt(token_ids=[1, -5])
    )
    cases.append((negative, grpc.StatusCode.INVALID_ARGUMENT, "non-negative"))
    too_long = router_pb2.GenerateRequest(
        conversation_id="c",
        model=stack.model,
        tokens=router_pb2.TokenPrompt(token_ids=[20] * (stack.decode.max_model_len + 1)),
    )
    cases.append((too_long, grpc.StatusCode.INVALID_ARGUMENT, "shorten the conversation"))
    bad_role = chat_request("c", stack.model, [("robot", "x")])
    cases.append((bad_role, grpc.StatusCode.INVALID_ARGUMENT, "role"))
    bad_top_p = chat_request("c", stack.model, [("user", "x")])
    bad_top_p.sampling.top_p = 1.5
    cases.append((bad_top_p, grpc.StatusCode.INVALID_ARGUMENT, "top_p"))
    for request, code, fragment in cases:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await generate_raw(stub, request, metadata(ACME))
        assert failed.value.code() == code, (request, failed.value.details())
        assert fragment in (failed.value.details() or ""), failed.value.details()
    for call, renew_request in (
        (stub.RenewConversation, router_pb2.RenewConversationRequest(conversation_id="bad id")),
        (stub.CloseConversation, router_pb2.CloseConversationRequest(conversation_id="")),
        (stub.GetConversation, router_pb2.GetConversationRequest(conversation_id="y" * 200)),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await call(renew_request, metadata=metadata(ACME))
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# -- failures --------------------------------------------------------------------------------------


async def test_engine_failure_before_first_token_retries_by_recompute(
    stack: Stack, standin_factory: StandInFactory
) -> None:
    prefill2 = await standin_factory("prefill", model=stack.model)
    decode2 = await standin_factory("decode", model=stack.model)
    await wait_for_engines(stack.router, {prefill2.engine_id, decode2.engine_id})
    stub = stack.grpc_stub()
    conv = f"rt-{uuid.uuid4().hex[:8]}"
    history = [("user", "retry me " * 20)]
    text, _, first = await generate(stub, chat_request(conv, stack.model, history))
    holder = first.decode_engine_id
    holder_engine = stack.decode if holder == stack.decode.engine_id else decode2
    holder_engine.fail_decodes = 1
    history += [("assistant", text), ("user", "again " * 5)]
    _, _tokens, summary = await generate(stub, chat_request(conv, stack.model, history))
    assert summary.decode_engine_id != holder
    assert summary.reuse == router_pb2.REUSE_DECISION_NONE and summary.pulled_tokens == 0
    assert summary.turn == 2
    # Prefill failing: retried on the other prefill engine.
    for engine in (stack.prefill, prefill2):
        engine.fail_prefills = 1
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await generate(stub, chat_request(conv, stack.model, history))
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "gave up after 2 attempts" in (failed.value.details() or "")


async def test_engine_failure_after_first_token_is_a_clear_error(stack: Stack) -> None:
    stack.decode.fail_decode_after_tokens = 2
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await generate(stack.grpc_stub(), chat_request("c-mid", stack.model, [("user", "x" * 40)]))
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "already streamed" in (failed.value.details() or "")
    stack.decode.fail_decode_after_tokens = None


async def test_engine_that_leaves_is_dropped_at_once(stack: Stack, standin_factory: StandInFactory) -> None:
    extra = await standin_factory("decode", model=stack.model)
    await wait_for_engines(stack.router, {extra.engine_id})
    await extra.deregister()
    deadline = asyncio.get_running_loop().time() + 2
    while stack.router.engines.get(extra.engine_id) is not None:
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)


async def test_client_disconnect_aborts_the_decode(stack: Stack) -> None:
    stack.decode.decode_token_delay_seconds = 0.05
    try:
        request = chat_request(
            f"dc-{uuid.uuid4().hex[:6]}", stack.model, [("user", "slow " * 20)], max_tokens=200
        )
        call = stack.grpc_stub().Generate(request, metadata=metadata(ACME))
        received = 0
        async for _event in call:
            received += 1
            if received == 3:
                call.cancel()
                break
        deadline = asyncio.get_running_loop().time() + 3
        while stack.decode.counters.aborted_requests == 0:
            assert asyncio.get_running_loop().time() < deadline, "decode was not aborted"
            await asyncio.sleep(0.02)
        # HTTP streaming: the same through SSE.
        before = stack.decode.counters.aborted_requests
        async with httpx.AsyncClient(base_url=stack.router.http_url, timeout=10) as http:
            async with http.stream(
                "POST",
                "/v1/chat/completions",
                json={
                    "model": stack.model,
                    "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 200,
                    "stream": True,
                },
                headers={"Authorization": f"Bearer {ACME}"},
            ) as response:
                lines = 0
                async for _ in response.aiter_lines():
                    lines += 1
                    if lines >= 4:
                        break
        deadline = asyncio.get_running_loop().time() + 3
        while stack.decode.counters.aborted_requests == before:
            assert asyncio.get_running_loop().time() < deadline, "SSE disconnect did not abort the decode"
            await asyncio.sleep(0.02)
    finally:
        stack.decode.decode_token_delay_seconds = 0.0


async def test_a_turn_that_retains_nothing_renews_the_previous_retention(stack: Stack) -> None:
    stub = stack.grpc_stub()
    conv = f"rn-{uuid.uuid4().hex[:8]}"
    history = [("user", "keep me alive " * 10)]
    text, _, _ = await generate(stub, chat_request(conv, stack.model, history))
    get = router_pb2.GetConversationRequest(conversation_id=conv)
    before = await stub.GetConversation(get, metadata=metadata(ACME))
    await asyncio.sleep(1.1)
    request = chat_request(conv, stack.model, [*history, ("assistant", text), ("user", "a side question")])
    request.retain = False
    _, _, summary = await generate(stub, request)
    assert summary.turn == 0 and summary.reuse == router_pb2.REUSE_DECISION_PULL
    deadline = asyncio.get_running_loop().time() + 3
    while True:
        after = await stub.GetConversation(get, metadata=metadata(ACME))
        if after.expire_time.ToNanoseconds() > before.expire_time.ToNanoseconds() + 900_000_000:
            break
        assert asyncio.get_running_loop().time() < deadline, "the retention was not renewed"
        await asyncio.sleep(0.05)
    assert after.turn == 1


async def test_registry_down_serves_by_recompute_with_last_known_engines(
    router_factory: RouterFactory, etcd: EtcdProcess
) -> None:
    """Rule 7: while the registry is away the router keeps its engines and serves every turn by
    recompute; when the registry comes back the router reconnects by itself."""
    config = RegistryConfig(
        listen_address="127.0.0.1:0",
        etcd_endpoints=(etcd.endpoint,),
        key_prefix=f"/kvferry-router-down-{uuid.uuid4().hex[:8]}/",
    )
    registry = await create_registry(config)
    port = registry.port
    model = f"standin-{uuid.uuid4().hex[:6]}"
    engines = [
        StandInEngine(
            f"p-{uuid.uuid4().hex[:6]}",
            resources_pb2.ENGINE_ROLE_PREFILL,
            model=model,
            registry_address=registry.address,
        ),
        StandInEngine(
            f"d-{uuid.uuid4().hex[:6]}",
            resources_pb2.ENGINE_ROLE_DECODE,
            model=model,
            registry_address=registry.address,
        ),
    ]
    for engine in engines:
        await engine.start()
    router = await router_factory(registry_address=registry.address, registry_timeout_seconds=0.5)
    await wait_for_engines(router, {e.engine_id for e in engines})
    stub = router_grpc.RouterServiceStub(grpc.aio.insecure_channel(router.grpc_address))
    conv = f"down-{uuid.uuid4().hex[:6]}"
    history = [("user", "while the registry is up " * 8)]
    text, _, summary = await generate(stub, chat_request(conv, model, history))
    assert summary.turn == 1
    await registry.stop(grace_seconds=0)
    try:
        history += [("assistant", text), ("user", "and now it is down")]
        _, _, summary = await generate(stub, chat_request(conv, model, history))
        assert summary.reuse == router_pb2.REUSE_DECISION_NONE and summary.turn == 0
        with pytest.raises(grpc.aio.AioRpcError) as unavailable:
            await stub.RenewConversation(
                router_pb2.RenewConversationRequest(conversation_id=conv), metadata=metadata(ACME)
            )
        assert unavailable.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "registry" in (unavailable.value.details() or "")
    finally:
        registry = await create_registry(dataclasses.replace(config, listen_address=f"127.0.0.1:{port}"))
    try:
        # Back: the retention of turn 1 is still there (its lease outlived the outage) and is reused.
        deadline = asyncio.get_running_loop().time() + 10
        while not router.watcher.connected:
            assert asyncio.get_running_loop().time() < deadline, "router did not reconnect"
            await asyncio.sleep(0.05)
        _, _, summary = await generate(stub, chat_request(conv, model, history))
        assert summary.reuse == router_pb2.REUSE_DECISION_PULL and summary.turn == 2
    finally:
        for engine in engines:
            await engine.stop()
        await registry.stop()


async def test_affinity_and_load_spread_with_two_decode_engines_and_a_killed_holder(
    stack: Stack, standin_factory: StandInFactory
) -> None:
    second = await standin_factory("decode", model=stack.model)
    await wait_for_engines(stack.router, {second.engine_id})
    stub = stack.grpc_stub()
    convs = [f"aff-{i}-{uuid.uuid4().hex[:6]}" for i in range(2)]
    histories: list[list[tuple[str, str]]] = [[("user", f"conversation {i} " * 12)] for i in range(2)]
    holders: list[set[str]] = [set(), set()]
    for turn in range(1, 4):
        results = await asyncio.gather(
            *(generate(stub, chat_request(c, stack.model, h)) for c, h in zip(convs, histories, strict=True))
        )
        for index, (text, _, summary) in enumerate(results):
            holders[index].add(summary.decode_engine_id)
            assert summary.turn == turn
            if turn > 1:
                assert summary.reuse == router_pb2.REUSE_DECISION_PULL
            histories[index] += [("assistant", text), ("user", "more " * 4)]
    # Each conversation stayed on one engine, and the two went to different engines.
    assert all(len(h) == 1 for h in holders) and holders[0] != holders[1], holders
    # Kill the first conversation's engine without a goodbye: its next turn is recomputed elsewhere.
    (held,) = holders[0]
    victim = stack.decode if held == stack.decode.engine_id else second
    await victim.crash()
    _, tokens, summary = await generate(stub, chat_request(convs[0], stack.model, histories[0]))
    assert summary.decode_engine_id != victim.engine_id and summary.pulled_tokens == 0
    prompt = standin_tokenize(standin_render_chat([{"role": r, "content": c} for r, c in histories[0]]))
    assert tokens == standin_generate(prompt, 8)


async def test_traces_and_metrics(router_factory: RouterFactory, standin_factory: StandInFactory) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    model = f"standin-{uuid.uuid4().hex[:6]}"
    prefill = await standin_factory("prefill", model=model)
    decode = await standin_factory("decode", model=model)
    router = await router_factory(span_exporter=exporter)
    await wait_for_engines(router, {prefill.engine_id, decode.engine_id})
    stub = router_grpc.RouterServiceStub(grpc.aio.insecure_channel(router.grpc_address))
    conv = f"tr-{uuid.uuid4().hex[:6]}"
    history = [("user", "trace me " * 20)]
    text, _, _ = await generate(stub, chat_request(conv, model, history))
    exporter.clear()
    history += [("assistant", text), ("user", "again")]
    _, _, summary = await generate(stub, chat_request(conv, model, history))
    assert summary.reuse == router_pb2.REUSE_DECISION_PULL
    spans = {s.name: s for s in exporter.get_finished_spans()}
    server, turn = spans["kvferry.v1.RouterService/Generate"], spans["kvferry.turn"]
    assert turn.parent is not None and turn.parent.span_id == server.context.span_id
    # The turn's registry calls (its mark; the lookup is the router's index's) nest under the turn.
    registry_calls = [
        s
        for s in exporter.get_finished_spans()
        if s.name in ("kvferry.v1.RegistryService/BeginTurn", "kvferry.v1.RegistryService/EndTurn")
    ]
    assert len(registry_calls) >= 2
    assert all(s.parent is not None and s.parent.span_id == turn.context.span_id for s in registry_calls)
    assert turn.attributes is not None
    assert turn.attributes["kvferry.reuse_decision"] == "pull"
    assert turn.attributes["kvferry.conversation"] == conv
    assert turn.attributes["kvferry.tokens_pulled"] == summary.pulled_tokens
    # The engines got the turn's trace context.
    assert decode.counters.decode_headers[-1]["traceparent"].split("-")[1] == format(
        turn.context.trace_id, "032x"
    )
    async with httpx.AsyncClient(base_url=router.http_url) as http:
        scraped = (await http.get("/metrics")).text
    assert 'kvferry_turns_total{reuse="pull"} 1.0' in scraped
    assert f"kvferry_tokens_pulled_total {float(summary.pulled_tokens)}" in scraped
    assert "kvferry_reuse_hits_total 1.0" in scraped
    assert 'kvferry_retention_lookups_total{path="index"}' in scraped


async def test_start_fails_cleanly_on_a_busy_port(router_factory: RouterFactory) -> None:
    import socket

    grpc_port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(OSError):
            await router_factory(grpc_listen=f"127.0.0.1:{grpc_port}", http_listen=f"127.0.0.1:{port}")
    # What had started is stopped the way stop() does it: the gRPC port is free, no task is left.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as again:
        again.bind(("127.0.0.1", grpc_port))
    assert not [task for task in asyncio.all_tasks() if task.get_name().startswith("kvferry-router-")]


async def test_non_streaming_client_that_leaves_aborts_the_decode(stack: Stack) -> None:
    stack.decode.decode_token_delay_seconds = 0.05
    try:
        before = stack.decode.counters.aborted_requests
        async with httpx.AsyncClient(base_url=stack.router.http_url, timeout=0.5) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post(
                    "/v1/chat/completions",
                    json={
                        "model": stack.model,
                        "messages": [{"role": "user", "content": "x"}],
                        "max_tokens": 200,
                    },
                    headers={
                        "Authorization": f"Bearer {ACME}",
                        "X-Conversation-Id": f"nl-{uuid.uuid4().hex[:6]}",
                    },
                )
        deadline = asyncio.get_running_loop().time() + 3
        while stack.decode.counters.aborted_requests == before:
            assert asyncio.get_running_loop().time() < deadline, "the decode ran on after the client left"
            await asyncio.sleep(0.02)
    finally:
        stack.decode.decode_token_delay_seconds = 0.0


async def test_a_first_turn_s_request_goes_out_beside_a_slow_mark_and_a_refused_mark_stops_the_turn(
    router_factory: RouterFactory, standin_factory: StandInFactory, router_registry_address: str
) -> None:
    """The router's registry calls cross a proxy adding 0.3 s each way: the mark (an etcd write behind
    the registry) answers long after the retention index (fed by a watch; it holds no record of a new
    conversation, so there is nothing to pull) and the token prompt are ready."""
    model = f"standin-{uuid.uuid4().hex[:6]}"
    prefill = await standin_factory("prefill", model=model, prefill_token_delay_seconds=0.002)
    decode = await standin_factory("decode", model=model, decode_token_delay_seconds=0.05)
    proxy = FaultProxy(router_registry_address)
    await proxy.start()
    try:
        router = await router_factory(registry_address=proxy.endpoint)
        await wait_for_engines(router, {prefill.engine_id, decode.engine_id})
        index = router.index
        assert index is not None
        await eventually(lambda: index.serving, what="the router's retention index")
        proxy.latency_seconds = 0.3
        stub = Stack(model, prefill, decode, router).grpc_stub()
        conv = f"beside-{uuid.uuid4().hex[:8]}"

        def turn(tokens: list[int], max_tokens: int) -> router_pb2.GenerateRequest:
            return router_pb2.GenerateRequest(
                conversation_id=conv,
                model=model,
                tokens=router_pb2.TokenPrompt(token_ids=tokens),
                sampling=router_pb2.SamplingParams(max_tokens=max_tokens),
            )

        history = list(range(20, 220))
        # P's request goes out while the mark is still on its way; D is asked once it is taken.
        first_turn = asyncio.ensure_future(generate(stub, turn(history, 40)))
        await eventually(lambda: prefill.counters.prefill_requests == 1, within=0.5, what="P's request")
        assert decode.counters.decode_requests == 0
        await eventually(lambda: decode.counters.decode_requests == 1, what="the turn's decode, once marked")
        # Another turn of the conversation while the first streams (40 tokens at 50 ms): P gets its request,
        # then the mark is refused and the turn never reaches D.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await generate(stub, turn([*history, 9], 4))
        assert refused.value.code() == grpc.StatusCode.ABORTED
        assert prefill.counters.prefill_requests == 2 and decode.counters.decode_requests == 1
        _, answer, first = await first_turn
        assert first.turn == 1
        # The next turn pulls turn 1 (a record the router's index holds: its P request waits for the mark).
        _, _, second = await generate(stub, turn([*history, *answer, 7, 8], 4))
        assert (second.turn, second.reuse) == (2, router_pb2.REUSE_DECISION_PULL)
    finally:
        await proxy.stop()


# -- one turn in flight per conversation, across router replicas --------------------------------------


async def test_two_routers_run_one_turn_of_a_conversation_at_a_time(
    router_factory: RouterFactory, standin_factory: StandInFactory
) -> None:
    model = f"standin-{uuid.uuid4().hex[:6]}"
    prefill = await standin_factory("prefill", model=model)
    # 40 tokens at 50 ms: the first turn streams for about 2 s.
    decode = await standin_factory("decode", model=model, decode_token_delay_seconds=0.05)
    first_router, second_router = await router_factory(), await router_factory()
    for router in (first_router, second_router):
        await wait_for_engines(router, {prefill.engine_id, decode.engine_id})
    conv = f"one-{uuid.uuid4().hex[:8]}"
    history = [("user", "Tell me about KV caches. " * 8)]
    first_stub = Stack(model, prefill, decode, first_router).grpc_stub()
    second_stub = Stack(model, prefill, decode, second_router).grpc_stub()
    running = asyncio.ensure_future(generate(first_stub, chat_request(conv, model, history, max_tokens=40)))
    await eventually(lambda: decode.counters.decode_requests == 1, within=10, what="the first turn's decode")
    running_id = decode.counters.decode_headers[-1]["x-request-id"].removesuffix("-1-d")

    # gRPC: ABORTED, naming the running turn.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await generate(second_stub, chat_request(conv, model, [*history, ("user", "again")]))
    assert refused.value.code() == grpc.StatusCode.ABORTED
    assert f"has a turn in flight: request {running_id}" in (refused.value.details() or "")
    # HTTP: 409, which OpenAI's clients retry with backoff.
    async with httpx.AsyncClient(base_url=second_router.http_url, timeout=10) as http:
        answer = await http.post(
            "/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "again"}], "max_tokens": 2},
            headers={"authorization": f"Bearer {ACME}", "x-conversation-id": conv},
        )
    assert answer.status_code == 409
    assert answer.json()["error"]["type"] == "conflict_error"
    assert running_id in answer.json()["error"]["message"]
    # Nothing of the refused turns reached an engine; another tenant's conversation of that id runs.
    assert decode.counters.decode_requests == 1
    _, _, other = await generate(second_stub, chat_request(conv, model, history), key=GLOBEX)
    assert other.turn == 1
    assert not running.done()

    text, _, first = await running
    assert first.turn == 1
    # As soon as the first turn's answer is in, the conversation is free, on either router.
    _, _, second = await generate(
        second_stub, chat_request(conv, model, [*history, ("assistant", text), ("user", "more? " * 4)])
    )
    assert second.turn == 2 and second.reuse == router_pb2.REUSE_DECISION_PULL


async def test_a_crashed_router_s_turn_frees_its_conversation_within_the_mark_s_lease(
    router_factory: RouterFactory, standin_factory: StandInFactory, router_registry_address: str
) -> None:
    """A router process killed (SIGKILL) mid-turn never clears its mark: the conversation is refused
    until the mark's lease (2 s here) runs out, then served by the other router."""
    model = f"standin-{uuid.uuid4().hex[:6]}"
    prefill = await standin_factory("prefill", model=model)
    decode = await standin_factory("decode", model=model, decode_token_delay_seconds=0.2)
    survivor = await router_factory()
    await wait_for_engines(survivor, {prefill.engine_id, decode.engine_id})
    doomed = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvferry.cli.main",
        "router",
        "--registry",
        router_registry_address,
        "--grpc-listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--api-keys",
        f"{ACME}=acme",
        "--turn-mark-lease",
        "2",
        "--event-loop",
        "asyncio",
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert doomed.stdout is not None
        line = (await asyncio.wait_for(doomed.stdout.readline(), 30)).decode()
        assert line.startswith("kvferry router: gRPC "), line
        grpc_address = line.split()[3].rstrip(",")
        channel = grpc.aio.insecure_channel(grpc_address)
        conv = f"crash-{uuid.uuid4().hex[:8]}"
        request = chat_request(conv, model, [("user", "hello " * 20)], max_tokens=100)

        async def stream_until_killed() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await generate(router_grpc.RouterServiceStub(channel), request)

        streaming = asyncio.ensure_future(stream_until_killed())
        await eventually(
            lambda: decode.counters.decode_requests == 1, within=30, what="the doomed router's decode"
        )
        doomed.kill()
        await doomed.wait()
        killed_at = asyncio.get_running_loop().time()
        await streaming
        await channel.close()

        stub = Stack(model, prefill, decode, survivor).grpc_stub()
        refusals = 0
        while True:
            try:
                _, _, summary = await generate(stub, chat_request(conv, model, [("user", "hello " * 20)]))
                break
            except grpc.aio.AioRpcError as error:
                assert error.code() == grpc.StatusCode.ABORTED, error
                refusals += 1
                waited = asyncio.get_running_loop().time() - killed_at
                assert waited < 8.0, "the crashed router's mark outlived its lease"
                await asyncio.sleep(0.1)
        assert refusals >= 1 and summary.finish_reason
    finally:
        if doomed.returncode is None:
            doomed.kill()
            await doomed.wait()
