"""``kvferry sidecar``: runs beside one vLLM engine.

Waits for the engine's /health, registers it in the registry under a heartbeat lease, serves the
connector inside the engine over a local gRPC endpoint (SidecarService), publishes the retentions
it reports and streams back their renewals and ends. Every flag can also be set by the
environment variable named in its help; flags win.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvferry.runtime.backoff import BackoffPolicy
from kvferry.runtime.flags import EnvFlags, add_log_level_flag, add_telemetry_flags
from kvferry.runtime.host import run_service
from kvferry.runtime.logs import setup_logging
from kvferry.runtime.tls import add_tls_flags, tls_from_args
from kvferry.sidecar.config import SidecarConfig
from kvferry.sidecar.engine import EngineMonitorSettings
from kvferry.sidecar.registration import EngineIdentity, RegistrationSettings
from kvferry.sidecar.releases import FanoutSettings
from kvferry.v1 import resources_pb2

if TYPE_CHECKING:
    from kvferry.sidecar.app import Sidecar

ROLES = {
    "prefill": resources_pb2.ENGINE_ROLE_PREFILL,
    "decode": resources_pb2.ENGINE_ROLE_DECODE,
    "both": resources_pb2.ENGINE_ROLE_BOTH,
}
DEFAULT_LISTEN = "unix:/tmp/kvferry/sidecar-{engine_id}.sock"


def configure(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    flags = EnvFlags(parser, environ)
    engine = flags.group("the engine")
    engine.add(
        "--engine-id",
        "KVFERRY_ENGINE_ID",
        "engine id; must equal the engine's kv_transfer_config.engine_id",
        required=True,
    )
    engine.add("--role", "KVFERRY_ENGINE_ROLE", "the engine's role", choices=sorted(ROLES), required=True)
    engine.add(
        "--engine-url",
        "KVFERRY_ENGINE_URL",
        "base URL of the engine's OpenAI-compatible HTTP server, e.g. http://127.0.0.1:8100",
        required=True,
    )
    engine.add(
        "--nixl-host",
        "KVFERRY_NIXL_HOST",
        "host of the engine's NIXL side channel",
        default="127.0.0.1",
    )
    engine.add(
        "--nixl-port",
        ("KVFERRY_NIXL_PORT", "VLLM_NIXL_SIDE_CHANNEL_PORT"),
        "port of the engine's NIXL side channel (the engine's VLLM_NIXL_SIDE_CHANNEL_PORT)",
        type=int,
        default=5600,
    )
    engine.add(
        "--kv-compatibility-hash",
        "KVFERRY_KV_COMPATIBILITY_HASH",
        "engines exchange KV only when this matches (same model, dtype, block layout)",
        required=True,
    )
    engine.add("--model", "KVFERRY_MODEL", "served model name (default: what /v1/models reports)")
    engine.add(
        "--block-size",
        "KVFERRY_BLOCK_SIZE",
        "tokens per KV block (default: from the engine's /metrics vllm:cache_config_info)",
        type=int,
    )
    engine.add(
        "--kv-capacity-blocks",
        "KVFERRY_KV_CAPACITY_BLOCKS",
        "KV blocks the engine has (default: num_gpu_blocks from the engine's /metrics)",
        type=int,
    )
    engine.add(
        "--max-model-len",
        "KVFERRY_MAX_MODEL_LEN",
        "the model's context limit in tokens (default: what /v1/models reports)",
        type=int,
    )
    engine.add(
        "--engine-timeout",
        "KVFERRY_ENGINE_TIMEOUT_SECONDS",
        "deadline of each HTTP call to the engine, seconds",
        type=float,
        default=5.0,
    )
    engine.add(
        "--engine-probe-interval",
        "KVFERRY_ENGINE_PROBE_INTERVAL_SECONDS",
        "seconds between /health probes",
        type=float,
        default=2.0,
    )
    engine.add(
        "--engine-down-after",
        "KVFERRY_ENGINE_DOWN_AFTER_SECONDS",
        "failing /health for this long deregisters the engine (a refused connection does at once)",
        type=float,
        default=30.0,
    )

    registry = flags.group("the registry")
    registry.add(
        "--registry",
        "KVFERRY_REGISTRY",
        "host:port of the registry's gRPC API",
        default="127.0.0.1:50051",
    )
    registry.add(
        "--ttl-seconds",
        "KVFERRY_ENGINE_TTL_SECONDS",
        "engine lease length asked for; heartbeats go every TTL/3 (0: the registry's default)",
        type=int,
        default=10,
    )
    registry.add(
        "--registry-timeout",
        "KVFERRY_REGISTRY_TIMEOUT_SECONDS",
        "deadline of each registry call, seconds",
        type=float,
        default=5.0,
    )
    registry.add(
        "--backoff-initial",
        "KVFERRY_BACKOFF_INITIAL_SECONDS",
        "first retry delay after a registry failure, seconds",
        type=float,
        default=0.2,
    )
    registry.add(
        "--backoff-max",
        "KVFERRY_BACKOFF_MAX_SECONDS",
        "longest retry delay, seconds",
        type=float,
        default=5.0,
    )
    registry.add(
        "--sweep-interval",
        "KVFERRY_SWEEP_INTERVAL_SECONDS",
        "seconds between re-checks of retentions past their expiry without news",
        type=float,
        default=5.0,
    )

    serving = flags.group("serving")
    serving.add(
        "--listen",
        "KVFERRY_SIDECAR_LISTEN",
        "endpoint for the connector: unix:/path or 127.0.0.1:port ({engine_id} is replaced)",
        default=DEFAULT_LISTEN,
    )
    add_log_level_flag(serving)
    add_tls_flags(flags)
    add_telemetry_flags(flags)


def config_from_args(args: argparse.Namespace) -> SidecarConfig:
    identity = EngineIdentity(
        engine_id=args.engine_id,
        role=ROLES[args.role],
        http_endpoint=args.engine_url.rstrip("/"),
        nixl_host=args.nixl_host,
        nixl_port=args.nixl_port,
        kv_compatibility_hash=args.kv_compatibility_hash,
        model=args.model,
        block_size=args.block_size,
        kv_capacity_blocks=args.kv_capacity_blocks,
        max_model_len=args.max_model_len,
    )
    backoff = BackoffPolicy(initial_seconds=args.backoff_initial, max_seconds=args.backoff_max)
    return SidecarConfig(
        identity=identity,
        registry_address=args.registry,
        listen=args.listen.replace("{engine_id}", args.engine_id),
        registration=RegistrationSettings(ttl_seconds=args.ttl_seconds, backoff=backoff),
        monitor=EngineMonitorSettings(
            probe_interval_seconds=args.engine_probe_interval, down_after_seconds=args.engine_down_after
        ),
        fanout=FanoutSettings(backoff=backoff, sweep_interval_seconds=args.sweep_interval),
        registry_timeout_seconds=args.registry_timeout,
        engine_timeout_seconds=args.engine_timeout,
        metrics_address=args.metrics_address,
        otlp_endpoint=args.otlp_endpoint,
        registry_tls=tls_from_args(args),
    )


async def start_sidecar(config: SidecarConfig) -> Sidecar:
    from kvferry.sidecar.app import Sidecar

    sidecar = Sidecar(config)
    await sidecar.start()
    return sidecar


def run(args: argparse.Namespace) -> int:
    """Runs until SIGTERM/SIGINT (exit 0, engine deregistered) or a fatal error such as the registry
    refusing the engine (exit 2)."""
    setup_logging(args.log_level)
    try:
        config = config_from_args(args)
    except ValueError as error:
        print(f"kvferry sidecar: error: {error}", file=sys.stderr)
        return 2
    return run_service("sidecar", lambda: start_sidecar(config))
