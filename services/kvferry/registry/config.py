"""The registry's configuration: one dataclass, filled from flags or environment variables."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.runtime.tls import TlsFiles


@dataclass(frozen=True)
class TtlPolicy:
    """Lease lengths the registry grants, in seconds: a request's 0 takes the default."""

    default_engine_ttl_seconds: int = 10
    max_engine_ttl_seconds: int = 300
    default_retention_ttl_seconds: int = 300
    max_retention_ttl_seconds: int = 3600
    # A turn's mark (BeginTurn): short, so a router that dies frees its conversations soon.
    default_turn_ttl_seconds: int = 5
    max_turn_ttl_seconds: int = 60

    def __post_init__(self) -> None:
        for name in (
            "default_engine_ttl_seconds",
            "default_retention_ttl_seconds",
            "default_turn_ttl_seconds",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1 s")
        if self.default_engine_ttl_seconds > self.max_engine_ttl_seconds:
            raise ValueError("the default engine TTL exceeds the maximum engine TTL")
        if self.default_retention_ttl_seconds > self.max_retention_ttl_seconds:
            raise ValueError("the default retention TTL exceeds the maximum retention TTL")
        if self.default_turn_ttl_seconds > self.max_turn_ttl_seconds:
            raise ValueError("the default turn TTL exceeds the maximum turn TTL")


@dataclass(frozen=True)
class RegistryConfig:
    listen_address: str = "127.0.0.1:50051"
    etcd_endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    # Deadline of every single etcd call; past it the RPC fails with UNAVAILABLE.
    etcd_timeout_seconds: float = 2.0
    key_prefix: str = "/kvferry/"
    ttl: TtlPolicy = field(default_factory=TtlPolicy)
    log_level: str = "info"
    # etcd history kept for watches to resume after an outage; older revisions are compacted
    # (every publish, end and turn mark writes revisions: without compaction etcd fills its quota). 0: never.
    history_seconds: int = 600
    # Prometheus /metrics on this host:port (port 0: any free one); None: not served.
    metrics_address: str | None = None
    # OTLP/gRPC collector for traces; None: tracing off (incoming trace context is still passed on).
    otlp_endpoint: str | None = None
    # Mutual TLS on the gRPC port, with each caller's role checked (kvferry.registry.access); None:
    # plaintext, every caller served alike (the local stack).
    tls: TlsFiles | None = None
    # Mutual TLS to etcd (etcd's --client-cert-auth); None: plaintext.
    etcd_tls: TlsFiles | None = None
    # Concurrent streams (calls) one client connection may have open; more wait for one to end.
    max_concurrent_streams: int = 1000

    def __post_init__(self) -> None:
        if not self.etcd_endpoints:
            raise ValueError("at least one etcd endpoint is required (--etcd-endpoints)")
        if not self.key_prefix.endswith("/"):
            raise ValueError(f"key prefix {self.key_prefix!r} must end with '/'")
        if self.history_seconds < 0:
            raise ValueError("history seconds cannot be negative (0 turns compaction off)")
        if self.etcd_timeout_seconds <= 0:
            raise ValueError("the etcd timeout must be positive")
        if self.max_concurrent_streams < 1:
            raise ValueError("max concurrent streams must be at least 1")
