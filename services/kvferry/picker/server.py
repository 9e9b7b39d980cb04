"""The picker's composition root: the router's registry client and engine watch, an ext_proc server.

Why a service of its own and not a mode of the router: the gateway calls it for every request (turns,
``/v1/models``, anything) and only needs the engine table and a registry lookup, while the router runs
turns; a picker scales and fails apart from the routers, stays out of the turn path, and a deployment
that routes through its gateway runs no router for placement. ``start_picker`` is also how tests run it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from grpc_health.v1 import health_pb2
from kvferry.picker.ext_proc import SERVICE_NAME, ExtProcPicker, add_to_server
from kvferry.picker.metrics import PickerMetrics
from kvferry.router.engines import EngineTable, LoadTracker
from kvferry.router.registry_client import EngineWatcher, GrpcRegistry
from kvferry.router.server import RouterConfig, api_keys_from_config
from kvferry.router.tenants import ApiKeys
from kvferry.runtime.host import GrpcEndpoint, ServiceHost
from kvferry.runtime.tls import TlsFiles, open_channel, server_credentials

log = logging.getLogger(__name__)

# The Inference Extension's health service names (its "Endpoint Picker Protocol"): liveness answers
# whenever the process does; readiness once the engine table is synced.
LIVENESS = "liveness"
READINESS = "readiness"


@dataclass
class PickerConfig:
    # Registry gRPC address, host:port.
    registry_address: str
    # ext_proc (gRPC) listen address; port 0 picks a free port. 9002 is the Inference Extension's.
    listen: str = "127.0.0.1:9002"
    # API keys -> tenants, as the router's (conversations are per tenant).
    tenants_file: Path | None = None
    api_keys: str = ""
    registry_timeout_seconds: float = 2.0
    max_body_bytes: int = 32 * 1024 * 1024
    engine_resync_seconds: float = 30.0
    # start_picker waits this long for the first engine table (0: don't wait).
    startup_sync_seconds: float = 10.0
    metrics_address: str | None = None
    # Mutual TLS to the registry (as the router: it reads what a router reads) and TLS for the gateway's
    # calls (no client certificate asked: gateways present none); None: plaintext.
    tls: TlsFiles | None = None


class RunningPicker:
    def __init__(
        self, *, host: ServiceHost, address: str, engines: EngineTable, metrics: PickerMetrics
    ) -> None:
        self.host = host
        self.address = address
        self.engines = engines
        self.metrics = metrics

    async def stop(self, grace_seconds: float | None = None) -> None:
        await self.host.stop(grace_seconds)


def _api_keys(config: PickerConfig) -> ApiKeys:
    return api_keys_from_config(
        RouterConfig(
            registry_address=config.registry_address,
            tenants_file=config.tenants_file,
            api_keys=config.api_keys,
        )
    )


async def start_picker(config: PickerConfig, *, api_keys: ApiKeys | None = None) -> RunningPicker:
    """Starts a picker in the running event loop; returns once it listens."""
    keys = api_keys if api_keys is not None else _api_keys(config)
    metrics = PickerMetrics()
    host = ServiceHost("picker")
    async with host.starting():
        channel = open_channel(config.registry_address, config.tls)
        host.on_stop("registry channel", channel.close)
        registry = GrpcRegistry(channel, timeout_seconds=config.registry_timeout_seconds)
        engines = EngineTable()
        watcher = EngineWatcher(registry, engines, LoadTracker(), resync_seconds=config.engine_resync_seconds)
        host.spawn(watcher.run(), "engine-watch")
        picker = ExtProcPicker(
            engines=engines,
            registry=registry,
            keys=keys,
            metrics=metrics,
            max_body_bytes=config.max_body_bytes,
        )
        credentials = server_credentials(config.tls, client_certificates=False) if config.tls else None
        endpoint = await host.serve_grpc(
            config.listen, [(add_to_server, picker, SERVICE_NAME)], credentials=credentials
        )
        await _not_ready(endpoint)
        host.spawn(_ready_when_synced(endpoint, watcher), "readiness")
        if config.startup_sync_seconds > 0:
            try:
                await asyncio.wait_for(watcher.synced.wait(), config.startup_sync_seconds)
            except TimeoutError:
                log.warning(
                    "no engine table from the registry yet", extra={"registry": config.registry_address}
                )
        if config.metrics_address:
            await host.serve_metrics(metrics.registry, config.metrics_address)
    address = f"{config.listen.rpartition(':')[0]}:{endpoint.port}"
    log.info("picker serving", extra={"listen": address, "registry": config.registry_address})
    return RunningPicker(host=host, address=address, engines=engines, metrics=metrics)


async def _not_ready(endpoint: GrpcEndpoint) -> None:
    await endpoint.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    for name in ("", READINESS, SERVICE_NAME):
        await endpoint.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


async def _ready_when_synced(endpoint: GrpcEndpoint, watcher: EngineWatcher) -> None:
    """Ready once the engine table is synced, and kept so: a registry that goes away leaves the last table in
    use (picks by it stay useful), as the router does."""
    await watcher.synced.wait()
    for name in ("", READINESS, SERVICE_NAME):
        await endpoint.health.set(name, health_pb2.HealthCheckResponse.SERVING)
    await asyncio.Event().wait()
