"""The one prefill-then-decode sequence of a turn, used by the router, the stack, the benchmarks and tools.

1. Prefill on P with ``max_tokens=1``. With a :class:`Pull`, P first pulls the retained prefix from D; the
   request then carries the time left of the pull's read window (:class:`~kvferry.pd.reuse.ReadWindow`,
   opened when the retention was looked up) so P's connector can decline a pull that might start too late.
2. Reconcile: P's own count of cached tokens says how many it really pulled (it may decline the pull: the
   deadline too near, fewer tokens than its ``kv_recompute_threshold``).
3. Decode on D with P's handoff and the mark: streamed (tokens as they come; closing the stream aborts the
   request on D) or not (D's answer then names the blocks it retained).

P samples one token anyway. A streamed token-id turn with ``EngineTurn.first_token_from_prefill`` makes it
the turn's first output: P samples it with the turn's settings, the sequence yields it as soon as P answers (a
:class:`PrefillToken`), and D continues after it (its prompt is the turn's plus that token, its budget one
token less), so the time to the first token is P's alone, not P's plus D's pull of the prompt and D's first
step. D loads the KV P computed and computes that one token itself: kvferry's connector on D loads no more
than P computed (vLLM alone would load the whole prompt, and one block more than P has when P's token starts
a block). Not with stop strings (one could span P's token and D's first, which D would not see), a budget of
one token, or chat turns (the engines' tool and reasoning parsers must see every output token). A P token
that ends the answer (end of sequence, a stop token) is the whole answer: D still decodes the prompt, one
token it does not show, so that it retains the conversation. A P token with no complete text (part of a
character) is not shown: D decodes from the prompt as usual.

:func:`prefill_then_decode` yields :class:`Prefilled` once P answered, then P's token when handed over, then
the decode's :class:`~kvferry.pd.engine_api.DecodeChunk` s, then :class:`Decoded`. An engine error before
:class:`Prefilled` is P's, after it D's: the caller knows which engine failed by what it has seen.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from kvferry.pd.chat import ChatRequest
from kvferry.pd.engine_api import (
    DecodeChunk,
    DecodeRequest,
    EngineApi,
    EngineUnavailableError,
    PrefillRequest,
    PrefillResult,
    Sampling,
    Usage,
)
from kvferry.pd.kvferry_params import (
    DEVICE_TIER,
    BlockGenerations,
    ConversationMark,
    Mark,
    PeerAddress,
    PullOptions,
)
from kvferry.pd.reuse import ReadWindow
from kvferry.pd.vllm_params import KvHandoff, RemoteBlocks


@dataclass(frozen=True)
class Pull:
    """The retained prefix P pulls from D instead of computing it."""

    blocks: RemoteBlocks
    # Until when P may start reading, opened when the retention was looked up. None: blocks vLLM holds on
    # its own (no lease, no kvferry deadline: vLLM's own expiry check guards them).
    window: ReadWindow | None = None
    # The generations the retention published for ``blocks`` (P checks them after pulling; None: no check).
    generations: BlockGenerations | None = None
    # Which of the holder's tiers ``blocks`` are in (kvferry.pd.kvferry_params.PULL_TIERS).
    tier: str = DEVICE_TIER


@dataclass(frozen=True)
class EngineTurn:
    """What one turn asks of its prefill and decode engines."""

    # The prompt; with ``chat``, the ids its messages render to (both engines compute exactly these).
    token_ids: tuple[int, ...]
    # Unused with ``chat``, which carries its own sampling fields.
    sampling: Sampling = field(default_factory=Sampling)
    # A conversation mark: D retains the turn for the conversation (and P gets the mark with the pull's read
    # deadline). A release mark: D frees the blocks when the decode finishes. None: vLLM's own handling.
    mark: Mark | None = None
    pull: Pull | None = None
    # Sent as X-Request-Id: "<id>-p" to P, "<id>-d" to D (None: the engines make their own).
    request_id: str | None = None
    # Options for P's pull (tests and comparisons; routers send none).
    pull_options: PullOptions | None = None
    # Served through the engines' chat endpoint (kvferry.pd.chat): templates, tool and reasoning parsers and
    # structured outputs run in the engines.
    chat: ChatRequest | None = None
    # A streamed turn may take its first token from P (module docs); needs kvferry's connector on D.
    first_token_from_prefill: bool = False
    # The decode engine's NIXL side channel, for P to handshake with ahead of the next turn's pull from it
    # (kvferry_params.PeerAddress; routers send it on turns D retains).
    decode_peer: PeerAddress | None = None

    def hands_first_token_over(self, *, stream: bool) -> bool:
        """Whether P samples the turn's first output token, for D to continue after it (module docs)."""
        return (
            stream
            and self.first_token_from_prefill
            and self.chat is None
            and not self.sampling.stop
            and self.sampling.max_tokens >= 2
        )

    @property
    def offered_pull_tokens(self) -> int:
        """Tokens the pull offers P (0 without one)."""
        if self.pull is None:
            return 0
        num_tokens = self.pull.blocks.num_tokens
        return len(self.token_ids) if num_tokens is None else num_tokens


