"""JSON on the hot paths: orjson, and the standard library for what orjson refuses."""

from __future__ import annotations

import json
import math

import pytest
from kvferry.pd.json_codec import decode_json, encode_json


def test_request_bodies_are_json_the_engine_reads_back_unchanged() -> None:
    body = {"model": "m", "prompt": list(range(40_000)), "max_tokens": 1, "stop": ["\u00e9"], "t": 0.5}
    encoded = encode_json(body)
    assert json.loads(encoded) == body and b" " not in encoded and "\u00e9".encode() in encoded
    # orjson refuses integers beyond 64 bits (a client's tool schema may hold one): the standard library then.
    schema = {"tools": [{"function": {"parameters": {"maximum": 2**70}}}], "prompt": "caf\u00e9"}
    assert json.loads(encode_json(schema)) == schema


def test_what_an_engine_sends_is_read_whatever_orjson_refuses() -> None:
    assert decode_json(b'{"choices": [{"text": "caf\xc3\xa9", "token_ids": [1, 2]}]}') == {
        "choices": [{"text": "caf\u00e9", "token_ids": [1, 2]}]
    }
    # A logprob of minus infinity as Python's json writes it, and a byte order mark: the standard library.
    assert math.isinf(decode_json(b'{"logprob": -Infinity}')["logprob"])
    assert decode_json("\ufeff{}".encode()) == {}
    for garbage in (b"", b"{", b"data: {}", b"\xff"):
        with pytest.raises(ValueError):
            decode_json(garbage)
