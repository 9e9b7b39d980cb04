"""The router's Prometheus series (docs/observability.md), in one ``CollectorRegistry`` per router."""

from __future__ import annotations

from kvferry.runtime.metrics import registry_errors_counter, rpc_server_histogram
from kvferry.v1 import router_service_pb2
from prometheus_client import CollectorRegistry, Counter, Histogram

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


def reuse_label(decision: router_service_pb2.ReuseDecision.ValueType) -> str:
    """``REUSE_DECISION_PULL`` -> ``pull``: the label value for a ``ReuseDecision``."""
    return router_service_pb2.ReuseDecision.Name(decision).removeprefix("REUSE_DECISION_").lower()


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.turns = Counter("kvferry_turns", "Finished turns, by reuse decision.", ["reuse"], registry=r)
        self.ttft_seconds = Histogram(
            "kvferry_ttft_seconds",
            "Time to first token seen by the router, by reuse decision.",
            ["reuse"],
            buckets=TTFT_BUCKETS_SECONDS,
            registry=r,
        )
        self.reuse_lookups = Counter(
            "kvferry_reuse_lookups", "Retention lookups for follow-up turns.", registry=r
        )
        self.reuse_hits = Counter(
            "kvferry_reuse_hits",
            "Lookups that found a usable retention (hit rate = hits / lookups).",
            registry=r,
        )
        self.retention_lookups = Counter(
            "kvferry_retention_lookups",
            "Turns' retention lookups by where they were answered: index (the router's retention index), "
            "else the registry because the index missed, was not synced, is off, or a recheck was needed "
            "(registry).",
            ["path"],
            registry=r,
        )
        self.tokens_pulled = Counter(
            "kvferry_tokens_pulled", "Prompt tokens whose KV was pulled from a retention.", registry=r
        )
        self.tokens_recomputed = Counter(
            "kvferry_tokens_recomputed", "Prompt tokens computed by prefill.", registry=r
        )
        self.registry_errors = registry_errors_counter(r)
        self.rpc_seconds = rpc_server_histogram(r)
        # The closed label set starts at zero so rates and ratios exist before the first turn.
        for decision in router_service_pb2.ReuseDecision.values():
            if decision != router_service_pb2.REUSE_DECISION_UNSPECIFIED:
                self.turns.labels(reuse=reuse_label(decision))
        for path in ("index", "miss", "not_synced", "off", "registry"):
            self.retention_lookups.labels(path=path)

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
