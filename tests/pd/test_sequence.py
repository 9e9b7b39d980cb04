"""The one prefill-then-decode sequence, against in-memory engines (tests/pd/fake_engine.py). The same
sequence runs against real engines in tests/connector/test_engines.py and behind the router."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest
from kvferry.pd.engine_api import DecodeChunk, EngineHttpError, EngineUnavailableError, Sampling
from kvferry.pd.kvferry_params import ConversationMark, ReleaseMark
from kvferry.pd.reuse import ReadWindow, RetainedKv
from kvferry.pd.sequence import (
    Decoded,
    EngineTurn,
    Prefilled,
    PrefillToken,
    Pull,
    TurnEvent,
    prefill_then_decode,
    run_turn,
)

from tests.pd.fake_engine import FakeEngine

MARK = ConversationMark("acme", "c-1", 2)
PROMPT = tuple(range(40))
NOW = 1_000.0
RETAINED = RetainedKv("d-0", "cmpl-r1-0", (5, 6, 7, 8), 32, "10.0.0.2", 5600, 8, lease_expire_time=NOW + 60)
# Opened at the lookup, 0.5 s before the sequence runs.
WINDOW = ReadWindow.opened(NOW - 0.5, 10.0, lease_seconds_left=60.0)


def turn(**changes: object) -> EngineTurn:
    fields: dict[str, object] = {
        "token_ids": PROMPT,
        "sampling": Sampling(max_tokens=3),
        "mark": MARK,
        "pull": Pull(RETAINED.prefix(24), window=WINDOW),
        "request_id": "r2",
    }
    fields.update(changes)
    return EngineTurn(**fields)  # type: ignore[arg-type]


async def events_of(p: FakeEngine, d: FakeEngine, engine_turn: EngineTurn) -> list[TurnEvent]:
    return [e async for e in prefill_then_decode(p, d, engine_turn, clock=lambda: NOW)]


async def test_a_streamed_turn_prefills_pulls_then_streams_the_decode() -> None:
    p, d = FakeEngine("p-0"), FakeEngine("d-0")
    events = await events_of(p, d, turn())
    prefilled, *chunks, decoded = events
    assert isinstance(prefilled, Prefilled) and isinstance(decoded, Decoded)
    assert all(isinstance(c, DecodeChunk) for c in chunks)
    assert [t for c in chunks if isinstance(c, DecodeChunk) for t in c.token_ids] == [101, 102, 103]
    assert prefilled.pulled_tokens == 24
    assert (decoded.finish_reason, decoded.completion_tokens, decoded.token_ids) == (
        "length",
        3,
        (101, 102, 103),
    )
    assert decoded.retained is None  # streams carry no kv_transfer_params

    [sent_p] = p.prefills
    assert sent_p.request_id == "r2-p" and sent_p.token_ids == PROMPT
    assert sent_p.reuse == RETAINED.prefix(24)
    # Marked, with the time the read window (opened at the lookup) has left when the prefill is sent.
    assert sent_p.mark == MARK and sent_p.read_ms == 9_500
    [sent_d] = d.decodes
    assert sent_d.request_id == "r2-d" and sent_d.mark == MARK and sent_d.handoff == prefilled.handoff
    assert sent_d.sampling == Sampling(max_tokens=3)


@pytest.mark.parametrize(
    ("looked_up_at", "lease_left", "window", "read_ms"),
    [
        (NOW, 60.0, 10.0, 10_000),
        (NOW, 4.0, 10.0, 4_000),
        (NOW - 1.0, 60.0, 2.5, 1_500),
        # Closed before the prefill went out: P is told 0 and declines.
        (NOW - 3.0, 60.0, 2.5, 0),
    ],
)
async def test_the_prefill_carries_the_time_its_read_window_has_left(
    looked_up_at: float, lease_left: float, window: float, read_ms: int
) -> None:
    p = FakeEngine()
    pull = Pull(RETAINED.prefix(8), window=ReadWindow.opened(looked_up_at, window, lease_left))
    await events_of(p, FakeEngine(), turn(pull=pull))
    assert p.prefills[0].read_ms == read_ms
    assert p.prefills[0].transfer_params()["kvferry_read_ms"] == read_ms


async def test_an_unmarked_pull_carries_its_read_window_too() -> None:
    # retain=false turns: the decode gets the release mark, the prefill no mark, but its pull is bounded.
    p = FakeEngine()
    await run_turn(p, FakeEngine(), turn(mark=ReleaseMark()), clock=lambda: NOW)
    [sent] = p.prefills
    assert sent.mark is None and sent.read_ms == 9_500
    assert sent.transfer_params()["kvferry_read_ms"] == 9_500


@pytest.mark.parametrize(
    ("engine", "pulled"),
    [
        (FakeEngine(), 24),
        # P declined the pull (deadline too near, below its threshold): it computed everything.
        (FakeEngine(pull_declined=True), 0),
        # P does not say (no --enable-prompt-tokens-details): it is taken to have pulled what was offered.
        (FakeEngine(report_cached_tokens=False), 24),
    ],
)
async def test_what_was_pulled_is_p_s_own_count(engine: FakeEngine, pulled: int) -> None:
    done = await run_turn(engine, FakeEngine(), turn())
    assert done.prefilled.pulled_tokens == pulled


async def test_without_a_pull_the_prefill_is_unmarked() -> None:
    p, d = FakeEngine(), FakeEngine()
    done = await run_turn(p, d, turn(pull=None))
    assert done.prefilled.pulled_tokens == 0
    assert p.prefills[0].mark is None and p.prefills[0].reuse is None and p.prefills[0].read_ms is None
    assert d.decodes[0].mark == MARK


async def test_a_release_mark_goes_to_the_decode_only() -> None:
    p, d = FakeEngine(), FakeEngine()
    await run_turn(p, d, turn(mark=ReleaseMark()))
    assert p.prefills[0].mark is None and p.prefills[0].reuse is not None
    assert d.decodes[0].mark == ReleaseMark()


async def test_vllm_held_blocks_are_pulled_without_mark_or_deadline() -> None:
    # vLLM's own bidirectional mode: D's answer names its blocks, no lease, no kvferry mark.
    p, d = FakeEngine(), FakeEngine()
    first = await run_turn(p, d, turn(mark=None, pull=None, request_id=None))
    assert first.decoded.retained is not None and first.decoded.retained.blocks is not None
    blocks = first.decoded.retained.blocks
    second = await run_turn(p, d, turn(token_ids=PROMPT * 2, mark=None, pull=Pull(blocks), request_id=None))
    sent = p.prefills[-1]
    assert sent.reuse == blocks and sent.mark is None and sent.read_ms is None
    assert "kvferry_read_ms" not in sent.transfer_params()
    assert second.prefilled.pulled_tokens == blocks.num_tokens
    assert sent.request_id is None and d.decodes[-1].request_id is None


async def test_a_non_streamed_turn_returns_what_d_retained() -> None:
    done = await run_turn(FakeEngine(), FakeEngine("d-0"), turn())
    assert done.decoded.token_ids == (101, 102, 103) and done.decoded.text == "efg"
    retained = RetainedKv.from_decode_answer(done.decoded.retained, block_size=8, lease_expire_time=1.0)
    assert retained is not None and retained.engine_id == "d-0" and retained.block_ids == (7, 8, 9)


@pytest.mark.parametrize("stream", [True, False])
async def test_a_decode_without_a_finish_reason_is_an_engine_failure(stream: bool) -> None:
    d = FakeEngine(finish_reason=None)
    with pytest.raises(EngineUnavailableError, match="without a finish reason"):
        async for _ in prefill_then_decode(FakeEngine(), d, turn(), stream=stream):
            pass


async def test_engine_errors_surface_unchanged_and_the_phase_tells_whose() -> None:
    seen: list[str] = []
    with pytest.raises(EngineHttpError, match="prefill"):
        async for event in prefill_then_decode(FakeEngine(fail_prefills=1), FakeEngine(), turn()):
            seen.append(type(event).__name__)
    assert seen == []
    with pytest.raises(EngineUnavailableError, match="mid-stream"):
        async for event in prefill_then_decode(FakeEngine(), FakeEngine(fail_after_tokens=1), turn()):
            seen.append(type(event).__name__)
    assert seen == ["Prefilled", "DecodeChunk"]


async def test_closing_the_sequence_mid_stream_aborts_the_decode() -> None:
    d = FakeEngine(stall=asyncio.Event())
    async with aclosing(prefill_then_decode(FakeEngine(), d, turn())) as events:
        async for event in events:
            if isinstance(event, DecodeChunk):
                break
    assert d.aborted == ["r2-d"]


# -- P's token as the turn's first output --------------------------------------------------------------


def handing(**changes: object) -> EngineTurn:
    return turn(first_token_from_prefill=True, **changes)


async def test_p_s_token_comes_first_and_d_continues_after_it() -> None:
    p, d = FakeEngine("p-0", output=(100,)), FakeEngine("d-0", output=(101, 102))
    events = await events_of(p, d, handing())
    prefilled, first, *chunks, decoded = events
    assert isinstance(prefilled, Prefilled) and isinstance(decoded, Decoded)
    assert first == PrefillToken((100,), "d", None)
    assert [t for c in chunks if isinstance(c, DecodeChunk) for t in c.token_ids] == [101, 102]
    # P sampled with the turn's settings; D's prompt has P's token, its budget one token less.
    [sent_p] = p.prefills
    assert sent_p.sampling == Sampling(max_tokens=3)
    [sent_d] = d.decodes
    assert sent_d.token_ids == (*PROMPT, 100) and sent_d.sampling == Sampling(max_tokens=2)
    assert sent_d.handoff == prefilled.handoff and sent_d.mark == MARK
    # The turn's figures are the client's: the prompt without P's token, the output with it.
    assert (decoded.token_ids, decoded.text, decoded.finish_reason) == ((100, 101, 102), "def", "length")
    assert decoded.usage is not None
    assert (decoded.usage.prompt_tokens, decoded.completion_tokens) == (len(PROMPT), 3)


@pytest.mark.parametrize(
    ("changes", "stream"),
    [
        ({"first_token_from_prefill": True}, False),  # the whole answer at once: nothing to show early
        ({}, True),
        ({"first_token_from_prefill": True, "sampling": Sampling(max_tokens=1)}, True),
        ({"first_token_from_prefill": True, "sampling": Sampling(max_tokens=3, stop=("x",))}, True),
    ],
)
async def test_d_decodes_every_token_when_p_s_cannot_be_handed_over(
    changes: dict[str, object], stream: bool
) -> None:
    p, d = FakeEngine(output=(100,)), FakeEngine(output=(101, 102, 103))
    events = [e async for e in prefill_then_decode(p, d, turn(**changes), stream=stream, clock=lambda: NOW)]
    assert not any(isinstance(e, PrefillToken) for e in events)
    assert p.prefills[0].sampling is None  # greedy: the token is only a by-product
    assert d.decodes[0].token_ids == PROMPT
    decoded = events[-1]
    assert isinstance(decoded, Decoded) and decoded.token_ids == (101, 102, 103)


async def test_a_p_token_without_whole_text_is_not_shown() -> None:
    # Part of a character: shown alone it would garble the text; D decodes from the prompt instead.
    p, d = FakeEngine(output=(100,), first_text="\ufffd"), FakeEngine(output=(101, 102, 103))
    events = await events_of(p, d, handing())
    assert not any(isinstance(e, PrefillToken) for e in events)
    assert d.decodes[0].token_ids == PROMPT and d.decodes[0].sampling == Sampling(max_tokens=3)


async def test_a_p_token_that_ends_the_answer_is_the_answer_and_d_still_retains() -> None:
    p = FakeEngine(output=(0,), first_text="", finish_reason="stop")
    d = FakeEngine(output=(101,))
    events = await events_of(p, d, handing())
    assert [type(e).__name__ for e in events] == ["Prefilled", "PrefillToken", "Decoded"]
    assert events[1] == PrefillToken((0,), "", "stop")
    # D decoded the prompt (one token, not shown) so that it retains the conversation.
    [sent_d] = d.decodes
    assert sent_d.token_ids == PROMPT and sent_d.sampling == Sampling(max_tokens=1) and sent_d.mark == MARK
    decoded = events[-1]
    assert isinstance(decoded, Decoded)
    assert (decoded.token_ids, decoded.finish_reason, decoded.completion_tokens) == ((0,), "stop", 1)
