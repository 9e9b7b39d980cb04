"""One way for every kvferry service to do metrics and traces.

Metrics: :func:`create_metrics` builds every ``kvferry_*`` series against a ``CollectorRegistry`` the
caller owns (one per process in production, one per test); :func:`serve_metrics` serves it on a port
from the event loop, :func:`metrics_asgi_app` mounts it into a Starlette app.

Traces: :func:`setup_tracing` returns a ``TracerProvider`` that is a no-op unless an OTLP endpoint
(or, in tests, an exporter) is given; a no-op provider still passes incoming trace context through.
:class:`TracingServerInterceptor` and :func:`tracing_client_interceptors` open one span per gRPC call
and carry W3C trace context in gRPC metadata; :func:`httpx_trace_hooks` does the same for the HTTP
calls to the engines. Nothing here sets the OpenTelemetry globals: the composition root passes the
provider to what needs it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
from kvferry.v1 import resources_pb2, router_service_pb2
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_asgi_app
from prometheus_client.exposition import choose_encoder

# --------------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------------

# TTFT spans ~10 ms (short reused suffix) to tens of seconds (long cold prompt on a busy engine).
TTFT_BUCKETS_SECONDS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    10.0,
    20.0,
    30.0,
)
RPC_BUCKETS_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def reuse_label(decision: int) -> str:
    """``REUSE_DECISION_PULL`` -> ``pull``: the label value for a ``ReuseDecision``."""
    return router_service_pb2.ReuseDecision.Name(decision).removeprefix("REUSE_DECISION_").lower()  # type: ignore[arg-type]


def release_reason_label(reason: int) -> str:
    """``RELEASE_REASON_EXPIRED`` -> ``expired``: the label value for a ``ReleaseReason``."""
    return resources_pb2.ReleaseReason.Name(reason).removeprefix("RELEASE_REASON_").lower()  # type: ignore[arg-type]


@dataclass(frozen=True)
class Metrics:
    """Every kvferry series, bound to one registry. Build with :func:`create_metrics`.

    Each service updates the series it owns (see docs/observability.md); the rest stay at zero.
    """

    registry: CollectorRegistry
    turns: Counter  # kvferry_turns_total{reuse}
    ttft_seconds: Histogram  # kvferry_ttft_seconds{reuse}
    reuse_lookups: Counter  # kvferry_reuse_lookups_total
    reuse_hits: Counter  # kvferry_reuse_hits_total
    tokens_pulled: Counter  # kvferry_tokens_pulled_total
    tokens_recomputed: Counter  # kvferry_tokens_recomputed_total
    retained_blocks: Gauge  # kvferry_retained_blocks{engine}
    releases: Counter  # kvferry_releases_total{reason}
    registry_errors: Counter  # kvferry_registry_errors_total{op}
    etcd_errors: Counter  # kvferry_etcd_errors_total{op}
    lease_renewals: Counter  # kvferry_lease_renewals_total{kind}
    rpc_server_seconds: Histogram  # kvferry_rpc_server_seconds{service,method,code}

    def record_turn(self, summary: router_service_pb2.TurnSummary) -> None:
        """Counts one finished turn from the router's ``TurnSummary``."""
        reuse = reuse_label(summary.reuse)
        self.turns.labels(reuse=reuse).inc()
        if summary.ttft_ms > 0:
            self.ttft_seconds.labels(reuse=reuse).observe(summary.ttft_ms / 1000.0)
        self.tokens_pulled.inc(max(summary.pulled_tokens, 0))
        self.tokens_recomputed.inc(max(summary.recomputed_tokens, 0))

    def record_lookup(self, *, hit: bool) -> None:
        """One retention lookup for a follow-up turn; ``hit``: a usable retention (prefix verified, lease
        and engine alive) was found, whether or not the cost model then chose to pull it."""
        self.reuse_lookups.inc()
        if hit:
            self.reuse_hits.inc()

    def record_release(self, reason: int) -> None:
        """One retention ended, by ``ReleaseReason``."""
        self.releases.labels(reason=release_reason_label(reason)).inc()