@dataclass(frozen=True)
class Prefilled:
    """P answered: its handoff for D, and what it really pulled."""

    result: PrefillResult
    # Prompt tokens P pulled instead of computing: its own count where it reports one (usage.cached_tokens).
    pulled_tokens: int
    seconds: float

    @property
    def handoff(self) -> KvHandoff:
        return self.result.handoff


@dataclass(frozen=True)
class PrefillToken:
    """P's token, handed over as the turn's first output (module docs); ``finish_reason`` set when it is the
    whole answer."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None


@dataclass(frozen=True)
class Decoded:
    """D finished the turn."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    usage: Usage | None
    # A non-streamed decode's returned params: the blocks D retained (vLLM streams carry none).
    retained: KvHandoff | None
    seconds: float
    # A non-streamed chat decode: D's chat completion as it came (without its kv_transfer_params).
    body: Mapping[str, Any] | None = None
    # The generations D published with the retained blocks (non-streamed decodes of fencing engines).
    retained_generations: BlockGenerations | None = None

    @property
    def completion_tokens(self) -> int:
        return self.usage.completion_tokens if self.usage is not None else len(self.token_ids)


@dataclass(frozen=True)
class FinishedTurn:
    prefilled: Prefilled
    decoded: Decoded


TurnEvent = Prefilled | PrefillToken | DecodeChunk | Decoded


async def prefill_then_decode(
    prefill_engine: EngineApi,
    decode_engine: EngineApi,
    turn: EngineTurn,
    *,
    stream: bool = True,
    clock: Callable[[], float] = time.monotonic,
) -> AsyncGenerator[TurnEvent, None]:
    """The turn's engine calls: :class:`Prefilled`, P's token when handed over, the decode's chunks,
    :class:`Decoded` (module docs)."""
    hand_over = turn.hands_first_token_over(stream=stream)
    prefilled = await prefill(prefill_engine, turn, clock=clock, sample=hand_over)
    yield prefilled
    first = _first_token(prefilled.result) if hand_over else None
    if first is None:
        async with aclosing(decode(decode_engine, turn, prefilled, stream=stream)) as events:
            async for event in events:
                yield event
        return
    yield first
    if first.finish_reason is not None:
        # P's token is the whole answer; D decodes the prompt only to retain the conversation (one token,
        # not shown).
        d_turn = dataclasses.replace(turn, sampling=dataclasses.replace(turn.sampling, max_tokens=1))
    else:
        d_turn = dataclasses.replace(
            turn,
            token_ids=turn.token_ids + first.token_ids,
            sampling=dataclasses.replace(turn.sampling, max_tokens=turn.sampling.max_tokens - 1),
        )
    async with aclosing(decode(decode_engine, d_turn, prefilled, stream=stream)) as events:
        async for event in events:
            if isinstance(event, Decoded):
                yield with_first_token(first, event)
            elif first.finish_reason is None:
                yield event


def _first_token(result: PrefillResult) -> PrefillToken | None:
    """P's token as the turn's first output, or None when it cannot be shown on its own (not exactly one
    token, no complete text, or P stopped for another reason than its budget or the answer's end)."""
    text = result.first_text
    if len(result.first_token_ids) != 1 or result.finish_reason not in ("length", "stop"):
        return None
    if result.finish_reason == "length" and (not text or "\ufffd" in text):
        return None
    finish = None if result.finish_reason == "length" else result.finish_reason
    return PrefillToken(result.first_token_ids, text, finish)


def with_first_token(first: PrefillToken, decoded: Decoded) -> Decoded:
    """The turn's :class:`Decoded`: P's token followed by D's (or P's alone when it ended the answer)."""
    usage = decoded.usage
    if first.finish_reason is not None:
        return dataclasses.replace(
            decoded,
            token_ids=first.token_ids,
            text=first.text,
            finish_reason=first.finish_reason,
            usage=None if usage is None else dataclasses.replace(usage, completion_tokens=1),
        )
    shown = len(first.token_ids)
    return dataclasses.replace(
        decoded,
        token_ids=first.token_ids + decoded.token_ids,
        text=first.text + decoded.text,
        usage=None
        if usage is None
        else dataclasses.replace(
            usage,
            prompt_tokens=usage.prompt_tokens - shown,
            completion_tokens=usage.completion_tokens + shown,
        ),
    )


