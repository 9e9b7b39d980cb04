"""Drives the turns of ``kvferry bench multiturn``: the three modes, engine counters, the gap sweep.

Modes (each on its own conversations, alternating turn by turn):
- ``reuse``: the kvferry router (SDK ``generate`` on one conversation id); between turns the agent
  heartbeats the conversation (SDK ``keep_alive``) as it would while a tool runs.
- ``recompute``: the same router, a fresh conversation id every turn (closed right after it): nothing
  is found to reuse, the prefill engine computes the whole prompt.
- ``vllm``: vLLM's own behaviour. The engines are driven directly (``kvferry.pd.sequence``):
  prefill on P, non-streaming decode on D without kvferry's mark, so D keeps the blocks for vLLM's fixed
  ``decoder_kv_blocks_ttl`` and returns them in its response; the client passes them to P next turn.
  No router state, no digest check, no heartbeat.

:class:`AgentDriver` runs the agent workload (``--workload agent``) the same way, its turns being chat
requests to the router's ``/v1/chat/completions`` with a tool call and its result between turns.

Per turn, the engines' Prometheus counters are read before and after: the prefill engine's NIXL
transfer time (its pull of the retained prefix from D), the decode engine's (its pull of the prompt's
new KV from P) and the decode engine's own TTFT. Deltas are exact when turns do not overlap
(``--parallel 1``, the default); otherwise they are marked ``exclusive: false``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from kvferry.bench.multiturn_agent import TOOLS, AgentConversation, ToolTiming
from kvferry.bench.multiturn_stats import (
    FIXED_TTL,
    HEARTBEAT,
    RECOMPUTE,
    REUSE,
    VLLM,
    GapRecord,
    TurnRecord,
)
from kvferry.bench.multiturn_workload import (
    ConversationPlan,
    ConversationTokens,
    WorkloadSpec,
    plan_conversations,
    seeded_rng,
)
from kvferry.pd.engine_api import EngineApi, Sampling
from kvferry.pd.engine_metrics import (
    TTFT_COUNT,
    TTFT_SECONDS,
    XFER_BYTES,
    XFER_COUNT,
    XFER_SECONDS,
    metric_sums,
)
from kvferry.pd.sequence import EngineTurn, Pull, run_turn
from kvferry.pd.vllm_params import RemoteBlocks
from kvferry.sdk import Client, KeepAlive, SamplingParams, TurnSummary

# Counters read from each engine's /metrics (summed over label sets).
METRIC_NAMES = (XFER_SECONDS, XFER_COUNT, XFER_BYTES, TTFT_SECONDS, TTFT_COUNT)


@dataclass(frozen=True)
class Engines:
    prefill_url: str
    decode_url: str
    model: str


class EngineCounters:
    """Reads both engines' counters; ``None`` everywhere when the engines are not known."""

    def __init__(self, engines: Engines | None) -> None:
        self._engines = engines
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(5.0))

    @property
    def available(self) -> bool:
        return self._engines is not None

    async def read(self) -> tuple[dict[str, float], dict[str, float]] | None:
        if self._engines is None:
            return None
        prefill, decode = await asyncio.gather(
            self._http.get(f"{self._engines.prefill_url}/metrics"),
            self._http.get(f"{self._engines.decode_url}/metrics"),
        )
        return metric_sums(prefill.text, METRIC_NAMES), metric_sums(decode.text, METRIC_NAMES)

    async def settled_after(
        self, before: tuple[dict[str, float], dict[str, float]] | None, *, expect_decode_ttft: bool
    ) -> tuple[dict[str, float], dict[str, float]] | None:
        """Counters after a turn, re-read briefly until the decode engine counted the turn's TTFT
        (its stats reach /metrics with the engine's next output, a few ms after the answer)."""
        after = await self.read()
        if before is None or after is None or not expect_decode_ttft:
            return after
        for _ in range(20):
            if after is None or after[1][TTFT_COUNT] > before[1][TTFT_COUNT]:
                break
            await asyncio.sleep(0.01)
            after = await self.read()
        return after

    async def aclose(self) -> None:
        await self._http.aclose()


