"""Traces for every service: a tracer provider (off unless configured) and the gRPC interceptors.

:func:`setup_tracing` returns a ``TracerProvider`` that is a no-op unless an OTLP endpoint (or, in
tests, an exporter) is given; a no-op provider still passes incoming trace context through.
:class:`TracingServerInterceptor` and :func:`tracing_client_interceptors` open one span per gRPC call
and carry W3C trace context in gRPC metadata; :func:`trace_headers` gives the same context for an HTTP
call. Nothing here sets the OpenTelemetry globals: the composition root passes the provider to what
needs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from prometheus_client import Histogram

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
) -> trace.TracerProvider:
    """The tracer provider for one service: off (a no-op provider) unless configured.

    ``otlp_endpoint`` (``host:port`` or ``http(s)://host:port`` of an OTLP/gRPC collector; TLS only
    for ``https://``) exports in batches; ``exporter`` (e.g. ``InMemorySpanExporter`` in tests) exports
    each span as it ends. A no-op provider records nothing but still hands incoming trace context to
    outgoing calls. Call :func:`shutdown_tracing` on exit to flush.
    """
    if not otlp_endpoint and exporter is None:  # None or "" (an empty environment variable): off
        return trace.NoOpTracerProvider()
    provider = SdkTracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    if otlp_endpoint:
        # Imported here: the OTLP exporter pulls in its own gRPC stubs, unneeded when tracing is off.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        insecure = not otlp_endpoint.startswith("https://")
        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint, insecure=insecure))
        )
    return provider


def shutdown_tracing(provider: trace.TracerProvider) -> None:
    """Flushes and stops an SDK provider (blocking: run it in a thread from async code); no-op otherwise."""
    if isinstance(provider, SdkTracerProvider):
        provider.shutdown()


def trace_headers() -> dict[str, str]:
    """W3C trace headers (``traceparent``, ``tracestate``) of the current span, for an HTTP call."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


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
    calls nest under it. With ``rpc_seconds`` (``kvferry.runtime.metrics.rpc_server_histogram``) it also
    records each call's duration by service, method and status code.
    """

    def __init__(
        self,
        tracer_provider: trace.TracerProvider,
        *,
        rpc_seconds: Histogram | None = None,
        untraced_method_prefixes: Iterable[str] = DEFAULT_UNTRACED_METHOD_PREFIXES,
    ) -> None:
        self._tracer = tracer_provider.get_tracer("kvferry.grpc.server")
        self._rpc_seconds = rpc_seconds
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
        call = _ServerCall(self._tracer, self._rpc_seconds, full_method, parent)
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
    rpc_seconds: Histogram | None
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
        if self.rpc_seconds is not None:
            service, method = _split_method(self.full_method)
            self.rpc_seconds.labels(service=service, method=method, code=code.name).observe(
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
