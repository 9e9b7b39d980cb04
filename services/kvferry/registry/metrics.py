"""The registry's Prometheus series (docs/observability.md), in one ``CollectorRegistry`` per registry
(tests run several in one process).

Counting rules that keep sums across registry replicas exact:

- releases are counted by the replica whose etcd transaction ended the retention (RELEASED, EVICTED,
  SUPERSEDED, ENGINE_GONE: every ending is one guarded transaction that only one replica wins);
- EXPIRED has no such transaction (etcd ends the lease): it is counted by the replica that reports the
  ending to the engine's watcher (a sidecar holds one WatchRetentions stream, on one replica);
- the live gauges count what etcd holds, so every replica reports the same cluster-wide figure.
"""

from __future__ import annotations

from kvferry.runtime.metrics import (
    LEASE_TURN,
    lease_renewals_counter,
    release_reason_label,
    releases_counter,
    rpc_server_histogram,
)
from kvferry.v1 import resources_pb2 as resources
from prometheus_client import CollectorRegistry, Counter, Gauge

# The etcd calls the gateway makes, as ``op`` labels of kvferry_etcd_errors_total (etcd's RPC names).
ETCD_OPS = (
    "range",
    "txn",
    "compact",
    "lease_grant",
    "lease_revoke",
    "lease_keepalive",
    "lease_time_to_live",
    "watch",
)


class RegistryMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.releases = releases_counter(r)
        self.lease_renewals = lease_renewals_counter(r)
        self.rpc_seconds = rpc_server_histogram(r)
        self.etcd_errors = Counter(
            "kvferry_etcd_errors", "Failed etcd operations, by operation.", ["op"], registry=r
        )
        self.live_engines = Gauge(
            "kvferry_registry_live_engines",
            "Engines registered in etcd (cluster-wide; refreshed every few seconds).",
            registry=r,
        )
        self.live_retentions = Gauge(
            "kvferry_registry_live_retentions",
            "Live retention records in etcd (cluster-wide; refreshed every few seconds).",
            registry=r,
        )
        self.turns_refused = Counter(
            "kvferry_registry_turns_refused",
            "BeginTurn calls refused because another turn of the conversation was in flight.",
            registry=r,
        )
        self.epochs_started = Counter(
            "kvferry_registry_epochs_started",
            "New epochs this registry started because etcd was found restored from an older snapshot.",
            registry=self.registry,
        )
        # Closed label sets start at zero so rates exist before the first event.
        for op in ETCD_OPS:
            self.etcd_errors.labels(op=op)
        self.lease_renewals.labels(kind=LEASE_TURN)

    def etcd_error(self, op: str) -> None:
        self.etcd_errors.labels(op=op).inc()

    def lease_renewed(self, kind: str) -> None:
        self.lease_renewals.labels(kind=kind).inc()

    def released(self, reason: resources.ReleaseReason.ValueType, count: int = 1) -> None:
        if count > 0:
            self.releases.labels(reason=release_reason_label(reason)).inc(count)

    def turn_refused(self) -> None:
        self.turns_refused.inc()

    def restore_detected(self) -> None:
        self.epochs_started.inc()

    def set_live(self, engines: int, retentions: int) -> None:
        self.live_engines.set(engines)
        self.live_retentions.set(retentions)