def counter_deltas(
    before: tuple[dict[str, float], dict[str, float]] | None,
    after: tuple[dict[str, float], dict[str, float]] | None,
) -> dict[str, float | None]:
    """Per-turn figures from two counter readings (None where unknown)."""
    if before is None or after is None:
        return {"pull_ms": None, "pull_bytes": None, "handoff_ms": None, "decode_ttft_ms": None}
    (p0, d0), (p1, d1) = before, after
    ttft_count = d1[TTFT_COUNT] - d0[TTFT_COUNT]
    return {
        "pull_ms": (p1[XFER_SECONDS] - p0[XFER_SECONDS]) * 1000,
        "pull_bytes": p1[XFER_BYTES] - p0[XFER_BYTES],
        "handoff_ms": (d1[XFER_SECONDS] - d0[XFER_SECONDS]) * 1000,
        "decode_ttft_ms": (d1[TTFT_SECONDS] - d0[TTFT_SECONDS]) * 1000 / ttft_count if ttft_count else None,
    }


@dataclass
class Progress:
    """A one-line progress bar on stderr (plain lines when stderr is not a terminal)."""

    total: int
    label: str
    done: int = 0
    started: float = field(default_factory=time.monotonic)
    _last_plain: float = 0.0

    def step(self, note: str = "") -> None:
        self.done += 1
        elapsed = time.monotonic() - self.started
        width = 30
        filled = int(width * self.done / max(self.total, 1))
        eta = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        line = (
            f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
            f"{elapsed:.0f}s eta {eta:.0f}s {note}"
        )
        if sys.stderr.isatty():
            print(
                f"\r{line[:150]:<150}",
                end="" if self.done < self.total else "\n",
                file=sys.stderr,
                flush=True,
            )
        elif self.done == self.total or time.monotonic() - self._last_plain > 5:
            self._last_plain = time.monotonic()
            print(line, file=sys.stderr, flush=True)


@dataclass
class DriverSettings:
    workload: WorkloadSpec
    modes: tuple[str, ...]
    parallel: int = 1
    seed: int = 0


