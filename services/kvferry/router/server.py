"""The router's composition root: builds every part from a :class:`RouterConfig` and serves gRPC and
HTTP in one event loop. ``start_router`` is also how tests, the SDK's tests and the local stack run a
router in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import ssl
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import uvicorn
from grpc_health.v1 import health, health_pb2
from kvferry.pd.engine_client import HttpTimeouts
from kvferry.pd.reuse import DEFAULT_READ_WINDOW_SECONDS, max_read_window, read_window_fits
from kvferry.router.calibration import CPU_DEFAULT, GPU_PROFILES, CostProfile
from kvferry.router.conversations import Conversations
from kvferry.router.cost import CostSettings
from kvferry.router.engine_clients import EngineClients
from kvferry.router.engines import EngineTable, LoadTracker
from kvferry.router.grpc_api import SERVICE_NAME, RouterServicer
from kvferry.router.http_api import HttpApi
from kvferry.router.limits import TenantLimits, TenantLimitSettings
from kvferry.router.metrics import RouterMetrics
from kvferry.router.observe import TurnTelemetry
from kvferry.router.openai_responses import ResponseStore
from kvferry.router.registry_client import EngineWatcher, GrpcRegistry
from kvferry.router.retention_index import RetentionIndex
from kvferry.router.tenants import ApiKeys, load_tenants, parse_key_pairs
from kvferry.router.turns import TurnRunner, TurnSettings
from kvferry.runtime.host import ServiceHost
from kvferry.runtime.tls import ReloadingServerContext, TlsFiles, open_channel, server_credentials
from kvferry.runtime.tracing import TracingServerInterceptor, tracing_client_interceptors
from kvferry.v1 import router_service_pb2_grpc as router_grpc
from opentelemetry.sdk.trace.export import SpanExporter
from starlette.applications import Starlette

log = logging.getLogger(__name__)

# In-flight calls (gRPC and HTTP) get this long to finish on stop.
_GRACE_SECONDS = 2


@dataclass
class RouterConfig:
    """Everything a router needs; the CLI fills it from flags and environment variables."""

    # Registry gRPC address, host:port.
    registry_address: str
    # gRPC and HTTP listen addresses; port 0 picks a free port.
    grpc_listen: str = "127.0.0.1:0"
    http_listen: str = "127.0.0.1:0"
    # API keys: a tenants file (JSON or TOML) and/or KEY=TENANT pairs.
    tenants_file: Path | None = None
    # Secret (KEY=TENANT pairs): never in a repr.
    api_keys: str = field(default="", repr=False)
    # Registry calls' deadline, seconds.
    registry_timeout_seconds: float = 2.0
    # Cost model: profile name ("cpu" or a GPU_PROFILES key), the engines' kv_recompute_threshold,
    # and the lease time that must remain after a pull.
    cost_profile: str = "cpu"
    kv_recompute_threshold: int = 64
    lease_margin_seconds: float = 2.0
    # "cost" (pull when cheaper), "always" (pull whenever safe) or "never" (always recompute).
    reuse_policy: str = "cost"
    default_max_tokens: int = 256
    max_attempts: int = 2
    publish_wait_seconds: float = 2.0
    # A prefill may start reading a retention at most this long after the router looked it up.
    read_window_seconds: float = DEFAULT_READ_WINDOW_SECONDS
    # The shortest release grace of the decode engines this router serves (their connectors'
    # release_grace_seconds, 30 by default): the read window must be safely under it (at most half) or
    # the router refuses to start. Each engine also publishes its own; retentions of an engine whose
    # grace is too short for the window are recomputed, never pulled.
    min_release_grace_seconds: float = 30.0
    # The lease of a turn's mark in the registry (one turn in flight per conversation), renewed every
    # third of it while the turn runs: how long a conversation stays held after its router died.
    turn_mark_seconds: int = 5
    # Engine HTTP: connect timeout, per-read timeout (a stalled stream fails after it), pool size.
    engine_connect_timeout_seconds: float = 3.0
    engine_read_timeout_seconds: float = 120.0
    engine_max_connections: int = 512
    max_body_bytes: int = 32 * 1024 * 1024
    # Stored Responses-API responses (previous_response_id): how many this process keeps, and how long.
    responses_max_stored: int = 10_000
    responses_ttl_seconds: float = 3600.0
    # Turns one tenant may have in flight on this router (gRPC and HTTP together); past it
    # RESOURCE_EXHAUSTED / 429 with Retry-After. 0: no cap.
    max_turns_per_tenant: int = 0
    # Tokens (prompt plus generated) one tenant may spend per second on this router, for tenants whose
    # entry in the tenants file names no tokens_per_second; past it RESOURCE_EXHAUSTED / 429. 0: no cap.
    tokens_per_second_per_tenant: float = 0.0
    # Calls one gRPC connection may have open at once; HTTP connections served at once (past it: 503).
    max_concurrent_streams: int = 1000
    max_http_connections: int = 4096
    engine_resync_seconds: float = 30.0
    # start_router waits this long for the first engine table (0: don't wait).
    startup_sync_seconds: float = 10.0
    # Keep a local index of every live retention (one WatchAllRetentions stream) and look turns'
    # retentions up there first; the router reports ready only once it is synced. False: every lookup
    # asks the registry (GetRetention), and readiness does not wait for an index.
    retention_index: bool = True
    # A streamed token or text turn shows P's token first and D continues after it (kvferry.pd.sequence).
    first_token_from_prefill: bool = True
    # Prometheus /metrics on its own address (also always at the HTTP API's /metrics); None: off.
    metrics_address: str | None = None
    # OTLP/gRPC collector for traces; None: tracing off (trace context still passes through).
    otlp_endpoint: str | None = None
    # The router's certificate: it serves agents over TLS with it (gRPC and HTTPS; API keys authenticate
    # them, no client certificate is asked) and calls the registry over mutual TLS with it (the certificate
    # names the role ``router``: docs/security.md). None: plaintext everywhere.
    tls: TlsFiles | None = None


COST_PROFILES = ("cpu", *sorted(GPU_PROFILES))
REUSE_POLICIES = ("cost", "always", "never")


def router_holder() -> str:
    """This router as its turns' marks name it: host:pid (as an id: [A-Za-z0-9._:-])."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:96] or "router"
    return f"{host}:{os.getpid()}"


