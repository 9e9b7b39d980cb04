"""The picker's Prometheus series (docs/gateway.md), in one ``CollectorRegistry`` per picker."""

from __future__ import annotations

from kvferry.picker.pick import PickReason
from prometheus_client import CollectorRegistry, Counter, Histogram


class PickerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.picks = Counter(
            "kvferry_picker_picks_total",
            "Requests routed, by why the decode engine was chosen (retained: it holds the conversation's KV)",
            ["reason"],
            registry=self.registry,
        )
        self.refusals = Counter(
            "kvferry_picker_refusals_total",
            "Requests answered by the picker itself (an immediate response), by HTTP status",
            ["status"],
            registry=self.registry,
        )
        self.pick_seconds = Histogram(
            "kvferry_picker_pick_seconds",
            "Time to pick, from the whole request (registry lookup included)",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=self.registry,
        )
        for reason in PickReason:
            self.picks.labels(reason.value)

    def picked(self, reason: PickReason, seconds: float) -> None:
        self.picks.labels(reason.value).inc()
        self.pick_seconds.observe(seconds)

    def refused(self, status: int) -> None:
        self.refusals.labels(str(status)).inc()