class TurnDriver:
    """Runs the main phase: every conversation of every mode, turns alternating between modes."""

    def __init__(
        self,
        client: Client,
        counters: EngineCounters,
        vllm_engines: tuple[EngineApi, EngineApi] | None,
        settings: DriverSettings,
        *,
        run_started: float,
        on_turn: Callable[[TurnRecord], None] | None = None,
    ) -> None:
        if VLLM in settings.modes and vllm_engines is None:
            raise ValueError("the vllm mode needs the engines' URLs")
        self._client = client
        self._counters = counters
        self._vllm_engines = vllm_engines
        self._settings = settings
        self._run_started = run_started
        self._on_turn = on_turn
        self._inflight = 0
        self.records: list[TurnRecord] = []
        self.errors: list[str] = []

    def schedule(self) -> list[tuple[str, int, int]]:
        """(mode, conversation, turn) in run order: turn by turn, conversation by conversation, the
        modes rotating who goes first so none always runs right after another's long prefill."""
        spec = self._settings.workload
        modes = self._settings.modes
        order: list[tuple[str, int, int]] = []
        for turn in range(spec.turns):
            for conversation in range(spec.conversations):
                shift = (turn + conversation) % len(modes)
                for mode in modes[shift:] + modes[:shift]:
                    order.append((mode, conversation, turn))
        return order

    async def run(self, progress: Progress | None = None) -> list[TurnRecord]:
        spec = self._settings.workload
        plans = plan_conversations(spec)
        chains: dict[tuple[str, int], _Chain] = {}
        for mode in self._settings.modes:
            for plan in plans:
                chains[(mode, plan.index)] = self._new_chain(mode, plan)
        order = self.schedule()
        queue: asyncio.Queue[tuple[str, int, int]] = asyncio.Queue()
        for step in order:
            queue.put_nowait(step)

        async def worker() -> None:
            while True:
                try:
                    mode, conversation, _turn = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                chain = chains[(mode, conversation)]
                # Locks are taken in queue order (no await between get_nowait and acquire of a free
                # lock; waiters are FIFO), so a conversation's turns run in order.
                async with chain.lock:
                    record = await self._turn(chain)
                if record is not None:
                    self.records.append(record)
                    if self._on_turn is not None:
                        self._on_turn(record)
                if progress is not None:
                    note = (
                        f"{mode} {record.prompt_tokens / 1000:.1f}k TTFT {record.ttft_ms:.0f}ms"
                        if record
                        else ""
                    )
                    progress.step(note)

        try:
            await asyncio.gather(*(worker() for _ in range(max(1, self._settings.parallel))))
        finally:
            await self._close(chains)
        return self.records

    def _new_chain(self, mode: str, plan: ConversationPlan) -> _Chain:
        spec = self._settings.workload
        tokens = ConversationTokens(plan, seed=spec.seed, salt=mode, vocab_size=spec.vocab_size)
        return _Chain(mode=mode, source=tokens, conversation_id=_conv_id(mode))

    async def _send(self, chain: _Chain) -> _TurnResult:
        assert isinstance(chain.source, ConversationTokens)
        prompt = list(chain.source.prompt())
        if chain.mode == VLLM:
            return await self._vllm_turn(chain, prompt)
        reply_tokens = self._settings.workload.reply_tokens

        async def send(conversation_id: str) -> _TurnResult:
            return await router_turn(self._client, conversation_id, prompt, reply_tokens, retain=True)

        return await self._router_turn(chain, send)

    def _close_turn(self, chain: _Chain, result: _TurnResult | None) -> None:
        """Adds the turn's reply to the conversation (``None``: the turn failed)."""
        assert isinstance(chain.source, ConversationTokens)
        chain.source.add_reply(list(result.reply_ids) if result is not None else [])

    async def _turn(self, chain: _Chain) -> TurnRecord | None:
        turn = chain.source.next_turn
        # The conversation's tool (agent workload) may still be running.
        wait = chain.ready_at - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        if chain.keep_alive is not None:
            await chain.keep_alive.stop()
            chain.keep_alive = None
        self._inflight += 1
        exclusive = self._inflight == 1
        try:
            before = await self._counters.read()
            started = time.perf_counter()
            result = await self._send(chain)
            after = await self._counters.settled_after(before, expect_decode_ttft=True)
            exclusive = exclusive and self._inflight == 1
        except Exception as error:  # a failed turn is reported, the run goes on
            self.errors.append(f"{chain.mode} conversation {chain.source.plan.index} turn {turn}: {error}")
            self._close_turn(chain, None)
            return None
        finally:
            self._inflight -= 1
        self._close_turn(chain, result)
        deltas = counter_deltas(before, after)
        if chain.mode == REUSE and not chain.source.done:
            # The agent runs its tool now (and waits for its next turn's slot behind the other
            # conversations'): keep the conversation's KV alive until then.
            chain.keep_alive = self._client.keep_alive(chain.conversation_id)
            await chain.keep_alive.__aenter__()
        ttft_ms = result.ttft_ms
        if ttft_ms is None:
            decode_ttft = deltas["decode_ttft_ms"]
            ttft_ms = result.prefill_ms + (decode_ttft or 0.0)
        pull_ms = deltas["pull_ms"]
        if pull_ms is not None and result.pulled_tokens == 0 and pull_ms < 0.5:
            pull_ms = 0.0
        pull_bytes = deltas["pull_bytes"]
        return TurnRecord(
            mode=chain.mode,
            conversation=chain.source.plan.index,
            turn=turn,
            prompt_tokens=result.prompt_tokens,
            ttft_ms=ttft_ms,
            prefill_ms=result.prefill_ms,
            pulled_tokens=result.pulled_tokens,
            recomputed_tokens=result.prompt_tokens - result.pulled_tokens,
            pull_ms=pull_ms,
            pull_bytes=int(pull_bytes) if pull_bytes is not None else None,
            handoff_ms=deltas["handoff_ms"],
            router_ttft_ms=result.router_ttft_ms,
            reuse=result.reuse,
            at_s=started - self._run_started,
            exclusive=exclusive,
        )

    async def _router_turn(self, chain: _Chain, send: Callable[[str], Awaitable[_TurnResult]]) -> _TurnResult:
        """``send`` on the chain's conversation (reuse), or on a new one closed right after (recompute)."""
        if chain.mode == REUSE:
            return await send(chain.conversation_id)
        # Recompute: a conversation the router has never seen, closed at once. (retain=False would
        # leave the decode engine holding the blocks for vLLM's fixed decoder_kv_blocks_ttl: the
        # connector leaves unmarked requests to vLLM.)
        conversation_id = _conv_id(RECOMPUTE)
        try:
            return await send(conversation_id)
        finally:
            with contextlib.suppress(Exception):
                await self._client.close_conversation(conversation_id)

    async def _vllm_turn(self, chain: _Chain, prompt: list[int]) -> _TurnResult:
        assert self._vllm_engines is not None
        prefill_engine, decode_engine = self._vllm_engines
        spec = self._settings.workload
        # No mark: vLLM's own handling. D keeps the blocks (no lease) and names them in its answer.
        done = await run_turn(
            prefill_engine,
            decode_engine,
            EngineTurn(
                token_ids=tuple(prompt),
                sampling=Sampling(max_tokens=spec.reply_tokens, ignore_eos=True),
                pull=Pull(chain.vllm_blocks) if chain.vllm_blocks is not None else None,
            ),
        )
        pulled = done.prefilled.pulled_tokens
        retained = done.decoded.retained
        chain.vllm_blocks = retained.blocks if retained is not None else None
        return _TurnResult(
            ttft_ms=None,
            prompt_tokens=len(prompt),
            prefill_ms=done.prefilled.seconds * 1000,
            pulled_tokens=pulled,
            reply_ids=done.decoded.token_ids,
            router_ttft_ms=None,
            reuse="pull" if pulled else "none",
        )

    async def _close(self, chains: Mapping[tuple[str, int], _Chain]) -> None:
        for chain in chains.values():
            if chain.keep_alive is not None:
                await chain.keep_alive.stop()
            if chain.mode == REUSE:
                with contextlib.suppress(Exception):
                    await self._client.close_conversation(chain.conversation_id)


