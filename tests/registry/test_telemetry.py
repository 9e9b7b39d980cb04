"""The registry's metrics and traces: a real registry on a real etcd, scraped over its real /metrics."""

from __future__ import annotations

import argparse
import asyncio
import uuid
from collections.abc import AsyncIterator, Callable

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvferry.registry.cli import config_from_args, configure
from kvferry.registry.config import RegistryConfig
from kvferry.registry.server import Registry, create_registry
from kvferry.runtime.tracing import setup_tracing, tracing_client_interceptors
from kvferry.stack.etcd_process import EtcdProcess, free_port
from kvferry.v1 import registry_service_pb2 as api
from kvferry.v1 import resources_pb2 as resources
from kvferry.v1.registry_service_pb2_grpc import RegistryServiceStub
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.registry import TEST_TTLS, unique
from tests.fixtures.spans import one, wait_for_spans
from tests.registry.builders import EventStream, publish, register, retention, status_of

pytestmark = pytest.mark.timeout(60)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _config(etcd_endpoint: str, **overrides: object) -> RegistryConfig:
    fields: dict[str, object] = {
        "listen_address": "127.0.0.1:0",
        "etcd_endpoints": (etcd_endpoint,),
        "key_prefix": f"/kvferry-telemetry-{uuid.uuid4().hex[:8]}/",
        "ttl": TEST_TTLS,
        "history_seconds": 0,
        "metrics_address": "127.0.0.1:0",
    }
    fields.update(overrides)
    return RegistryConfig(**fields)  # type: ignore[arg-type]


@pytest.fixture
async def observed(etcd: EtcdProcess) -> AsyncIterator[Registry]:
    """A registry of its own (fresh series, fresh key prefix) serving /metrics on a free port."""
    running = await create_registry(_config(etcd.endpoint))
    try:
        yield running
    finally:
        await running.stop(grace_seconds=0.2)


async def scrape(port: int) -> Samples:
    """Every sample the real /metrics endpoint serves, keyed by (name, labels)."""
    async with httpx.AsyncClient(timeout=5) as client:
        response = await client.get(f"http://127.0.0.1:{port}/metrics")
    response.raise_for_status()
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), float("nan"))


async def scrape_until(port: int, accept: Callable[[Samples], bool], within: float = 10.0) -> Samples:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        samples = await scrape(port)
        if accept(samples) or loop.time() > deadline:
            return samples
        await asyncio.sleep(0.1)


async def test_metrics_endpoint_counts_renewals_releases_and_live_records(observed: Registry) -> None:
    assert observed.metrics_port is not None
    port = observed.metrics_port
    before = await scrape(port)
    # Closed label sets exist at zero before anything happens.
    for op in ("range", "txn", "lease_grant", "lease_keepalive", "watch"):
        assert value(before, "kvferry_etcd_errors_total", op=op) == 0
    for kind in ("engine", "retention"):
        assert value(before, "kvferry_lease_renewals_total", kind=kind) == 0
    for reason in ("released", "evicted", "superseded", "engine_gone", "expired"):
        assert value(before, "kvferry_releases_total", reason=reason) == 0

    async with grpc.aio.insecure_channel(observed.address) as channel:
        stub = RegistryServiceStub(channel)
        engine_id, tenant = unique("engine"), unique("tenant")
        await register(stub, engine_id)
        await stub.HeartbeatEngine(api.HeartbeatEngineRequest(engine_id=engine_id), timeout=5)
        watch = await EventStream.open(stub.WatchRetentions(api.WatchRetentionsRequest(engine_id=engine_id)))
        async with watch:
            await publish(stub, retention(tenant, "kept", engine_id, turn=1))
            await publish(stub, retention(tenant, "kept", engine_id, turn=2))  # supersedes turn 1
            await stub.RenewRetention(
                api.RenewRetentionRequest(tenant=tenant, conversation_id="kept"), timeout=5
            )
            await publish(stub, retention(tenant, "released", engine_id))
            await stub.ReleaseRetention(
                api.ReleaseRetentionRequest(tenant=tenant, conversation_id="released"), timeout=5
            )
            evicted = (await publish(stub, retention(tenant, "evicted", engine_id))).retention
            await stub.ReleaseRetention(
                api.ReleaseRetentionRequest(
                    tenant=tenant,
                    conversation_id="evicted",
                    reason=resources.RELEASE_REASON_EVICTED,
                    engine_request_id=evicted.engine_request_id,
                ),
                timeout=5,
            )
            # A guarded release that is refused ends nothing and counts nothing.
            stale = stub.ReleaseRetention(
                api.ReleaseRetentionRequest(
                    tenant=tenant, conversation_id="kept", engine_request_id="req-old"
                ),
                timeout=5,
            )
            assert await status_of(stale) == grpc.StatusCode.FAILED_PRECONDITION

            # The live gauges come from etcd every few seconds: 1 record ("kept"), 1 engine.
            live = await scrape_until(
                port,
                lambda s: (
                    value(s, "kvferry_registry_live_retentions") == 1
                    and value(s, "kvferry_registry_live_engines") == 1
                ),
            )
            assert value(live, "kvferry_registry_live_engines") == 1
            assert value(live, "kvferry_registry_live_retentions") == 1

            # An expiry ends no registry transaction: the replica serving the engine's watch counts it.
            await publish(stub, retention(tenant, "expiring", engine_id, ttl_seconds=2))
            await watch.next_matching(lambda e: e.reason == resources.RELEASE_REASON_EXPIRED)
        await stub.DeregisterEngine(api.DeregisterEngineRequest(engine_id=engine_id), timeout=5)

    after = await scrape(port)
    assert value(after, "kvferry_lease_renewals_total", kind="engine") == 1
    assert value(after, "kvferry_lease_renewals_total", kind="retention") == 1
    assert value(after, "kvferry_releases_total", reason="superseded") == 1
    assert value(after, "kvferry_releases_total", reason="released") == 1
    assert value(after, "kvferry_releases_total", reason="evicted") == 1
    assert value(after, "kvferry_releases_total", reason="expired") == 1
    assert value(after, "kvferry_releases_total", reason="engine_gone") == 1  # "kept", on deregistration
    assert value(after, "kvferry_etcd_errors_total", op="txn") == 0
    served = dict(service="kvferry.v1.RegistryService", method="PublishRetention", code="OK")
    assert value(after, "kvferry_rpc_server_seconds_count", **served) == 5
    refused = dict(
        service="kvferry.v1.RegistryService", method="ReleaseRetention", code="FAILED_PRECONDITION"
    )
    assert value(after, "kvferry_rpc_server_seconds_count", **refused) == 1


