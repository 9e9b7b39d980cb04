"""The host tier on real engines (issue 19): a decode engine with a host pool moves an idle retention out
of its KV cache, the registry accepts the move, the KV-cache blocks go back to vLLM, and the next turn's
prefill pulls the conversation from the pool over real NIXL, fenced, with outputs equal to a recompute.

A decode engine of its own (``host_pool_blocks``, a short ``demote_after_seconds``) beside the session's
prefill engine, real sidecars, the real registry on real etcd, a router. Run under the engine lock::

    flock /tmp/kvferry-engines.lock pytest -m engines tests/connector/test_engines_host_tier.py
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from kvferry.connector.connector import FREED_LOG
from kvferry.connector.host_tier import HOST_REQUEST_SUFFIX
from kvferry.pd.chat import ChatMessage, ChatRequest
from kvferry.pd.kvferry_params import ConversationMark, PullOptions
from kvferry.pd.reuse import RetainedKv
from kvferry.router.server import RunningRouter, start_router
from kvferry.stack.engine import EngineProcess, direct_turn
from kvferry.stack.etcd_process import free_port
from kvferry.v1 import registry_service_pb2 as registry_pb2
from kvferry.v1 import resources_pb2
from kvferry.v1 import router_service_pb2 as router_pb2
from kvferry.v1 import router_service_pb2_grpc as router_grpc

from tests.connector.test_engines_fence import (
    TEXT,
    assert_same_kv,
    fence_line,
    first_token,
    next_prompt,
    reuse_pull,
)
from tests.fixtures.engines import (
    BLOCK_SIZE,
    ENGINE_SETTINGS,
    KV_CAPACITY_BLOCKS,
    UNMARKED_DECODE_TTL_SECONDS,
    EngineHandle,
    EnginePair,
)
from tests.fixtures.polling import eventually
from tests.fixtures.registry import RegistryHandle
from tests.fixtures.router import router_api_keys
from tests.fixtures.sidecar import SidecarHandle
from tests.router.test_router_engines import (
    SYSTEM,
    chat,
    engine_router_config,
    engine_sidecar_config,
    generate,
    start_sidecar,
    warm_up,
)

pytestmark = [pytest.mark.engines, pytest.mark.timeout(900)]

HOST_DECODE_ID = "host-tier-decode-0"
# Room for three of the tests' conversations (6 blocks each): a fourth makes the pool evict.
POOL_SLOTS = 20
DEMOTE_AFTER_SECONDS = 1.0
TENANT = "acme"


@dataclasses.dataclass
class HostTierStack:
    pair: EnginePair
    decode: EngineHandle
    registry: RegistryHandle
    router: RunningRouter

    def router_stub(self) -> router_grpc.RouterServiceStub:
        return router_grpc.RouterServiceStub(grpc.aio.insecure_channel(self.router.grpc_address))

    async def moved(self, conversation_id: str, tenant: str = TENANT) -> resources_pb2.Retention:
        """The conversation's record once it is in the host tier."""

        async def in_pool() -> resources_pb2.Retention | None:
            record = await self.record(conversation_id, tenant)
            return record if record is not None and record.tier == resources_pb2.MEMORY_TIER_HOST else None

        found: resources_pb2.Retention = await eventually(
            in_pool, within=60, what="the move to the host tier"
        )
        return found

    async def record(self, conversation_id: str, tenant: str = TENANT) -> resources_pb2.Retention | None:
        try:
            found = await self.registry.stub().GetRetention(
                registry_pb2.GetRetentionRequest(tenant=tenant, conversation_id=conversation_id), timeout=10
            )
        except Exception:
            return None
        retention: resources_pb2.Retention = found.retention
        return retention


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    engine_pair: EnginePair, registry: RegistryHandle, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[HostTierStack]:
    workdir: Path = tmp_path_factory.mktemp("host-tier")
    sidecar_address = f"127.0.0.1:{free_port()}"
    process = EngineProcess(
        role="decode",
        engine_id=HOST_DECODE_ID,
        log_path=workdir / "host-decode.log",
        cpu_core=1,
        settings=dataclasses.replace(
            ENGINE_SETTINGS,
            sidecar_address=sidecar_address,
            host_pool_blocks=POOL_SLOTS,
            demote_after_seconds=DEMOTE_AFTER_SECONDS,
        ),
        block_size=BLOCK_SIZE,
        nixl_extra_config={"decoder_kv_blocks_ttl": UNMARKED_DECODE_TTL_SECONDS},
    )
    await asyncio.to_thread(process.start_and_wait, 420)
    decode = EngineHandle(process=process, sidecar_address=sidecar_address)
    sidecars: list[SidecarHandle] = []
    router = None
    try:
        for engine, address in (
            (engine_pair.prefill.process, engine_pair.prefill.sidecar_address),
            (process, sidecar_address),
        ):
            sidecars.append(await start_sidecar(engine_sidecar_config(registry, engine, address)))
        for handle in sidecars:
            await handle.wait_registered(within=60)
        router = await start_router(engine_router_config(registry), api_keys=router_api_keys())
        stack = HostTierStack(engine_pair, decode, registry, router)
        ids = {engine_pair.prefill.engine_id, HOST_DECODE_ID}
        await eventually(lambda: ids <= {e.engine_id for e in router.engines.all()}, within=30)
        await warm_up(stack.router_stub(), engine_pair.model, HOST_DECODE_ID)
        yield stack
    finally:
        if router is not None:
            await router.stop(grace_seconds=0.5)
        for handle in sidecars:
            await handle.stop()
        await asyncio.to_thread(process.stop)


