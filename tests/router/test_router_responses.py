"""The Responses API (``/v1/responses``) with the official client against a real router and registry with
FAST STAND-IN engines: function tools and their outputs, ``previous_response_id`` chains reusing the
conversation's KV, ``store``, streaming events, tenants. The same on real engines:
test_router_chat_engines.py."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import openai
import pytest
from kvferry.router.openai_responses import ResponseStore, StoredResponse, input_messages

from tests.fixtures.router import Stack
from tests.router.test_router_standin import ACME, GLOBEX

pytestmark = pytest.mark.timeout(60)

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
INSTRUCTIONS = "You are a weather bot: call get_weather, then answer in one line. " * 4


async def test_a_tool_round_trip_chained_by_previous_response_id_reuses_the_kv(standin_stack: Stack) -> None:
    client = standin_stack.openai()
    first = await client.responses.create(
        model=standin_stack.model,
        instructions=INSTRUCTIONS,
        input="Weather in Oslo?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        max_output_tokens=6,
    )
    assert first.status == "completed" and first.id.startswith("resp_")
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"]
    assert first.usage is not None and first.usage.input_tokens_details.cached_tokens == 0
    sent = standin_stack.decode.counters.chat_bodies[-1]
    assert sent["messages"][0] == {"role": "system", "content": INSTRUCTIONS}
    assert sent["tools"][0]["function"]["name"] == "get_weather" and sent["max_completion_tokens"] == 6
    # The tool's output continues the chain: the whole history comes from the stored response.
    second = await client.responses.create(
        model=standin_stack.model,
        instructions=INSTRUCTIONS,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": 4}'}],
        tools=[WEATHER],  # type: ignore[list-item]
        max_output_tokens=6,
    )
    assert second.output_text and second.previous_response_id == first.id
    assert second.usage is not None and second.usage.input_tokens_details.cached_tokens > 100
    assert second.usage.model_extra is not None and second.usage.model_extra["kvferry"]["turn"] == 2
    messages = standin_stack.decode.counters.chat_bodies[-1]["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[2]["tool_calls"][0]["id"] == call.call_id and messages[3]["tool_call_id"] == call.call_id
    fetched = await client.responses.retrieve(second.id)
    assert fetched.id == second.id and fetched.output_text == second.output_text
    # Another tenant can neither continue nor read it.
    other = standin_stack.openai(GLOBEX)
    with pytest.raises(openai.NotFoundError):
        await other.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError, match="not stored here"):
        await other.responses.create(model=standin_stack.model, previous_response_id=second.id, input="hi")
    deleted = await client.responses.delete(second.id)
    assert deleted is None
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(second.id)


async def test_streamed_responses_emit_the_api_s_events_and_reuse(standin_stack: Stack) -> None:
    client = standin_stack.openai()
    first = await client.responses.create(
        model=standin_stack.model,
        instructions=INSTRUCTIONS,
        input="Tell me a story. " * 6,
        max_output_tokens=5,
    )
    stream = await client.responses.create(
        model=standin_stack.model,
        instructions=INSTRUCTIONS,
        previous_response_id=first.id,
        input="And then?",
        max_output_tokens=5,
        stream=True,
    )
    kinds: list[str] = []
    deltas: list[str] = []
    final = None
    async for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # max_output_tokens reached (the stand-in never stops by itself)
    ]
    assert final is not None and final.output_text == "".join(deltas) and len(deltas) == 5
    assert final.incomplete_details is not None and final.incomplete_details.reason == "max_output_tokens"
    assert final.usage is not None and final.usage.input_tokens_details.cached_tokens > 100


async def test_streamed_tool_calls_become_function_call_items(standin_stack: Stack) -> None:
    client = standin_stack.openai()
    async with client.responses.stream(
        model=standin_stack.model,
        input="Weather in Rome?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=4,
    ) as stream:
        arguments = [e.delta async for e in stream if e.type == "response.function_call_arguments.delta"]
        final = await stream.get_final_response()
    [call] = final.output
    assert (
        call.type == "function_call" and call.name == "get_weather" and call.arguments == "".join(arguments)
    )
    assert final.status == "completed"


async def test_store_false_one_off_and_named_conversations(standin_stack: Stack) -> None:
    client = standin_stack.openai()
    unstored = await client.responses.create(
        model=standin_stack.model, input="Hello. " * 20, store=False, max_output_tokens=3
    )
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model=standin_stack.model, previous_response_id=unstored.id, input="x")
    # Nothing is retained for a one-off response; a named conversation reuses without stored responses.
    assert standin_stack.decode.counters.decode_params[-1]["kvferry"] == {"retain": False}
    conv = f"named-{uuid.uuid4().hex[:6]}"
    history: list[Any] = [{"role": "user", "content": "Hello. " * 20}]
    first = await client.responses.create(
        model=standin_stack.model,
        input=history,
        store=False,
        max_output_tokens=3,
        extra_body={"conversation_id": conv},
    )
    history += [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "More."}]
    second = await client.responses.create(
        model=standin_stack.model, input=history, store=False, max_output_tokens=3, prompt_cache_key=conv
    )
    assert second.usage is not None and second.usage.input_tokens_details.cached_tokens > 0


async def test_responses_bad_input(standin_stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=standin_stack.router.http_url, timeout=20) as http:
        for body, param in (
            ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
            ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
            (
                {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
                "input[0].content[0]",
            ),
            ({"input": "x", "background": True}, "background"),
            ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
            ({"input": "x", "max_output_tokens": "5"}, "max_output_tokens"),
            ({"input": "x", "prompt": {"id": "p"}}, "prompt"),
        ):
            answer = await http.post(
                "/v1/responses",
                json={"model": standin_stack.model, **body},
                headers={"Authorization": f"Bearer {ACME}"},
            )
            assert answer.status_code == 400, (body, answer.text)
            assert answer.json()["error"]["param"] == param, (body, answer.json())


def test_input_items_become_chat_messages() -> None:
    items: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {
            "type": "reasoning",
            "id": "rs",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "think"}],
        },
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "calling"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
    ]
    assert input_messages(items) == [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "calling",
            "reasoning": "think",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
    ]


def test_the_store_forgets_the_oldest_and_the_expired() -> None:
    store = ResponseStore(capacity=2, ttl_seconds=10)
    for index in range(3):
        store.put(StoredResponse("acme", f"r{index}", "conv", (), {}, stored_at=100.0))
    assert len(store) == 2
    with pytest.raises(Exception, match="not stored here"):
        store.get("acme", "r0", now=100.0)
    assert store.get("acme", "r2", now=105.0).response_id == "r2"
    with pytest.raises(Exception, match="expired"):
        store.get("acme", "r2", now=111.0)
    with pytest.raises(Exception, match="not stored here"):
        store.get("globex", "r1", now=100.0)
