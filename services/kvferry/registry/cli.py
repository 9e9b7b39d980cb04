"""``kvferry registry``: run the KV-metadata registry service against etcd.

Every flag has an environment variable; a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Mapping

from kvferry.common import telemetry
from kvferry.common.logs import setup_logging
from kvferry.registry.config import RegistryConfig, TtlPolicy

_DEFAULTS = RegistryConfig()


def _env(environ: Mapping[str, str], name: str, default: object) -> str:
    return environ.get(name, str(default))


def configure(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    env = os.environ if environ is None else environ
    ttl = _DEFAULTS.ttl
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.add_argument(
        "--listen",
        default=_env(env, "KVFERRY_REGISTRY_LISTEN", _DEFAULTS.listen_address),
        help="host:port the gRPC server binds (port 0 picks a free one) [env KVFERRY_REGISTRY_LISTEN]",
    )
    parser.add_argument(
        "--etcd-endpoints",
        default=_env(env, "KVFERRY_ETCD_ENDPOINTS", ",".join(_DEFAULTS.etcd_endpoints)),
        help="comma-separated etcd client endpoints, host:port each [env KVFERRY_ETCD_ENDPOINTS]",
    )
    parser.add_argument(
        "--etcd-timeout",
        type=float,
        default=float(_env(env, "KVFERRY_ETCD_TIMEOUT_SECONDS", _DEFAULTS.etcd_timeout_seconds)),
        help="deadline of each etcd call in seconds; past it the RPC fails with UNAVAILABLE "
        "[env KVFERRY_ETCD_TIMEOUT_SECONDS]",
    )
    parser.add_argument(
        "--key-prefix",
        default=_env(env, "KVFERRY_KEY_PREFIX", _DEFAULTS.key_prefix),
        help="etcd key prefix for everything the registry stores; must end with '/' [env KVFERRY_KEY_PREFIX]",
    )
    parser.add_argument(
        "--default-engine-ttl",
        type=int,
        default=int(_env(env, "KVFERRY_DEFAULT_ENGINE_TTL_SECONDS", ttl.default_engine_ttl_seconds)),
        help="engine lease in seconds when RegisterEngine asks for 0 "
        "[env KVFERRY_DEFAULT_ENGINE_TTL_SECONDS]",
    )
    parser.add_argument(
        "--max-engine-ttl",
        type=int,
        default=int(_env(env, "KVFERRY_MAX_ENGINE_TTL_SECONDS", ttl.max_engine_ttl_seconds)),
        help="longest engine lease in seconds a caller may ask for [env KVFERRY_MAX_ENGINE_TTL_SECONDS]",
    )
    parser.add_argument(
        "--default-retention-ttl",
        type=int,
        default=int(_env(env, "KVFERRY_DEFAULT_RETENTION_TTL_SECONDS", ttl.default_retention_ttl_seconds)),
        help="retention lease in seconds when PublishRetention asks for 0 "
        "[env KVFERRY_DEFAULT_RETENTION_TTL_SECONDS]",
    )
    parser.add_argument(
        "--max-retention-ttl",
        type=int,
        default=int(_env(env, "KVFERRY_MAX_RETENTION_TTL_SECONDS", ttl.max_retention_ttl_seconds)),
        help="longest retention lease in seconds a caller may ask for (the operator's cap) "
        "[env KVFERRY_MAX_RETENTION_TTL_SECONDS]",
    )
    parser.add_argument(
        "--etcd-history",
        type=int,
        default=int(_env(env, "KVFERRY_ETCD_HISTORY_SECONDS", _DEFAULTS.history_seconds)),
        help="seconds of etcd history kept for watches to resume; older revisions are compacted "
        "(0: leave compaction to etcd's --auto-compaction-*) [env KVFERRY_ETCD_HISTORY_SECONDS]",
    )
    parser.add_argument(
        "--log-level",
        default=_env(env, "KVFERRY_LOG_LEVEL", _DEFAULTS.log_level),
        choices=["debug", "info", "warning", "error"],
        help="log level; logs are JSON lines on stderr [env KVFERRY_LOG_LEVEL]",
    )
    telemetry.add_telemetry_arguments(parser)
    if environ is not None:
        # The shared flags read os.environ; an injected environment (tests) wins here too.
        parser.set_defaults(
            metrics_address=env.get("KVFERRY_METRICS_ADDRESS"),
            otlp_endpoint=env.get("KVFERRY_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
        )


def config_from_args(args: argparse.Namespace) -> RegistryConfig:
    endpoints = tuple(endpoint.strip() for endpoint in args.etcd_endpoints.split(",") if endpoint.strip())
    return RegistryConfig(
        listen_address=args.listen,
        etcd_endpoints=endpoints,
        etcd_timeout_seconds=args.etcd_timeout,
        key_prefix=args.key_prefix,
        ttl=TtlPolicy(
            default_engine_ttl_seconds=args.default_engine_ttl,
            max_engine_ttl_seconds=args.max_engine_ttl,
            default_retention_ttl_seconds=args.default_retention_ttl,
            max_retention_ttl_seconds=args.max_retention_ttl,
        ),
        log_level=args.log_level,
        history_seconds=args.etcd_history,
        metrics_address=args.metrics_address or None,
        otlp_endpoint=args.otlp_endpoint or None,
    )


def run(args: argparse.Namespace) -> int:
    from kvferry.registry.server import serve

    try:
        config = config_from_args(args)
    except ValueError as error:
        raise SystemExit(f"kvferry registry: {error}") from None
    setup_logging(config.log_level)
    asyncio.run(serve(config))
    return 0
