"""The kit's tracing and metrics against real servers: two grpc.aio servers (a router-shaped and a
registry-shaped service) joined by the tracing interceptors, a real HTTP endpoint standing in for an
engine, and each service's metrics scraped over HTTP from the kit's endpoint."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import grpc
import httpx
import pytest
from kvferry.registry.metrics import RegistryMetrics
from kvferry.router.metrics import RouterMetrics
from kvferry.router.observe import (
    ATTR_DECODE_ENGINE,
    ATTR_PREFILL_ENGINE,
    ATTR_REUSE_DECISION,
    ATTR_TOKENS_PULLED,
    ATTR_TOKENS_RECOMPUTED,
    TURN_SPAN_NAME,
    set_turn_attributes,
)
from kvferry.runtime.grpc_server import start_server
from kvferry.runtime.metrics import serve_metrics
from kvferry.runtime.tracing import (
    TracingServerInterceptor,
    setup_tracing,
    shutdown_tracing,
    trace_headers,
    tracing_client_interceptors,
)
from kvferry.sidecar.metrics import SidecarMetrics
from kvferry.v1 import (
    registry_service_pb2,
    registry_service_pb2_grpc,
    resources_pb2,
    router_service_pb2,
    router_service_pb2_grpc,
)
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tests.fixtures.spans import one, wait_for_spans

pytestmark = pytest.mark.timeout(30)

SUMMARY = router_service_pb2.TurnSummary(
    prompt_tokens=640,
    completion_tokens=2,
    pulled_tokens=512,
    recomputed_tokens=128,
    ttft_ms=42.0,
    reuse=router_service_pb2.REUSE_DECISION_PULL,
    prefill_engine_id="prefill-0",
    decode_engine_id="decode-0",
    turn=2,
)


class RegistryStandIn(registry_service_pb2_grpc.RegistryServiceServicer):
    async def GetRetention(
        self, request: registry_service_pb2.GetRetentionRequest, context: grpc.aio.ServicerContext
    ) -> registry_service_pb2.GetRetentionResponse:
        if request.conversation_id == "broken":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "etcd is unreachable; retry")
        return registry_service_pb2.GetRetentionResponse(
            retention=resources_pb2.Retention(conversation_id=request.conversation_id)
        )


@dataclass
class HeaderCapture:
    """A real HTTP server (stand-in for a vLLM engine) that remembers each request's traceparent."""

    traceparents: list[str] = field(default_factory=list)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        for line in head.split("\r\n")[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "traceparent":
                self.traceparents.append(value.strip())
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
        await writer.drain()
        writer.close()


class RouterStandIn(router_service_pb2_grpc.RouterServiceServicer):
    """Shaped like the router's turn: registry lookup, an engine HTTP call, a turn span, a summary."""

    def __init__(
        self, provider: trace.TracerProvider, registry_address: str, engine_url: str, metrics: RouterMetrics
    ) -> None:
        self._tracer = provider.get_tracer("test.router")
        self._channel = grpc.aio.insecure_channel(
            registry_address, interceptors=tracing_client_interceptors(provider)
        )
        self._registry = registry_service_pb2_grpc.RegistryServiceStub(self._channel)
        self._engine_url = engine_url
        self._metrics = metrics

    async def Generate(
        self, request: router_service_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_service_pb2.GenerateResponse]:
        with self._tracer.start_as_current_span(TURN_SPAN_NAME) as turn:
            await self._registry.GetRetention(
                registry_service_pb2.GetRetentionRequest(tenant="t", conversation_id=request.conversation_id),
                timeout=5,
            )
            async with httpx.AsyncClient(timeout=5) as engine:
                sent = await engine.post(
                    self._engine_url, json={"prompt": [1, 2, 3]}, headers=trace_headers()
                )
                sent.raise_for_status()
            yield router_service_pb2.GenerateResponse(delta=router_service_pb2.TextDelta(text="hi"))
            set_turn_attributes(turn, SUMMARY)
            self._metrics.record_turn(SUMMARY)
            yield router_service_pb2.GenerateResponse(summary=SUMMARY)

    async def GetConversation(
        self, request: router_service_pb2.GetConversationRequest, context: grpc.aio.ServicerContext
    ) -> router_service_pb2.GetConversationResponse:
        await self._registry.GetRetention(
            registry_service_pb2.GetRetentionRequest(tenant="t", conversation_id=request.conversation_id),
            timeout=5,
        )
        return router_service_pb2.GetConversationResponse()

    async def close(self) -> None:
        await self._channel.close()


@dataclass
class Stack:
    router_address: str
    engine: HeaderCapture
    metrics: RouterMetrics


@asynccontextmanager
async def running_stack(
    router_provider: trace.TracerProvider, registry_provider: trace.TracerProvider
) -> AsyncIterator[Stack]:
    metrics = RouterMetrics()
    engine = HeaderCapture()
    engine_server = await asyncio.start_server(engine.handle, "127.0.0.1", 0)
    engine_port = engine_server.sockets[0].getsockname()[1]
    registry = RegistryStandIn()  # type: ignore[abstract]
    registry_server, registry_port, _ = await start_server(
        "127.0.0.1:0",
        [
            (
                registry_service_pb2_grpc.add_RegistryServiceServicer_to_server,
                registry,
                "kvferry.v1.RegistryService",
            )
        ],
        interceptors=[TracingServerInterceptor(registry_provider, rpc_seconds=metrics.rpc_seconds)],
    )
    router = RouterStandIn(  # type: ignore[abstract]
        router_provider,
        f"127.0.0.1:{registry_port}",
        f"http://127.0.0.1:{engine_port}/v1/completions",
        metrics,
    )
    router_server, router_port, _ = await start_server(
        "127.0.0.1:0",
        [(router_service_pb2_grpc.add_RouterServiceServicer_to_server, router, "kvferry.v1.RouterService")],
        interceptors=[TracingServerInterceptor(router_provider, rpc_seconds=metrics.rpc_seconds)],
    )
    try:
        yield Stack(f"127.0.0.1:{router_port}", engine, metrics)
    finally:
        await router.close()
        await router_server.stop(None)
        await registry_server.stop(None)
        engine_server.close()
        await engine_server.wait_closed()


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


async def test_span_tree_parents_across_grpc_and_http() -> None:
    exporter = InMemorySpanExporter()
    agent_provider = setup_tracing("agent", None, exporter=exporter)
    router_provider = setup_tracing("kvferry-router", None, exporter=exporter)
    registry_provider = setup_tracing("kvferry-registry", None, exporter=exporter)
    async with running_stack(router_provider, registry_provider) as stack:
        channel = grpc.aio.insecure_channel(
            stack.router_address, interceptors=tracing_client_interceptors(agent_provider)
        )
        stub = router_service_pb2_grpc.RouterServiceStub(channel)
        with agent_provider.get_tracer("test.agent").start_as_current_span("agent.turn"):
            events = [
                e async for e in stub.Generate(router_service_pb2.GenerateRequest(conversation_id="c1"))
            ]
        await channel.close()
        spans = await wait_for_spans(exporter, 6)

    assert events[-1].summary == SUMMARY
    root = one(spans, "agent.turn", SpanKind.INTERNAL)
    generate_client = one(spans, "kvferry.v1.RouterService/Generate", SpanKind.CLIENT)
    generate_server = one(spans, "kvferry.v1.RouterService/Generate", SpanKind.SERVER)
    turn = one(spans, TURN_SPAN_NAME, SpanKind.INTERNAL)
    lookup_client = one(spans, "kvferry.v1.RegistryService/GetRetention", SpanKind.CLIENT)
    lookup_server = one(spans, "kvferry.v1.RegistryService/GetRetention", SpanKind.SERVER)

    assert {s.context.trace_id for s in spans} == {root.context.trace_id}, "one trace per turn"
    assert parent_id(root) is None
    assert parent_id(generate_client) == root.context.span_id
    assert parent_id(generate_server) == generate_client.context.span_id
    assert generate_server.parent is not None and generate_server.parent.is_remote
    assert parent_id(turn) == generate_server.context.span_id
    assert parent_id(lookup_client) == turn.context.span_id
    assert parent_id(lookup_server) == lookup_client.context.span_id

    # The engine call carried the turn span as its parent.
    (traceparent,) = stack.engine.traceparents
    assert traceparent.startswith(f"00-{turn.context.trace_id:032x}-{turn.context.span_id:016x}-")

    assert turn.attributes is not None
    assert turn.attributes[ATTR_REUSE_DECISION] == "pull"
    assert turn.attributes[ATTR_TOKENS_PULLED] == 512
    assert turn.attributes[ATTR_TOKENS_RECOMPUTED] == 128
    assert turn.attributes[ATTR_PREFILL_ENGINE] == "prefill-0"
    assert turn.attributes[ATTR_DECODE_ENGINE] == "decode-0"
    assert generate_server.attributes is not None
    assert generate_server.attributes["rpc.grpc.status_code"] == 0
    assert generate_server.attributes["rpc.service"] == "kvferry.v1.RouterService"
    assert generate_server.resource.attributes["service.name"] == "kvferry-router"


async def test_error_status_recorded_on_both_sides() -> None:
    exporter = InMemorySpanExporter()
    provider = setup_tracing("kvferry-registry", None, exporter=exporter)
    async with running_stack(provider, provider) as stack:
        channel = grpc.aio.insecure_channel(stack.router_address)
        stub = router_service_pb2_grpc.RouterServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await stub.GetConversation(router_service_pb2.GetConversationRequest(conversation_id="broken"))
        await channel.close()
        spans = await wait_for_spans(exporter, 3)
    # The router handler let the registry's error escape, so the router answers UNKNOWN.
    assert failure.value.code() == grpc.StatusCode.UNKNOWN
    lookup_server = one(spans, "kvferry.v1.RegistryService/GetRetention", SpanKind.SERVER)
    lookup_client = one(spans, "kvferry.v1.RegistryService/GetRetention", SpanKind.CLIENT)
    router_server = one(spans, "kvferry.v1.RouterService/GetConversation", SpanKind.SERVER)
    for span in (lookup_server, lookup_client):
        assert span.attributes is not None
        assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNAVAILABLE.value[0]
        assert span.status.status_code == StatusCode.ERROR
    assert lookup_server.status.description == "etcd is unreachable; retry"
    assert router_server.status.status_code == StatusCode.ERROR
    assert router_server.events and router_server.events[0].name == "exception"


async def test_untraced_service_passes_context_through() -> None:
    """A router with tracing off (no-op provider) still carries the caller's trace to the registry."""
    exporter = InMemorySpanExporter()
    agent_provider = setup_tracing("agent", None, exporter=exporter)
    registry_provider = setup_tracing("kvferry-registry", None, exporter=exporter)
    router_provider = setup_tracing("kvferry-router", None)
    assert isinstance(router_provider, trace.NoOpTracerProvider)
    async with running_stack(router_provider, registry_provider) as stack:
        channel = grpc.aio.insecure_channel(
            stack.router_address, interceptors=tracing_client_interceptors(agent_provider)
        )
        stub = router_service_pb2_grpc.RouterServiceStub(channel)
        await stub.GetConversation(router_service_pb2.GetConversationRequest(conversation_id="c2"))
        await channel.close()
        spans = await wait_for_spans(exporter, 2)
    client = one(spans, "kvferry.v1.RouterService/GetConversation", SpanKind.CLIENT)
    lookup_server = one(spans, "kvferry.v1.RegistryService/GetRetention", SpanKind.SERVER)
    assert len(spans) == 2
    assert parent_id(lookup_server) == client.context.span_id


async def scrape(
    metrics: RouterMetrics | RegistryMetrics | SidecarMetrics, accept: str = ""
) -> httpx.Response:
    endpoint = await serve_metrics(metrics.registry, "127.0.0.1:0")
    try:
        async with httpx.AsyncClient(timeout=5) as http:
            return await http.get(f"http://127.0.0.1:{endpoint.port}/metrics", headers={"Accept": accept})
    finally:
        await endpoint.stop()


async def test_each_service_serves_the_series_it_owns() -> None:
    """Every series docs/observability.md names, on the service that updates it."""
    router = RouterMetrics()
    router.record_turn(SUMMARY)
    router.record_lookup(hit=True)
    router.record_lookup(hit=False)
    router.registry_errors.labels(op="get_retention").inc()
    text = (await scrape(router)).text
    assert 'kvferry_turns_total{reuse="pull"} 1.0' in text
    assert 'kvferry_turns_total{reuse="recompute"} 0.0' in text, "closed label sets start at zero"
    assert "kvferry_tokens_pulled_total 512.0" in text
    assert "kvferry_tokens_recomputed_total 128.0" in text
    assert "kvferry_reuse_hits_total 1.0" in text
    assert "kvferry_reuse_lookups_total 2.0" in text
    assert 'kvferry_ttft_seconds_bucket{le="0.05",reuse="pull"} 1.0' in text
    assert 'kvferry_registry_errors_total{op="get_retention"} 1.0' in text
    assert "kvferry_rpc_server_seconds" in text

    registry = RegistryMetrics()
    registry.released(resources_pb2.RELEASE_REASON_SUPERSEDED)
    registry.etcd_error("txn")
    registry.lease_renewed("retention")
    registry.set_live(2, 3)
    text = (await scrape(registry)).text
    assert 'kvferry_releases_total{reason="superseded"} 1.0' in text
    assert 'kvferry_releases_total{reason="engine_gone"} 0.0' in text
    assert 'kvferry_etcd_errors_total{op="txn"} 1.0' in text
    assert 'kvferry_lease_renewals_total{kind="retention"} 1.0' in text
    assert "kvferry_registry_live_engines 2.0" in text and "kvferry_registry_live_retentions 3.0" in text
    assert "kvferry_rpc_server_seconds" in text

    sidecar = SidecarMetrics("decode-0")
    sidecar.set_retained(2, 17)
    sidecar.heartbeat()
    sidecar.release(resources_pb2.RELEASE_REASON_EXPIRED)
    sidecar.registry_error("heartbeat_engine")
    text = (await scrape(sidecar)).text
    assert 'kvferry_retained_blocks{engine="decode-0"} 17.0' in text
    assert 'kvferry_lease_renewals_total{kind="engine"} 1.0' in text
    assert 'kvferry_releases_total{reason="expired"} 1.0' in text
    assert 'kvferry_registry_errors_total{op="heartbeat_engine"} 1.0' in text
    assert "kvferry_sidecar_retentions 2.0" in text


async def test_the_metrics_endpoint_speaks_prometheus_text_and_openmetrics() -> None:
    text = await scrape(RouterMetrics())
    assert text.status_code == 200
    assert text.headers["content-type"].startswith("text/plain")
    openmetrics = await scrape(RouterMetrics(), accept="application/openmetrics-text")
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    assert openmetrics.text.endswith("# EOF\n")


async def test_server_interceptor_feeds_rpc_metrics() -> None:
    provider = setup_tracing("kvferry-router", None)
    async with running_stack(provider, provider) as stack:
        channel = grpc.aio.insecure_channel(stack.router_address)
        stub = router_service_pb2_grpc.RouterServiceStub(channel)
        await stub.GetConversation(router_service_pb2.GetConversationRequest(conversation_id="c3"))
        await channel.close()
        text = (await scrape(stack.metrics)).text
    counts = "kvferry_rpc_server_seconds_count"
    assert f'{counts}{{code="OK",method="GetConversation",service="kvferry.v1.RouterService"}} 1.0' in text
    assert f'{counts}{{code="OK",method="GetRetention",service="kvferry.v1.RegistryService"}} 1.0' in text


class CollectorStandIn(trace_service_pb2_grpc.TraceServiceServicer):
    """A real OTLP/gRPC endpoint that keeps the span names it receives."""

    def __init__(self) -> None:
        self.span_names: list[str] = []
        self.service_names: list[str] = []

    async def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.aio.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            for attribute in resource_spans.resource.attributes:
                if attribute.key == "service.name":
                    self.service_names.append(attribute.value.string_value)
            for scope_spans in resource_spans.scope_spans:
                self.span_names.extend(span.name for span in scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


async def test_otlp_endpoint_receives_spans() -> None:
    collector = CollectorStandIn()
    server, port, _ = await start_server(
        "127.0.0.1:0",
        [
            (
                trace_service_pb2_grpc.add_TraceServiceServicer_to_server,
                collector,
                "opentelemetry.proto.collector.trace.v1.TraceService",
            )
        ],
    )
    try:
        provider = setup_tracing("kvferry-router", f"127.0.0.1:{port}")
        with provider.get_tracer("test").start_as_current_span(TURN_SPAN_NAME):
            pass
        # The batch exporter is synchronous gRPC in its own thread; flush it off the loop.
        await asyncio.to_thread(shutdown_tracing, provider)
    finally:
        await server.stop(None)
    assert collector.span_names == [TURN_SPAN_NAME]
    assert collector.service_names == ["kvferry-router"]
