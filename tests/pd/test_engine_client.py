"""The engine HTTP client's wire forms (streams, errors), against a loopback server instead of an engine.

The same calls run against real engines in tests/connector/test_engines.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from kvferry.pd import engine_api as api
from kvferry.pd import engine_client as vh
from kvferry.pd.vllm_params import KvHandoff
from multidict import CIMultiDict

from tests.fixtures.http_answers import answering
from tests.pd.test_params import P_PARAMS


def test_stream_events_parse_into_chunks_and_errors() -> None:
    url = "http://engine"
    chunk = vh._completion_event(
        url, b'{"choices":[{"index":0,"text":"hi","token_ids":[5,6],"finish_reason":null}]}'
    )
    assert chunk == api.DecodeChunk(token_ids=(5, 6), text="hi")
    usage_event = {
        "choices": [],
        "usage": {"prompt_tokens": 9, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 8}},
    }
    usage = vh._completion_event(url, json.dumps(usage_event).encode())
    assert usage is not None and usage.usage == api.Usage(9, 2, 8)
    assert usage.usage.body == usage_event["usage"]
    with pytest.raises(api.EngineHttpError, match="boom"):
        vh._completion_event(url, b'{"error":{"message":"boom","code":400}}')
    with pytest.raises(api.EngineHttpError, match="malformed stream event"):
        vh._completion_event(url, b"{not json")


def test_sse_data_skips_keep_alives_comments_and_done() -> None:
    events = vh.SseData()
    found = []
    for piece in (b': keep-alive\r\n\r\ndata: {"a"', b":1}\r\n\r\n\r\ndata:[DONE]\n\n", b"data: x"):
        found += events.feed(piece)
    # The last, unterminated line is not an event yet.
    assert found == [b'{"a":1}']


def test_chat_events_are_relayed_as_they_came_and_only_their_ends_read() -> None:
    url = "http://engine"
    # Text that spells the field inside a string does not look like the field.
    delta = (
        b'{"id":"c1","choices":[{"index":0,"delta":{"content":"\\"finish_reason\\":\\"x"},'
        b'"finish_reason":null}]}'
    )
    assert vh._chat_event(url, delta) == api.DecodeChunk((), "", raw=delta)
    last = b'{"id":"c1","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}'
    assert vh._chat_event(url, last) == api.DecodeChunk((), "", finish_reason="tool_calls", raw=last)
    usage = b'{"id":"c1","choices":[],"usage":{"prompt_tokens":4,"completion_tokens":2}}'
    assert vh._chat_event(url, usage) == api.DecodeChunk((), "", usage=api.Usage(4, 2))
    # Continuous usage stats: a delta with usage is relayed, its usage read.
    continuous = (
        b'{"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}],'
        b'"usage":{"prompt_tokens":4,"completion_tokens":1}}'
    )
    chunk = vh._chat_event(url, continuous)
    assert chunk.raw == continuous and chunk.usage == api.Usage(4, 1)
    with pytest.raises(api.EngineHttpError, match="bad tool"):
        vh._chat_event(url, b'{"error":{"message":"bad tool","code":400}}')


async def test_a_decode_stream_split_anywhere_yields_the_same_chunks() -> None:
    events = [
        {"choices": [{"index": 0, "text": "h\u00e9", "token_ids": [5], "finish_reason": None}]},
        {"choices": [{"index": 0, "text": "llo", "token_ids": [6, 7], "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}},
    ]
    body = b"".join(b"data: " + json.dumps(e, ensure_ascii=False).encode() + b"\r\n\r\n" for e in events)
    body += b"data: [DONE]\r\n\r\n"
    handoff = KvHandoff.from_params(P_PARAMS)
    assert handoff is not None
    for size in (1, 2, 7, len(body)):
        pieces = [body[i : i + size] for i in range(0, len(body), size)]

        async def stream(request: web.Request, pieces: list[bytes] = pieces) -> web.StreamResponse:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for piece in pieces:
                await response.write(piece)
                await asyncio.sleep(0)  # each piece its own write, so the client reads them apart
            await response.write_eof()
            return response

        async with answering(stream) as url, vh.VllmEngineClient(url, "m") as client:
            chunks = [c async for c in client.decode_stream(api.DecodeRequest((1, 2, 3), handoff))]
        assert [c.text for c in chunks] == ["hé", "llo", ""], size
        assert [c.token_ids for c in chunks] == [(5,), (6, 7), ()]
        assert chunks[1].finish_reason == "length" and chunks[2].usage == api.Usage(3, 3, None)


async def test_http_errors_and_unreachable_engines_raise_typed_errors() -> None:
    async def refuse(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        assert body["max_tokens"] == 1 and body["kv_transfer_params"]["do_remote_decode"] is True
        assert request.headers["X-Request-Id"] == "rid-1"
        return web.json_response({"error": {"message": "prompt too long", "code": 400}}, status=400)

    async with answering(refuse) as url, vh.VllmEngineClient(url, "m") as client:
        with pytest.raises(api.EngineHttpError, match="prompt too long") as caught:
            await client.prefill(api.PrefillRequest((1, 2, 3), request_id="rid-1"))
        assert caught.value.status_code == 400

    async with vh.VllmEngineClient(
        "http://127.0.0.1:9", "m", timeouts=vh.HttpTimeouts(connect=0.5)
    ) as client:
        with pytest.raises(api.EngineUnavailableError):
            await client.prefill(api.PrefillRequest((1, 2, 3)))
        assert not await client.health()


async def test_a_call_on_a_closed_client_is_the_engines_failure() -> None:
    """The router closes the client of an engine that left while a turn may still hold it: that turn's next
    call must fail as an unreachable engine (retried elsewhere), not with the HTTP library's own error."""

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"tokens": [1]})

    async with answering(ok) as url:
        client = vh.VllmEngineClient(url, "m")
        assert await client.tokenize("hi") == [1]
        await client.aclose()
        with pytest.raises(api.EngineUnavailableError, match="closed"):
            await client.tokenize("hi")
        with pytest.raises(api.EngineUnavailableError, match="closed"):
            await client.models()
        with pytest.raises(api.EngineUnavailableError, match="closed"):
            handoff = KvHandoff.from_params(P_PARAMS)
            assert handoff is not None
            async for _ in client.decode_stream(api.DecodeRequest((1, 2), handoff)):
                pass
        assert not await client.health()


async def test_engine_requests_carry_the_encoded_body_as_json_and_the_callers_headers() -> None:
    seen: list[tuple[CIMultiDict[str], bytes]] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append((request.headers.copy(), await request.read()))
        return web.json_response(
            {"choices": [{"token_ids": [7]}], "kv_transfer_params": P_PARAMS, "usage": None}
        )

    async with (
        answering(answer) as url,
        vh.VllmEngineClient(url, "m", headers=lambda: {"traceparent": "00-ab-cd-01"}) as client,
    ):
        await client.prefill(api.PrefillRequest(token_ids=(1, 2, 3), request_id="r1"))
    ((headers, content),) = seen
    assert headers["Content-Type"] == "application/json" and headers["X-Request-Id"] == "r1"
    assert headers["traceparent"] == "00-ab-cd-01"
    assert json.loads(content)["prompt"] == [1, 2, 3]
