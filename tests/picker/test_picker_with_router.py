"""The picker and the router on one registry: a conversation the router served (its decode engine retained
it and published the retention, as kvferry's connector does) is sent by the picker to that engine; a new
one to the least loaded. The engines are FAST STAND-INS (kvferry.testing.standin_engine): they register
and publish retentions as real engines with the connector and sidecar do; real engines are tested in
tests/router/test_router_engines.py."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator

import grpc
import pytest_asyncio
from envoy_data_plane.envoy.extensions.filters.http.ext_proc.v3 import ProcessingModeBodySendMode as Mode
from kvferry.picker.server import PickerConfig, RunningPicker, start_picker
from kvferry.testing.standin_engine import StandInEngine
from kvferry.v1 import resources_pb2
from kvferry.v1 import router_service_pb2_grpc as router_grpc

from tests.fixtures.registry import RegistryHandle
from tests.fixtures.router import RouterFactory, StandInFactory, router_api_keys, wait_for_engines
from tests.picker.test_ext_proc import envoy_messages, request_headers, send, until
from tests.router.test_router_standin import chat_request, generate


@pytest_asyncio.fixture
async def picker(registry: RegistryHandle) -> AsyncIterator[RunningPicker]:
    running = await start_picker(
        PickerConfig(registry_address=registry.address, listen="127.0.0.1:0"), api_keys=router_api_keys()
    )
    try:
        yield running
    finally:
        await running.stop(grace_seconds=0.5)


async def test_the_picker_follows_the_routers_retentions(
    registry: RegistryHandle,
    router_factory: RouterFactory,
    standin_factory: StandInFactory,
    picker: RunningPicker,
) -> None:
    model = f"standin-{uuid.uuid4().hex[:6]}"
    suffix = uuid.uuid4().hex[:8]
    prefill = await standin_factory("prefill", model=model)
    router = await router_factory()
    # The conversation's first turn, with one decode engine: it holds the retention. A second decode engine
    # joins after; with equal load it is the one a load-aware pick takes (the lower id).
    holder = StandInEngine(
        f"decode-b-{suffix}", resources_pb2.ENGINE_ROLE_DECODE, model=model, registry_address=registry.address
    )
    other = StandInEngine(
        f"decode-a-{suffix}", resources_pb2.ENGINE_ROLE_DECODE, model=model, registry_address=registry.address
    )
    async with contextlib.AsyncExitStack() as started:
        await holder.start()
        started.push_async_callback(holder.stop)
        await wait_for_engines(router, {prefill.engine_id, holder.engine_id})
        conversation = f"c-{uuid.uuid4().hex[:8]}"
        messages = [("system", "You are terse. " * 10), ("user", "Tell me about KV caches. " * 8)]
        async with grpc.aio.insecure_channel(router.grpc_address) as channel:
            stub = router_grpc.RouterServiceStub(channel)
            _, _, summary = await generate(stub, chat_request(conversation, model, messages))
        assert summary.decode_engine_id == holder.engine_id
        await other.start()
        started.push_async_callback(other.stop)
        ids = {prefill.engine_id, holder.engine_id, other.engine_id}
        await until(lambda: ids <= {e.engine_id for e in picker.engines.all()})

        body = json.dumps({"model": model, "messages": [{"role": r, "content": c} for r, c in messages]})
        for key, reason, expected in (
            (conversation, "retained", holder),
            (f"c-{uuid.uuid4().hex[:8]}", "no_retention", other),
        ):
            headers = request_headers(key="key-acme", conversation=key)
            answer = await send(picker, envoy_messages(Mode.FULL_DUPLEX_STREAMED, headers, body.encode()))
            assert answer.immediate is None, answer.immediate
            assert answer.destination == address(expected.url)
            mutations = answer.mutation_headers()
            assert mutations["x-kvferry-pick-reason"] == reason
            assert mutations["x-prefiller-host-port"] == address(prefill.url)


def address(url: str) -> str:
    return url.removeprefix("http://").rstrip("/")