async def test_etcd_failures_are_counted_by_operation() -> None:
    """A registry whose etcd is not there: calls fail UNAVAILABLE and count as etcd errors."""
    nowhere = f"127.0.0.1:{free_port()}"
    running = await create_registry(_config(nowhere, etcd_timeout_seconds=0.3))
    try:
        assert running.metrics_port is not None
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = RegistryServiceStub(channel)
            lookup = stub.GetRetention(api.GetRetentionRequest(tenant="t", conversation_id="c"), timeout=5)
            assert await status_of(lookup) == grpc.StatusCode.UNAVAILABLE
            grant = stub.RegisterEngine(api.RegisterEngineRequest(engine=resources.Engine()), timeout=5)
            assert await status_of(grant) == grpc.StatusCode.INVALID_ARGUMENT  # refused before etcd
        samples = await scrape_until(
            running.metrics_port, lambda s: value(s, "kvferry_etcd_errors_total", op="range") >= 1
        )
    finally:
        await running.stop(grace_seconds=0.2)
    assert value(samples, "kvferry_etcd_errors_total", op="txn") >= 1  # the lookup
    assert value(samples, "kvferry_etcd_errors_total", op="range") >= 1  # health probe, live counts
    unavailable = dict(service="kvferry.v1.RegistryService", method="GetRetention", code="UNAVAILABLE")
    assert value(samples, "kvferry_rpc_server_seconds_count", **unavailable) == 1


async def test_a_traced_call_has_its_server_span_under_the_callers_span(etcd: EtcdProcess) -> None:
    exporter = InMemorySpanExporter()
    registry_provider = setup_tracing("kvferry-registry", None, exporter=exporter)
    caller_provider = setup_tracing("kvferry-router", None, exporter=exporter)
    running = await create_registry(
        _config(etcd.endpoint, metrics_address=None), tracer_provider=registry_provider
    )
    try:
        assert running.metrics_endpoint is None
        engine_id = unique("engine")
        async with grpc.aio.insecure_channel(
            running.address, interceptors=tracing_client_interceptors(caller_provider)
        ) as channel:
            stub = RegistryServiceStub(channel)
            await register(stub, engine_id)
            exporter.clear()
            with caller_provider.get_tracer("test").start_as_current_span("kvferry.turn"):
                lookup = stub.GetRetention(
                    api.GetRetentionRequest(tenant="t", conversation_id="none"), timeout=5
                )
                assert await status_of(lookup) == grpc.StatusCode.NOT_FOUND
            spans = await wait_for_spans(exporter, 3)
            # Health checks are not traced on the server (probe noise).
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            await asyncio.sleep(0.05)
            assert not [
                s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER and "Health" in s.name
            ]
    finally:
        await running.stop(grace_seconds=0.2)

    turn = one(spans, "kvferry.turn", SpanKind.INTERNAL)
    client = one(spans, "kvferry.v1.RegistryService/GetRetention", SpanKind.CLIENT)
    server = one(spans, "kvferry.v1.RegistryService/GetRetention", SpanKind.SERVER)
    assert {s.context.trace_id for s in (turn, client, server)} == {turn.context.trace_id}
    assert client.parent is not None and client.parent.span_id == turn.context.span_id
    assert server.parent is not None and server.parent.span_id == client.context.span_id
    assert server.parent.is_remote
    assert server.resource.attributes["service.name"] == "kvferry-registry"
    assert server.attributes is not None
    assert server.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]


def _parse(argv: list[str], environ: dict[str, str]) -> RegistryConfig:
    parser = argparse.ArgumentParser()
    configure(parser, environ)
    return config_from_args(parser.parse_args(argv))


def test_the_cli_takes_the_shared_telemetry_flags_and_environment() -> None:
    assert _parse([], {}).metrics_address is None
    assert _parse([], {}).otlp_endpoint is None
    environ = {"KVFERRY_METRICS_ADDRESS": "127.0.0.1:9464", "KVFERRY_OTLP_ENDPOINT": "127.0.0.1:4317"}
    config = _parse([], environ)
    assert (config.metrics_address, config.otlp_endpoint) == ("127.0.0.1:9464", "127.0.0.1:4317")
    flagged = _parse(["--metrics-address", "127.0.0.1:0", "--otlp-endpoint", "http://c:4317"], environ)
    assert (flagged.metrics_address, flagged.otlp_endpoint) == ("127.0.0.1:0", "http://c:4317")
    assert _parse([], {"OTEL_EXPORTER_OTLP_ENDPOINT": "c:4317"}).otlp_endpoint == "c:4317"
    # An empty variable (compose's ${VAR:-}) means off.
    assert _parse([], {"KVFERRY_OTLP_ENDPOINT": "", "KVFERRY_METRICS_ADDRESS": ""}).otlp_endpoint is None
