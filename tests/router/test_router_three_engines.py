"""One prefill and two decode engines (the shared pair plus one more, started here): decode affinity
keeps each conversation on the engine that holds it, load spreads new conversations, and a decode
engine killed mid-conversation costs its conversations only a recompute.

The extra engine shares a core with the pair's decode engine, so this module is slow; run it under
the engine lock::

    flock /tmp/kvferry-engines.lock pytest -m engines tests/router/test_router_three_engines.py
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from kvferry.router.server import RunningRouter, start_router
from kvferry.stack.engine import EngineProcess
from kvferry.stack.etcd_process import free_port
from kvferry.v1 import router_service_pb2 as router_pb2
from kvferry.v1 import router_service_pb2_grpc as router_grpc

from tests.fixtures.engines import (
    BLOCK_SIZE,
    ENGINE_SETTINGS,
    UNMARKED_DECODE_TTL_SECONDS,
    EnginePair,
)
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
)

pytestmark = [pytest.mark.engines, pytest.mark.timeout(1200)]

# Sorts before the pair's "test-decode-0": with equal load the router picks the lowest id, so the first
# conversation lands on this engine, the one the test may kill.
EXTRA_DECODE_ID = "extra-decode-1"


@dataclasses.dataclass
class ThreeEngines:
    pair: EnginePair
    extra: EngineProcess
    extra_sidecar: SidecarHandle
    router: RunningRouter

    def stub(self) -> router_grpc.RouterServiceStub:
        return router_grpc.RouterServiceStub(grpc.aio.insecure_channel(self.router.grpc_address))


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def three(
    engine_pair: EnginePair, registry: RegistryHandle, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ThreeEngines]:
    workdir: Path = tmp_path_factory.mktemp("extra-engine")
    sidecar_address = f"127.0.0.1:{free_port()}"
    extra = EngineProcess(
        role="decode",
        engine_id=EXTRA_DECODE_ID,
        log_path=workdir / "extra-decode.log",
        cpu_core=1,
        settings=dataclasses.replace(ENGINE_SETTINGS, sidecar_address=sidecar_address),
        block_size=BLOCK_SIZE,
        nixl_extra_config={"decoder_kv_blocks_ttl": UNMARKED_DECODE_TTL_SECONDS},
    )
    await asyncio.to_thread(extra.start_and_wait, 420)
    handles: list[SidecarHandle] = []
    router = None
    try:
        targets = [
            (engine_pair.prefill.process, engine_pair.prefill.sidecar_address),
            (engine_pair.decode.process, engine_pair.decode.sidecar_address),
            (extra, sidecar_address),
        ]
        for process, address in targets:
            handles.append(await start_sidecar(engine_sidecar_config(registry, process, address)))
        for handle in handles:
            await handle.wait_registered(within=60)
        router = await start_router(engine_router_config(registry), api_keys=router_api_keys())
        ids = {engine_pair.prefill.engine_id, engine_pair.decode.engine_id, EXTRA_DECODE_ID}
        deadline = asyncio.get_running_loop().time() + 30
        while not ids <= {e.engine_id for e in router.engines.all()}:
            assert asyncio.get_running_loop().time() < deadline, "router never saw the three engines"
            await asyncio.sleep(0.05)
        three = ThreeEngines(engine_pair, extra, handles[2], router)
        # Both decode engines' connectors must be linked to their sidecars before the tests.
        deadline = asyncio.get_running_loop().time() + 120
        linked: set[str] = set()
        while linked != {engine_pair.decode.engine_id, EXTRA_DECODE_ID}:
            assert asyncio.get_running_loop().time() < deadline, f"connectors never linked (ok: {linked})"
            results = await asyncio.gather(
                *(
                    generate(
                        three.stub(),
                        chat(f"warm-{uuid.uuid4().hex[:6]}", engine_pair.model, [("user", "hi")]),
                    )
                    for _ in range(2)
                )
            )
            linked |= {s.decode_engine_id for _, _, s in results if s.turn == 1}
        # ...and their release grace (said on the connector's watch) must have reached the router: without
        # it the router recomputes instead of pulling.
        deadline = asyncio.get_running_loop().time() + 30
        graces: dict[str, float] = {}
        while not all(grace > 0 for grace in graces.values()) or len(graces) < len(linked):
            assert asyncio.get_running_loop().time() < deadline, f"release graces never published: {graces}"
            graces = {
                engine.engine_id: engine.release_grace_seconds
                for engine in router.engines.all()
                if engine.engine_id in linked
            }
            await asyncio.sleep(0.05)
        yield three
    finally:
        if router is not None:
            await router.stop(grace_seconds=0.5)
        for handle in handles:
            await handle.stop()
        await asyncio.to_thread(extra.stop)


async def test_affinity_keeps_conversations_on_their_decode_engine_and_load_spreads_them(
    three: ThreeEngines,
) -> None:
    model = three.pair.model
    # Load spreading compares turns in flight plus each engine's reported running requests: start from idle
    # engines (earlier modules' turns on the pair's decode engine may still be reported for a heartbeat).
    deadline = asyncio.get_running_loop().time() + 60
    while busy := {
        e.engine_id: e.stats.running_requests
        for e in three.router.engines.all()
        if e.can_decode and e.stats.running_requests
    }:
        assert asyncio.get_running_loop().time() < deadline, (
            f"decode engines still report running requests: {busy}"
        )
        await asyncio.sleep(0.2)
    convs = [f"aff-{i}-{uuid.uuid4().hex[:6]}" for i in range(2)]
    histories: list[list[tuple[str, str]]] = [
        [("system", SYSTEM), ("user", f"Question {i}.")] for i in range(2)
    ]
    holders: list[set[str]] = [set(), set()]
    for turn in range(1, 4):
        # Both conversations' turns at once: a new conversation goes to the less loaded decode engine.
        results = await asyncio.gather(
            *(
                generate(three.stub(), chat(conv, model, history))
                for conv, history in zip(convs, histories, strict=True)
            )
        )
        for index, (text, _, summary) in enumerate(results):
            assert summary.turn == turn
            holders[index].add(summary.decode_engine_id)
            if turn > 1:
                assert summary.reuse == router_pb2.REUSE_DECISION_PULL and summary.pulled_tokens > 0
            histories[index] += [("assistant", text), ("user", f"More ({turn}).")]
    assert all(len(h) == 1 for h in holders), holders
    assert holders[0] != holders[1], "the two conversations should be spread over both decode engines"


async def test_decode_engine_killed_mid_conversation_costs_only_a_recompute(three: ThreeEngines) -> None:
    model = three.pair.model
    history: list[tuple[str, str]] = [("system", SYSTEM), ("user", "Explain iterators.")]
    # A conversation the extra engine holds. A new conversation goes to the less loaded decode engine,
    # which depends on what the module's earlier tests left retained; each one placed on the other
    # engine adds to its load, so a few new conversations reach the extra engine.
    for _ in range(6):
        conv = f"kill-{uuid.uuid4().hex[:6]}"
        text, _, first = await generate(three.stub(), chat(conv, model, history))
        if first.decode_engine_id == EXTRA_DECODE_ID:
            break
    assert first.decode_engine_id == EXTRA_DECODE_ID and first.turn == 1
    # Kill the engine that holds the conversation (its whole process group, no goodbye).
    assert three.extra.pid is not None
    os.killpg(three.extra.pid, signal.SIGKILL)
    history += [("assistant", text), ("user", "And iterables?")]
    _, tokens, summary = await generate(three.stub(), chat(conv, model, history))
    assert summary.decode_engine_id == three.pair.decode.engine_id
    assert summary.pulled_tokens == 0
    assert summary.turn == 2
    # The output equals a recompute from scratch of the same prompt.
    _, scratch, _ = await generate(
        three.stub(), chat(f"scratch-{uuid.uuid4().hex[:6]}", model, history, retain=False)
    )
    assert tokens == scratch
    # The registry drops the dead engine when its sidecar sees it gone; the router follows at once.
    deadline = asyncio.get_running_loop().time() + 30
    while three.router.engines.get(EXTRA_DECODE_ID) is not None:
        assert asyncio.get_running_loop().time() < deadline, "the killed engine stayed in the router's table"
        await asyncio.sleep(0.1)