async def pull_line(pair: EnginePair, request_id: str) -> dict[str, Any]:
    """P's ``kv pull`` line of a request's pull (read "mapped" or "nixl")."""
    (line,) = await pair.prefill.connector_lines("kv pull", lambda e: request_id in str(e.get("request_id")))
    return line


async def test_an_idle_retention_moves_to_the_host_pool_and_the_next_turn_pulls_it_from_there(
    stack: HostTierStack,
) -> None:
    model = stack.pair.model
    conv = f"host-{uuid.uuid4().hex[:8]}"
    history: list[tuple[str, str]] = [("system", SYSTEM), ("user", "Explain context managers.")]
    text, tokens_1, first = await generate(stack.router_stub(), chat(conv, model, history))
    assert first.turn == 1 and first.decode_engine_id == HOST_DECODE_ID

    # Idle past demote_after_seconds: the engine copies it into its pool and re-publishes the turn there.
    record = await stack.moved(conv)
    assert record.turn == 1
    assert record.engine_request_id.endswith(HOST_REQUEST_SUFFIX)
    first_request = record.relocates_engine_request_id
    assert record.engine_request_id == first_request + HOST_REQUEST_SUFFIX
    assert all(KV_CAPACITY_BLOCKS <= b < KV_CAPACITY_BLOCKS + POOL_SLOTS for b in record.block_ids)
    assert len(record.block_generations) == len(record.block_ids)
    await stack.decode.connector_lines("copied to the host pool", lambda e: first_request in e["request_ids"])

    # The KV-cache blocks go back to vLLM once the move was accepted, a grace later.
    def kv_cache_freed() -> list[dict[str, object]]:
        return [e for e in stack.decode.connector_events(FREED_LOG) if e["request_id"] == first_request]

    freed = await eventually(kv_cache_freed, within=ENGINE_SETTINGS.release_grace_seconds + 30)
    assert freed[0]["reason"] == "superseded" and freed[0]["confirmed"] is True
    assert all(b < KV_CAPACITY_BLOCKS for b in freed[0]["block_ids"])  # type: ignore[union-attr]

    # Turn 2 pulls the conversation from the pool: checked by the fence, and the output equals a recompute.
    history += [("assistant", text), ("user", "And async ones?")]
    _, tokens_2, second = await generate(stack.router_stub(), chat(conv, model, history))
    assert second.turn == 2 and second.decode_engine_id == HOST_DECODE_ID
    assert second.reuse == router_pb2.REUSE_DECISION_PULL
    assert second.pulled_tokens >= 4 * BLOCK_SIZE
    fences = await stack.pair.prefill.connector_lines(
        "kv pull fence", lambda e: e.get("remote_request_id") == record.engine_request_id
    )
    assert fences[-1]["fenced"] is False, fences
    _, recomputed, scratch = await generate(
        stack.router_stub(), chat(f"scratch-{uuid.uuid4().hex[:8]}", model, history, retain=False)
    )
    assert scratch.pulled_tokens == 0
    assert tokens_2 == recomputed
    assert tokens_1  # turn 1 generated something

    # Turn 2's retention supersedes the pool's: its slots go back (and their generations move on).
    def pool_freed() -> list[dict[str, object]]:
        return [
            e for e in stack.decode.connector_events(FREED_LOG) if e["request_id"] == record.engine_request_id
        ]

    freed_pool = await eventually(pool_freed, within=ENGINE_SETTINGS.release_grace_seconds + 30)
    line = freed_pool[0]
    assert line["reason"] == "superseded"
    assert line["block_ids"] == list(record.block_ids)
    assert all(
        after == before + 1
        for before, after in zip(line["generations"], line["generations_after"], strict=True)  # type: ignore[call-overload]
    )


