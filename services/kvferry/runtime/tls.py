"""TLS for kvferry's gRPC and HTTPS traffic, one way for every service: the same three files (certificate,
key, CA) and the same flags on the registry (server), the sidecar and the router (its clients).

- A server reads its files again when they change, before the next TLS handshake: one watcher,
  :class:`WatchedTlsFiles`, compares the files' inode, modification time and size (one ``stat`` each, at
  most once a second: handshakes in between take the current build) and builds again when they moved.
  grpc asks it through :class:`ReloadingCertificates` (:func:`server_credentials` requires a client
  certificate signed by the CA); an HTTPS server through :class:`ReloadingServerContext` (an
  ``ssl.SSLContext`` whose SNI callback moves each new handshake onto the current context). cert-manager
  and kubelet rotate Secrets by swapping the files under a mount; running connections keep the
  certificate they started with, new ones get the new one, no restart. Files that do not make a
  certificate and its matching key keep the current certificate, with an error logged.
- A client (:func:`open_channel`) presents its certificate and trusts only the CA, and takes rotated files
  up without a restart too: grpc's channel credentials are fixed once built, so :class:`ReloadingChannel`
  compares the files' fingerprint before a call (at most once a second) and, when they moved, sends the
  calls from then on over a new channel built from the new files. Calls running on the old channel (a
  watch stream) keep it until the next rotation or until they end, and reconnect over the new one.
- Without TLS settings (the local stack, tests) everything stays plaintext, as before.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import grpc
from kvferry.runtime.flags import EnvFlags

log = logging.getLogger(__name__)

T = TypeVar("T")


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


class WatchedTlsFiles(Generic[T]):
    """What a server builds from its TLS files (``build``), built again when the files change: the one
    watcher behind the gRPC servers' credentials and the HTTPS port's ``ssl.SSLContext``.

    :meth:`current` is asked before each new TLS handshake (from grpc's threads or the event loop); it
    looks at the files (a ``stat`` each) at most once every ``check_seconds``, so a burst of handshakes
    costs the event loop no file system calls. When the fingerprint moved, ``build`` runs; a build that
    fails (a file unreadable, a key that does not match its certificate, a file caught half-written) keeps
    the last good one and logs an error naming the files, once per change: the next change (the rest of
    the write, the fixed file) is tried again.
    """

    def __init__(
        self,
        files: TlsFiles,
        build: Callable[[TlsFiles], T],
        *,
        check_seconds: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._files = files
        self._build = build
        self._check_seconds = check_seconds
        self._clock = clock
        self._checked = clock()
        self._lock = threading.Lock()
        self._seen = files.fingerprint()
        self._unreadable = ""
        # The first build raises: a server that cannot read its files at start does not start.
        self._current = build(files)
        self.reloads = 0

    def current(self) -> T:
        """The build of the files as they are now, or the last good one when they no longer build."""
        with self._lock:
            checked = self._clock()
            if checked - self._checked < self._check_seconds:
                return self._current
            self._checked = checked
            try:
                now = self._files.fingerprint()
            except OSError as error:
                # A file missing for a moment (a Secret's files being swapped); said once, tried again.
                if str(error) != self._unreadable:
                    self._unreadable = str(error)
                    log.warning(
                        "TLS files not reloaded: one cannot be read now; keeping the current certificate",
                        extra={"error": str(error)},
                    )
                return self._current
            self._unreadable = ""
            if now == self._seen:
                return self._current
            self._seen = now
            try:
                fresh = self._build(self._files)
            except (OSError, ssl.SSLError, ValueError) as error:
                log.error(
                    "TLS files not reloaded: they do not make a certificate and matching key; keeping the "
                    "current certificate until they change again",
                    extra={
                        "certificate": str(self._files.cert),
                        "key": str(self._files.key),
                        "ca": str(self._files.ca),
                        "error": str(error),
                    },
                )
                return self._current
            self._current = fresh
            self.reloads += 1
            log.info("TLS certificate reloaded", extra={"certificate": str(self._files.cert)})
            return fresh


def check_files(files: TlsFiles, purpose: int = ssl.PROTOCOL_TLS_SERVER) -> None:
    """Raises (ssl.SSLError naming what is wrong, OSError) unless the files make a certificate, its matching
    key and a CA. grpc takes the bytes as they are, and a key that does not match (or a CA that is no
    certificate) would fail every handshake from then on: OpenSSL checks them first."""
    check = ssl.SSLContext(purpose)
    check.load_cert_chain(files.cert, files.key)
    check.load_verify_locations(files.ca)


def _grpc_configuration(files: TlsFiles) -> grpc.ServerCertificateConfiguration:
    check_files(files)
    cert, key, ca = files.read()
    return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)


class ReloadingCertificates:
    """grpc's certificate configuration fetcher: the files as a new configuration when they changed since
    the last one handed out, else None (grpc keeps the current one)."""

    def __init__(self, files: TlsFiles, *, check_seconds: float = 1.0) -> None:
        self._watched = WatchedTlsFiles(files, _grpc_configuration, check_seconds=check_seconds)
        self.initial = self._handed = self._watched.current()

    @property
    def reloads(self) -> int:
        return self._watched.reloads

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        configuration = self._watched.current()
        if configuration is self._handed:
            return None
        self._handed = configuration
        return configuration


class ReloadingServerContext:
    """An ``ssl.SSLContext`` for an HTTPS server that takes rotated files up on the next handshake.

    ``context`` is the one the server listens with; its SNI callback, which OpenSSL runs for every
    ClientHello (with or without a server name), asks the watcher for the context built from the files as
    they are now and moves the handshake onto it. Connections already open keep their certificate.
    ``build`` makes a server context from the files (the server's own settings: ALPN, ciphers).
    """

    def __init__(
        self, files: TlsFiles, build: Callable[[TlsFiles], ssl.SSLContext], *, check_seconds: float = 1.0
    ) -> None:
        self._watched = WatchedTlsFiles(files, build, check_seconds=check_seconds)
        self.context = self._watched.current()
        self.context.sni_callback = self._on_client_hello

    @property
    def reloads(self) -> int:
        return self._watched.reloads

    def _on_client_hello(
        self, connection: ssl.SSLObject | ssl.SSLSocket, _server_name: str | None, _context: object
    ) -> None:
        current = self._watched.current()
        if current is not connection.context:
            connection.context = current


def server_credentials(
    files: TlsFiles, *, client_certificates: bool = True, check_seconds: float = 1.0
) -> grpc.ServerCredentials:
    """Server credentials, reloaded when the files change (looked at, on a handshake, at most once every
    ``check_seconds``), requiring a client certificate from ``files.ca`` (``client_certificates`` False:
    none asked, for agents that authenticate with API keys)."""
    fetcher = ReloadingCertificates(files, check_seconds=check_seconds)
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
    """A channel to ``address``: mutual TLS with ``tls`` (rotated files taken up, :class:`ReloadingChannel`),
    plaintext without."""
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=list(interceptors))
    return ReloadingChannel(address, tls, interceptors=interceptors, options=options)


class ReloadingChannel(grpc.aio.Channel):  # type: ignore[misc]
    """A mutual-TLS channel that reads its files again when they change.

    Stubs keep the multi-callables a channel hands them, so each one here looks up the current channel
    when it is called. Before a call, at most once every ``check_seconds``, the files' fingerprint (one
    ``stat`` each) is compared with the one the current channel was built from; when it moved, a new channel
    takes the calls from then on. The channel it replaces is kept for the calls still running on it (a
    long watch) and closed at the next rotation or :meth:`close`. Files that do not make a certificate and
    its matching key (one caught half-written: a certificate written before its key) are not taken: the
    current channel stays, an error is logged once, and the next change (the rest of the write) is tried.
    """

    def __init__(
        self,
        address: str,
        files: TlsFiles,
        *,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        options: Sequence[tuple[str, Any]] = (),
        check_seconds: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._address = address
        self._files = files
        self._interceptors = list(interceptors)
        self._options = list(options)
        self._check_seconds = check_seconds
        self._clock = clock
        self._seen = files.fingerprint()
        self._checked = clock()
        self._channel = self._open()
        self._retired: grpc.aio.Channel | None = None
        self._closing: set[asyncio.Future[None]] = set()
        self.reloads = 0

    def _open(self) -> grpc.aio.Channel:
        return grpc.aio.secure_channel(
            self._address,
            channel_credentials(self._files),
            options=self._options,
            interceptors=self._interceptors,
        )

    def current(self) -> grpc.aio.Channel:
        """The channel built from the files as they are now (rebuilt when they changed)."""
        now = self._clock()
        if now - self._checked < self._check_seconds:
            return self._channel
        self._checked = now
        try:
            fingerprint = self._files.fingerprint()
            if fingerprint == self._seen:
                return self._channel
        except OSError as error:
            log.warning(
                "client TLS files not reloaded; keeping the current ones", extra={"error": str(error)}
            )
            return self._channel
        try:
            check_files(self._files, ssl.PROTOCOL_TLS_CLIENT)
            fresh = self._open()
        except (OSError, ssl.SSLError, ValueError) as error:
            self._seen = fingerprint  # said once per change; the next change is tried again
            log.error(
                "client TLS files not reloaded: they do not make a certificate and matching key; keeping "
                "the current ones until they change again",
                extra={
                    "certificate": str(self._files.cert),
                    "key": str(self._files.key),
                    "error": str(error),
                },
            )
            return self._channel
        if self._retired is not None:
            # Calls still on the channel two rotations back have lived a whole rotation: they reconnect.
            closing = asyncio.ensure_future(self._retired.close())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        self._retired, self._channel, self._seen = self._channel, fresh, fingerprint
        self.reloads += 1
        log.info(
            "client TLS certificate reloaded",
            extra={"certificate": str(self._files.cert), "peer": self._address},
        )
        return self._channel

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Reloading(self, "unary_unary", method, args, kwargs)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Reloading(self, "unary_stream", method, args, kwargs)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Reloading(self, "stream_unary", method, args, kwargs)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Reloading(self, "stream_stream", method, args, kwargs)

    async def __aenter__(self) -> ReloadingChannel:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self, grace: float | None = None) -> None:
        if self._retired is not None:
            await self._retired.close(grace)
        await self._channel.close(grace)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self.current().get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self.current().channel_ready()


class _Reloading:
    """A multi-callable of :class:`ReloadingChannel`: each call goes to the channel current then."""

    def __init__(
        self, owner: ReloadingChannel, kind: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        self._owner = owner
        self._kind = kind
        self._method = method
        self._args = args
        self._kwargs = kwargs
        self._made_on: grpc.aio.Channel | None = None
        self._callable: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        channel = self._owner.current()
        if channel is not self._made_on:
            self._callable = getattr(channel, self._kind)(self._method, *self._args, **self._kwargs)
            self._made_on = channel
        return self._callable(*args, **kwargs)
