"""The engine HTTP client's wire forms (kv_transfer_params, streams, metrics), without an engine.

The same calls run against real engines in test_engines.py.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest
from kvferry.common import vllm_http as vh
from kvferry.common.marks import ConversationMark, ReleaseMark, parse_mark

MARK = ConversationMark("acme", "c-1", 3)
P_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[4, 5, 6]],
    "remote_engine_id": "prefill-0",
    "remote_request_id": "cmpl-x-0-abcd",
    "remote_host": "127.0.0.1",
    "remote_port": 5601,
    "tp_size": 1,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 70,
    "remote_blocks_expiry_time": None,
    "transfer_mode": "pull",
}


def test_a_prefill_handoff_round_trips_into_the_decode_params() -> None:
    handoff = vh.KvHandoff.from_params(P_PARAMS)
    assert handoff is not None and handoff.do_remote_prefill and handoff.blocks is not None
    assert handoff.blocks.block_ids == ((4, 5, 6),)
    params = vh.decode_transfer_params(handoff, MARK)
    assert params["kvferry"] == {"tenant": "acme", "conversation_id": "c-1", "turn": 3}
    assert {k: v for k, v in params.items() if k != "kvferry"} == {
        k: v for k, v in P_PARAMS.items() if v is not None
    }


def test_a_release_mark_rides_in_the_decode_params_and_parses_back() -> None:
    handoff = vh.KvHandoff.from_params(P_PARAMS)
    assert handoff is not None
    params = vh.decode_transfer_params(handoff, ReleaseMark())
    assert params["kvferry"] == {"retain": False}
    assert parse_mark(params) == ReleaseMark()
    # Not a conversation: nothing to retain for it.
    assert ConversationMark.from_params(params) is None
    assert parse_mark(vh.decode_transfer_params(handoff, MARK)) == MARK
    assert parse_mark(vh.decode_transfer_params(handoff, None)) is None


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ({"retain": True}, "may only be false"),
        ({"retain": 0}, "may only be false"),
        ("c-1", "must be an object"),
        ({"tenant": "acme", "turn": 1}, "lacks 'conversation_id'"),
        ({"tenant": "acme", "conversation_id": "c-1", "turn": "1"}, "wrong type"),
    ],
)
def test_malformed_marks_are_refused_with_the_reason(raw: object, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_mark({"kvferry": raw})


def test_a_decode_answer_offers_its_blocks_for_the_next_turn() -> None:
    d_params = {**P_PARAMS, "do_remote_prefill": False, "do_remote_decode": True, "remote_engine_id": "d-0"}
    retained = vh.RetainedKv.from_decode_answer(
        vh.KvHandoff.from_params(d_params), block_size=32, lease_expire_time=5.0
    )
    assert retained == vh.RetainedKv("d-0", "cmpl-x-0-abcd", (4, 5, 6), 70, "127.0.0.1", 5601, 32, 5.0)
    assert vh.RetainedKv.from_decode_answer(None, block_size=32, lease_expire_time=5.0) is None


def test_decode_params_need_a_prefill_handoff() -> None:
    with pytest.raises(ValueError, match="do_remote_prefill"):
        vh.decode_transfer_params(vh.KvHandoff(False, True, None), MARK)


def test_reuse_pulls_exactly_the_blocks_of_the_reused_prefix() -> None:
    retained = vh.RetainedKv("decode-0", "cmpl-y", (7, 8, 9, 10), 120, "127.0.0.1", 5602, 32, 1e12)
    reuse = retained.prefix(64)
    params = vh.prefill_transfer_params(MARK, reuse, lease_expire_time=123.0)
    assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
    assert params["remote_block_ids"] == [[7, 8]]
    assert params["remote_num_tokens"] == 64
    assert params["remote_engine_id"] == "decode-0" and params["remote_request_id"] == "cmpl-y"
    assert vh.lease_expire_time_from_params(params) == 123.0
    for bad in (0, 48, 128):
        with pytest.raises(ValueError):
            retained.prefix(bad)


def test_a_fresh_prefill_carries_no_remote_blocks_and_no_lease() -> None:
    params = vh.prefill_transfer_params(MARK, None, lease_expire_time=5.0)
    assert params == {"do_remote_decode": True, "do_remote_prefill": False, **MARK.to_params()}
    assert vh.lease_expire_time_from_params(params) is None


def test_reusable_tokens_are_block_aligned_and_leave_a_token_to_compute() -> None:
    assert vh.max_reusable_tokens(prompt_len=100, matched_tokens=90, block_size=32) == 64
    assert vh.max_reusable_tokens(prompt_len=65, matched_tokens=200, block_size=32) == 64
    assert vh.max_reusable_tokens(prompt_len=64, matched_tokens=64, block_size=32) == 32
    assert vh.max_reusable_tokens(prompt_len=10, matched_tokens=10, block_size=32) == 0


def test_read_deadline_never_exceeds_the_lease() -> None:
    assert vh.read_deadline(lease_expire_time=100.0, now=50.0, window_seconds=10) == 60.0
    assert vh.read_deadline(lease_expire_time=55.0, now=50.0, window_seconds=10) == 55.0


def test_stream_lines_parse_into_chunks_and_errors() -> None:
    url = "http://engine"
    assert vh._parse_stream_line(url, "data: [DONE]") is None
    assert vh._parse_stream_line(url, ": keep-alive") is None
    assert vh._parse_stream_line(url, "\r") is None
    chunk = vh._parse_stream_line(
        url, 'data: {"choices":[{"index":0,"text":"hi","token_ids":[5,6],"finish_reason":null}]}\r'
    )
    assert chunk == vh.DecodeChunk(token_ids=(5, 6), text="hi")
    usage_event = {
        "choices": [],
        "usage": {"prompt_tokens": 9, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 8}},
    }
    usage = vh._parse_stream_line(url, "data: " + json.dumps(usage_event))
    assert usage is not None and usage.usage == vh.Usage(9, 2, 8)
    with pytest.raises(vh.EngineHttpError, match="boom"):
        vh._parse_stream_line(url, 'data: {"error":{"message":"boom","code":400}}')
    with pytest.raises(vh.EngineHttpError, match="malformed stream event"):
        vh._parse_stream_line(url, "data: {not json")


async def test_a_decode_stream_split_anywhere_yields_the_same_chunks() -> None:
    events = [
        {"choices": [{"index": 0, "text": "h\u00e9", "token_ids": [5], "finish_reason": None}]},
        {"choices": [{"index": 0, "text": "llo", "token_ids": [6, 7], "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}},
    ]
    body = b"".join(b"data: " + json.dumps(e, ensure_ascii=False).encode() + b"\r\n\r\n" for e in events)
    body += b"data: [DONE]\r\n\r\n"
    handoff = vh.KvHandoff.from_params(P_PARAMS)
    assert handoff is not None
    for size in (1, 2, 7, len(body)):
        pieces = [body[i : i + size] for i in range(0, len(body), size)]

        def handler(request: httpx.Request, pieces: list[bytes] = pieces) -> httpx.Response:
            return httpx.Response(200, stream=_Pieces(pieces))

        async with vh.VllmEngineClient(
            "http://engine", "m", transport=httpx.MockTransport(handler)
        ) as client:
            chunks = [c async for c in client.decode_stream(vh.DecodeRequest((1, 2, 3), handoff))]
        assert [c.text for c in chunks] == ["hé", "llo", ""], size
        assert [c.token_ids for c in chunks] == [(5,), (6, 7), ()]
        assert chunks[1].finish_reason == "length" and chunks[2].usage == vh.Usage(3, 3, None)


class _Pieces(httpx.AsyncByteStream):
    def __init__(self, pieces: list[bytes]) -> None:
        self._pieces = pieces

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for piece in self._pieces:
            yield piece


def test_metrics_parse_the_counters_kvferry_reads() -> None:
    text = "\n".join(
        [
            "# HELP vllm:prompt_tokens_by_source_total x",
            'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 30.0',
            'vllm:prompt_tokens_by_source_total{engine="0",source="external_kv_transfer"} 352.0',
            'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 352.0',
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
            'vllm:prompt_tokens_total{engine="0",model_name="m"} 382.0',
        ]
    )
    metrics = vh.parse_metrics(text)
    assert metrics.prompt_tokens_by_source == {"local_compute": 30.0, "external_kv_transfer": 352.0}
    assert metrics.external_prefix_cache_hits == 352.0
    assert metrics.kv_cache_usage == 0.25 and metrics.prompt_tokens_total == 382.0


async def test_http_errors_and_unreachable_engines_raise_typed_errors() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["max_tokens"] == 1 and body["kv_transfer_params"]["do_remote_decode"] is True
        assert request.headers["X-Request-Id"] == "rid-1"
        return httpx.Response(400, json={"error": {"message": "prompt too long", "code": 400}})

    async with vh.VllmEngineClient("http://engine", "m", transport=httpx.MockTransport(handler)) as client:
        with pytest.raises(vh.EngineHttpError, match="prompt too long") as caught:
            await client.prefill(vh.PrefillRequest((1, 2, 3), request_id="rid-1"))
        assert caught.value.status_code == 400

    async with vh.VllmEngineClient(
        "http://127.0.0.1:9", "m", timeouts=vh.HttpTimeouts(connect=0.5)
    ) as client:
        with pytest.raises(vh.EngineUnavailableError):
            await client.prefill(vh.PrefillRequest((1, 2, 3)))
        assert not await client.health()
