"""Mutual TLS of the service kit (kvferry.runtime.tls) with real certificates: the flags, a server that
takes rotated certificate files on its next handshake, and a client channel that takes its rotated files on
its next call, both without a restart."""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import ssl
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvferry.runtime.flags import EnvFlags
from kvferry.runtime.grpc_server import start_server
from kvferry.runtime.tls import (
    ReloadingChannel,
    ReloadingServerContext,
    TlsFiles,
    WatchedTlsFiles,
    add_tls_flags,
    open_channel,
    server_credentials,
    tls_from_args,
)

from tests.fixtures.certificates import TestPki, certificate_der, install, served_certificate


def _parse(argv: list[str], environ: dict[str, str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvferry test")
    add_tls_flags(EnvFlags(parser, environ or {}))
    return parser.parse_args(argv)


def test_tls_is_all_three_files_or_none(tmp_path: Path) -> None:
    pki = TestPki(tmp_path)
    files = pki.issue("router", common_name="router")
    assert tls_from_args(_parse([])) is None
    environ = {
        "KVFERRY_TLS_CERT": str(files.cert),
        "KVFERRY_TLS_KEY": str(files.key),
        "KVFERRY_TLS_CA": str(files.ca),
    }
    assert tls_from_args(_parse([], environ)) == files
    with pytest.raises(ValueError, match="missing --tls-key, --tls-ca"):
        tls_from_args(_parse(["--tls-cert", str(files.cert)]))
    with pytest.raises(ValueError, match="not readable: key"):
        missing_key = ["--tls-key", str(tmp_path / "nope")]
        tls_from_args(_parse(["--tls-cert", str(files.cert), *missing_key, "--tls-ca", str(files.ca)]))


async def _check(address: str, files: TlsFiles | None) -> grpc.StatusCode:
    async with open_channel(address, files) as channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.aio.AioRpcError as error:
            return error.code()
    return grpc.StatusCode.OK


async def test_a_server_takes_rotated_certificates_without_a_restart(tmp_path: Path) -> None:
    old, new = TestPki(tmp_path / "old", name="old-ca"), TestPki(tmp_path / "new", name="new-ca")
    serving = old.issue("registry", common_name="registry")
    # The files the server reads live in one place; rotation replaces them (as a Secret's mount does).
    live = TlsFiles(tmp_path / "tls.crt", tmp_path / "tls.key", tmp_path / "ca.crt")
    install(serving, live)
    # Files looked at on every handshake: no waiting for the check interval.
    credentials = server_credentials(live, check_seconds=0.0)
    server, port, _ = await start_server("127.0.0.1:0", [], credentials=credentials)
    address = f"127.0.0.1:{port}"
    old_client = old.issue("old-client", common_name="router")
    new_client = new.issue("new-client", common_name="router")
    try:
        assert await _check(address, old_client) == grpc.StatusCode.OK
        assert await _check(address, new_client) == grpc.StatusCode.UNAVAILABLE

        rotated = new.issue("registry", common_name="registry")
        install(rotated, live)
        assert await _check(address, new_client) == grpc.StatusCode.OK
        assert await _check(address, old_client) == grpc.StatusCode.UNAVAILABLE
        assert await _check(address, None) == grpc.StatusCode.UNAVAILABLE

        # A key that does not match the certificate, or a CA file that is no certificate, is not taken: the
        # server keeps the last good files.
        shutil.copy(new.issue("other", common_name="registry").key, live.key)
        assert await _check(address, new_client) == grpc.StatusCode.OK
        shutil.copy(rotated.key, live.key)
        live.ca.write_text("not a CA\n")
        assert await _check(address, new_client) == grpc.StatusCode.OK
    finally:
        await server.stop(None)


def _https_context(files: TlsFiles) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(files.cert, files.key)
    return context


async def _hang_up(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.close()


def _refused(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "kvferry.runtime.tls" and "not reloaded" in r.getMessage()]


async def test_an_https_server_takes_rotated_certificates_and_keeps_the_last_good_pair(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pki = TestPki(tmp_path / "pki")
    live = TlsFiles(tmp_path / "tls.crt", tmp_path / "tls.key", tmp_path / "ca.crt")
    first = pki.issue("first")
    install(first, live)
    reloading = ReloadingServerContext(live, _https_context, check_seconds=0.0)
    server = await asyncio.start_server(_hang_up, "127.0.0.1", 0, ssl=reloading.context)
    port = int(server.sockets[0].getsockname()[1])
    caplog.set_level(logging.INFO, logger="kvferry.runtime.tls")
    try:
        assert await served_certificate(port, pki.ca) == certificate_der(first)
        second = pki.issue("second")
        install(second, live)
        assert await served_certificate(port, pki.ca) == certificate_der(second)
        assert reloading.reloads == 1

        # The new certificate lands before its key: not a pair, so the last good one is served, said once.
        third = pki.issue("third")
        shutil.copy(third.cert, live.cert)
        for _ in range(2):
            assert await served_certificate(port, pki.ca) == certificate_der(second)
        [mismatch] = _refused(caplog)
        assert mismatch.levelno == logging.ERROR
        assert mismatch.key == str(live.key) and mismatch.certificate == str(live.cert)  # type: ignore[attr-defined]
        assert "KEY_VALUES_MISMATCH" in mismatch.error  # type: ignore[attr-defined]
        # Its key follows: the pair is served from the next handshake on, the old key no longer.
        shutil.copy(third.key, live.key)
        assert await served_certificate(port, pki.ca) == certificate_der(third)
        assert reloading.reloads == 2

        # A certificate file that is no certificate, then one that is gone: the last good pair again.
        live.cert.write_text("not a certificate\n")
        assert await served_certificate(port, pki.ca) == certificate_der(third)
        assert "PEM" in _refused(caplog)[-1].error  # type: ignore[attr-defined]
        live.cert.unlink()
        assert await served_certificate(port, pki.ca) == certificate_der(third)
        assert "No such file" in _refused(caplog)[-1].error  # type: ignore[attr-defined]
        install(first, live)
        assert await served_certificate(port, pki.ca) == certificate_der(first)
        assert reloading.reloads == 3
    finally:
        server.close()
        await server.wait_closed()


def test_the_watcher_looks_at_the_files_at_most_once_per_check_interval(tmp_path: Path) -> None:
    pki = TestPki(tmp_path / "pki")
    live = TlsFiles(tmp_path / "tls.crt", tmp_path / "tls.key", tmp_path / "ca.crt")
    install(pki.issue("first"), live)
    now = [100.0]
    built: list[str] = []

    def build(files: TlsFiles) -> str:
        built.append(files.cert.read_text())
        return built[-1]

    watched = WatchedTlsFiles(live, build, check_seconds=1.0, clock=lambda: now[0])
    first = watched.current()
    install(pki.issue("second"), live)
    now[0] += 0.5
    assert watched.current() == first and len(built) == 1  # within the interval: the files are not read
    live.cert.unlink()  # not even looked at: no warning, no stat
    now[0] += 0.4
    assert watched.current() == first
    install(pki.issue("second"), live)
    now[0] += 0.2
    assert watched.current() != first and len(built) == 2 and watched.reloads == 1


async def test_a_client_channel_keeps_its_files_until_a_rotation_makes_a_matching_pair(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pki = TestPki(tmp_path / "pki")
    live = TlsFiles(tmp_path / "client.crt", tmp_path / "client.key", tmp_path / "client-ca.crt")
    install(pki.issue("first", common_name="router"), live)
    caplog.set_level(logging.INFO, logger="kvferry.runtime.tls")
    channel = ReloadingChannel("127.0.0.1:1", live, check_seconds=0.0)
    try:
        first = channel.current()
        second = pki.issue("second", common_name="router")
        shutil.copy(second.cert, live.cert)  # the certificate lands before its key
        for _ in range(2):
            assert channel.current() is first and channel.reloads == 0
        [refused] = [r for r in caplog.records if "client TLS files not reloaded" in r.getMessage()]
        assert refused.levelno == logging.ERROR and "KEY_VALUES_MISMATCH" in refused.error  # type: ignore[attr-defined]
        shutil.copy(second.key, live.key)
        assert channel.current() is not first and channel.reloads == 1
    finally:
        await channel.close()


class _PeerNames(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Notes the CN of each caller's certificate (what the server's auth context says)."""

    def __init__(self) -> None:
        self.names: list[str] = []

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = await continuation(handler_call_details)
        unary = handler.unary_unary

        async def noting(request, context):  # type: ignore[no-untyped-def]
            self.names.extend(name.decode() for name in context.auth_context().get("x509_common_name", ()))
            return await unary(request, context)

        return grpc.unary_unary_rpc_method_handler(
            noting, handler.request_deserializer, handler.response_serializer
        )


async def test_a_client_channel_takes_rotated_certificates_without_a_restart(tmp_path: Path) -> None:
    old, new = TestPki(tmp_path / "old", name="old-ca"), TestPki(tmp_path / "new", name="new-ca")
    # Server and client each read their files from one place; a CA rotation replaces both sets.
    server_live = TlsFiles(tmp_path / "server.crt", tmp_path / "server.key", tmp_path / "server-ca.crt")
    client_live = TlsFiles(tmp_path / "client.crt", tmp_path / "client.key", tmp_path / "client-ca.crt")
    install(old.issue("registry", common_name="registry"), server_live)
    install(old.issue("client", common_name="router"), client_live)
    peers = _PeerNames()
    server, port, _ = await start_server(
        "127.0.0.1:0",
        [],
        interceptors=[peers],
        credentials=server_credentials(server_live, check_seconds=0.0),
    )
    address = f"127.0.0.1:{port}"
    channel = open_channel(address, client_live)
    assert isinstance(channel, ReloadingChannel)
    channel_checks = ReloadingChannel(address, client_live, check_seconds=0.0)
    # Stubs keep what the channel handed them when they were made: these live across the rotation.
    stub, stub_checking = health_pb2_grpc.HealthStub(channel), health_pb2_grpc.HealthStub(channel_checks)
    check = health_pb2.HealthCheckRequest()
    try:
        await stub.Check(check, timeout=5)
        await stub_checking.Check(check, timeout=5)
        assert peers.names == ["router", "router"]

        # Both sides rotate to the new CA; the client's certificate now names another identity.
        install(new.issue("registry", common_name="registry"), server_live)
        install(new.issue("client", common_name="admin"), client_live)
        await stub_checking.Check(check, timeout=5)
        assert peers.names[-1] == "admin" and channel_checks.reloads == 1
        await stub_checking.Check(check, timeout=5)  # no change since: no rebuild
        assert channel_checks.reloads == 1
        # A channel that kept the old files would offer a certificate the server no longer trusts (and
        # distrust the server's): the default channel checks its files at most once a second.
        await asyncio.sleep(1.1)
        await stub.Check(check, timeout=5)
        assert peers.names[-1] == "admin"
    finally:
        await channel.close()
        await channel_checks.close()
        await server.stop(None)
