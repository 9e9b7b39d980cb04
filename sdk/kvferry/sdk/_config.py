"""Client settings as plain dataclasses, and the one place that reads them from the environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvferry.sdk._errors import ConfigError
from kvferry.sdk._keepalive import KeepAliveSettings
from kvferry.sdk._retry import RetryPolicy

ENV_ADDRESS = "KVFERRY_ADDRESS"
ENV_API_KEY = "KVFERRY_API_KEY"
ENV_TLS = "KVFERRY_TLS"
ENV_TLS_CA = "KVFERRY_TLS_CA"
ENV_TLS_CERT = "KVFERRY_TLS_CERT"
ENV_TLS_KEY = "KVFERRY_TLS_KEY"
ENV_TLS_SERVER_NAME = "KVFERRY_TLS_SERVER_NAME"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class Deadlines:
    """Deadline of every call, in seconds; retries happen within it, never past it."""

    # A whole Generate stream: first token to summary.
    generate_seconds: float = 300.0
    # RenewConversation, CloseConversation, GetConversation.
    control_seconds: float = 10.0

    def __post_init__(self) -> None:
        if self.generate_seconds <= 0 or self.control_seconds <= 0:
            raise ValueError("deadlines must be positive")


@dataclass(frozen=True)
class TlsConfig:
    """TLS to the router: PEM bytes; no ``root_certificates`` trusts the system roots.

    ``certificate_chain`` + ``private_key`` present a client certificate (mutual TLS);
    ``server_name`` overrides the name checked against the router's certificate.
    """

    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    # Secret: never in a repr (nor in logs or errors that print the config).
    private_key: bytes | None = field(default=None, repr=False)
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ConfigError("a client certificate needs both certificate_chain and private_key")

    @classmethod
    def from_files(
        cls,
        ca: str | Path | None = None,
        cert: str | Path | None = None,
        key: str | Path | None = None,
        server_name: str | None = None,
    ) -> TlsConfig:
        """Reads PEM files (a CA bundle, and optionally a client certificate and key)."""
        return cls(
            root_certificates=_read_pem(ca, "CA certificate"),
            certificate_chain=_read_pem(cert, "client certificate"),
            private_key=_read_pem(key, "client key"),
            server_name=server_name,
        )


@dataclass(frozen=True)
class ClientConfig:
    """Everything a ``Client`` needs; build it directly or with ``ClientConfig.load``."""

    address: str
    # Secret: never in a repr (nor in logs or errors that print the config).
    api_key: str | None = field(default=None, repr=False)
    tls: TlsConfig | None = None
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    deadlines: Deadlines = field(default_factory=Deadlines)
    keep_alive: KeepAliveSettings = field(default_factory=KeepAliveSettings)

    def __post_init__(self) -> None:
        problem = address_problem(self.address)
        if problem:
            raise ConfigError(problem)

    @classmethod
    def load(
        cls,
        address: str | None = None,
        *,
        api_key: str | None = None,
        tls: bool | TlsConfig | None = None,
        retry: RetryPolicy | None = None,
        deadlines: Deadlines | None = None,
        keep_alive: KeepAliveSettings | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> ClientConfig:
        """Arguments first, then the environment (KVFERRY_ADDRESS, KVFERRY_API_KEY, KVFERRY_TLS*).

        ``tls``: a ``TlsConfig`` is used as given; True turns TLS on (with KVFERRY_TLS_CA etc. when
        set, else the system roots); False turns it off whatever the environment says; None lets
        the environment decide (TLS when KVFERRY_TLS is true or KVFERRY_TLS_CA is set).
        """
        env = os.environ if environ is None else environ
        resolved_address = address or env.get(ENV_ADDRESS, "")
        if not resolved_address:
            raise ConfigError(
                f"no router address: pass address='host:port' or set {ENV_ADDRESS} "
                "(`kvferry up` prints the router's gRPC address)"
            )
        resolved_key = api_key if api_key is not None else (env.get(ENV_API_KEY) or None)
        return cls(
            address=resolved_address,
            api_key=resolved_key,
            tls=_resolve_tls(tls, env),
            retry=retry or RetryPolicy(),
            deadlines=deadlines or Deadlines(),
            keep_alive=keep_alive or KeepAliveSettings(),
        )


def address_problem(address: str) -> str | None:
    """None when ``address`` is a usable ``host:port``, else what is wrong with it."""
    if "://" in address:
        return f"router address {address!r} must be host:port, without a scheme"
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        return f"router address {address!r} must be host:port (e.g. 127.0.0.1:50051)"
    return None


def _resolve_tls(tls: bool | TlsConfig | None, env: Mapping[str, str]) -> TlsConfig | None:
    if isinstance(tls, TlsConfig):
        return tls
    if tls is False:
        return None
    wanted = tls is True or _env_flag(env, ENV_TLS) or bool(env.get(ENV_TLS_CA))
    if not wanted:
        return None
    return TlsConfig.from_files(
        ca=env.get(ENV_TLS_CA) or None,
        cert=env.get(ENV_TLS_CERT) or None,
        key=env.get(ENV_TLS_KEY) or None,
        server_name=env.get(ENV_TLS_SERVER_NAME) or None,
    )


def _env_flag(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={value!r} is not a boolean; use 1/0, true/false, yes/no or on/off")


def _read_pem(path: str | Path | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ConfigError(f"cannot read the {what} at {path}: {error.strerror or error}") from error
