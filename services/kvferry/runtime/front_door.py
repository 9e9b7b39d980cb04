"""The flags both front doors share, ``kvferry router`` and ``kvferry picker``: the registry they read, the
API keys that map callers to tenants (format: docs/router.md), and mutual TLS (:mod:`kvferry.runtime.tls`).

The registry's address is ``KVFERRY_REGISTRY`` for every service; the other variables carry the service's
name (``KVFERRY_ROUTER_TENANTS_FILE``, ``KVFERRY_PICKER_TENANTS_FILE``), so one environment can give the
router and the picker different files.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from kvferry.runtime.flags import EnvFlags
from kvferry.runtime.tls import TlsFiles, add_tls_flags, tls_from_args

DEFAULT_REGISTRY = "127.0.0.1:50051"


@dataclass(frozen=True)
class FrontDoorSettings:
    registry_address: str
    registry_timeout_seconds: float
    tenants_file: Path | None
    # KEY=TENANT[,KEY=TENANT...]
    api_keys: str
    tls: TlsFiles | None


def add_front_door_flags(flags: EnvFlags, service: str, *, registry_timeout_seconds: float) -> None:
    """``--registry``, ``--registry-timeout``, ``--tenants-file``, ``--api-keys`` and the TLS flags, their
    variables named after ``service`` (``router``: ``KVFERRY_ROUTER_API_KEYS``)."""
    env = f"KVFERRY_{service.upper()}"
    flags.add("--registry", "KVFERRY_REGISTRY", "registry gRPC address, HOST:PORT", default=DEFAULT_REGISTRY)
    flags.add(
        "--registry-timeout",
        f"{env}_REGISTRY_TIMEOUT",
        "deadline of each registry call, seconds",
        type=float,
        default=registry_timeout_seconds,
    )
    flags.add(
        "--tenants-file",
        f"{env}_TENANTS_FILE",
        "API keys -> tenants, a .toml or .json file (format: docs/router.md)",
    )
    flags.add(
        "--api-keys",
        f"{env}_API_KEYS",
        "extra API keys as KEY=TENANT[,KEY=TENANT...] (for local stacks; prefer --tenants-file)",
    )
    add_tls_flags(flags)


def front_door_from_args(args: argparse.Namespace) -> FrontDoorSettings:
    """What the flags of :func:`add_front_door_flags` say; ValueError when the TLS flags are incomplete or
    name a file that cannot be read."""
    return FrontDoorSettings(
        registry_address=args.registry,
        registry_timeout_seconds=args.registry_timeout,
        tenants_file=Path(args.tenants_file) if args.tenants_file else None,
        api_keys=args.api_keys or "",
        tls=tls_from_args(args),
    )
