"""Mutual TLS for kvferry's gRPC traffic, one way for every service: the same three files (certificate,
key, CA) and the same flags on the registry (server), the sidecar and the router (its clients).

- A server (:func:`server_credentials`) requires a client certificate signed by the CA and reads its files
  again when they change: grpc asks :class:`ReloadingCertificates` before each new TLS handshake, which
  compares the files' modification times and sizes (one ``stat`` each) and hands grpc the new pair and CA
  when they moved. cert-manager and kubelet rotate Secrets by swapping the files under a mount; running
  connections keep the certificate they started with, new ones get the new one, no restart.
- A client (:func:`open_channel`) presents its certificate and trusts only the CA. It reads the files when
  the channel opens: a rotated client certificate is taken up by the next process start or channel
  (grpc's channel credentials are fixed once built).
- Without TLS settings (the local stack, tests) everything stays plaintext, as before.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from kvferry.runtime.flags import EnvFlags

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TlsFiles:
    """Where a process finds its PEM certificate (chain), its private key and the CA it trusts."""

    cert: Path
    key: Path
    ca: Path

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(certificate chain, private key, CA); OSError naming the file that could not be read."""
        return self.cert.read_bytes(), self.key.read_bytes(), self.ca.read_bytes()

    def check(self) -> None:
        """ValueError naming each file that cannot be read (at start, so a typo stops the command)."""
        missing = [f"{what} {path}" for what, path in self._named() if not os.access(path, os.R_OK)]
        if missing:
            raise ValueError(f"TLS files not readable: {', '.join(missing)}")

    def _named(self) -> tuple[tuple[str, Path], ...]:
        return (("certificate", self.cert), ("key", self.key), ("CA", self.ca))

    def fingerprint(self) -> tuple[tuple[int, int, int], ...]:
        """What changes when any of the files is replaced (inode, mtime, size)."""
        stats = [path.stat() for _, path in self._named()]
        return tuple((s.st_ino, s.st_mtime_ns, s.st_size) for s in stats)


def add_tls_flags(flags: EnvFlags, *, peer: str = "", prefix: str = "tls") -> None:
    """``--tls-cert``, ``--tls-key``, ``--tls-ca`` (env ``KVFERRY_TLS_*``): all three turn mutual TLS on,
    none leaves it off. ``prefix`` names another set (``etcd-tls``: ``--etcd-tls-*``, ``KVFERRY_ETCD_TLS_*``)
    for the connection to ``peer``."""
    env = "KVFERRY_" + prefix.upper().replace("-", "_")
    towards = f" to {peer}" if peer else ""
    tls = flags.group(f"TLS{towards} (all three or none; none: plaintext)")
    tls.add(
        f"--{prefix}-cert",
        f"{env}_CERT",
        f"PEM certificate (chain) this process presents{towards}; it names its role (docs/security.md)",
    )
    tls.add(f"--{prefix}-key", f"{env}_KEY", f"PEM private key of --{prefix}-cert")
    tls.add(f"--{prefix}-ca", f"{env}_CA", "PEM CA certificate(s) the peers' certificates must chain to")


def tls_from_args(args: Any, prefix: str = "tls") -> TlsFiles | None:
    """The TLS files the flags of :func:`add_tls_flags` name; None when none is set. ValueError when only
    some are, or one cannot be read."""
    attribute = prefix.replace("-", "_")
    given = {f"--{prefix}-{part}": getattr(args, f"{attribute}_{part}") for part in ("cert", "key", "ca")}
    if not any(given.values()):
        return None
    missing = [flag for flag, value in given.items() if not value]
    if missing:
        raise ValueError(
            f"TLS needs --{prefix}-cert, --{prefix}-key and --{prefix}-ca together; "
            f"missing {', '.join(missing)}"
        )
    cert, key, ca = given.values()
    files = TlsFiles(Path(cert), Path(key), Path(ca))
    files.check()
    return files


class ReloadingCertificates:
    """grpc's certificate configuration fetcher: the files as a new configuration when they changed since
    the last one handed out, else None (grpc keeps the current one).

    grpc calls it from its own threads before each handshake; a ``stat`` per file keeps that cheap. A file
    caught half-written (the key not matching yet) fails that one handshake, and the next call reads again.
    """

    def __init__(self, files: TlsFiles) -> None:
        self._files = files
        self._lock = threading.Lock()
        self._seen = files.fingerprint()
        self.initial = self._configuration()
        self.reloads = 0

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        cert, key, ca = self._files.read()
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        with self._lock:
            try:
                now = self._files.fingerprint()
                if now == self._seen:
                    return None
                configuration = self._configuration()
            except OSError as error:
                log.warning("TLS files not reloaded; keeping the current ones", extra={"error": str(error)})
                return None
            self._seen = now
            self.reloads += 1
            log.info("TLS certificate reloaded", extra={"certificate": str(self._files.cert)})
            return configuration


def server_credentials(files: TlsFiles, *, client_certificates: bool = True) -> grpc.ServerCredentials:
    """Server credentials, reloaded when the files change, requiring a client certificate from ``files.ca``
    (``client_certificates`` False: none asked, for agents that authenticate with API keys)."""
    fetcher = ReloadingCertificates(files)
    return grpc.dynamic_ssl_server_credentials(
        fetcher.initial, fetcher, require_client_authentication=client_certificates
    )


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    cert, key, ca = files.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def open_channel(
    address: str,
    tls: TlsFiles | None,
    *,
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.aio.Channel:
    """A channel to ``address``: mutual TLS with ``tls``, plaintext without."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=list(interceptors))
    return grpc.aio.secure_channel(
        address, channel_credentials(tls), options=list(options), interceptors=list(interceptors)
    )
