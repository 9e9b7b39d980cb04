"""The sidecar's Prometheus series: the ``kvferry_*`` ones it shares with other services (see
docs/observability.md) plus its own ``kvferry_sidecar_*``, all in one registry per sidecar (tests run
several in one process)."""

from __future__ import annotations

from kvferry.runtime.metrics import (
    LEASE_ENGINE,
    lease_renewals_counter,
    registry_errors_counter,
    release_reason_label,
    releases_counter,
    rpc_server_histogram,
)
from kvferry.v1 import resources_pb2
from prometheus_client import CollectorRegistry, Counter, Gauge


class SidecarMetrics:
    def __init__(self, engine_id: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self._engine_id = engine_id
        self.retained_blocks = Gauge(
            "kvferry_retained_blocks", "KV blocks an engine holds for retentions.", ["engine"], registry=r
        )
        self.releases = releases_counter(r)
        self.lease_renewals = lease_renewals_counter(r)
        self.registry_errors = registry_errors_counter(r)
        self.rpc_seconds = rpc_server_histogram(r)
        self.retentions = Gauge(
            "kvferry_sidecar_retentions",
            "Live retentions of this engine, as the sidecar knows them.",
            registry=r,
        )
        self.publishes = Counter(
            "kvferry_sidecar_publishes", "Retentions published to the registry.", registry=r
        )
        self.publish_failures = Counter(
            "kvferry_sidecar_publish_failures",
            "ReportRetention calls that could not publish, by the gRPC code returned to the connector.",
            ["code"],
            registry=r,
        )
        self.evictions = Counter(
            "kvferry_sidecar_evictions", "EvictRetention calls from the connector's budget.", registry=r
        )
        self.heartbeat_failures = Counter(
            "kvferry_sidecar_heartbeat_failures", "Engine heartbeats that failed.", registry=r
        )
        self.registrations = Counter(
            "kvferry_sidecar_registrations",
            "Times the engine was registered, the first included.",
            registry=r,
        )
        self.reregistrations = Counter(
            "kvferry_sidecar_reregistrations",
            "Registrations after a lost lease, a registry restart or an engine restart.",
            registry=r,
        )
        self.last_heartbeat = Gauge(
            "kvferry_sidecar_last_heartbeat_timestamp_seconds",
            "Wall-clock time of the last accepted heartbeat or registration.",
            registry=r,
        )
        self.engine_up = Gauge("kvferry_sidecar_engine_up", "1 while the engine answers /health.", registry=r)
        self.registry_up = Gauge(
            "kvferry_sidecar_registry_up",
            "1 while the engine is registered and heartbeats succeed.",
            registry=r,
        )
        self.watch_reconnects = Counter(
            "kvferry_sidecar_watch_reconnects",
            "Times the registry WatchRetentions stream was opened.",
            registry=r,
        )
        self.release_subscribers = Gauge(
            "kvferry_sidecar_release_subscribers", "Open WatchReleases streams from connectors.", registry=r
        )
        self.fenced_pulls = Counter(
            "kvferry_sidecar_fenced_pulls",
            "Pulls of a retention the engine dropped and recomputed because the holder's block "
            "generations had changed (pull-time fencing), from the engine's stats.",
            registry=r,
        )
        self._fenced_pulls_seen = 0

    def heartbeat(self) -> None:
        self.lease_renewals.labels(kind=LEASE_ENGINE).inc()

    def release(self, reason: resources_pb2.ReleaseReason.ValueType) -> None:
        self.releases.labels(reason=release_reason_label(reason)).inc()

    def registry_error(self, op: str) -> None:
        self.registry_errors.labels(op=op).inc()

    def engine_stats(self, stats: resources_pb2.EngineStats) -> None:
        """The engine's own totals, as its connector reports them (a lower total: the engine restarted)."""
        total = int(stats.fenced_pulls_total)
        since_last = total - self._fenced_pulls_seen if total >= self._fenced_pulls_seen else total
        if since_last:
            self.fenced_pulls.inc(since_last)
        self._fenced_pulls_seen = total

    def set_retained(self, retentions: int, blocks: int) -> None:
        self.retentions.set(retentions)
        self.retained_blocks.labels(engine=self._engine_id).set(blocks)
