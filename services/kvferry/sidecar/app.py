"""The composition root: builds every part of one sidecar, runs its loops, serves its endpoints."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from grpc_health.v1 import health, health_pb2
from kvferry.runtime.clock import Clock, SystemClock
from kvferry.runtime.host import ServiceHost
from kvferry.runtime.tracing import TracingServerInterceptor, tracing_client_interceptors
from kvferry.sidecar.config import SidecarConfig
from kvferry.sidecar.engine import EngineMonitor, EngineProbe, HttpEngineProbe
from kvferry.sidecar.metrics import SidecarMetrics
from kvferry.sidecar.registration import EngineRegistration
from kvferry.sidecar.registry_link import GrpcRegistry, RegistryApi
from kvferry.sidecar.releases import ReleaseFanout, RetentionBook
from kvferry.sidecar.retentions import RetentionPublisher
from kvferry.sidecar.service import SERVICE_NAME, SidecarServicer
from kvferry.v1 import sidecar_service_pb2_grpc as sidecar_grpc

log = logging.getLogger("kvferry.sidecar")

# Health checking service names: the whole sidecar (""), its API, and each dependency on its own.
HEALTH_ENGINE = "kvferry.sidecar.engine"
HEALTH_REGISTRY = "kvferry.sidecar.registry"

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True)
class SidecarStatus:
    """A point-in-time view of one sidecar (tests, logs, ``kvferry up``)."""

    engine_id: str
    phase: str
    engine_state: str
    engine_last_ok_time: float | None
    registry_link_up: bool
    last_heartbeat_time: float | None
    registration_generation: int
    releases_in_sync: bool
    retentions: int
    retained_blocks: int
    release_subscribers: int


class Sidecar:
    """One sidecar, and its composition root. ``start()``, then ``stop()``; ``failed`` resolves if a loop
    dies (bad config)."""

    def __init__(
        self,
        config: SidecarConfig,
        *,
        registry: RegistryApi | None = None,
        probe: EngineProbe | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.config = config
        identity = config.identity
        # Everything this sidecar opens is closed by its host, in reverse order, on stop or on a failed
        # start alike.
        self.host = ServiceHost("sidecar", grace_seconds=config.shutdown_grace_seconds)
        self.metrics = SidecarMetrics(identity.engine_id)
        self._clock: Clock = clock or SystemClock()
        self._tracer_provider = self.host.setup_tracing("kvferry-sidecar", config.otlp_endpoint)
        if registry is None:
            grpc_registry = GrpcRegistry(
                config.registry_address,
                timeout_seconds=config.registry_timeout_seconds,
                interceptors=tracing_client_interceptors(self._tracer_provider),
                on_error=self.metrics.registry_error,
                tls=config.registry_tls,
            )
            self.host.on_stop("registry channel", grpc_registry.close)
            registry = grpc_registry
        if probe is None:
            http_probe = HttpEngineProbe(
                identity.http_endpoint, timeout_seconds=config.engine_timeout_seconds
            )
            self.host.on_stop("engine probe", http_probe.close)
            probe = http_probe
        self.registry: RegistryApi = registry
        self._probe: EngineProbe = probe
        self._health_dirty = asyncio.Event()
        self.monitor = EngineMonitor(self._probe, self._clock, config.monitor, on_change=self._engine_changed)
        self.book = RetentionBook(on_change=self._book_changed)
        self.registration = EngineRegistration(
            identity,
            self.registry,
            self.monitor,
            self._probe,
            self._clock,
            self.metrics,
            config.registration,
            on_change=self._health_dirty.set,
            on_deregistered=self._engine_gone,
        )
        if isinstance(self.registry, GrpcRegistry):
            self.registry.on_rewind = self.registration.rewound
        self.fanout = ReleaseFanout(
            identity.engine_id,
            self.registry,
            self.registration,
            self.book,
            self._clock,
            self.metrics,
            config.fanout,
        )
        self.publisher = RetentionPublisher(
            identity.engine_id, self.registry, self.registration, self.fanout, self.metrics
        )
        self._servicer = SidecarServicer(
            identity.engine_id, self.publisher, self.fanout, self.registration, self.metrics
        )
        self._health: health.aio.HealthServicer | None = None
        self.address = ""
        self.metrics_port: int | None = None

    @property
    def failed(self) -> asyncio.Future[BaseException]:
        """Resolves with the error when one of the sidecar's loops dies (a bad configuration)."""
        return self.host.failed

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        async with self.host.starting():
            listen = self.config.listen
            if listen.startswith("unix:"):
                _prepare_socket_path(Path(listen.removeprefix("unix:")))
            endpoint = await self.host.serve_grpc(
                listen,
                [(sidecar_grpc.add_SidecarServiceServicer_to_server, self._servicer, SERVICE_NAME)],
                interceptors=[
                    TracingServerInterceptor(self._tracer_provider, rpc_seconds=self.metrics.rpc_seconds)
                ],
            )
            self._health = endpoint.health
            self.address = (
                listen if listen.startswith("unix:") else f"{listen.rsplit(':', 1)[0]}:{endpoint.port}"
            )
            await self._apply_health()
            if self.config.metrics_address is not None:
                self.metrics_port = (
                    await self.host.serve_metrics(self.metrics.registry, self.config.metrics_address)
                ).port
            # Deregistering ends the engine's retentions (ENGINE_GONE); connectors hear it before their
            # streams close, which the server's graceful stop does next.
            self.host.on_stop("deregistration", self._deregister)
            self.host.spawn(self.monitor.run(), "engine-monitor")
            self.host.spawn(self.registration.run(), "registration")
            self.host.spawn(self.fanout.run(), "release-fanout")
            self.host.spawn(self.fanout.sweep_forever(), "release-sweep")
            self.host.spawn(self._health_loop(), "health")
        log.info(
            "sidecar serving",
            extra={
                "engine_id": self.config.identity.engine_id,
                "address": self.address,
                "registry": self.config.registry_address,
                "engine": self.config.identity.http_endpoint,
                "metrics_port": self.metrics_port,
            },
        )

    async def stop(self) -> None:
        """Clean shutdown: stop heartbeating, deregister the engine, end the streams, close. Idempotent."""
        await self.host.stop()
        log.info("sidecar stopped", extra={"engine_id": self.config.identity.engine_id})

    def status(self) -> SidecarStatus:
        return SidecarStatus(
            engine_id=self.config.identity.engine_id,
            phase=self.registration.phase.value,
            engine_state=self.monitor.state.value,
            engine_last_ok_time=self.monitor.last_ok_time,
            registry_link_up=self.registration.link_up,
            last_heartbeat_time=self.registration.last_heartbeat_time,
            registration_generation=self.registration.generation,
            releases_in_sync=self.fanout.synced,
            retentions=len(self.book),
            retained_blocks=self.book.retained_blocks,
            release_subscribers=self.fanout.subscriber_count,
        )

    # ---- internals -----------------------------------------------------------------------------

    async def _deregister(self) -> None:
        await self.registration.shutdown()
        self.fanout.close_all()

    def _engine_changed(self) -> None:
        self.metrics.engine_up.set(1 if self.monitor.reachable else 0)
        self.registration.poke()
        self._health_dirty.set()

    def _book_changed(self) -> None:
        self.metrics.set_retained(len(self.book), self.book.retained_blocks)

    def _engine_gone(self) -> None:
        self.fanout.engine_gone()

    async def _health_loop(self) -> None:
        while True:
            await self._health_dirty.wait()
            self._health_dirty.clear()
            await self._apply_health()

    async def _apply_health(self) -> None:
        if self._health is None:
            return
        engine_ok = self.monitor.reachable
        registry_ok = self.registration.registered and self.registration.link_up
        overall = _SERVING if engine_ok and registry_ok else _NOT_SERVING
        await self._health.set(HEALTH_ENGINE, _SERVING if engine_ok else _NOT_SERVING)
        await self._health.set(HEALTH_REGISTRY, _SERVING if registry_ok else _NOT_SERVING)
        await self._health.set("", overall)
        await self._health.set(SERVICE_NAME, overall)


def prepare_socket_dir(directory: Path, *, uid: int | None = None) -> None:
    """Makes ``directory`` a safe home for the connector's socket: created with mode 0700 (only this user
    reaches the socket; the connector runs as the same user), or, when it exists, refused (ValueError)
    unless it is a real directory owned by this user or by root. A directory another user created (say
    ``/tmp/kvferry`` on a shared host) would let that user replace the socket and take the connector's
    reports. A root-owned one is accepted: a Kubernetes emptyDir (only the pod's containers see it)."""
    me = os.geteuid() if uid is None else uid
    directory.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
        return
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(
            f"the sidecar's socket directory {directory} is not a directory (a symlink or a file); remove it "
            "or choose another --listen path"
        )
    if info.st_uid not in (me, 0):
        raise ValueError(
            f"the sidecar's socket directory {directory} belongs to uid {info.st_uid}, not to this user "
            f"(uid {me}): another user could replace the socket. Remove it, or choose a --listen path in a "
            "directory of your own"
        )


def _prepare_socket_path(path: Path) -> None:
    prepare_socket_dir(path.parent)
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.stat(path).st_mode):
            # A socket file left by a sidecar that did not stop cleanly.
            path.unlink()
