"""``kvferry picker``: the Gateway API Inference Extension endpoint picker (Envoy ext_proc), docs/gateway.md.

Every flag has an environment variable (shown in --help); a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path

from kvferry.picker.server import PickerConfig, RunningPicker, start_picker
from kvferry.runtime.flags import EnvFlags, add_log_level_flag, add_telemetry_flags
from kvferry.runtime.host import run_service
from kvferry.runtime.logs import setup_logging
from kvferry.runtime.tls import add_tls_flags, tls_from_args

_DEFAULTS = PickerConfig(registry_address="127.0.0.1:50051")


def configure(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    parser.description = (
        "Run the endpoint picker: answers Envoy's external processing (ext_proc) for a gateway of the "
        "Gateway API Inference Extension, sending each turn to the engine that holds its conversation's KV."
    )
    flags = EnvFlags(parser, environ)
    flags.add(
        "--registry",
        "KVFERRY_REGISTRY",
        "registry gRPC address, HOST:PORT",
        default=_DEFAULTS.registry_address,
    )
    flags.add(
        "--listen",
        "KVFERRY_PICKER_LISTEN",
        "ext_proc gRPC listen address (port 0: any)",
        default=_DEFAULTS.listen,
    )
    flags.add(
        "--tenants-file",
        "KVFERRY_PICKER_TENANTS_FILE",
        "API keys -> tenants, the router's file (format: docs/router.md)",
    )
    flags.add(
        "--api-keys",
        "KVFERRY_PICKER_API_KEYS",
        "extra API keys as KEY=TENANT[,KEY=TENANT...] (for local stacks; prefer --tenants-file)",
    )
    flags.add(
        "--registry-timeout",
        "KVFERRY_PICKER_REGISTRY_TIMEOUT",
        "deadline of each registry call, seconds",
        type=float,
        default=_DEFAULTS.registry_timeout_seconds,
    )
    flags.add(
        "--max-body-bytes",
        "KVFERRY_PICKER_MAX_BODY_BYTES",
        "largest request body the picker reads",
        type=int,
        default=_DEFAULTS.max_body_bytes,
    )
    add_log_level_flag(flags)
    add_tls_flags(flags)
    add_telemetry_flags(flags)


def config_from_args(args: argparse.Namespace) -> PickerConfig:
    return PickerConfig(
        registry_address=args.registry,
        listen=args.listen,
        tenants_file=Path(args.tenants_file) if args.tenants_file else None,
        api_keys=args.api_keys or "",
        registry_timeout_seconds=args.registry_timeout,
        max_body_bytes=args.max_body_bytes,
        # The service starts even with the registry away (not ready) and syncs when it comes.
        startup_sync_seconds=3.0,
        metrics_address=args.metrics_address or None,
        tls=tls_from_args(args),
    )


async def _start(config: PickerConfig) -> RunningPicker:
    picker = await start_picker(config)
    print(f"kvferry picker: ext_proc {picker.address}", flush=True)
    return picker


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    config = config_from_args(args)
    return run_service("picker", lambda: _start(config))
