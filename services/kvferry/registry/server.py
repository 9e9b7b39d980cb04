"""The registry's composition root: builds every object, starts the gRPC server and background tasks.

``create_registry`` starts one in the running event loop (``kvferry registry``, tests, ``kvferry up``,
benchmarks); ``Registry.stop`` stops it gracefully.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import time
from dataclasses import dataclass, field

from grpc_health.v1 import health, health_pb2
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
from kvferry.registry.turns import TurnStore
from kvferry.runtime.clock import Clock, SystemClock
from kvferry.runtime.errors import ServiceError
from kvferry.runtime.host import ServiceHost
from kvferry.runtime.metrics import MetricsEndpoint
from kvferry.runtime.tls import server_credentials
from kvferry.runtime.tracing import TracingServerInterceptor
from kvferry.v1 import registry_service_pb2 as registry
from kvferry.v1 import registry_service_pb2_grpc as registry_grpc
from opentelemetry import trace

log = logging.getLogger(__name__)

SERVICE_NAME = registry.DESCRIPTOR.services_by_name["RegistryService"].full_name
_HEALTH_PROBE_SECONDS = 2.0
# The live engines / retentions gauges: two count-only reads per refresh.
_LIVE_COUNT_SECONDS = 5.0
# In-flight calls get this long to finish on stop.
_GRACE_SECONDS = 2.0


class Registry:
    """A running registry: its address, its stores (for in-process callers), and how to stop it."""

    def __init__(
        self,
        *,
        host: ServiceHost,
        address: str,
        etcd: EtcdGateway,
        engines: EngineStore,
        retentions: RetentionStore,
        turns: TurnStore,
        reaper: EngineReaper,
        metrics: RegistryMetrics,
        metrics_endpoint: MetricsEndpoint | None,
    ) -> None:
        self.host = host
        self.address = address
        self.etcd = etcd
        self.engines = engines
        self.retentions = retentions
        self.turns = turns
        self.reaper = reaper
        self.metrics = metrics
        self.metrics_endpoint = metrics_endpoint

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])

    @property
    def metrics_port(self) -> int | None:
        return self.metrics_endpoint.port if self.metrics_endpoint is not None else None

    async def stop(self, grace_seconds: float | None = None) -> None:
        """Stops serving (in-flight calls get ``grace_seconds``, 2 s by default), then closes."""
        await self.host.stop(grace_seconds)


async def etcd_health(etcd: EtcdGateway) -> str | None:
    """Why the registry cannot serve now (etcd unreachable, or out of space), or None when it can."""
    try:
        alarms = await etcd.alarms()
    except EtcdUnavailable as error:
        return f"etcd unreachable: {error}"
    except ServiceError as error:
        return f"etcd's alarms unreadable: {error}"
    if "NOSPACE" in alarms:
        return (
            f"etcd at {etcd.endpoints_text} is out of space (NOSPACE alarm) and refuses every write: "
            "free space (the registry compacts its history; defragment with etcdctl defrag) and disarm "
            "the alarm (etcdctl alarm disarm); the registry serves again by itself once it is disarmed"
        )
    return None


async def _probe_etcd(
    etcd: EtcdGateway, epochs: EpochKeeper, health_servicer: health.aio.HealthServicer
) -> None:
    """Reports NOT_SERVING while etcd does not answer or refuses writes for space (NOSPACE), so load
    balancers route elsewhere; SERVING again, by itself, once etcd answers and the alarm is gone.

    The probe is also how an idle registry notices etcd going back in time (the gateway checks
    every answer's revision), and it reads the epoch once etcd first answers.
    """
    serving: bool | None = None
    while True:
        problem: str | None
        try:
            await etcd.current_revision()
            problem = await etcd_health(etcd)
        except EtcdUnavailable as error:
            problem = f"etcd unreachable: {error}"
        ok = problem is None
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
            if serving is not None or not ok:
                log.warning(
                    "registry serving: etcd reachable and writable" if ok else "registry not serving",
                    extra={"endpoints": etcd.endpoints_text, "reason": problem},
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
    """Starts a registry on ``config.listen_address`` (``host:0`` picks a free port): the composition
    root, building every object. A start that fails half-way stops what it started.

    It does not wait for etcd: calls fail with UNAVAILABLE until etcd answers. ``metrics`` and
    ``tracer_provider`` (tests inject an in-memory exporter) default to fresh ones built from
    ``config`` (``metrics_address``, ``otlp_endpoint``).
    """
    clock = clock if clock is not None else SystemClock()
    metrics = metrics if metrics is not None else RegistryMetrics()
    host = ServiceHost("registry", grace_seconds=_GRACE_SECONDS)
    async with host.starting():
        if tracer_provider is None:
            tracer_provider = host.setup_tracing("kvferry-registry", config.otlp_endpoint)
        etcd = EtcdGateway(
            EtcdSettings(
                endpoints=config.etcd_endpoints,
                timeout_seconds=config.etcd_timeout_seconds,
                tls=config.etcd_tls,
            ),
            on_error=metrics.etcd_error,
        )
        await etcd.connect()
        host.on_stop("etcd client", etcd.close)
        layout = KeyLayout(config.key_prefix)
        epochs = EpochKeeper(etcd, layout, metrics=metrics)
        etcd.on_rewind = epochs.on_rewind
        reaper = EngineReaper(etcd, layout, clock=clock, metrics=metrics)
        engines = EngineStore(etcd, layout, config.ttl, reaper, epochs=epochs, clock=clock, metrics=metrics)
        retentions = RetentionStore(etcd, layout, config.ttl, clock=clock, metrics=metrics)
        turns = TurnStore(etcd, layout, config.ttl, records=retentions.cache, clock=clock, metrics=metrics)
        host.on_stop("turn store", turns.close)
        hub = RetentionEventHub(etcd, layout, clock, metrics=metrics)
        host.on_stop("retention event hub", hub.close)
        metrics_endpoint = (
            await host.serve_metrics(metrics.registry, config.metrics_address)
            if config.metrics_address is not None
            else None
        )
        servicer = RegistryServicer(engines, retentions, hub, turns, mutual_tls=config.tls is not None)
        grpc_endpoint = await host.serve_grpc(
            config.listen_address,
            [(registry_grpc.add_RegistryServiceServicer_to_server, servicer, SERVICE_NAME)],
            interceptors=[TracingServerInterceptor(tracer_provider, rpc_seconds=metrics.rpc_seconds)],
            options=[("grpc.max_concurrent_streams", config.max_concurrent_streams)],
            credentials=server_credentials(config.tls) if config.tls is not None else None,
        )
        host.spawn(reaper.run(), "reaper")
        host.spawn(_probe_etcd(etcd, epochs, grpc_endpoint.health), "etcd-probe")
        host.spawn(_count_live(etcd, layout, metrics), "live-counts")
        if config.history_seconds:
            host.spawn(_compact_history(etcd, config.history_seconds), "compactor")
    address = f"{config.listen_address.rpartition(':')[0] or '127.0.0.1'}:{grpc_endpoint.port}"
    log.info(
        "registry serving",
        extra={
            "address": address,
            "etcd": etcd.endpoints_text,
            "key_prefix": config.key_prefix,
            "metrics_port": metrics_endpoint.port if metrics_endpoint is not None else None,
            "tracing": not isinstance(tracer_provider, trace.NoOpTracerProvider),
            "mutual_tls": config.tls is not None,
        },
    )
    return Registry(
        host=host,
        address=address,
        etcd=etcd,
        engines=engines,
        retentions=retentions,
        turns=turns,
        reaper=reaper,
        metrics=metrics,
        metrics_endpoint=metrics_endpoint,
    )


async def start_and_freeze(config: RegistryConfig) -> Registry:
    """``kvferry registry``'s start: a registry whose start-up objects the cyclic collector skips."""
    running = await create_registry(config)
    # Everything built so far lives as long as the process: keeping it out of the cyclic
    # collector's full passes cut their pauses from ~15 ms to under 1 ms (lookup p99).
    gc.collect()
    gc.freeze()
    return running
