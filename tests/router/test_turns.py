"""The router's turn (TurnRunner) against in-memory engines and an in-memory registry: retries, failures,
publication, renewals, load accounting. No servers. The same paths run against the real registry with
stand-in engines in test_router_standin.py and with real engines in test_router_engines.py."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field

import pytest
from kvferry.pd.chat import ChatRequest
from kvferry.pd.digest import block_digests
from kvferry.pd.engine_api import DecodeRequest, EngineApi
from kvferry.pd.kvferry_params import ConversationMark, PeerAddress, ReleaseMark
from kvferry.pd.vllm_params import PROMPT_TOKEN_IDS
from kvferry.router.calibration import CostProfile
from kvferry.router.cli import config_from_args, configure
from kvferry.router.cost import CostSettings, Reuse
from kvferry.router.engines import EngineInfo, EngineTable, LoadTracker
from kvferry.router.limits import TenantLimits, TenantLimitSettings
from kvferry.router.registry_client import BegunTurn, RegistryUnavailable, RetentionRecord
from kvferry.router.retention_index import RetentionIndex
from kvferry.router.server import RouterConfig
from kvferry.router.tenants import Tenant
from kvferry.router.turns import (
    ChatOut,
    ChatPrompt,
    PreparedTurn,
    TextOut,
    TextPrompt,
    TokenPrompt,
    TurnEvent,
    TurnRequest,
    TurnResult,
    TurnRunner,
    TurnSettings,
)
from kvferry.runtime.errors import Aborted, ErrorKind, ResourceExhausted, ServiceError
from kvferry.v1 import resources_pb2

from tests.fixtures.polling import eventually
from tests.pd.fake_engine import FakeEngine, render

BS = 4
SALT = "kv-a"
NOW = 1_000.0
TENANT = Tenant("acme")
P, D = resources_pb2.ENGINE_ROLE_PREFILL, resources_pb2.ENGINE_ROLE_DECODE
# Pulling always wins above the threshold: the cost model is tested in test_plan.py.
SETTINGS = TurnSettings(
    cost=CostSettings(
        CostProfile(
            prefill_tokens_per_second=1.0, transfer_bytes_per_second=1e12, transfer_setup_seconds=0.0
        ),
        kv_recompute_threshold=8,
        fallback_kv_bytes_per_token=1,
    ),
    publish_wait_seconds=0.1,
)


class FakeRegistry:
    """AN IN-MEMORY STAND-IN for the registry's retention calls (RetentionPort)."""

    def __init__(self) -> None:
        self.retentions: dict[tuple[str, str], RetentionRecord] = {}
        self.renewed: list[str] = []
        self.down = False
        # Turn marks: (tenant, conversation) -> request id; every call, in order.
        self.marks: dict[tuple[str, str], str] = {}
        self.mark_calls: list[tuple[str, str]] = []
        self.marks_down = False
        self.lookups = 0
        # What BeginTurn says was retained when it took the mark (None: the truth).
        self.retained_turn_at_mark: int | None = None
        self.retained_request_id_at_mark: str | None = None
        # BeginTurn waits for it (a mark slower than the prompt and the lookup).
        self.mark_gate: asyncio.Event | None = None

    async def get_retention(self, tenant: str, conversation_id: str) -> RetentionRecord | None:
        self.lookups += 1
        if self.down:
            raise RegistryUnavailable("fake registry down")
        return self.retentions.get((tenant, conversation_id))

    async def begin_turn(
        self, tenant: str, conversation_id: str, request_id: str, *, holder: str, ttl_seconds: int
    ) -> BegunTurn:
        await asyncio.sleep(0)
        if self.mark_gate is not None:
            await self.mark_gate.wait()
        if self.down or self.marks_down:
            raise RegistryUnavailable("fake registry down")
        held = self.marks.setdefault((tenant, conversation_id), request_id)
        if held != request_id:
            self.mark_calls.append(("refused", request_id))
            raise Aborted(f"conversation {conversation_id} has a turn in flight: {held}")
        self.mark_calls.append(("begin", request_id))
        record = self.retentions.get((tenant, conversation_id))
        retained = record.turn if record is not None else 0
        retained_request_id = record.engine_request_id if record is not None else ""
        if self.retained_turn_at_mark is not None:
            retained = self.retained_turn_at_mark
        if self.retained_request_id_at_mark is not None:
            retained_request_id = self.retained_request_id_at_mark
        return BegunTurn(
            ttl_seconds=ttl_seconds, retained_turn=retained, retained_request_id=retained_request_id
        )

    async def end_turn(self, tenant: str, conversation_id: str, request_id: str) -> bool:
        self.mark_calls.append(("end", request_id))
        if self.marks.get((tenant, conversation_id)) != request_id:
            return False
        del self.marks[(tenant, conversation_id)]
        return True

    async def renew_retention(self, tenant: str, conversation_id: str) -> float | None:
        self.renewed.append(conversation_id)
        return NOW + 120 if (tenant, conversation_id) in self.retentions else None

    def publish(self, engine: FakeEngine, request: DecodeRequest) -> None:
        """What D's connector and sidecar do when a marked decode finishes: retain, publish."""
        mark = request.mark
        if not isinstance(mark, ConversationMark):
            return
        tokens = [*request.token_ids, *engine.output][:-1]  # the last sampled token has no KV yet
        self.retentions[(mark.tenant, mark.conversation_id)] = RetentionRecord(
            tenant=mark.tenant,
            conversation_id=mark.conversation_id,
            engine_id=engine.engine_id,
            engine_request_id=f"cmpl-{request.request_id}-0",
            block_ids=tuple(range(len(tokens) // BS)),
            num_tokens=len(tokens),
            block_digests=tuple(block_digests(tokens, BS, salt=SALT)),
            turn=mark.turn,
            expire_time=NOW + 120,
        )


@dataclass
class Cluster:
    """Two prefill and two decode engines, the registry, and the runner."""

    registry: FakeRegistry = field(default_factory=FakeRegistry)
    fakes: dict[str, FakeEngine] = field(default_factory=dict)
    load: LoadTracker = field(default_factory=LoadTracker)
    # Both the monotonic and the wall clock the runner reads (tests move it).
    now: float = NOW
    # The router's retention index the runner reads first (None: lookups ask the registry).
    index: RetentionIndex | None = None
    settings: TurnSettings = SETTINGS

    def __post_init__(self) -> None:
        for engine_id in ("p1", "p2", "d1", "d2"):
            self.fakes[engine_id] = FakeEngine(engine_id, block_size=BS, on_finished=self.registry.publish)
        infos = [
            EngineInfo(
                e,
                P if e[0] == "p" else D,
                f"http://{e}",
                "10.0.0.1",
                5600,
                "m",
                SALT,
                BS,
                4096,
                release_grace_seconds=2 * SETTINGS.read_window_seconds,
            )
            for e in self.fakes
        ]
        self.runner = TurnRunner(
            engines=EngineTable(infos),
            load=self.load,
            clients=self,
            registry=self.registry,
            settings=self.settings,
            clock=lambda: self.now,
            index=self.index,
        )

    def get(self, engine: EngineInfo) -> EngineApi:
        return self.fakes[engine.engine_id]

    async def prepare(
        self, prompt: list[int] | str, *, conversation: str | None = "c1", retain: bool = True
    ) -> PreparedTurn:
        as_prompt = TextPrompt(prompt) if isinstance(prompt, str) else TokenPrompt(tuple(prompt))
        request = TurnRequest(TENANT, conversation, "", as_prompt, retain=retain)
        return await self.runner.prepare(request)

    async def turn(self, prompt: list[int] | str, **options: object) -> tuple[list[TextOut], TurnResult]:
        return await self.run(await self.prepare(prompt, **options))  # type: ignore[arg-type]

    async def run(self, prepared: PreparedTurn) -> tuple[list[TextOut], TurnResult]:
        """A prepared turn to its end: its text outputs and its result."""
        texts: list[TextOut] = []
        result = None
        async for event in self.runner.execute(prepared):
            if isinstance(event, TextOut):
                texts.append(event)
            elif isinstance(event, TurnResult):
                result = event
        assert result is not None
        return texts, result

    def idle(self) -> bool:
        return all(self.load.prefill_tokens(e) == 0 and self.load.decode_requests(e) == 0 for e in self.fakes)

    async def background(self) -> None:
        await asyncio.sleep(0)
        await self.runner.aclose()


PROMPT = list(range(10, 50))  # 40 tokens: 10 blocks


@pytest.fixture
def cluster() -> Cluster:
    return Cluster()


async def test_a_first_turn_recomputes_streams_and_is_published(cluster: Cluster) -> None:
    texts, result = await cluster.turn(PROMPT)
    assert [t.token_ids for t in texts] == [(101,), (102,), (103,)]
    assert (result.reuse, result.pulled_tokens, result.recomputed_tokens) == (Reuse.NONE, 0, 40)
    assert result.turn == 1 and result.finish_reason == "length" and result.completion_tokens == 3
    assert (result.prefill_engine_id, result.decode_engine_id) == ("p1", "d1")
    [decode] = cluster.fakes["d1"].decodes
    assert decode.mark == ConversationMark("acme", "c1", 1)
    [prefill] = cluster.fakes["p1"].prefills
    assert prefill.reuse is None and prefill.mark is None
    assert (
        prefill.request_id == f"{result.request_id}-1-p" and decode.request_id == f"{result.request_id}-1-d"
    )
    assert cluster.idle()


async def test_p_is_told_the_retaining_decode_engine_so_it_handshakes_before_the_next_turn_pulls(
    cluster: Cluster,
) -> None:
    """P's first pull from an engine would otherwise wait for NIXL's handshake with it (0.3-1.9 s on an
    H100)."""
    await cluster.turn(PROMPT)
    assert cluster.fakes["p1"].prefills[-1].peer == PeerAddress("d1", "10.0.0.1", 5600)
    await cluster.turn([*PROMPT, 101, 102, 103, 7, 8, 9])
    assert cluster.fakes["p1"].prefills[-1].peer == PeerAddress("d1", "10.0.0.1", 5600)
    # Nothing will be pulled from the decode engine of a turn it does not retain.
    await cluster.turn(PROMPT, conversation=None)
    await cluster.turn(PROMPT, conversation="c2", retain=False)
    assert [prefill.peer for prefill in cluster.fakes["p1"].prefills[2:]] == [None, None]


async def test_the_turn_line_says_where_the_ttft_went(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kvferry.router.turns"):
        _, result = await cluster.turn(PROMPT)
    [line] = [vars(r) for r in caplog.records if r.getMessage() == "turn done"]
    parts = (line["before_prefill_ms"], line["prefill_ms"], line["after_prefill_ms"])
    assert all(part >= 0 for part in parts) and line["ttft_ms"] == round(result.ttft_ms, 2)
    assert sum(parts) == pytest.approx(line["ttft_ms"], abs=0.05)


async def test_the_next_turn_pulls_the_proven_prefix_from_the_holder(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    _, first = await cluster.turn(PROMPT)
    history = [*PROMPT, 101, 102, 103]
    with caplog.at_level(logging.INFO, logger="kvferry.router.turns"):
        _, second = await cluster.turn([*history, 7, 8, 9])
    [line] = [vars(r) for r in caplog.records if r.getMessage() == "turn done"]
    assert line["pull_tier"] == "device"
    # Retained: 42 tokens (the last sampled one has no KV): 10 full blocks.
    assert (second.reuse, second.matched_tokens, second.pulled_tokens) == (Reuse.PULL, 40, 40)
    assert second.decode_engine_id == first.decode_engine_id == "d1" and second.turn == 2
    prefill = cluster.fakes["p1"].prefills[-1]
    assert prefill.reuse is not None and prefill.reuse.engine_id == "d1" and prefill.reuse.num_tokens == 40
    # The read window's time left: the read window (the lease, NOW + 120, ends later), from the lookup.
    assert prefill.mark == ConversationMark("acme", "c1", 2)
    assert prefill.read_ms == SETTINGS.read_window_seconds * 1000


async def test_a_conversation_s_next_turn_hashes_only_its_new_blocks(
    cluster: Cluster, chained_blocks: list[int]
) -> None:
    await cluster.turn(PROMPT)
    second = [*PROMPT, 101, 102, 103, 7, 8, 9]
    _, pulled = await cluster.turn(second)
    _, again = await cluster.turn([*second, 101, 102, 103, 4, 5, 6])
    # Turn 2 checks 10 blocks against turn 1's retention; turn 3 checks 12, of which 10 were turn 2's.
    assert chained_blocks == [10, 2]
    assert pulled.reuse == again.reuse == Reuse.PULL and again.matched_tokens > pulled.matched_tokens


async def test_a_slow_tokenization_eats_into_the_read_window_not_past_it(cluster: Cluster) -> None:
    text = "".join(chr(c) for c in PROMPT)
    await cluster.turn(text)
    tokenize = cluster.fakes["p1"].tokenize

    async def slow_tokenize(text: str, *, add_special_tokens: bool = True) -> list[int]:
        # The lookup went out first (it opened the window); then tokenization takes 4 s.
        await asyncio.sleep(0)
        cluster.now += 4.0
        return await tokenize(text, add_special_tokens=add_special_tokens)

    cluster.fakes["p1"].tokenize = slow_tokenize  # type: ignore[method-assign]
    _, second = await cluster.turn(text + "".join(chr(c) for c in (101, 102, 103, 7)))
    assert second.reuse is Reuse.PULL
    # The window opened at the lookup: 4 s of it went to tokenizing, P gets the 6 s left.
    assert cluster.fakes["p1"].prefills[-1].read_ms == (SETTINGS.read_window_seconds - 4.0) * 1000


async def test_a_read_window_that_closed_while_tokenizing_means_recompute(cluster: Cluster) -> None:
    text = "".join(chr(c) for c in PROMPT)
    await cluster.turn(text)
    tokenize = cluster.fakes["p1"].tokenize

    async def stalled_tokenize(text: str, *, add_special_tokens: bool = True) -> list[int]:
        await asyncio.sleep(0)
        cluster.now += SETTINGS.read_window_seconds
        return await tokenize(text, add_special_tokens=add_special_tokens)

    cluster.fakes["p1"].tokenize = stalled_tokenize  # type: ignore[method-assign]
    _, second = await cluster.turn(text + "".join(chr(c) for c in (101, 102, 103, 7)))
    assert (second.reuse, second.matched_tokens, second.pulled_tokens) == (Reuse.RECOMPUTE, 40, 0)
    assert cluster.fakes["p1"].prefills[-1].reuse is None


async def test_a_declined_pull_is_reported_as_recompute(cluster: Cluster) -> None:
    await cluster.turn(PROMPT)
    cluster.fakes["p1"].pull_declined = True
    _, second = await cluster.turn([*PROMPT, 101, 102, 103, 7])
    assert (second.reuse, second.matched_tokens, second.pulled_tokens) == (Reuse.RECOMPUTE, 40, 0)


async def test_a_prefill_failure_is_retried_by_recompute_elsewhere(cluster: Cluster) -> None:
    await cluster.turn(PROMPT)
    cluster.fakes["p1"].fail_prefills = 1
    _, second = await cluster.turn([*PROMPT, 101, 102, 103, 7])
    # The retry avoids the failed prefill engine and, since it failed while pulling, the holder.
    assert (second.prefill_engine_id, second.decode_engine_id) == ("p2", "d2")
    assert (second.reuse, second.pulled_tokens) == (Reuse.NONE, 0)
    assert cluster.fakes["p2"].prefills[-1].reuse is None
    assert second.turn == 2 and cluster.idle()


async def test_a_decode_failure_before_output_is_retried(cluster: Cluster) -> None:
    cluster.fakes["d1"].unreachable = True
    texts, result = await cluster.turn(PROMPT)
    assert result.decode_engine_id == "d2" and len(texts) == 3
    assert cluster.idle()


async def test_the_turn_gives_up_after_its_attempts(cluster: Cluster) -> None:
    for engine_id in ("p1", "p2"):
        cluster.fakes[engine_id].fail_prefills = 1
    with pytest.raises(ServiceError, match="gave up after 2 attempts") as raised:
        await cluster.turn(PROMPT)
    assert raised.value.kind is ErrorKind.UNAVAILABLE and cluster.idle()


async def test_a_failure_after_the_decode_s_first_token_is_not_retried(cluster: Cluster) -> None:
    cluster.fakes["d1"].fail_after_tokens = 1
    prepared = await cluster.prepare(PROMPT)
    seen: list[TurnEvent | TurnResult] = []
    with pytest.raises(ServiceError, match="output was already streamed") as raised:
        async for event in cluster.runner.execute(prepared):
            seen.append(event)
    assert raised.value.kind is ErrorKind.UNAVAILABLE
    # P's token, then D's first.
    assert [type(e) for e in seen] == [TextOut, TextOut]
    assert len(cluster.fakes["d2"].decodes) == 0 and cluster.idle()


# Not a whole number of blocks (PROMPT is): P's token is the first output either way.
HANDING = [*PROMPT, 7]


async def test_p_s_token_is_the_first_output_and_d_continues_after_it(cluster: Cluster) -> None:
    texts, result = await cluster.turn(HANDING)
    [prefill] = cluster.fakes["p1"].prefills
    [decode] = cluster.fakes["d1"].decodes
    assert prefill.sampling is not None and prefill.sampling.max_tokens == decode.sampling.max_tokens + 1
    assert decode.token_ids == (*HANDING, 101)
    # P's token first, then D's.
    assert [t.token_ids for t in texts] == [(101,), (102,), (103,)]
    assert result.prompt_tokens == 41 and result.completion_tokens == 3 and result.turn == 1
    assert cluster.idle()


async def test_a_decode_failing_after_p_s_token_is_continued_elsewhere(cluster: Cluster) -> None:
    cluster.fakes["d1"].unreachable = True
    texts, result = await cluster.turn(HANDING)
    # The retry recomputes the prompt and P's token, and its decode goes on after that token.
    assert result.decode_engine_id == "d2" and texts[0].token_ids == (101,)
    [first_prefill, retry_prefill] = cluster.fakes["p1"].prefills
    assert retry_prefill.token_ids == (*HANDING, 101) and retry_prefill.sampling is None
    [decode] = cluster.fakes["d2"].decodes
    assert decode.token_ids == (*HANDING, 101)
    assert first_prefill.sampling is not None
    assert decode.sampling.max_tokens == first_prefill.sampling.max_tokens - 1
    assert [t.token_ids for t in texts[1:]] == [(102,), (103,)]
    assert result.prompt_tokens == 41 and result.completion_tokens == 3 and cluster.idle()


async def test_without_the_setting_d_decodes_every_token() -> None:
    cluster = Cluster(settings=dataclasses.replace(SETTINGS, first_token_from_prefill=False))
    texts, _ = await cluster.turn(HANDING)
    assert cluster.fakes["d1"].decodes[0].token_ids == tuple(HANDING) and len(texts) == 3


async def test_an_engine_s_4xx_is_the_request_s_fault(cluster: Cluster) -> None:
    cluster.fakes["p1"].fail_prefills, cluster.fakes["p1"].fail_status = 1, 400
    with pytest.raises(ServiceError, match="the prefill engine rejected the request") as raised:
        await cluster.turn(PROMPT)
    assert raised.value.kind is ErrorKind.INVALID_ARGUMENT
    assert cluster.fakes["p2"].prefills == [] and cluster.idle()


async def test_a_retention_not_published_in_time_gives_turn_0_and_renews_the_old_one(
    cluster: Cluster,
) -> None:
    await cluster.turn(PROMPT)
    cluster.fakes["d1"].on_finished = None  # the sidecar does not publish this time
    _, second = await cluster.turn([*PROMPT, 101, 102, 103, 7])
    assert second.turn == 0
    await cluster.background()
    assert cluster.registry.renewed == ["c1"]


async def test_a_published_turn_renews_nothing(cluster: Cluster) -> None:
    await cluster.turn(PROMPT)
    await cluster.turn([*PROMPT, 101, 102, 103, 7])
    await cluster.background()
    assert cluster.registry.renewed == []


async def test_an_unretained_turn_releases_its_blocks_and_renews_the_conversation(cluster: Cluster) -> None:
    await cluster.turn(PROMPT)
    _, second = await cluster.turn([*PROMPT, 101, 102, 103, 7], retain=False)
    assert second.turn == 0 and second.reuse is Reuse.PULL
    assert cluster.fakes["d1"].decodes[-1].mark == ReleaseMark()
    # The pull carries no conversation mark (nothing of this turn is retained), but its read window.
    prefill = cluster.fakes["p1"].prefills[-1]
    assert prefill.mark is None and prefill.read_ms == SETTINGS.read_window_seconds * 1000
    assert prefill.transfer_params()["kvferry_read_ms"] == prefill.read_ms
    await cluster.background()
    assert cluster.registry.renewed == ["c1"]


async def test_without_the_registry_the_turn_recomputes_and_retains_nothing(cluster: Cluster) -> None:
    await cluster.turn(PROMPT)
    cluster.registry.down = True
    _, second = await cluster.turn([*PROMPT, 101, 102, 103, 7])
    assert (second.reuse, second.turn) == (Reuse.NONE, 0)
    assert cluster.fakes["d1"].decodes[-1].mark == ReleaseMark()


async def test_a_one_off_turn_looks_nothing_up(cluster: Cluster) -> None:
    cluster.registry.down = True  # never asked
    _, result = await cluster.turn(PROMPT, conversation=None)
    assert (result.reuse, result.turn) == (Reuse.NONE, 0)
    assert cluster.fakes["d1"].decodes[-1].mark == ReleaseMark()


async def test_a_client_that_leaves_mid_stream_aborts_the_decode(cluster: Cluster) -> None:
    await cluster.turn(PROMPT)
    cluster.fakes["d1"].stall = asyncio.Event()
    prepared = await cluster.prepare([*PROMPT, 101, 102, 103, 7])
    events: AsyncGenerator[TurnEvent | TurnResult, None] = cluster.runner.execute(prepared)
    async with aclosing(events):
        # P's token, then D's first.
        for _ in range(2):
            assert isinstance(await anext(events), TextOut)
        # Load is counted while the decode runs.
        assert cluster.load.decode_requests("d1") == 1
    assert cluster.fakes["d1"].aborted == [f"{prepared.request_id}-1-d"]
    assert cluster.idle()
    await cluster.background()
    assert cluster.registry.renewed == ["c1"]


async def test_load_is_counted_from_the_plan_until_each_engine_is_done(cluster: Cluster) -> None:
    cluster.fakes["d1"].stall = asyncio.Event()
    prepared = await cluster.prepare(PROMPT)
    events = cluster.runner.execute(prepared)
    async with aclosing(events):
        await anext(events)
        # P answered: its tokens are no longer in flight; D's request is.
        assert cluster.load.prefill_tokens("p1") == 0 and cluster.load.decode_requests("d1") == 1
        cluster.fakes["d1"].stall.set()
        rest = [e async for e in events]
    assert isinstance(rest[-1], TurnResult) and cluster.idle()


async def test_the_decode_counts_until_the_turn_ends(cluster: Cluster) -> None:
    seen: list[int] = []
    lookup = cluster.registry.get_retention

    async def counting_lookup(tenant: str, conversation_id: str) -> RetentionRecord | None:
        seen.append(cluster.load.decode_requests("d1"))
        return await lookup(tenant, conversation_id)

    cluster.registry.get_retention = counting_lookup  # type: ignore[method-assign]
    await cluster.turn(PROMPT)
    # The lookup before the plan, then the publication wait after the decode: D's request still counts
    # there, so a concurrent turn planned meanwhile goes elsewhere.
    assert seen[0] == 0 and seen[1:] and set(seen[1:]) == {1}
    assert cluster.idle()


# -- chat turns: the engines' chat endpoint ------------------------------------------------------------


async def _chat_turn(
    cluster: Cluster, messages: list[dict[str, object]], *, stream: bool = True, finish: str = "stop"
) -> tuple[list[TurnEvent], TurnResult]:
    for fake in cluster.fakes.values():
        fake.finish_reason = finish
    chat = ChatRequest({"messages": messages, "tools": [{"type": "function", "function": {"name": "f"}}]})
    request = TurnRequest(TENANT, "c1", "", ChatPrompt(chat), stream=stream)
    prepared = await cluster.runner.prepare(request)
    events: list[TurnEvent] = []
    result = None
    async for event in cluster.runner.execute(prepared):
        if isinstance(event, TurnResult):
            result = event
        else:
            events.append(event)
    assert result is not None
    return events, result


async def test_a_chat_turn_relays_the_engine_s_events_and_both_engines_get_the_checked_ids(
    cluster: Cluster,
) -> None:
    messages: list[dict[str, object]] = [{"role": "user", "content": "x" * 40}]
    events, result = await _chat_turn(cluster, messages, finish="tool_calls")
    assert [
        json.loads(e.raw)["choices"][0]["delta"]["content"] for e in events if isinstance(e, ChatOut)
    ] == [
        "e",
        "f",
        "g",
    ]
    [prefill], [decode] = cluster.fakes["p1"].prefills, cluster.fakes["d1"].decodes
    rendered = [ord(c) for c in render(ChatRequest({"messages": messages}))]
    for request in (prefill, decode):
        assert request.chat is not None and request.chat.body["tools"][0]["function"]["name"] == "f"
        assert request.transfer_params()[PROMPT_TOKEN_IDS] == rendered
    # No max_tokens sent: the router's default, within the context.
    assert decode.chat is not None and decode.chat.body["max_tokens"] == SETTINGS.default_max_tokens
    # A tool-call answer ends normally: it is retained and the next turn pulls it.
    assert result.finish_reason == "tool_calls" and result.turn == 1
    assert result.engine_usage == {"prompt_tokens": len(rendered), "completion_tokens": 3}
    messages += [{"role": "assistant", "content": "efg"}, {"role": "user", "content": "more"}]
    _, second = await _chat_turn(cluster, messages)
    assert second.reuse is Reuse.PULL and second.pulled_tokens > 0 and second.turn == 2


async def test_a_chat_turn_not_streamed_carries_the_engine_s_answer(cluster: Cluster) -> None:
    events, result = await _chat_turn(cluster, [{"role": "user", "content": "y" * 40}], stream=False)
    assert events == []
    assert result.answer is not None and result.answer["choices"][0]["message"]["content"] == "efg"
    assert "kv_transfer_params" not in result.answer and result.turn == 1 and result.ttft_ms > 0


async def test_a_chat_turn_takes_the_mark_the_tenant_s_slot_and_the_read_window_as_any_turn(
    cluster: Cluster,
) -> None:
    messages: list[dict[str, object]] = [{"role": "user", "content": "z" * 40}]
    await _chat_turn(cluster, messages)
    cluster.runner.tenant_limits = TenantLimits(TenantLimitSettings(max_concurrent_turns=1))
    messages += [{"role": "assistant", "content": "efg"}, {"role": "user", "content": "more"}]
    chat = ChatRequest({"messages": messages})
    prepared = await cluster.runner.prepare(TurnRequest(TENANT, "c1", "", ChatPrompt(chat)))
    assert cluster.registry.marks == {("acme", "c1"): prepared.request_id}
    assert cluster.runner.tenant_limits.in_flight("acme") == 1
    # The tenant's cap counts chat turns: another conversation's turn is refused.
    with pytest.raises(ResourceExhausted):
        await cluster.prepare(PROMPT, conversation="c2")
    async for event in cluster.runner.execute(prepared):
        if isinstance(event, TurnResult):
            assert cluster.registry.marks == {} and event.reuse is Reuse.PULL
    assert cluster.runner.tenant_limits.in_flight("acme") == 0
    # The pull carried the time its read window had left.
    pull = [p for fake in cluster.fakes.values() for p in fake.prefills if p.reuse is not None]
    assert len(pull) == 1 and pull[0].chat is not None and pull[0].read_ms is not None
    assert 0 < pull[0].read_ms <= SETTINGS.read_window_seconds * 1000


# -- one turn in flight per conversation --------------------------------------------------------------


async def test_a_turn_holds_its_conversation_s_mark_until_just_before_its_result(cluster: Cluster) -> None:
    prepared = await cluster.prepare(PROMPT)
    assert cluster.registry.marks == {("acme", "c1"): prepared.request_id}
    async for event in cluster.runner.execute(prepared):
        if isinstance(event, TurnResult):
            # Cleared before the client has the result: its next turn finds the conversation free.
            assert cluster.registry.marks == {}
    assert cluster.registry.mark_calls == [("begin", prepared.request_id), ("end", prepared.request_id)]


async def test_a_second_concurrent_turn_is_refused_naming_the_running_one(cluster: Cluster) -> None:
    running = await cluster.prepare(PROMPT)
    with pytest.raises(Aborted) as refused:
        await cluster.prepare([*PROMPT, 1])
    assert running.request_id in refused.value.message
    # Nothing ran for the refused turn, and the running one is untouched.
    assert cluster.fakes["p1"].prefills == [] and cluster.registry.marks == {
        ("acme", "c1"): running.request_id
    }
    async for _ in cluster.runner.execute(running):
        pass
    # Other conversations and one-off turns never wait for it.
    await cluster.turn(PROMPT, conversation="c2")
    await cluster.turn(PROMPT, conversation=None)
    assert cluster.registry.marks == {}


async def test_a_failed_turn_frees_its_conversation_before_the_client_hears(cluster: Cluster) -> None:
    for engine in ("d1", "d2"):
        cluster.fakes[engine].fail_decodes = 1
    prepared = await cluster.prepare(PROMPT)
    with pytest.raises(ServiceError):
        async for _ in cluster.runner.execute(prepared):
            pass
    assert cluster.registry.marks == {}
    await cluster.turn(PROMPT)  # sent again at once: not refused


async def test_a_turn_refused_before_it_ran_or_abandoned_frees_the_mark(cluster: Cluster) -> None:
    # The prompt is too long for the model: refused in prepare, after the mark was taken.
    with pytest.raises(ServiceError) as refused:
        await cluster.prepare(list(range(5000)))
    assert refused.value.kind is ErrorKind.INVALID_ARGUMENT and cluster.registry.marks == {}
    # The engine refuses the prompt while the mark is being taken: cleared before the error is out.
    cluster.fakes["p1"].fail_tokenizes, cluster.fakes["p1"].fail_status = 1, 400
    with pytest.raises(ServiceError) as rejected:
        await cluster.prepare("some text")
    assert rejected.value.kind is ErrorKind.INVALID_ARGUMENT and cluster.registry.marks == {}
    # Prepared, then the client went away before the stream ended.
    prepared = await cluster.prepare(PROMPT)
    events = cluster.runner.execute(prepared)
    await anext(events)
    await events.aclose()
    await cluster.background()
    assert cluster.registry.marks == {}


async def test_the_mark_is_renewed_while_the_turn_runs(cluster: Cluster) -> None:
    stall = asyncio.Event()
    cluster.fakes["d1"].stall = stall
    cluster.runner._settings = dataclasses.replace(SETTINGS, turn_mark_seconds=1)
    prepared = await cluster.prepare(PROMPT)
    events = cluster.runner.execute(prepared)
    await anext(events)  # streaming, then stalled
    await asyncio.sleep(0.8)
    stall.set()
    async for _ in events:
        pass
    begins = [call for call in cluster.registry.mark_calls if call[0] == "begin"]
    assert len(begins) >= 3 and cluster.registry.marks == {}


async def test_a_lookup_made_before_the_mark_is_repeated_when_a_turn_came_in_between(
    cluster: Cluster,
) -> None:
    await cluster.turn(PROMPT)
    # The mark's transaction saw turn 2 retained while the concurrent lookup read turn 1.
    cluster.registry.retained_turn_at_mark = 2
    before = cluster.registry.lookups
    await cluster.turn([*PROMPT, 101, 102, 103, 7])
    assert cluster.registry.lookups == before + 2 + 1  # the lookup, its repetition, the publication poll
    cluster.registry.retained_turn_at_mark = None
    before = cluster.registry.lookups
    await cluster.turn([*PROMPT, 101, 102, 103, 7, 101, 102, 103, 8])
    assert cluster.registry.lookups == before + 1 + 1


async def test_a_lookup_that_found_another_record_of_the_same_turn_is_repeated(cluster: Cluster) -> None:
    """The mark names the record it read: one of the same turn number but another request (a conversation
    that started over, a record whose engine left) is not the one the lookup found."""
    await cluster.turn(PROMPT)
    cluster.registry.retained_request_id_at_mark = "kvf-some-other-request-d"
    before = cluster.registry.lookups
    await cluster.turn([*PROMPT, 101, 102, 103, 7])
    assert cluster.registry.lookups == before + 2 + 1  # the lookup, its repetition, the publication poll
    cluster.registry.retained_request_id_at_mark = None


def test_the_mark_confirms_only_the_record_it_read() -> None:
    record = RetentionRecord(
        tenant="t",
        conversation_id="c",
        engine_id="d1",
        engine_request_id="kvf-a-d",
        block_ids=(1,),
        num_tokens=16,
        block_digests=(b"x",),
        turn=2,
        expire_time=NOW + 60,
    )
    assert BegunTurn(ttl_seconds=5, retained_turn=2, retained_request_id="kvf-a-d").confirms(record)
    assert not BegunTurn(ttl_seconds=5, retained_turn=2, retained_request_id="kvf-b-d").confirms(record)
    assert not BegunTurn(ttl_seconds=5, retained_turn=3, retained_request_id="kvf-a-d").confirms(record)
    assert not BegunTurn(ttl_seconds=5, retained_turn=0).confirms(record)
    assert BegunTurn(ttl_seconds=5, retained_turn=0).confirms(None)
    assert not BegunTurn(ttl_seconds=5, retained_turn=2, retained_request_id="kvf-a-d").confirms(None)
    # A registry from before the request id was reported: the turn alone.
    assert BegunTurn(ttl_seconds=5, retained_turn=2).confirms(record)


async def test_without_its_mark_a_turn_neither_reuses_nor_retains(cluster: Cluster) -> None:
    await cluster.turn(PROMPT)
    cluster.registry.marks_down = True
    _, second = await cluster.turn([*PROMPT, 101, 102, 103, 7])
    assert (second.reuse, second.turn, second.pulled_tokens) == (Reuse.NONE, 0, 0)
    assert cluster.fakes["d1"].decodes[-1].mark == ReleaseMark()


async def _p_out_beside_a_slow_mark(
    cluster: Cluster, *, hold_p: bool = False
) -> tuple[asyncio.Event, PreparedTurn, asyncio.Future[tuple[list[TextOut], TurnResult]]]:
    """Turn 1, then turn 2 prepared while its mark waits for the returned gate, and run until P has its
    request (``hold_p``: P holds it unanswered)."""
    await cluster.turn(PROMPT)
    cluster.registry.mark_gate = gate = asyncio.Event()
    if hold_p:
        cluster.fakes["p1"].prefill_gate = asyncio.Event()
    prepared = await cluster.prepare([*PROMPT, 101, 102, 103, 7])
    running = asyncio.ensure_future(cluster.run(prepared))
    await eventually(lambda: len(cluster.fakes["p1"].prefills) == 2)
    return gate, prepared, running


async def test_p_s_request_goes_out_beside_a_slow_mark_and_nothing_reaches_d_or_the_client_before_it(
    cluster: Cluster,
) -> None:
    gate, prepared, running = await _p_out_beside_a_slow_mark(cluster)
    assert prepared.marking is not None and prepared.mark is None
    # P's request (pulling turn 1) went out and P answered; D and the client wait for the mark.
    await asyncio.sleep(0.05)
    assert cluster.fakes["p1"].prefills[-1].reuse is not None and len(cluster.fakes["d1"].decodes) == 1
    assert not running.done()
    gate.set()
    texts, result = await running
    assert [t.token_ids for t in texts] == [(101,), (102,), (103,)]
    assert (result.reuse, result.pulled_tokens, result.turn) == (Reuse.PULL, 40, 2)
    assert cluster.fakes["d1"].decodes[-1].mark == ConversationMark("acme", "c1", 2)
    assert cluster.registry.marks == {} and cluster.idle()


async def test_a_mark_refused_while_p_s_request_is_out_cancels_it(cluster: Cluster) -> None:
    gate, prepared, running = await _p_out_beside_a_slow_mark(cluster, hold_p=True)
    cluster.registry.marks[("acme", "c1")] = "kvf-another-turn"
    gate.set()
    with pytest.raises(Aborted, match="kvf-another-turn"):
        await running
    # P aborts the request (its connection closed); D never hears of the turn.
    assert cluster.fakes["p1"].prefills_cancelled == [f"{prepared.request_id}-1-p"]
    assert len(cluster.fakes["d1"].decodes) == 1 and cluster.idle()
    assert cluster.registry.marks == {("acme", "c1"): "kvf-another-turn"}


async def test_a_mark_that_does_not_confirm_the_lookup_drops_p_s_request_and_plans_again(
    cluster: Cluster,
) -> None:
    gate, prepared, running = await _p_out_beside_a_slow_mark(cluster, hold_p=True)
    # The retention ended after the lookup, before the mark's transaction.
    del cluster.registry.retentions[("acme", "c1")]
    cluster.fakes["p1"].prefill_gate = None
    gate.set()
    _, result = await running
    # The pulling request was cancelled; the next one, planned on the registry's answer, recomputes.
    assert cluster.fakes["p1"].prefills_cancelled == [f"{prepared.request_id}-1-p"]
    planned_again = cluster.fakes["p1"].prefills[-1]
    assert planned_again.request_id == f"{prepared.request_id}-2-p" and planned_again.reuse is None
    assert (result.reuse, result.pulled_tokens, result.turn) == (Reuse.NONE, 0, 1)
    assert cluster.registry.marks == {} and cluster.idle()


async def test_without_its_mark_a_turn_whose_p_went_out_beside_it_neither_reuses_nor_retains(
    cluster: Cluster,
) -> None:
    gate, _, running = await _p_out_beside_a_slow_mark(cluster)
    cluster.registry.marks_down = True
    gate.set()
    _, second = await running
    # P's pulling answer is dropped; the turn runs again by recompute and D frees its blocks.
    assert (second.reuse, second.turn, second.pulled_tokens) == (Reuse.NONE, 0, 0)
    assert cluster.fakes["d1"].decodes[-1].mark == ReleaseMark() and len(cluster.fakes["d1"].decodes) == 2
    assert cluster.idle()


def test_p_s_token_first_is_on_by_default_and_turned_off_by_flag_or_environment() -> None:
    def config(argv: list[str], environ: dict[str, str]) -> RouterConfig:
        parser = argparse.ArgumentParser()
        configure(parser, environ)
        return config_from_args(parser.parse_args(argv))

    assert config([], {}).first_token_from_prefill
    assert not config(["--first-token-from-prefill", "off"], {}).first_token_from_prefill
    assert not config([], {"KVFERRY_ROUTER_FIRST_TOKEN_FROM_PREFILL": "off"}).first_token_from_prefill


async def test_a_decode_failing_after_p_s_token_ended_the_answer_still_answers(cluster: Cluster) -> None:
    cluster.fakes["p1"].output = (0,)
    cluster.fakes["p1"].finish_reason = "stop"
    cluster.fakes["d1"].unreachable = True
    texts, result = await cluster.turn(HANDING)
    # The client has the whole answer; only its retention is lost, and the turn says so.
    assert [t.token_ids for t in texts] == [(0,)]
    assert (result.finish_reason, result.completion_tokens, result.turn) == ("stop", 1, 0)
    assert len(cluster.fakes["d2"].decodes) == 0 and cluster.idle()