def check_read_window(config: RouterConfig) -> None:
    """Refuses a read window that is not safely under the engines' minimum release grace (ValueError)."""
    window, grace = config.read_window_seconds, config.min_release_grace_seconds
    if not grace > 0:
        raise ValueError(
            f"--min-release-grace is {grace:g} s; give the shortest release_grace_seconds of your decode "
            "engines' connectors (> 0: without a grace a retention ended just after its lookup could be "
            "freed while a prefill reads it)"
        )
    if not window > 0:
        raise ValueError(
            f"--read-window is {window:g} s; it must be > 0 (use --reuse-policy never to not pull)"
        )
    if not read_window_fits(window, grace):
        raise ValueError(
            f"--read-window {window:g} s is not safely under the engines' release grace "
            f"(--min-release-grace {grace:g} s): a read window may be at most half of it, "
            f"{max_read_window(grace):g} s. Lower --read-window, or raise the engines' release_grace_seconds "
            "and --min-release-grace with it"
        )


def cost_profile(name: str) -> CostProfile:
    if name == "cpu":
        return CPU_DEFAULT
    if name in GPU_PROFILES:
        return GPU_PROFILES[name]
    raise ValueError(f"unknown cost profile {name!r}; known: {['cpu', *sorted(GPU_PROFILES)]}")


def _reuse_policy(name: str) -> Literal["cost", "always", "never"]:
    if name == "cost":
        return "cost"
    if name == "always":
        return "always"
    if name == "never":
        return "never"
    raise ValueError(f"unknown reuse policy {name!r}; use cost, always or never")


def api_keys_from_config(config: RouterConfig) -> ApiKeys:
    keys = ApiKeys({})
    if config.tenants_file is not None:
        keys = keys.merged(load_tenants(config.tenants_file))
    if config.api_keys:
        keys = keys.merged(parse_key_pairs(config.api_keys))
    if not len(keys):
        raise ValueError("no API keys configured: pass --tenants-file (or --api-keys KEY=TENANT,...)")
    return keys


