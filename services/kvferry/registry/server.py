"""The registry's composition root: builds every object, starts the gRPC server and background tasks.

``create_registry`` is for in-process use (tests, ``kvferry up``, benchmarks);
``serve`` runs one until SIGINT/SIGTERM (``kvferry registry``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import logging
import signal
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2
from kvferry.common import telemetry
from kvferry.common.grpc_server import start_server
from kvferry.registry.config import RegistryConfig
from kvferry.registry.engines import EngineStore
from kvferry.registry.epochs import EpochKeeper
from kvferry.registry.errors import EtcdUnavailable
from kvferry.registry.etcd import EtcdGateway, EtcdSettings, prefix_end
from kvferry.registry.events import RetentionEventHub
from kvferry.registry.keys import KeyLayout
from kvferry.registry.metrics import RegistryMetrics
from kvferry.registry.reaper import EngineReaper
from kvferry.registry.retentions import RetentionStore
from kvferry.registry.service import RegistryServicer
from kvferry.runtime.clock import Clock, SystemClock
from kvferry.runtime.errors import ServiceError
from kvferry.v1 import registry_service_pb2 as registry
from kvferry.v1 import registry_service_pb2_grpc as registry_grpc
from opentelemetry import trace

log = logging.getLogger(__name__)

SERVICE_NAME = registry.DESCRIPTOR.services_by_name["RegistryService"].full_name
_HEALTH_PROBE_SECONDS = 2.0
# The live engines / retentions gauges: two count-only reads per refresh.
_LIVE_COUNT_SECONDS = 5.0


@dataclass
class Registry:
    """A running registry: its address, its stores (for in-process callers), and how to stop it."""

    server: grpc.aio.Server
    port: int
    host: str
    engines: EngineStore
    retentions: RetentionStore
    reaper: EngineReaper
    hub: RetentionEventHub
    etcd: EtcdGateway
    health: health.aio.HealthServicer
    metrics: RegistryMetrics
    tracer_provider: trace.TracerProvider
    # Serving /metrics when ``metrics_address`` was configured.
    metrics_server: telemetry.MetricsServer | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    # Shut down (flushing spans) on stop only when create_registry built it.
    _owns_tracing: bool = False

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def metrics_port(self) -> int | None:
        return self.metrics_server.port if self.metrics_server is not None else None

    async def stop(self, grace_seconds: float = 1.0) -> None:
        await self.server.stop(grace_seconds)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.hub.close()
        await self.etcd.close()
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        if self._owns_tracing:
            await asyncio.to_thread(telemetry.shutdown_tracing, self.tracer_provider)


async def _probe_etcd(
    etcd: EtcdGateway, epochs: EpochKeeper, health_servicer: health.aio.HealthServicer
) -> None:
    """Reports NOT_SERVING while etcd does not answer, so load balancers route elsewhere.

    The probe is also how an idle registry notices etcd going back in time (the gateway checks
    every answer's revision), and it reads the epoch once etcd first answers.
    """
    serving: bool | None = None
    while True:
        try:
            await etcd.current_revision()
            ok = True
        except EtcdUnavailable:
            ok = False
        if ok and epochs.known is None:
            try:
                await epochs.load()
            except ServiceError as error:
                log.debug("epoch not read yet", extra={"error": str(error)})
        if ok != serving:
            status = (
                health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            await health_servicer.set("", status)
            await health_servicer.set(SERVICE_NAME, status)
            if serving is not None:
                log.warning(
                    "etcd reachable" if ok else "etcd unreachable", extra={"endpoints": etcd.endpoints_text}
                )
            serving = ok
        await asyncio.sleep(_HEALTH_PROBE_SECONDS)


async def _count_live(etcd: EtcdGateway, layout: KeyLayout, metrics: RegistryMetrics) -> None:
    """Keeps the live engines / retentions gauges current (count-only reads; etcd sends no records)."""
    while True:
        try:
            engines, retentions = await asyncio.gather(
                etcd.count(layout.engines, prefix_end(layout.engines)),
                etcd.count(layout.live_retentions, prefix_end(layout.live_retentions)),
            )
            metrics.set_live(engines, retentions)
        except ServiceError as error:
            log.debug("live counts not refreshed", extra={"error": str(error)})
        await asyncio.sleep(_LIVE_COUNT_SECONDS)


@dataclass
class HistoryCompactor:
    """Remembers (time, revision) marks and says which revision is older than the history kept."""

    keep_seconds: float
    marks: collections.deque[tuple[float, int]] = field(default_factory=collections.deque)

    def observe(self, now: float, revision: int) -> int | None:
        """Records a mark; returns the revision to compact up to, if one is due."""
        self.marks.append((now, revision))
        target = None
        while self.marks and self.marks[0][0] <= now - self.keep_seconds:
            target = self.marks.popleft()[1]
        return target


async def _compact_history(etcd: EtcdGateway, keep_seconds: int) -> None:
    compactor = HistoryCompactor(keep_seconds)
    interval = max(1.0, keep_seconds / 10)
    while True:
        await asyncio.sleep(interval)
        try:
            target = compactor.observe(time.monotonic(), await etcd.current_revision())
            if target is not None:
                await etcd.compact(target)
                log.debug("etcd history compacted", extra={"revision": target})
        except ServiceError as error:
            log.warning("etcd compaction skipped", extra={"error": str(error)})


async def create_registry(
    config: RegistryConfig,
    *,
    clock: Clock | None = None,
    metrics: RegistryMetrics | None = None,
    tracer_provider: trace.TracerProvider | None = None,
) -> Registry:
    """Starts a registry on ``config.listen_address`` (``host:0`` picks a free port).

    It does not wait for etcd: calls fail with UNAVAILABLE until etcd answers. ``metrics`` and
    ``tracer_provider`` (tests inject an in-memory exporter) default to fresh ones built from
    ``config`` (``metrics_address``, ``otlp_endpoint``).
    """
    metrics = metrics if metrics is not None else RegistryMetrics()
    clock = clock if clock is not None else SystemClock()
    owns_tracing = tracer_provider is None
    provider = (
        tracer_provider
        if tracer_provider is not None
        else telemetry.setup_tracing("kvferry-registry", config.otlp_endpoint)
    )
    etcd = EtcdGateway(
        EtcdSettings(endpoints=config.etcd_endpoints, timeout_seconds=config.etcd_timeout_seconds),
        on_error=metrics.etcd_error,
    )
    await etcd.connect()
    layout = KeyLayout(config.key_prefix)
    epochs = EpochKeeper(etcd, layout, metrics=metrics)
    etcd.on_rewind = epochs.on_rewind
    reaper = EngineReaper(etcd, layout, clock=clock, metrics=metrics)
    engines = EngineStore(etcd, layout, config.ttl, reaper, epochs=epochs, clock=clock, metrics=metrics)
    retentions = RetentionStore(etcd, layout, config.ttl, clock=clock, metrics=metrics)
    hub = RetentionEventHub(etcd, layout, clock, metrics=metrics)
    servicer = RegistryServicer(engines, retentions, hub)
    metrics_server: telemetry.MetricsServer | None = None
    server: grpc.aio.Server | None = None
    try:
        if config.metrics_address is not None:
            metrics_server = await telemetry.serve_metrics(metrics.registry, config.metrics_address)
        server, port, health_servicer = await start_server(
            config.listen_address,
            [(registry_grpc.add_RegistryServiceServicer_to_server, servicer, SERVICE_NAME)],
            interceptors=[telemetry.TracingServerInterceptor(provider, metrics=metrics.shared)],
        )
    except BaseException:
        # Whatever started before the failure (a port taken, say) must not outlive it.
        if server is not None:
            await server.stop(None)
        if metrics_server is not None:
            await metrics_server.stop()
        await etcd.close()
        if owns_tracing:
            await asyncio.to_thread(telemetry.shutdown_tracing, provider)
        raise
    host = config.listen_address.rpartition(":")[0] or "127.0.0.1"
    tasks = [
        asyncio.create_task(reaper.run(), name="registry-reaper"),
        asyncio.create_task(_probe_etcd(etcd, epochs, health_servicer), name="registry-etcd-probe"),
        asyncio.create_task(_count_live(etcd, layout, metrics), name="registry-live-counts"),
    ]
    if config.history_seconds:
        tasks.append(
            asyncio.create_task(_compact_history(etcd, config.history_seconds), name="registry-compactor")
        )
    log.info(
        "registry serving",
        extra={
            "address": f"{host}:{port}",
            "etcd": etcd.endpoints_text,
            "key_prefix": config.key_prefix,
            "metrics_port": metrics_server.port if metrics_server is not None else None,
            "tracing": bool(config.otlp_endpoint) or not owns_tracing,
        },
    )
    return Registry(
        server,
        port,
        host,
        engines,
        retentions,
        reaper,
        hub,
        etcd,
        health_servicer,
        metrics,
        provider,
        metrics_server,
        tasks,
        owns_tracing,
    )


async def serve(config: RegistryConfig) -> None:
    """Runs a registry until SIGINT or SIGTERM, then stops gracefully."""
    running = await create_registry(config)
    # Everything built so far lives as long as the process: keeping it out of the cyclic
    # collector's full passes cut their pauses from ~15 ms to under 1 ms (lookup p99).
    gc.collect()
    gc.freeze()
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stopping.set)
    try:
        await stopping.wait()
    finally:
        log.info("registry stopping")
        await running.stop(grace_seconds=2.0)
