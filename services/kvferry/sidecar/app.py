"""The composition root: builds every part of one sidecar, runs its loops, serves its endpoints."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2
from kvferry.common import telemetry
from kvferry.common.grpc_server import start_server
from kvferry.runtime.clock import Clock, SystemClock
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
    """One sidecar. ``start()``, then ``stop()``; ``failed`` resolves if a loop dies (bad config)."""

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
        self.metrics = SidecarMetrics(identity.engine_id)
        self._clock: Clock = clock or SystemClock()
        self._tracer_provider = telemetry.setup_tracing("kvferry-sidecar", config.otlp_endpoint)
        self._owned_registry = GrpcRegistry(
            config.registry_address,
            timeout_seconds=config.registry_timeout_seconds,
            interceptors=telemetry.tracing_client_interceptors(self._tracer_provider),
            on_error=self.metrics.registry_error,
        )
        self._owned_probe = HttpEngineProbe(
            identity.http_endpoint, timeout_seconds=config.engine_timeout_seconds
        )
        self.registry: RegistryApi = registry or self._owned_registry
        self._probe: EngineProbe = probe or self._owned_probe
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
        self._servicer = SidecarServicer(identity.engine_id, self.publisher, self.fanout, self.registration)
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._metrics_server: telemetry.MetricsServer | None = None
        self.address = ""
        self.metrics_port: int | None = None
        self._stopped = False
        self.failed: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        listen = self.config.listen
        if listen.startswith("unix:"):
            _prepare_socket_path(Path(listen.removeprefix("unix:")))
        self._server, port, self._health = await start_server(
            listen,
            [(sidecar_grpc.add_SidecarServiceServicer_to_server, self._servicer, SERVICE_NAME)],
            interceptors=[
                telemetry.TracingServerInterceptor(self._tracer_provider, metrics=self.metrics.shared)
            ],
        )
        self.address = listen if listen.startswith("unix:") else f"{listen.rsplit(':', 1)[0]}:{port}"
        await self._apply_health()
        if self.config.metrics_address is not None:
            self._metrics_server = await telemetry.serve_metrics(
                self.metrics.registry, self.config.metrics_address
            )
            self.metrics_port = self._metrics_server.port
        self._spawn(self.monitor.run(), "engine-monitor")
        self._spawn(self.registration.run(), "registration")
        self._spawn(self.fanout.run(), "release-fanout")
        self._spawn(self.fanout.sweep_forever(), "release-sweep")
        self._spawn(self._health_loop(), "health")
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
        if self._stopped:
            return
        self._stopped = True
        background = list(self._tasks)
        self._tasks.clear()
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        # Deregistering ends the engine's retentions (ENGINE_GONE); connectors hear it before
        # their streams close.
        await self.registration.shutdown()
        self.fanout.close_all()
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(self.config.shutdown_grace_seconds)
        if self._metrics_server is not None:
            await self._metrics_server.stop()
        await self._owned_registry.close()
        await self._owned_probe.close()
        await asyncio.to_thread(telemetry.shutdown_tracing, self._tracer_provider)
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

    def _spawn(self, coro: Any, name: str) -> None:
        task: asyncio.Task[None] = asyncio.create_task(coro, name=f"kvferry-sidecar-{name}")
        task.add_done_callback(self._task_ended)
        self._tasks.append(task)

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        error = task.exception() or RuntimeError(f"{task.get_name()} ended unexpectedly")
        log.error("sidecar loop failed", extra={"task": task.get_name(), "error": str(error)})
        if not self.failed.done():
            self.failed.set_result(error)

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


def _prepare_socket_path(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.stat(path).st_mode):
            # A socket file left by a sidecar that did not stop cleanly.
            path.unlink()
