"""``kvferry registry``: run the KV-metadata registry service against etcd.

Every flag has an environment variable; a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping

from kvferry.registry.config import RegistryConfig, TtlPolicy
from kvferry.runtime.flags import EnvFlags, add_log_level_flag, add_telemetry_flags
from kvferry.runtime.host import run_service
from kvferry.runtime.logs import setup_logging
from kvferry.runtime.tls import add_tls_flags, tls_from_args

_DEFAULTS = RegistryConfig()


def configure(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    flags = EnvFlags(parser, environ)
    ttl = _DEFAULTS.ttl
    flags.add(
        "--listen",
        "KVFERRY_REGISTRY_LISTEN",
        "host:port the gRPC server binds (port 0 picks a free one)",
        default=_DEFAULTS.listen_address,
    )
    flags.add(
        "--etcd-endpoints",
        "KVFERRY_ETCD_ENDPOINTS",
        "comma-separated etcd client endpoints, host:port each",
        default=",".join(_DEFAULTS.etcd_endpoints),
    )
    flags.add(
        "--etcd-timeout",
        "KVFERRY_ETCD_TIMEOUT_SECONDS",
        "deadline of each etcd call in seconds; past it the RPC fails with UNAVAILABLE",
        type=float,
        default=_DEFAULTS.etcd_timeout_seconds,
    )
    flags.add(
        "--key-prefix",
        "KVFERRY_KEY_PREFIX",
        "etcd key prefix for everything the registry stores; must end with '/'",
        default=_DEFAULTS.key_prefix,
    )
    flags.add(
        "--default-engine-ttl",
        "KVFERRY_DEFAULT_ENGINE_TTL_SECONDS",
        "engine lease in seconds when RegisterEngine asks for 0",
        type=int,
        default=ttl.default_engine_ttl_seconds,
    )
    flags.add(
        "--max-engine-ttl",
        "KVFERRY_MAX_ENGINE_TTL_SECONDS",
        "longest engine lease in seconds a caller may ask for",
        type=int,
        default=ttl.max_engine_ttl_seconds,
    )
    flags.add(
        "--default-retention-ttl",
        "KVFERRY_DEFAULT_RETENTION_TTL_SECONDS",
        "retention lease in seconds when PublishRetention asks for 0",
        type=int,
        default=ttl.default_retention_ttl_seconds,
    )
    flags.add(
        "--max-retention-ttl",
        "KVFERRY_MAX_RETENTION_TTL_SECONDS",
        "longest retention lease in seconds a caller may ask for (the operator's cap)",
        type=int,
        default=ttl.max_retention_ttl_seconds,
    )
    flags.add(
        "--etcd-history",
        "KVFERRY_ETCD_HISTORY_SECONDS",
        "seconds of etcd history kept for watches to resume; older revisions are compacted "
        "(0: leave compaction to etcd's --auto-compaction-*)",
        type=int,
        default=_DEFAULTS.history_seconds,
    )
    flags.add(
        "--max-concurrent-streams",
        "KVFERRY_MAX_CONCURRENT_STREAMS",
        "calls one client connection may have open at once; more wait for one to end",
        type=int,
        default=_DEFAULTS.max_concurrent_streams,
    )
    add_tls_flags(flags)
    add_tls_flags(flags, peer="etcd", prefix="etcd-tls")
    add_log_level_flag(flags)
    add_telemetry_flags(flags)


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
        tls=tls_from_args(args),
        etcd_tls=tls_from_args(args, "etcd-tls"),
        max_concurrent_streams=args.max_concurrent_streams,
    )


def run(args: argparse.Namespace) -> int:
    from kvferry.registry.server import start_and_freeze

    try:
        config = config_from_args(args)
    except ValueError as error:
        print(f"kvferry registry: error: {error}", file=sys.stderr)
        return 2
    setup_logging(config.log_level)
    return run_service("registry", lambda: start_and_freeze(config))
