"""The router's traces and metrics: one ``kvferry.turn`` span per turn, parent of its registry calls and
engine HTTP calls, and the turn counters (``RouterMetrics``). A no-op by default."""

from __future__ import annotations

from kvferry.router.metrics import RouterMetrics, reuse_label
from kvferry.v1 import router_service_pb2 as router_pb2
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

TURN_SPAN_NAME = "kvferry.turn"
# Attributes of the turn span (docs/observability.md).
ATTR_REUSE_DECISION = "kvferry.reuse_decision"
ATTR_TOKENS_PULLED = "kvferry.tokens_pulled"
ATTR_TOKENS_RECOMPUTED = "kvferry.tokens_recomputed"
ATTR_PREFILL_ENGINE = "kvferry.prefill_engine"
ATTR_DECODE_ENGINE = "kvferry.decode_engine"
ATTR_CONVERSATION = "kvferry.conversation"
ATTR_TURN = "kvferry.turn"


def set_turn_attributes(span: Span, summary: router_pb2.TurnSummary) -> None:
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


class TurnTelemetry:
    def __init__(
        self,
        provider: trace.TracerProvider | None = None,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self._tracer = (provider or trace.NoOpTracerProvider()).get_tracer("kvferry.router")
        self.metrics = metrics

    def start_turn(self, conversation_id: str | None) -> Span:
        return self._tracer.start_span(
            TURN_SPAN_NAME,
            kind=SpanKind.INTERNAL,
            attributes={ATTR_CONVERSATION: conversation_id} if conversation_id else None,
        )

    def turn_done(self, span: Span, summary: router_pb2.TurnSummary, *, looked_up: bool, hit: bool) -> None:
        set_turn_attributes(span, summary)
        if self.metrics is not None:
            self.metrics.record_turn(summary)
            if looked_up:
                self.metrics.record_lookup(hit=hit)

    @staticmethod
    def turn_failed(span: Span, error: BaseException) -> None:
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, str(error)[:200]))

    def retention_lookup(self, path: str) -> None:
        """One retention lookup of a turn, by where it was answered (``retention_index.LookupPath``)."""
        if self.metrics is not None:
            self.metrics.retention_lookups.labels(path=path).inc()

    def registry_error(self, op: str) -> None:
        if self.metrics is not None:
            self.metrics.registry_errors.labels(op=op).inc()