@dataclass
class _Chain:
    mode: str
    source: ConversationTokens | AgentConversation
    conversation_id: str
    keep_alive: KeepAlive | None = None
    # Monotonic time the conversation's next turn may start (its tool's call ends).
    ready_at: float = 0.0
    # vLLM mode: the blocks D returned for this conversation's last turn.
    vllm_blocks: RemoteBlocks | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass(frozen=True)
class _TurnResult:
    # Client-side TTFT (None: derive it from the prefill call and D's own TTFT).
    ttft_ms: float | None
    prompt_tokens: int
    prefill_ms: float
    pulled_tokens: int
    reply_ids: tuple[int, ...]
    router_ttft_ms: float | None
    reuse: str
    reply_text: str = ""


def _conv_id(mode: str) -> str:
    return f"bench-{mode}-{uuid.uuid4().hex[:16]}"


async def router_turn(
    client: Client, conversation_id: str, prompt: list[int], reply_tokens: int, *, retain: bool
) -> _TurnResult:
    started = time.perf_counter()
    stream = client.generate(
        conversation_id,
        prompt,
        sampling=SamplingParams(max_tokens=reply_tokens, ignore_eos=True),
        retain=retain,
    )
    ttft_ms: float | None = None
    reply: list[int] = []
    async for chunk in stream:
        if chunk.token_ids and ttft_ms is None:
            ttft_ms = (time.perf_counter() - started) * 1000
        reply.extend(chunk.token_ids)
    summary: TurnSummary | None = stream.summary
    if summary is None:
        raise RuntimeError("the router's stream ended without a summary")
    return _TurnResult(
        ttft_ms=ttft_ms if ttft_ms is not None else summary.ttft_ms,
        prompt_tokens=len(prompt),
        prefill_ms=summary.prefill_ms,
        pulled_tokens=summary.pulled_tokens,
        reply_ids=tuple(reply),
        router_ttft_ms=summary.ttft_ms,
        reuse=summary.reuse.value,
    )