async def run_turn(
    prefill_engine: EngineApi,
    decode_engine: EngineApi,
    turn: EngineTurn,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> FinishedTurn:
    """:func:`prefill_then_decode` to its end, the decode not streamed (D's answer names what it retained)."""
    prefilled: Prefilled | None = None
    async with aclosing(
        prefill_then_decode(prefill_engine, decode_engine, turn, stream=False, clock=clock)
    ) as events:
        async for event in events:
            if isinstance(event, Prefilled):
                prefilled = event
            elif isinstance(event, Decoded):
                assert prefilled is not None
                return FinishedTurn(prefilled, event)
    raise AssertionError("the sequence ended without a decode")


async def prefill(
    engine: EngineApi,
    turn: EngineTurn,
    *,
    clock: Callable[[], float] = time.monotonic,
    sample: bool = False,
) -> Prefilled:
    """Step 1 and 2: P computes the prompt (pulling the offered prefix first), and what it pulled. ``clock``:
    the monotonic clock the pull's read window was opened on; ``sample``: P samples its token with the turn's
    settings (it is the turn's first output)."""
    pull = turn.pull
    read_ms = pull.window.ms_left(clock()) if pull is not None and pull.window is not None else None
    started = time.perf_counter()
    result = await engine.prefill(
        PrefillRequest(
            token_ids=turn.token_ids,
            mark=turn.mark if pull is not None and isinstance(turn.mark, ConversationMark) else None,
            reuse=pull.blocks if pull is not None else None,
            read_ms=read_ms,
            request_id=f"{turn.request_id}-p" if turn.request_id else None,
            pull_options=turn.pull_options,
            chat=turn.chat,
            generations=pull.generations if pull is not None else None,
            tier=pull.tier if pull is not None else DEVICE_TIER,
            sampling=turn.sampling if sample else None,
            peer=turn.decode_peer,
        )
    )
    seconds = time.perf_counter() - started
    offered = turn.offered_pull_tokens
    cached = result.usage.cached_tokens if result.usage is not None else None
    # P's own count: it may have declined the pull. An engine that does not report it pulled what it got.
    pulled = offered if cached is None else min(offered, cached)
    return Prefilled(result=result, pulled_tokens=pulled, seconds=seconds)


async def decode(
    engine: EngineApi, turn: EngineTurn, prefilled: Prefilled, *, stream: bool = True
) -> AsyncGenerator[DecodeChunk | Decoded, None]:
    """Step 3: D pulls the prompt from P and generates; the chunks, then :class:`Decoded`."""
    request = DecodeRequest(
        token_ids=turn.token_ids,
        handoff=prefilled.handoff,
        mark=turn.mark,
        sampling=turn.sampling,
        request_id=f"{turn.request_id}-d" if turn.request_id else None,
        chat=turn.chat,
    )
    started = time.perf_counter()
    token_ids: list[int] = []
    texts: list[str] = []
    finish_reason = ""
    usage: Usage | None = None
    retained: KvHandoff | None = None
    body: Mapping[str, Any] | None = None
    retained_generations: BlockGenerations | None = None
    if stream:
        # Closing the stream (here, or when our caller closes us) closes the HTTP request: vLLM aborts it.
        async with aclosing(engine.decode_stream(request)) as chunks:
            async for chunk in chunks:
                finish_reason = chunk.finish_reason or finish_reason
                usage = chunk.usage or usage
                token_ids.extend(chunk.token_ids)
                texts.append(chunk.text)
                yield chunk
    else:
        answer = await engine.decode(request)
        finish_reason, usage, retained = answer.finish_reason or "", answer.usage, answer.retained
        body = answer.body
        retained_generations = answer.retained_generations
        token_ids.extend(answer.token_ids)
        texts.append(answer.text)
        yield DecodeChunk(answer.token_ids, answer.text, answer.finish_reason, answer.usage)
    if not finish_reason:
        raise EngineUnavailableError(engine.base_url, EOFError("the decode ended without a finish reason"))
    yield Decoded(
        token_ids=tuple(token_ids),
        text="".join(texts),
        finish_reason=finish_reason,
        usage=usage,
        retained=retained,
        seconds=time.perf_counter() - started,
        body=body,
        retained_generations=retained_generations,
    )