def create_metrics(registry: CollectorRegistry | None = None) -> Metrics:
    """Creates every kvferry series in ``registry`` (a fresh one if None).

    Series with a small closed label set (reuse decision, release reason) are pre-created at zero so
    rates and ratios exist before the first event.
    """
    registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
    metrics = Metrics(
        registry=registry,
        turns=Counter("kvferry_turns", "Finished turns, by reuse decision.", ["reuse"], registry=registry),
        ttft_seconds=Histogram(
            "kvferry_ttft_seconds",
            "Time to first token seen by the router, by reuse decision.",
            ["reuse"],
            buckets=TTFT_BUCKETS_SECONDS,
            registry=registry,
        ),
        reuse_lookups=Counter(
            "kvferry_reuse_lookups", "Retention lookups for follow-up turns.", registry=registry
        ),
        reuse_hits=Counter(
            "kvferry_reuse_hits",
            "Lookups that found a usable retention (hit rate = hits / lookups).",
            registry=registry,
        ),
        tokens_pulled=Counter(
            "kvferry_tokens_pulled", "Prompt tokens whose KV was pulled from a retention.", registry=registry
        ),
        tokens_recomputed=Counter(
            "kvferry_tokens_recomputed", "Prompt tokens computed by prefill.", registry=registry
        ),
        retained_blocks=Gauge(
            "kvferry_retained_blocks",
            "KV blocks an engine holds for retentions.",
            ["engine"],
            registry=registry,
        ),
        releases=Counter("kvferry_releases", "Retentions ended, by reason.", ["reason"], registry=registry),
        registry_errors=Counter(
            "kvferry_registry_errors",
            "Failed calls to the registry service, by operation.",
            ["op"],
            registry=registry,
        ),
        etcd_errors=Counter(
            "kvferry_etcd_errors", "Failed etcd operations, by operation.", ["op"], registry=registry
        ),
        lease_renewals=Counter(
            "kvferry_lease_renewals",
            "Lease renewals (heartbeats), by what the lease keeps alive.",
            ["kind"],
            registry=registry,
        ),
        rpc_server_seconds=Histogram(
            "kvferry_rpc_server_seconds",
            "gRPC calls served, by service, method and status code.",
            ["service", "method", "code"],
            buckets=RPC_BUCKETS_SECONDS,
            registry=registry,
        ),
    )
    for decision in router_service_pb2.ReuseDecision.values():
        if decision != router_service_pb2.REUSE_DECISION_UNSPECIFIED:
            metrics.turns.labels(reuse=reuse_label(decision))
    for reason in resources_pb2.ReleaseReason.values():
        if reason != resources_pb2.RELEASE_REASON_UNSPECIFIED:
            metrics.releases.labels(reason=release_reason_label(reason))
    return metrics


def metrics_asgi_app(registry: CollectorRegistry) -> Callable[..., Any]:
    """An ASGI app serving ``registry``; mount it into Starlette: ``Mount("/metrics", app=...)``."""
    return make_asgi_app(registry=registry)  # type: ignore[no-any-return]


_MAX_REQUEST_HEAD_BYTES = 16 * 1024
_REQUEST_HEAD_TIMEOUT_SECONDS = 5.0


@dataclass
class MetricsServer:
    """``GET /metrics`` on an asyncio server; from :func:`serve_metrics`."""

    server: asyncio.Server
    port: int

    async def stop(self) -> None:
        self.server.close()
        await self.server.wait_closed()


async def serve_metrics(registry: CollectorRegistry, address: str = "127.0.0.1:0") -> MetricsServer:
    """Serves ``registry`` at ``http://address/metrics`` from the running event loop.

    ``address`` is ``host:port`` (port 0 picks a free one; the bound port is on the result). A minimal
    HTTP/1.1 responder (one request per connection) so services need no web framework for scraping;
    exposition runs in a worker thread so a large registry never stalls the loop.
    """
    host, _, port_text = address.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(_REQUEST_HEAD_TIMEOUT_SECONDS):
                head = await reader.readuntil(b"\r\n\r\n")
            status, headers, body = await _metrics_response(registry, head)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            writer.close()
            return
        lines = [
            f"HTTP/1.1 {status}",
            *(f"{k}: {v}" for k, v in headers.items()),
            f"Content-Length: {len(body)}",
            "Connection: close",
            "",
            "",
        ]
        try:
            writer.write("\r\n".join(lines).encode("latin-1") + body)
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    server = await asyncio.start_server(handle, host, int(port_text), limit=_MAX_REQUEST_HEAD_BYTES)
    port = int(server.sockets[0].getsockname()[1])
    return MetricsServer(server=server, port=port)