async def test_a_pool_pull_reads_the_moved_kv_and_a_pull_of_freed_slots_is_fenced(
    stack: HostTierStack,
) -> None:
    """The KV oracle (P's first token's top-k log-probabilities against a recompute) on a pull from the pool,
    then the fence on a pull of the same slots after the retention ended and its slots were given back."""
    pair = stack.pair
    tenant, conversation = f"t-{uuid.uuid4().hex[:6]}", f"pool-fence-{uuid.uuid4().hex[:8]}"
    async with pair.prefill.client() as prefill, stack.decode.client() as decode:
        prompt = await prefill.render_chat(ChatRequest.of([ChatMessage("user", f"{conversation}: {TEXT}")]))
        turn = await direct_turn(
            prefill,
            decode,
            prompt,
            mark=ConversationMark(tenant, conversation, 1),
            max_tokens=8,
            block_size=pair.block_size,
            request_id=f"{conversation}-t1",
        )
    history = [*prompt, *turn.output_token_ids]
    record = await stack.moved(conversation, tenant)
    retained = RetainedKv(
        engine_id=record.engine_id,
        engine_request_id=record.engine_request_id,
        block_ids=tuple(record.block_ids),
        num_tokens=record.num_tokens,
        nixl_host=stack.decode.nixl_host,
        nixl_port=stack.decode.nixl_port,
        block_size=pair.block_size,
        lease_expire_time=time.time() + 60,
        block_generations=tuple(record.block_generations),
        tier=record.tier,
    )
    prompt_2 = await next_prompt(pair, history)
    pull = reuse_pull(retained, prompt_2)
    mark = ConversationMark(tenant, conversation, 2)
    pulled, cached = await first_token(pair, prompt_2, f"{conversation}-t2", pull, mark)
    recomputed, _ = await first_token(pair, prompt_2, f"{conversation}-scratch")
    assert (await fence_line(pair.prefill, f"{conversation}-t2"))["fenced"] is False
    assert pull.blocks.num_tokens is not None and cached == pull.blocks.num_tokens
    assert_same_kv(pulled, recomputed)

    # On one host P maps the holder's pool and copies the slots itself.
    assert (await pull_line(pair, f"{conversation}-t2"))["read"] == "mapped"

    # P times pulls from the holder's pool apart from pulls from its KV cache, and the router prices a
    # host-tier retention by that rate. Pulled again, over NIXL this time (the path for a holder on another
    # host): the same KV.
    again, _ = await first_token(
        pair,
        prompt_2,
        f"{conversation}-t2-again",
        reuse_pull(retained, prompt_2),
        mark,
        options=PullOptions(mapped=False),
    )
    assert_same_kv(again, recomputed)
    assert (await pull_line(pair, f"{conversation}-t2-again"))["read"] == "nixl"

    def host_pool_rate() -> float:
        engine = stack.router.engines.get(pair.prefill.engine_id)
        return (
            0.0 if engine is None else engine.stats.pull_rate(HOST_DECODE_ID, resources_pb2.MEMORY_TIER_HOST)
        )

    await eventually(host_pool_rate, within=15, what="P's host-pool pull rate in the router's engine table")

    # The client ends the conversation: the slots go back a grace later, their generations bumped.
    await stack.registry.stub().ReleaseRetention(
        registry_pb2.ReleaseRetentionRequest(tenant=tenant, conversation_id=conversation), timeout=5
    )

    def freed() -> list[dict[str, Any]]:
        return [
            e for e in stack.decode.connector_events(FREED_LOG) if e["request_id"] == record.engine_request_id
        ]

    (free,) = await eventually(
        freed, within=ENGINE_SETTINGS.release_grace_seconds + 20, what="the slots freed"
    )
    assert free["reason"] == "released" and free["tier"] == "host"

    # A router that handed the record out before the release pulls it now: fenced, recomputed, same KV.
    # (a read window of its own: the first one closed meanwhile, and P would decline it).
    late = reuse_pull(retained, prompt_2)
    pulled_late, cached_late = await first_token(pair, prompt_2, f"{conversation}-late", late, mark)
    line = await fence_line(pair.prefill, f"{conversation}-late")
    assert line["fenced"] is True
    assert cached_late == 0
    assert_same_kv(pulled_late, recomputed)


async def test_a_full_pool_evicts_its_least_recently_used_retention_to_take_a_new_one(
    stack: HostTierStack,
) -> None:
    model = stack.pair.model
    convs = [f"full-{i}-{uuid.uuid4().hex[:6]}" for i in range(4)]
    for conv in convs:
        _, _, summary = await generate(
            stack.router_stub(), chat(conv, model, [("system", SYSTEM), ("user", f"Question on {conv}.")])
        )
        assert summary.turn == 1 and summary.decode_engine_id == HOST_DECODE_ID
    # Four conversations of 6 blocks do not fit 20 slots: the pool evicts its oldest to take the last one.
    last = await stack.moved(convs[-1])
    assert all(KV_CAPACITY_BLOCKS <= b < KV_CAPACITY_BLOCKS + POOL_SLOTS for b in last.block_ids)
    # The pool should have evicted to make room.
    evictions = await stack.decode.connector_lines(
        "evicting least recently used host-tier retention (pool full)"
    )
    evicted = {str(e["conversation_id"]) for e in evictions}
    for conversation in evicted & set(convs):
        assert await stack.record(conversation) is None, f"{conversation} was evicted and must be gone"
