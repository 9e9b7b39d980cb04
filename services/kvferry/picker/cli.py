"""``kvferry picker``: the Gateway API Inference Extension endpoint picker (Envoy ext_proc), docs/gateway.md.

Every flag has an environment variable (shown in --help); a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from kvferry.picker.server import PickerConfig, RunningPicker, start_picker
from kvferry.runtime.flags import EnvFlags, add_log_level_flag, add_telemetry_flags
from kvferry.runtime.front_door import DEFAULT_REGISTRY, add_front_door_flags, front_door_from_args
from kvferry.runtime.host import run_service
from kvferry.runtime.logs import setup_logging

_DEFAULTS = PickerConfig(registry_address=DEFAULT_REGISTRY)


def configure(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    parser.description = (
        "Run the endpoint picker: answers Envoy's external processing (ext_proc) for a gateway of the "
        "Gateway API Inference Extension, sending each turn to the engine that holds its conversation's KV."
    )
    flags = EnvFlags(parser, environ)
    add_front_door_flags(flags, "picker", registry_timeout_seconds=_DEFAULTS.registry_timeout_seconds)
    flags.add(
        "--listen",
        "KVFERRY_PICKER_LISTEN",
        "ext_proc gRPC listen address (port 0: any)",
        default=_DEFAULTS.listen,
    )
    flags.add(
        "--max-body-bytes",
        "KVFERRY_PICKER_MAX_BODY_BYTES",
        "largest request body the picker reads",
        type=int,
        default=_DEFAULTS.max_body_bytes,
    )
    add_log_level_flag(flags)
    add_telemetry_flags(flags)


def config_from_args(args: argparse.Namespace) -> PickerConfig:
    front = front_door_from_args(args)
    return PickerConfig(
        registry_address=front.registry_address,
        listen=args.listen,
        tenants_file=front.tenants_file,
        api_keys=front.api_keys,
        registry_timeout_seconds=front.registry_timeout_seconds,
        max_body_bytes=args.max_body_bytes,
        # The service starts even with the registry away (not ready) and syncs when it comes.
        startup_sync_seconds=3.0,
        metrics_address=args.metrics_address or None,
        tls=front.tls,
    )


async def _start(config: PickerConfig) -> RunningPicker:
    picker = await start_picker(config)
    print(f"kvferry picker: ext_proc {picker.address}", flush=True)
    return picker


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    config = config_from_args(args)
    return run_service("picker", lambda: _start(config))