async def _metrics_response(registry: CollectorRegistry, head: bytes) -> tuple[str, dict[str, str], bytes]:
    request_line, *header_lines = head.decode("latin-1").split("\r\n")
    parts = request_line.split(" ")
    if len(parts) != 3:
        return "400 Bad Request", {"Content-Type": "text/plain"}, b"bad request line\n"
    method, target, _ = parts
    if target.split("?", 1)[0] not in ("/metrics", "/metrics/"):
        return "404 Not Found", {"Content-Type": "text/plain"}, b"metrics are at /metrics\n"
    if method not in ("GET", "HEAD"):
        return "405 Method Not Allowed", {"Allow": "GET, HEAD", "Content-Type": "text/plain"}, b""
    accept = ""
    for line in header_lines:
        name, _, value = line.partition(":")
        if name.strip().lower() == "accept":
            accept = value.strip()
    encoder, content_type = choose_encoder(accept)
    body = await asyncio.to_thread(encoder, registry)
    return "200 OK", {"Content-Type": content_type}, (b"" if method == "HEAD" else body)


# --------------------------------------------------------------------------------------------------
# Tracing
# --------------------------------------------------------------------------------------------------

# Attributes of the router's per-turn span (TURN_SPAN_NAME).
TURN_SPAN_NAME = "kvferry.turn"
ATTR_REUSE_DECISION = "kvferry.reuse_decision"
ATTR_TOKENS_PULLED = "kvferry.tokens_pulled"
ATTR_TOKENS_RECOMPUTED = "kvferry.tokens_recomputed"
ATTR_PREFILL_ENGINE = "kvferry.prefill_engine"
ATTR_DECODE_ENGINE = "kvferry.decode_engine"
ATTR_CONVERSATION = "kvferry.conversation"
ATTR_TURN = "kvferry.turn"

# Health checks and reflection would fill traces with probe noise.
DEFAULT_UNTRACED_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

# gRPC codes that mark a server span as failed (OpenTelemetry RPC semantic conventions).
_SERVER_ERROR_CODES = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)


def setup_tracing(
    service_name: str,
    otlp_endpoint: str | None,
    exporter: SpanExporter | None = None,
    *,
    otlp_insecure: bool | None = None,
) -> trace.TracerProvider:
    """The tracer provider for one service: off (a no-op provider) unless configured.

    ``otlp_endpoint`` (``host:port`` or ``http(s)://host:port`` of an OTLP/gRPC collector) exports in
    batches; ``exporter`` (e.g. ``InMemorySpanExporter`` in tests) exports each span as it ends. A no-op
    provider records nothing but still hands incoming trace context to outgoing calls. Call
    :func:`shutdown_tracing` on exit to flush.
    """
    if not otlp_endpoint and exporter is None:  # None or "" (an empty environment variable): off
        return trace.NoOpTracerProvider()
    provider = SdkTracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    if otlp_endpoint:
        # Imported here: the OTLP exporter pulls in its own gRPC stubs, unneeded when tracing is off.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        insecure = otlp_insecure if otlp_insecure is not None else not otlp_endpoint.startswith("https://")
        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint, insecure=insecure))
        )
    return provider


def shutdown_tracing(provider: trace.TracerProvider) -> None:
    """Flushes and stops an SDK provider (blocking: run it in a thread from async code); no-op otherwise."""
    if isinstance(provider, SdkTracerProvider):
        provider.shutdown()