def _split_host_port(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn inside an event loop it does not own: the process owner handles signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class RunningRouter:
    """A started router: where it listens, its engine table, and how to stop it."""

    def __init__(
        self,
        *,
        host: ServiceHost,
        grpc_address: str,
        http_host: str,
        http_port: int,
        engines: EngineTable,
        watcher: EngineWatcher,
        metrics: RouterMetrics,
        tenant_limits: TenantLimits,
        http_app: Starlette,
        index: RetentionIndex | None = None,
        https: bool = False,
    ) -> None:
        self.host = host
        # The ASGI application the HTTP server serves (tests drive it directly to play a client exactly).
        self.http_app = http_app
        self.https = https
        self.grpc_address = grpc_address
        self.http_host = http_host
        self.http_port = http_port
        self.engines = engines
        self.watcher = watcher
        self.metrics = metrics
        self.tenant_limits = tenant_limits
        # The retention index (None: turned off).
        self.index = index

    @property
    def grpc_host(self) -> str:
        return self.grpc_address.rpartition(":")[0]

    @property
    def grpc_port(self) -> int:
        return int(self.grpc_address.rpartition(":")[2])

    @property
    def http_url(self) -> str:
        return f"{'https' if self.https else 'http'}://{self.http_host}:{self.http_port}"

    async def stop(self, grace_seconds: float | None = None) -> None:
        """Stops taking calls (in-flight ones get ``grace_seconds``, 2 s by default), then closes."""
        await self.host.stop(grace_seconds)


async def start_router(
    config: RouterConfig,
    *,
    api_keys: ApiKeys | None = None,
    span_exporter: SpanExporter | None = None,
) -> RunningRouter:
    """Starts a router in the running event loop and returns once both servers listen: the composition
    root, building every object. A start that fails half-way stops what it started.

    ``api_keys`` overrides the keys named in ``config`` (tests pass a table directly);
    ``span_exporter`` (e.g. an ``InMemorySpanExporter``) turns tracing on for tests.
    """
    check_read_window(config)
    keys = api_keys if api_keys is not None else api_keys_from_config(config)
    grpc_host, _ = _split_host_port(config.grpc_listen)
    http_host, http_port = _split_host_port(config.http_listen)
    metrics = RouterMetrics()
    host = ServiceHost("router", grace_seconds=_GRACE_SECONDS)
    async with host.starting():
        provider = host.setup_tracing("kvferry-router", config.otlp_endpoint, span_exporter)
        channel = open_channel(
            config.registry_address, config.tls, interceptors=tracing_client_interceptors(provider)
        )
        host.on_stop("registry channel", channel.close)
        registry = GrpcRegistry(channel, timeout_seconds=config.registry_timeout_seconds)
        engines = EngineTable()
        load = LoadTracker()
        clients = EngineClients(
            timeouts=HttpTimeouts(
                connect=config.engine_connect_timeout_seconds, read=config.engine_read_timeout_seconds
            ),
            max_connections=config.engine_max_connections,
        )
        host.on_stop("engine clients", clients.aclose)
        watcher = EngineWatcher(
            registry,
            engines,
            load,
            resync_seconds=config.engine_resync_seconds,
            on_left=clients.forget,
            read_window_seconds=config.read_window_seconds,
        )
        index = RetentionIndex(registry.watch_all_retentions) if config.retention_index else None
        runner = TurnRunner(
            index=index,
            engines=engines,
            load=load,
            clients=clients,
            registry=registry,
            settings=TurnSettings(
                cost=CostSettings(
                    profile=cost_profile(config.cost_profile),
                    kv_recompute_threshold=config.kv_recompute_threshold,
                    lease_margin_seconds=config.lease_margin_seconds,
                    policy=_reuse_policy(config.reuse_policy),
                ),
                default_max_tokens=config.default_max_tokens,
                max_attempts=config.max_attempts,
                publish_wait_seconds=config.publish_wait_seconds,
                read_window_seconds=config.read_window_seconds,
                turn_mark_seconds=config.turn_mark_seconds,
                holder=router_holder(),
                first_token_from_prefill=config.first_token_from_prefill,
                tenant_limits=TenantLimitSettings(
                    max_concurrent_turns=config.max_turns_per_tenant,
                    tokens_per_second=config.tokens_per_second_per_tenant,
                ),
            ),
            telemetry=TurnTelemetry(provider, metrics),
        )
        host.on_stop("turn runner", runner.aclose)
        host.spawn(watcher.run(), "engine-watch")
        if config.startup_sync_seconds > 0:
            try:
                await asyncio.wait_for(watcher.synced.wait(), config.startup_sync_seconds)
            except TimeoutError:
                log.warning(
                    "no engine table from the registry yet; serving anyway and retrying in the background",
                    extra={"registry": config.registry_address},
                )
        conversations = Conversations(registry)
        servicer = RouterServicer(runner=runner, keys=keys, conversations=conversations)
        grpc_endpoint = await host.serve_grpc(
            config.grpc_listen,
            [(router_grpc.add_RouterServiceServicer_to_server, servicer, SERVICE_NAME)],
            interceptors=[TracingServerInterceptor(provider, rpc_seconds=metrics.rpc_seconds)],
            options=[("grpc.max_concurrent_streams", config.max_concurrent_streams)],
            credentials=(
                server_credentials(config.tls, client_certificates=False) if config.tls is not None else None
            ),
            serving=index is None,
        )
        if index is not None:
            host.spawn(_follow_retentions(index, grpc_endpoint.health), "retention-index")
        if config.metrics_address:
            await host.serve_metrics(metrics.registry, config.metrics_address)
        app = HttpApi(
            runner=runner,
            keys=keys,
            engines=engines,
            conversations=conversations,
            responses=ResponseStore(
                capacity=config.responses_max_stored, ttl_seconds=config.responses_ttl_seconds
            ),
            registry_connected=lambda: watcher.connected,
            index_synced=(lambda: index.ready.is_set()) if index is not None else (lambda: True),
            max_body_bytes=config.max_body_bytes,
            metrics_registry=metrics.registry,
        ).app()
        http_port, http_protocol = await _serve_http(
            host, app, http_host, http_port, config.max_http_connections, config.tls
        )
    grpc_address = f"{grpc_host}:{grpc_endpoint.port}"
    router_http_url = f"{'https' if config.tls else 'http'}://{http_host}:{http_port}"
    log.info(
        "router serving",
        extra={
            "grpc": grpc_address,
            "http": router_http_url,
            "registry": config.registry_address,
            "engines": len(engines),
            "retention_index": "on" if index is not None else "off",
            # The protocol uvicorn loaded: HttpToolsProtocol (its C parser) when httptools is importable,
            # else H11Protocol (Python: slower per request and per streamed chunk).
            "http_protocol": http_protocol,
        },
    )
    return RunningRouter(
        host=host,
        grpc_address=grpc_address,
        http_host=http_host,
        http_port=http_port,
        engines=engines,
        watcher=watcher,
        metrics=metrics,
        tenant_limits=runner.tenant_limits,
        http_app=app,
        index=index,
        https=config.tls is not None,
    )


async def _follow_retentions(index: RetentionIndex, health_servicer: health.aio.HealthServicer) -> None:
    """Keeps the retention index until stop. The router's gRPC health is NOT_SERVING until the index has
    its first snapshot (a restarted router rebuilds it before it takes traffic), then SERVING."""

    async def serving_once_synced() -> None:
        await index.ready.wait()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)

    readiness = asyncio.ensure_future(serving_once_synced())
    try:
        await index.run()
    finally:
        readiness.cancel()


