"""The router's and the picker's shared flags (kvferry.runtime.front_door): the same flags on both, each
with its documented variable (docs/router.md; the picker's carry its own name), the command line winning."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from kvferry.picker import cli as picker_cli
from kvferry.router import cli as router_cli
from kvferry.runtime.tls import TlsFiles

pytestmark = pytest.mark.timeout(30)

Configure = Callable[[argparse.ArgumentParser, Mapping[str, str]], None]
CLIS: list[tuple[str, Configure, Callable[[argparse.Namespace], Any]]] = [
    ("ROUTER", router_cli.configure, router_cli.config_from_args),
    ("PICKER", picker_cli.configure, picker_cli.config_from_args),
]


def _config(configure: Configure, to_config: Callable[[argparse.Namespace], Any], environ: dict[str, str],
            argv: list[str]) -> Any:  # fmt: skip
    parser = argparse.ArgumentParser(prog="kvferry test")
    configure(parser, environ)
    return to_config(parser.parse_args(argv))


@pytest.mark.parametrize(("service", "configure", "to_config"), CLIS)
def test_each_front_door_reads_its_variables_and_the_command_line_wins(
    service: str, configure: Configure, to_config: Callable[[argparse.Namespace], Any], tmp_path: Path
) -> None:
    pem = {part: tmp_path / f"{part}.pem" for part in ("cert", "key", "ca")}
    for path in pem.values():
        path.write_text("pem")
    environ = {
        "KVFERRY_REGISTRY": "10.0.0.7:50051",
        f"KVFERRY_{service}_REGISTRY_TIMEOUT": "4.5",
        f"KVFERRY_{service}_TENANTS_FILE": "/etc/kvferry/tenants.toml",
        f"KVFERRY_{service}_API_KEYS": "k1=acme",
        **{f"KVFERRY_TLS_{part.upper()}": str(path) for part, path in pem.items()},
    }
    config = _config(configure, to_config, environ, [])
    assert (config.registry_address, config.registry_timeout_seconds) == ("10.0.0.7:50051", 4.5)
    assert (config.tenants_file, config.api_keys) == (Path("/etc/kvferry/tenants.toml"), "k1=acme")
    assert config.tls == TlsFiles(pem["cert"], pem["key"], pem["ca"])

    argv = ["--registry", "r:1", "--registry-timeout", "1", "--tenants-file", "t.json", "--api-keys", "k2=x"]
    config = _config(configure, to_config, environ, argv)
    assert (config.registry_address, config.registry_timeout_seconds) == ("r:1", 1.0)
    assert (config.tenants_file, config.api_keys) == (Path("t.json"), "k2=x")

    config = _config(configure, to_config, {}, [])
    assert (config.registry_address, config.tenants_file, config.api_keys, config.tls) == (
        "127.0.0.1:50051",
        None,
        "",
        None,
    )


@pytest.mark.parametrize(("service", "configure", "to_config"), CLIS)
def test_half_the_tls_flags_are_refused_on_both(
    service: str, configure: Configure, to_config: Callable[[argparse.Namespace], Any]
) -> None:
    with pytest.raises(ValueError, match="missing --tls-key, --tls-ca"):
        _config(configure, to_config, {"KVFERRY_TLS_CERT": "cert.pem"}, [])