# ---------------------------------------------------------------------------------------------
# The agent workload: chat messages through the router's OpenAI API, a tool call between turns
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatEndpoint:
    """The router's OpenAI-compatible HTTP API."""

    base_url: str  # http://host:port (no /v1)
    api_key: str
    model: str


class AgentDriver(TurnDriver):
    """The main phase with the agent workload (:mod:`kvferry.bench.multiturn_agent`): each turn sends the
    whole chat history to ``/v1/chat/completions`` (streamed, the tools declared), then the agent calls a
    tool: the answer and the call join the history, the call takes its seeded time, and its result opens
    the next turn. Modes ``reuse`` and ``recompute`` only (the vllm mode drives the engines by token ids).
    """

    def __init__(
        self,
        client: Client,
        counters: EngineCounters,
        settings: DriverSettings,
        *,
        chat: ChatEndpoint,
        words: tuple[str, ...],
        tool_timing: ToolTiming,
        run_started: float,
        on_turn: Callable[[TurnRecord], None] | None = None,
    ) -> None:
        if VLLM in settings.modes:
            raise ValueError("the agent workload runs the reuse and recompute modes, not vllm")
        super().__init__(client, counters, None, settings, run_started=run_started, on_turn=on_turn)
        self._chat = chat
        self._words = words
        self._tool_timing = tool_timing
        self._http = httpx.AsyncClient(base_url=chat.base_url, timeout=httpx.Timeout(900.0, connect=10.0))

    def _new_chain(self, mode: str, plan: ConversationPlan) -> _Chain:
        source = AgentConversation(
            plan,
            seed=self._settings.workload.seed,
            salt=mode,
            words=self._words,
            tool_timing=self._tool_timing,
        )
        return _Chain(mode=mode, source=source, conversation_id=_conv_id(mode))

    async def _send(self, chain: _Chain) -> _TurnResult:
        assert isinstance(chain.source, AgentConversation)
        messages = chain.source.messages()
        reply_tokens = self._settings.workload.reply_tokens

        async def send(conversation_id: str) -> _TurnResult:
            return await chat_turn(self._http, self._chat, conversation_id, messages, reply_tokens)

        return await self._router_turn(chain, send)

    def _close_turn(self, chain: _Chain, result: _TurnResult | None) -> None:
        assert isinstance(chain.source, AgentConversation)
        call = chain.source.add_reply(result.reply_text if result is not None else "")
        if call is not None:
            chain.ready_at = time.monotonic() + call.seconds

    async def run(self, progress: Progress | None = None) -> list[TurnRecord]:
        try:
            return await super().run(progress)
        finally:
            await self._http.aclose()


