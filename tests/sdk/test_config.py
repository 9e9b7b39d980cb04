"""Client settings from arguments and the environment."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvferry.sdk import ClientConfig, ConfigError, Deadlines, RetryPolicy, TlsConfig


def test_address_and_key_from_environment() -> None:
    config = ClientConfig.load(environ={"KVFERRY_ADDRESS": "127.0.0.1:7000", "KVFERRY_API_KEY": "k1"})
    assert config.address == "127.0.0.1:7000"
    assert config.api_key == "k1"
    assert config.tls is None
    assert config.retry == RetryPolicy() and config.deadlines == Deadlines()


def test_arguments_win_over_environment() -> None:
    env = {"KVFERRY_ADDRESS": "127.0.0.1:7000", "KVFERRY_API_KEY": "k1", "KVFERRY_TLS": "true"}
    config = ClientConfig.load("127.0.0.1:9000", api_key="k2", tls=False, environ=env)
    assert (config.address, config.api_key, config.tls) == ("127.0.0.1:9000", "k2", None)


def test_missing_address_says_how_to_fix_it() -> None:
    with pytest.raises(ConfigError, match="KVFERRY_ADDRESS"):
        ClientConfig.load(environ={})


@pytest.mark.parametrize("address", ["http://127.0.0.1:1", "localhost", "127.0.0.1:", ":80", "h:port"])
def test_rejects_malformed_addresses(address: str) -> None:
    with pytest.raises(ConfigError, match="host:port"):
        ClientConfig.load(address, environ={})


def test_tls_files_from_environment(tmp_path: Path) -> None:
    ca, cert, key = tmp_path / "ca.pem", tmp_path / "c.pem", tmp_path / "k.pem"
    ca.write_bytes(b"CA")
    cert.write_bytes(b"CERT")
    key.write_bytes(b"KEY")
    env = {
        "KVFERRY_ADDRESS": "127.0.0.1:7000",
        "KVFERRY_TLS_CA": str(ca),
        "KVFERRY_TLS_CERT": str(cert),
        "KVFERRY_TLS_KEY": str(key),
        "KVFERRY_TLS_SERVER_NAME": "router.kvferry",
    }
    config = ClientConfig.load(environ=env)
    assert config.tls == TlsConfig(b"CA", b"CERT", b"KEY", "router.kvferry")


def test_tls_true_without_ca_uses_system_roots() -> None:
    config = ClientConfig.load("127.0.0.1:7000", tls=True, environ={})
    assert config.tls == TlsConfig()


def test_tls_flag_must_be_boolean() -> None:
    with pytest.raises(ConfigError, match="KVFERRY_TLS"):
        ClientConfig.load("127.0.0.1:7000", environ={"KVFERRY_TLS": "maybe"})


def test_unreadable_ca_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="CA certificate"):
        ClientConfig.load("127.0.0.1:7000", environ={"KVFERRY_TLS_CA": str(tmp_path / "missing.pem")})


def test_client_certificate_needs_its_key() -> None:
    with pytest.raises(ConfigError, match="private_key"):
        TlsConfig(certificate_chain=b"CERT")


def test_rejects_non_positive_deadlines() -> None:
    with pytest.raises(ValueError):
        Deadlines(control_seconds=0)
