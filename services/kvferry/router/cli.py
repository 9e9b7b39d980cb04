"""``kvferry router``: the gRPC and OpenAI-compatible HTTP front door.

Every flag has an environment variable (shown in --help); a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Mapping

from kvferry.router.server import COST_PROFILES, REUSE_POLICIES, RouterConfig, RunningRouter, start_router
from kvferry.runtime.flags import EnvFlags, add_log_level_flag, add_telemetry_flags
from kvferry.runtime.front_door import DEFAULT_REGISTRY, add_front_door_flags, front_door_from_args
from kvferry.runtime.host import run_service
from kvferry.runtime.logs import setup_logging

_DEFAULTS = RouterConfig(registry_address=DEFAULT_REGISTRY)


def configure(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    parser.description = (
        "Run the router: gRPC (kvferry.v1.RouterService) and an OpenAI-compatible HTTP API in front of "
        "the prefill/decode engines registered in the registry. API keys map to tenants (--tenants-file)."
    )
    flags = EnvFlags(parser, environ)
    add_front_door_flags(flags, "router", registry_timeout_seconds=_DEFAULTS.registry_timeout_seconds)
    flags.add(
        "--grpc-listen",
        "KVFERRY_ROUTER_GRPC_LISTEN",
        "gRPC listen address (port 0: any)",
        default="127.0.0.1:50052",
    )
    flags.add(
        "--http-listen",
        "KVFERRY_ROUTER_HTTP_LISTEN",
        "HTTP listen address (port 0: any)",
        default="127.0.0.1:8080",
    )
    flags.add(
        "--cost-profile",
        "KVFERRY_ROUTER_COST_PROFILE",
        "default rates for the pull-or-recompute decision until engines report their own ('cpu' or a GPU "
        "profile of kvferry.router.calibration)",
        default=_DEFAULTS.cost_profile,
        choices=COST_PROFILES,
    )
    flags.add(
        "--kv-recompute-threshold",
        "KVFERRY_ROUTER_KV_RECOMPUTE_THRESHOLD",
        "fewest matched tokens worth a pull; set it to the engines' kv_recompute_threshold",
        type=int,
        default=_DEFAULTS.kv_recompute_threshold,
    )
    flags.add(
        "--lease-margin",
        "KVFERRY_ROUTER_LEASE_MARGIN",
        "lease time that must remain after an estimated pull, seconds (else recompute)",
        type=float,
        default=_DEFAULTS.lease_margin_seconds,
    )
    flags.add(
        "--reuse-policy",
        "KVFERRY_ROUTER_REUSE_POLICY",
        "cost: pull a retained prefix when the cost model says it is cheaper; always: whenever the "
        "threshold and the lease allow; never: always recompute",
        default=_DEFAULTS.reuse_policy,
        choices=REUSE_POLICIES,
    )
    flags.add(
        "--default-max-tokens",
        "KVFERRY_ROUTER_DEFAULT_MAX_TOKENS",
        "max_tokens when a request sets none",
        type=int,
        default=_DEFAULTS.default_max_tokens,
    )
    flags.add(
        "--max-attempts",
        "KVFERRY_ROUTER_MAX_ATTEMPTS",
        "engine attempts per turn (retries happen only before the decode engine's first token, by recompute)",
        type=int,
        default=_DEFAULTS.max_attempts,
    )
    flags.add(
        "--publish-wait",
        "KVFERRY_ROUTER_PUBLISH_WAIT",
        "after the last token, wait up to this long for the registry to show the turn's retention, seconds",
        type=float,
        default=_DEFAULTS.publish_wait_seconds,
    )
    flags.add(
        "--read-window",
        "KVFERRY_ROUTER_READ_WINDOW",
        "a prefill may start reading a retention at most this long after the router looked it up, "
        "seconds; at most half of --min-release-grace",
        type=float,
        default=_DEFAULTS.read_window_seconds,
    )
    flags.add(
        "--min-release-grace",
        "KVFERRY_ROUTER_MIN_RELEASE_GRACE",
        "the shortest release_grace_seconds of the decode engines' connectors, seconds; the router "
        "refuses to start when --read-window is more than half of it",
        type=float,
        default=_DEFAULTS.min_release_grace_seconds,
    )
    flags.add(
        "--turn-mark-lease",
        "KVFERRY_ROUTER_TURN_MARK_LEASE",
        "lease of a turn's mark in the registry (one turn in flight per conversation), renewed while the "
        "turn runs, seconds: how long a conversation stays held after its router died",
        type=int,
        default=_DEFAULTS.turn_mark_seconds,
    )
    flags.add(
        "--engine-connect-timeout",
        "KVFERRY_ROUTER_ENGINE_CONNECT_TIMEOUT",
        "engine HTTP connect timeout, seconds",
        type=float,
        default=_DEFAULTS.engine_connect_timeout_seconds,
    )
    flags.add(
        "--engine-read-timeout",
        "KVFERRY_ROUTER_ENGINE_READ_TIMEOUT",
        "longest wait for an engine's next bytes (a prefill, a streamed token), seconds",
        type=float,
        default=_DEFAULTS.engine_read_timeout_seconds,
    )
    flags.add(
        "--engine-max-connections",
        "KVFERRY_ROUTER_ENGINE_MAX_CONNECTIONS",
        "HTTP connections per engine",
        type=int,
        default=_DEFAULTS.engine_max_connections,
    )
    flags.add(
        "--max-body-bytes",
        "KVFERRY_ROUTER_MAX_BODY_BYTES",
        "largest HTTP request body accepted",
        type=int,
        default=_DEFAULTS.max_body_bytes,
    )
    flags.add(
        "--responses-max-stored",
        "KVFERRY_ROUTER_RESPONSES_MAX_STORED",
        "Responses API: stored responses this process keeps for previous_response_id (oldest go first)",
        type=int,
        default=_DEFAULTS.responses_max_stored,
    )
    flags.add(
        "--responses-ttl",
        "KVFERRY_ROUTER_RESPONSES_TTL",
        "Responses API: how long a stored response can be continued or fetched, seconds",
        type=float,
        default=_DEFAULTS.responses_ttl_seconds,
    )
    flags.add(
        "--max-turns-per-tenant",
        "KVFERRY_ROUTER_MAX_TURNS_PER_TENANT",
        "turns one tenant may have in flight on this router; past it RESOURCE_EXHAUSTED / 429 with "
        "Retry-After (0: no cap)",
        type=int,
        default=_DEFAULTS.max_turns_per_tenant,
    )
    flags.add(
        "--tokens-per-second-per-tenant",
        "KVFERRY_ROUTER_TOKENS_PER_SECOND_PER_TENANT",
        "tokens (prompt plus generated) one tenant may spend per second on this router, unless its entry "
        "in the tenants file sets tokens_per_second; past it RESOURCE_EXHAUSTED / 429 with Retry-After "
        "(0: no cap)",
        type=float,
        default=_DEFAULTS.tokens_per_second_per_tenant,
    )
    flags.add(
        "--max-concurrent-streams",
        "KVFERRY_MAX_CONCURRENT_STREAMS",
        "gRPC calls one client connection may have open at once; more wait for one to end",
        type=int,
        default=_DEFAULTS.max_concurrent_streams,
    )
    flags.add(
        "--max-http-connections",
        "KVFERRY_ROUTER_MAX_HTTP_CONNECTIONS",
        "HTTP connections and requests served at once; past it 503",
        type=int,
        default=_DEFAULTS.max_http_connections,
    )
    flags.add(
        "--retention-index",
        "KVFERRY_ROUTER_RETENTION_INDEX",
        "on: keep a local index of every live retention (one registry watch), look turns' retentions up "
        "there first (the registry when it misses) and report ready once it is synced; off: every lookup "
        "asks the registry",
        default="on" if _DEFAULTS.retention_index else "off",
        choices=("on", "off"),
    )
    flags.add(
        "--first-token-from-prefill",
        "KVFERRY_ROUTER_FIRST_TOKEN_FROM_PREFILL",
        "on: a streamed token or text turn shows the prefill engine's token as soon as it answers and the "
        "decode engine continues after it (the time to first token is the prefill's alone); off: the decode "
        "engine generates every token",
        default="on" if _DEFAULTS.first_token_from_prefill else "off",
        choices=("on", "off"),
    )
    add_log_level_flag(flags)
    flags.add(
        "--event-loop",
        "KVFERRY_ROUTER_EVENT_LOOP",
        "uvloop (faster) or asyncio",
        default="uvloop",
        choices=("uvloop", "asyncio"),
    )
    add_telemetry_flags(flags)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    front = front_door_from_args(args)
    return RouterConfig(
        registry_address=front.registry_address,
        grpc_listen=args.grpc_listen,
        http_listen=args.http_listen,
        tenants_file=front.tenants_file,
        api_keys=front.api_keys,
        registry_timeout_seconds=front.registry_timeout_seconds,
        cost_profile=args.cost_profile,
        kv_recompute_threshold=args.kv_recompute_threshold,
        lease_margin_seconds=args.lease_margin,
        reuse_policy=args.reuse_policy,
        default_max_tokens=args.default_max_tokens,
        max_attempts=args.max_attempts,
        publish_wait_seconds=args.publish_wait,
        read_window_seconds=args.read_window,
        min_release_grace_seconds=args.min_release_grace,
        turn_mark_seconds=args.turn_mark_lease,
        engine_connect_timeout_seconds=args.engine_connect_timeout,
        engine_read_timeout_seconds=args.engine_read_timeout,
        engine_max_connections=args.engine_max_connections,
        max_body_bytes=args.max_body_bytes,
        responses_max_stored=args.responses_max_stored,
        responses_ttl_seconds=args.responses_ttl,
        max_turns_per_tenant=args.max_turns_per_tenant,
        tokens_per_second_per_tenant=args.tokens_per_second_per_tenant,
        max_concurrent_streams=args.max_concurrent_streams,
        max_http_connections=args.max_http_connections,
        retention_index=args.retention_index == "on",
        first_token_from_prefill=args.first_token_from_prefill == "on",
        # The service starts even with the registry away and syncs when it comes.
        startup_sync_seconds=3.0,
        metrics_address=args.metrics_address or None,
        otlp_endpoint=args.otlp_endpoint or None,
        tls=front.tls,
    )


async def _start(config: RouterConfig) -> RunningRouter:
    router = await start_router(config)
    print(f"kvferry router: gRPC {router.grpc_address}, HTTP {router.http_url}", flush=True)
    return router


def _loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return None


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    try:
        config = config_from_args(args)
    except ValueError as error:
        print(f"kvferry router: error: {error}", file=sys.stderr)
        return 2
    # A bad tenants file or cost profile, or an address in use, is refused at start: exit 2, one line.
    return run_service("router", lambda: _start(config), loop_factory=_loop_factory(args.event_loop))
