"""The router's traces and metrics (kvferry.common.telemetry): one ``kvferry.turn`` span per turn,
parent of its registry calls and engine HTTP calls, and the turn counters. A no-op by default."""

from __future__ import annotations

from kvferry.common import telemetry
from kvferry.v1 import router_service_pb2 as router_pb2
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode


class TurnTelemetry:
    def __init__(
        self,
        provider: trace.TracerProvider | None = None,
        metrics: telemetry.Metrics | None = None,
    ) -> None:
        self._tracer = (provider or trace.NoOpTracerProvider()).get_tracer("kvferry.router")
        self.metrics = metrics

    def start_turn(self, conversation_id: str | None) -> Span:
        return self._tracer.start_span(
            "kvferry.turn",
            kind=SpanKind.INTERNAL,
            attributes={telemetry.ATTR_CONVERSATION: conversation_id} if conversation_id else None,
        )

    def turn_done(self, span: Span, summary: router_pb2.TurnSummary, *, looked_up: bool, hit: bool) -> None:
        telemetry.set_turn_attributes(span, summary)
        if self.metrics is not None:
            self.metrics.record_turn(summary)
            if looked_up:
                self.metrics.record_lookup(hit=hit)

    @staticmethod
    def turn_failed(span: Span, error: BaseException) -> None:
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, str(error)[:200]))

    def registry_error(self, op: str) -> None:
        if self.metrics is not None:
            self.metrics.registry_errors.labels(op=op).inc()
