"""The sidecar's configuration as plain dataclasses; ``cli`` fills them from flags and environment."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.runtime.tls import TlsFiles
from kvferry.sidecar.engine import EngineMonitorSettings
from kvferry.sidecar.registration import EngineIdentity, RegistrationSettings
from kvferry.sidecar.releases import FanoutSettings


@dataclass(frozen=True)
class SidecarConfig:
    identity: EngineIdentity
    # host:port of the registry's gRPC API.
    registry_address: str
    # Where the connector reaches the sidecar: ``unix:/path`` or ``127.0.0.1:port`` (port 0 picks one).
    listen: str
    registration: RegistrationSettings = field(default_factory=RegistrationSettings)
    monitor: EngineMonitorSettings = field(default_factory=EngineMonitorSettings)
    fanout: FanoutSettings = field(default_factory=FanoutSettings)
    # Deadline of each unary registry call.
    registry_timeout_seconds: float = 5.0
    # Deadline of each HTTP call to the engine.
    engine_timeout_seconds: float = 5.0
    # host:port for Prometheus /metrics (port 0 picks one); None serves none.
    metrics_address: str | None = None
    # OTLP/gRPC collector for traces; None turns tracing off.
    otlp_endpoint: str | None = None
    # Seconds in-flight connector calls get to finish on shutdown.
    shutdown_grace_seconds: float = 2.0
    # Mutual TLS to the registry (its certificate names this engine: engine:<engine-id>); None: plaintext.
    registry_tls: TlsFiles | None = None