def add_telemetry_arguments(parser: argparse.ArgumentParser) -> None:
    """The same ``--metrics-address`` / ``--otlp-endpoint`` flags on every service CLI."""
    group = parser.add_argument_group("telemetry")
    group.add_argument(
        "--metrics-address",
        default=os.environ.get("KVFERRY_METRICS_ADDRESS"),
        help="host:port to serve Prometheus /metrics on (port 0: any free port); off when unset "
        "[env KVFERRY_METRICS_ADDRESS]",
    )
    group.add_argument(
        "--otlp-endpoint",
        default=os.environ.get("KVFERRY_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
        help="OTLP/gRPC collector for traces (host:port or http(s)://host:port); tracing is off when unset "
        "[env KVFERRY_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_ENDPOINT]",
    )


def set_turn_attributes(span: Span, summary: router_service_pb2.TurnSummary) -> None:
    """Puts a finished turn's reuse decision, token split and engines on the turn span."""
    span.set_attributes(
        {
            ATTR_REUSE_DECISION: reuse_label(summary.reuse),
            ATTR_TOKENS_PULLED: summary.pulled_tokens,
            ATTR_TOKENS_RECOMPUTED: summary.recomputed_tokens,
            ATTR_PREFILL_ENGINE: summary.prefill_engine_id,
            ATTR_DECODE_ENGINE: summary.decode_engine_id,
            ATTR_TURN: summary.turn,
        }
    )


def trace_headers(context: otel_context.Context | None = None) -> dict[str, str]:
    """W3C trace headers (``traceparent``, ``tracestate``) for the current (or given) context."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return carrier


async def _inject_into_httpx_request(request: httpx.Request) -> None:
    # Event hooks run in the caller's task, so the current span is the caller's.
    propagate.inject(request.headers)


def httpx_trace_hooks() -> dict[str, list[Callable[[httpx.Request], Awaitable[None]]]]:
    """``httpx.AsyncClient(event_hooks=httpx_trace_hooks())`` adds trace headers to every request."""
    return {"request": [_inject_into_httpx_request]}


def _split_method(full_method: str) -> tuple[str, str]:
    # "/kvferry.v1.RegistryService/GetRetention" -> ("kvferry.v1.RegistryService", "GetRetention")
    service, _, method = full_method.lstrip("/").partition("/")
    return service, method


def _rpc_attributes(full_method: str) -> dict[str, str]:
    service, method = _split_method(full_method)
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}


def _as_str(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class TracingServerInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Opens a SERVER span per RPC, parented on the W3C context in the request metadata.

    The span is the current span while the handler runs, so the handler's own spans and outgoing
    calls nest under it. With ``metrics`` it also records ``kvferry_rpc_server_seconds``.
    """

    def __init__(
        self,
        tracer_provider: trace.TracerProvider,
        *,
        metrics: Metrics | None = None,
        untraced_method_prefixes: Iterable[str] = DEFAULT_UNTRACED_METHOD_PREFIXES,
    ) -> None:
        self._tracer = tracer_provider.get_tracer("kvferry.grpc.server")
        self._metrics = metrics
        self._untraced = tuple(untraced_method_prefixes)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        full_method: str = handler_call_details.method
        if handler is None or full_method.startswith(self._untraced):
            return handler
        carrier = {_as_str(k): _as_str(v) for k, v in (handler_call_details.invocation_metadata or ())}
        parent = propagate.extract(carrier)
        call = _ServerCall(self._tracer, self._metrics, full_method, parent)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                call.wrap(handler.unary_unary), handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                call.wrap(handler.unary_stream), handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                call.wrap(handler.stream_unary), handler.request_deserializer, handler.response_serializer
            )
        return grpc.stream_stream_rpc_method_handler(
            call.wrap(handler.stream_stream), handler.request_deserializer, handler.response_serializer
        )