def chat_request(model: str, messages: list[dict[str, Any]], reply_tokens: int) -> dict[str, Any]:
    """One agent turn's request body: the whole history, the tools, a streamed answer of ``reply_tokens``."""
    return {
        "model": model,
        "messages": messages,
        "tools": list(TOOLS),
        # The calls are the client's (module docs of multiturn_agent): the model answers in text.
        "tool_choice": "none",
        "max_tokens": reply_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def chat_turn(
    http: httpx.AsyncClient,
    chat: ChatEndpoint,
    conversation_id: str,
    messages: list[dict[str, Any]],
    reply_tokens: int,
) -> _TurnResult:
    """One streamed chat turn; TTFT is the first chunk with a choice (vLLM sends one per token, the
    first with the assistant's role), the rest comes from the usage chunk's kvferry figures."""
    started = time.perf_counter()
    ttft_ms: float | None = None
    text: list[str] = []
    usage: dict[str, Any] | None = None
    async with http.stream(
        "POST",
        "/v1/chat/completions",
        json=chat_request(chat.model, messages, reply_tokens),
        headers={"Authorization": f"Bearer {chat.api_key}", "X-Conversation-Id": conversation_id},
    ) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            raise RuntimeError(f"chat completions answered HTTP {response.status_code}: {body[:500]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RuntimeError(f"the stream failed: {chunk['error']}")
            for choice in chunk.get("choices") or ():
                if ttft_ms is None:
                    ttft_ms = (time.perf_counter() - started) * 1000
                text.append((choice.get("delta") or {}).get("content") or "")
            if "kvferry" in (chunk.get("usage") or {}):
                usage = chunk["usage"]
    if usage is None:
        raise RuntimeError("the router's stream ended without its usage chunk")
    figures = usage["kvferry"]
    return _TurnResult(
        ttft_ms=ttft_ms if ttft_ms is not None else float(figures["ttft_ms"]),
        prompt_tokens=int(usage["prompt_tokens"]),
        prefill_ms=float(figures["prefill_ms"]),
        pulled_tokens=int(usage["pulled_tokens"]),
        reply_ids=(),
        router_ttft_ms=float(figures["ttft_ms"]),
        reuse=str(figures["reuse"]),
        reply_text="".join(text),
    )


# ---------------------------------------------------------------------------------------------
# The inter-turn gap sweep
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GapSettings:
    gaps_s: tuple[float, ...]
    per_gap: int
    first_tokens: int
    added_tokens: int
    reply_tokens: int
    seed: int
    vocab_size: int
    # Turns in flight at once (the waits overlap whatever this is).
    parallel: int = 2


async def gap_sweep(
    client: Client, settings: GapSettings, progress: Progress | None = None
) -> list[GapRecord]:
    """Per gap and arm, ``per_gap`` two-turn conversations with that pause between the turns.

    ``fixed_ttl``: nothing renews the retention during the pause (a fixed TTL, as vLLM's).
    ``heartbeat``: the SDK's keep-alive renews it during the pause. A hit is a second turn that pulled.
    """
    gate = asyncio.Semaphore(settings.parallel)
    records: list[GapRecord] = []

    async def one(arm: str, gap: float, index: int) -> None:
        rng = seeded_rng("gap", settings.seed, arm, gap, index)
        first = [rng.randrange(300, settings.vocab_size) for _ in range(settings.first_tokens)]
        conversation_id = f"bench-gap-{arm}-{uuid.uuid4().hex[:12]}"
        async with gate:
            result = await router_turn(client, conversation_id, first, settings.reply_tokens, retain=True)
        if progress is not None:
            progress.step(f"{arm} gap {gap:g}s: first turn")
        second = [
            *first,
            *result.reply_ids,
            *(rng.randrange(300, settings.vocab_size) for _ in range(settings.added_tokens)),
        ]
        if arm == HEARTBEAT:
            async with client.keep_alive(conversation_id):
                await asyncio.sleep(gap)
        else:
            await asyncio.sleep(gap)
        async with gate:
            try:
                again = await router_turn(client, conversation_id, second, settings.reply_tokens, retain=True)
            finally:
                with contextlib.suppress(Exception):
                    await client.close_conversation(conversation_id)
        records.append(
            GapRecord(
                arm=arm,
                gap_s=gap,
                conversation=index,
                hit=again.pulled_tokens > 0,
                pulled_tokens=again.pulled_tokens,
                prompt_tokens=len(second),
                reuse=again.reuse,
            )
        )
        if progress is not None:
            progress.step(f"{arm} gap {gap:g}s: {'hit' if again.pulled_tokens else 'miss'}")

    tasks = []
    # Longest gaps first: their waits overlap the short ones' turns.
    for gap in sorted(settings.gaps_s, reverse=True):
        for index in range(settings.per_gap):
            for arm in (FIXED_TTL, HEARTBEAT):
                tasks.append(asyncio.create_task(one(arm, gap, index)))
                await asyncio.sleep(0)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures and not records:
        raise RuntimeError(f"every gap-sweep conversation failed, first: {failures[0]!r}")
    return records