def _reloading_ssl_context(
    tls: TlsFiles,
) -> Callable[[uvicorn.Config, Callable[[], ssl.SSLContext]], ssl.SSLContext]:
    """uvicorn's SSL context factory: uvicorn's own context (its ALPN, ciphers), built again from the files
    whenever they change (kvferry.runtime.tls.ReloadingServerContext)."""

    def factory(_config: uvicorn.Config, uvicorn_context: Callable[[], ssl.SSLContext]) -> ssl.SSLContext:
        # uvicorn's factory reads the config's ssl_certfile/ssl_keyfile: the same files as ``tls``.
        return ReloadingServerContext(tls, lambda _files: uvicorn_context()).context

    return factory


async def _serve_http(
    host: ServiceHost, app: Starlette, address: str, port: int, max_connections: int, tls: TlsFiles | None
) -> tuple[int, str]:
    """Serves the OpenAI-compatible API with uvicorn until the host stops; returns the bound port and the name
    of the HTTP protocol class uvicorn loaded."""
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and
    # without it every keep-alive response waits ~40 ms for a delayed ACK (Nagle).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)

    async def close_socket() -> None:
        sock.close()  # uvicorn closes it too once it served; closing twice is harmless

    host.on_stop("HTTP socket", close_socket)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if port:
        # Several router processes may share one address (gRPC does so by default): the kernel
        # spreads connections over them, so a host runs as many routers as it has cores to spare.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((address, port))
    sock.listen(2048)
    sock.setblocking(False)
    server = _EmbeddedUvicorn(
        uvicorn.Config(
            app,
            lifespan="off",
            log_config=None,
            access_log=False,
            server_header=False,
            date_header=False,
            timeout_graceful_shutdown=_GRACE_SECONDS,
            # Past it uvicorn answers 503 at once instead of taking more memory and sockets.
            limit_concurrency=max_connections,
            # HTTPS with the router's certificate, taken up again when its files change (as the gRPC port).
            ssl_certfile=str(tls.cert) if tls is not None else None,
            ssl_keyfile=str(tls.key) if tls is not None else None,
            ssl_context_factory=_reloading_ssl_context(tls) if tls is not None else None,
        )
    )
    serving = host.spawn(server.serve(sockets=[sock]), "http")

    async def graceful_stop() -> None:
        # uvicorn stops taking connections and gives open ones its graceful timeout to finish.
        server.should_exit = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(serving), _GRACE_SECONDS + 3)

    host.on_stop("HTTP server", graceful_stop)
    while not server.started:
        if serving.done():
            serving.result()
            raise RuntimeError("the HTTP server stopped during start")
        await asyncio.sleep(0.005)
    return int(sock.getsockname()[1]), server.config.http_protocol_class.__name__