@dataclass
class _ServerCall:
    tracer: trace.Tracer
    metrics: Metrics | None
    full_method: str
    parent: otel_context.Context
    started: float = field(default=0.0, init=False)

    def wrap(self, behavior: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behavior):

            async def stream_wrapper(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                span = self._start()
                # Closed here however the call ends, not left to garbage collection: the handler's
                # cleanup (aborting its engine requests) must not wait for a collector pass.
                async with contextlib.aclosing(behavior(request, context)) as responses:
                    try:
                        while True:
                            # Current only while the handler runs: the context is attached and detached
                            # within one step, so it never leaks into the server's code between messages.
                            token = otel_context.attach(trace.set_span_in_context(span, self.parent))
                            try:
                                response = await responses.__anext__()
                            except StopAsyncIteration:
                                break
                            finally:
                                otel_context.detach(token)
                            yield response
                    except BaseException as exc:
                        self._finish(span, context, exc)
                        raise
                    self._finish(span, context, None)

            return stream_wrapper

        async def unary_wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
            span = self._start()
            try:
                with trace.use_span(
                    span, end_on_exit=False, record_exception=False, set_status_on_exception=False
                ):
                    result = behavior(request, context)
                    if inspect.isawaitable(result):
                        result = await result
            except BaseException as exc:
                self._finish(span, context, exc)
                raise
            self._finish(span, context, None)
            return result

        return unary_wrapper

    def _start(self) -> Span:
        self.started = time.perf_counter()
        service, method = _split_method(self.full_method)
        return self.tracer.start_span(
            f"{service}/{method}",
            context=self.parent,
            kind=SpanKind.SERVER,
            attributes=_rpc_attributes(self.full_method),
        )

    def _finish(self, span: Span, context: grpc.aio.ServicerContext, exc: BaseException | None) -> None:
        code = _server_code(context, exc)
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code in _SERVER_ERROR_CODES:
            details = context.details() if exc is None or isinstance(exc, grpc.aio.AbortError) else repr(exc)
            span.set_status(Status(StatusCode.ERROR, _as_str(details) if details else code.name))
            if exc is not None and not isinstance(exc, grpc.aio.AbortError):
                span.record_exception(exc)
        span.end()
        if self.metrics is not None:
            service, method = _split_method(self.full_method)
            self.metrics.rpc_server_seconds.labels(service=service, method=method, code=code.name).observe(
                time.perf_counter() - self.started
            )


def _server_code(context: grpc.aio.ServicerContext, exc: BaseException | None) -> grpc.StatusCode:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(code, int):
        return next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    if exc is None:
        return grpc.StatusCode.OK
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


class _TracingClientInterceptorBase:
    """Opens a CLIENT span per call and writes its W3C context into the call's metadata.

    The interceptor runs in a task that copied the caller's context, so the caller's current span is
    the parent. The span ends when the call is done (done callback), which for streaming calls is after
    the last message, without wrapping the call object the caller gets.
    """

    def __init__(self, tracer_provider: trace.TracerProvider) -> None:
        self._tracer = tracer_provider.get_tracer("kvferry.grpc.client")
        self._pending: set[asyncio.Task[None]] = set()

    async def _intercept(
        self, continuation: Callable[..., Awaitable[Any]], details: Any, request: Any
    ) -> Any:
        full_method = _as_str(details.method)
        service, method = _split_method(full_method)
        span = self._tracer.start_span(
            f"{service}/{method}", kind=SpanKind.CLIENT, attributes=_rpc_attributes(full_method)
        )
        metadata = grpc.aio.Metadata(*(tuple(details.metadata) if details.metadata else ()))
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        for key, value in carrier.items():
            metadata[key] = value
        new_details = grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )
        try:
            call = await continuation(new_details, request)
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, repr(exc)))
            span.end()
            raise
        call.add_done_callback(lambda done: self._schedule_end(span, done))
        return call

    def _schedule_end(self, span: Span, call: Any) -> None:
        # The aio call's code() is a coroutine, so ending the span takes one more loop step.
        task = asyncio.get_running_loop().create_task(_end_client_span(span, call))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)


async def _end_client_span(span: Span, call: Any) -> None:
    try:
        code: grpc.StatusCode = await call.code()
        details = await call.details()
    except BaseException as exc:  # the call itself failed before it had a status
        code, details = grpc.StatusCode.UNKNOWN, repr(exc)
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code != grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details}" if details else code.name))
    span.end()


class _UnaryUnary(_TracingClientInterceptorBase, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await self._intercept(continuation, client_call_details, request)


class _UnaryStream(_TracingClientInterceptorBase, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await self._intercept(continuation, client_call_details, request)


class _StreamUnary(_TracingClientInterceptorBase, grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_unary(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        return await self._intercept(continuation, client_call_details, request_iterator)


class _StreamStream(_TracingClientInterceptorBase, grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_stream_stream(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        return await self._intercept(continuation, client_call_details, request_iterator)


def tracing_client_interceptors(tracer_provider: trace.TracerProvider) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for ``grpc.aio.insecure_channel(..., interceptors=...)`` (or secure_channel): one
    CLIENT span per call, trace context in metadata, for all four call shapes."""
    return [
        _UnaryUnary(tracer_provider),
        _UnaryStream(tracer_provider),
        _StreamUnary(tracer_provider),
        _StreamStream(tracer_provider),
    ]


def extract_context(metadata: Mapping[str, str]) -> otel_context.Context:
    """The trace context carried in a metadata/header mapping (for code outside the interceptors)."""
    return propagate.extract(dict(metadata))
