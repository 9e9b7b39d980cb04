"""The router's retention index in a real router against the real registry (real etcd), with FAST
STAND-IN engines (kvferry.testing.standin_engine): a turn's lookup read from the index, the router
not ready (gRPC health, HTTP /health) until the index has synced, and the index rebuilt from the
registry's snapshot after a router restart. The lookup rules themselves: test_retention_lookups.py."""

from __future__ import annotations

import uuid

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvferry.router.server import RunningRouter
from kvferry.stack.readiness import grpc_serving
from kvferry.v1 import router_service_pb2 as router_pb2
from kvferry.v1 import router_service_pb2_grpc as router_grpc

from tests.fixtures.polling import eventually
from tests.fixtures.registry import RegistryHandle
from tests.fixtures.router import RouterFactory, Stack, wait_for_engines
from tests.fixtures.tcp_proxy import CuttableProxy
from tests.router.test_router_standin import chat_request, generate

pytestmark = pytest.mark.timeout(90)

TENANT = "acme"  # the tenant of the fixtures' key-acme


def lookups(router: RunningRouter, path: str) -> float:
    """How many of the router's turns' lookups were answered by ``path`` (its Prometheus counter)."""
    value = router.metrics.registry.get_sample_value("kvferry_retention_lookups_total", {"path": path})
    return value or 0.0


def indexed_turn(router: RunningRouter, conversation_id: str) -> int:
    assert router.index is not None
    found = router.index.find(TENANT, conversation_id)
    return found.turn if found is not None else 0


async def grpc_health(router: RunningRouter) -> int:
    async with grpc.aio.insecure_channel(router.grpc_address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return int(reply.status)


async def test_a_turn_s_lookup_is_read_from_the_router_s_index(standin_stack: Stack) -> None:
    stack, router = standin_stack, standin_stack.router
    stub = stack.grpc_stub()
    conv = f"idx-{uuid.uuid4().hex[:8]}"
    history = [("user", "Remember this, please. " * 12)]
    text, _, first = await generate(stub, chat_request(conv, stack.model, history))
    assert first.turn == 1
    # Published through the registry's watch into the index (the registry confirmed it already).
    await eventually(lambda: indexed_turn(router, conv) == 1)
    from_index, missed = lookups(router, "index"), lookups(router, "miss")
    history += [("assistant", text), ("user", "And now the next question.")]
    _, _, second = await generate(stub, chat_request(conv, stack.model, history))
    assert (second.turn, second.reuse) == (2, router_pb2.REUSE_DECISION_PULL) and second.pulled_tokens > 0
    assert lookups(router, "index") == from_index + 1
    assert lookups(router, "miss") == missed


async def test_a_router_is_ready_once_its_index_is_synced_and_rebuilds_it_after_a_restart(
    standin_stack: Stack, router_factory: RouterFactory, registry: RegistryHandle
) -> None:
    stack = standin_stack
    conv = f"idx-{uuid.uuid4().hex[:8]}"
    history = [("user", "Keep this conversation across a restart. " * 8)]
    text, _, first = await generate(stack.grpc_stub(), chat_request(conv, stack.model, history))
    assert first.turn == 1
    await eventually(lambda: indexed_turn(stack.router, conv) == 1)
    await stack.router.stop(grace_seconds=0.5)

    # The restarted router reaches the registry through a proxy the test holds cut for now.
    proxy = CuttableProxy(registry.address)
    await proxy.start()
    await proxy.cut()
    try:
        restarted = await router_factory(registry_address=proxy.endpoint, startup_sync_seconds=0)
        assert restarted.index is not None and not restarted.index.ready.is_set()
        assert await grpc_health(restarted) == health_pb2.HealthCheckResponse.NOT_SERVING
        async with httpx.AsyncClient() as client:
            answer = await client.get(f"{restarted.http_url}/health", timeout=5)
        assert answer.status_code == 503
        assert answer.json()["retention_index_synced"] is False

        proxy.resume()
        await grpc_serving("router", restarted.grpc_address, 30)
        assert restarted.index.ready.is_set()
        # Rebuilt from the registry's snapshot: the conversation's retention is there before any turn.
        assert indexed_turn(restarted, conv) == 1
        await wait_for_engines(restarted, {stack.prefill.engine_id, stack.decode.engine_id}, within=20)
        async with httpx.AsyncClient() as client:
            answer = await client.get(f"{restarted.http_url}/health", timeout=5)
        assert answer.status_code == 200 and answer.json()["retention_index_synced"] is True

        stub = router_grpc.RouterServiceStub(grpc.aio.insecure_channel(restarted.grpc_address))
        history += [("assistant", text), ("user", "Still there?")]
        _, _, second = await generate(stub, chat_request(conv, stack.model, history))
        assert (second.turn, second.reuse) == (2, router_pb2.REUSE_DECISION_PULL)
        assert lookups(restarted, "index") == 1
    finally:
        await proxy.stop()


async def test_with_the_index_off_every_lookup_asks_the_registry(
    standin_stack: Stack, router_factory: RouterFactory
) -> None:
    stack = standin_stack
    router = await router_factory(retention_index=False)
    assert router.index is None
    await grpc_serving("router", router.grpc_address, 10)
    await wait_for_engines(router, {stack.prefill.engine_id, stack.decode.engine_id})
    stub = router_grpc.RouterServiceStub(grpc.aio.insecure_channel(router.grpc_address))
    conv = f"idx-{uuid.uuid4().hex[:8]}"
    history = [("user", "No index here. " * 12)]
    text, _, _ = await generate(stub, chat_request(conv, stack.model, history))
    history += [("assistant", text), ("user", "Next.")]
    _, _, second = await generate(stub, chat_request(conv, stack.model, history))
    assert (second.turn, second.reuse) == (2, router_pb2.REUSE_DECISION_PULL)
    assert (lookups(router, "off"), lookups(router, "index")) == (2, 0)
