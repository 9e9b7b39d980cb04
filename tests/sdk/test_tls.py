"""TLS to a real grpc.aio server (the STAND-IN RouterService) with certificates made by `openssl`:
the CA from KVFERRY_TLS_CA, the name override, and mutual TLS with a client certificate."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from kvferry.sdk import Client, TlsConfig, UnavailableError

from tests.sdk.conftest import API_KEY, OTHER_API_KEY
from tests.sdk.standin_router import StandInRouter

SERVER_NAME = "router.kvferry.test"

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _issue(directory: Path, name: str, subject: str, extensions: str) -> None:
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-subj", subject,
             "-out", f"{name}.csr", cwd=directory)  # fmt: skip
    (directory / f"{name}.ext").write_text(extensions)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "1", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=directory)  # fmt: skip


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tls")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
             "-days", "1", "-subj", "/CN=kvferry test CA", cwd=directory)  # fmt: skip
    _issue(directory, "server", f"/CN={SERVER_NAME}", f"subjectAltName=DNS:{SERVER_NAME}\n")
    _issue(directory, "client", "/CN=agent", "extendedKeyUsage=clientAuth\n")
    return directory


def _router(certificates: Path, *, require_client_cert: bool) -> StandInRouter:
    credentials = grpc.ssl_server_credentials(
        [((certificates / "server.key").read_bytes(), (certificates / "server.pem").read_bytes())],
        root_certificates=(certificates / "ca.pem").read_bytes() if require_client_cert else None,
        require_client_auth=require_client_cert,
    )
    return StandInRouter({API_KEY: "tenant-a", OTHER_API_KEY: "tenant-b"}, server_credentials=credentials)


@pytest.fixture
def tls_router(certificates: Path) -> Iterator[StandInRouter]:
    router = _router(certificates, require_client_cert=False)
    router.start()
    yield router
    router.stop()


@pytest.fixture
def mtls_router(certificates: Path) -> Iterator[StandInRouter]:
    router = _router(certificates, require_client_cert=True)
    router.start()
    yield router
    router.stop()


async def test_tls_from_the_environment(tls_router: StandInRouter, certificates: Path) -> None:
    env = {
        "KVFERRY_ADDRESS": tls_router.address,
        "KVFERRY_API_KEY": API_KEY,
        "KVFERRY_TLS_CA": str(certificates / "ca.pem"),
        "KVFERRY_TLS_SERVER_NAME": SERVER_NAME,
    }
    async with await Client.connect(environ=env) as client:
        reply = await client.conversation().complete("hello")
    assert reply.text == "Hello there"
    assert tls_router.record.generate_metadata[0]["authorization"] == f"Bearer {API_KEY}"


async def test_plaintext_or_untrusted_clients_are_refused(
    tls_router: StandInRouter, certificates: Path
) -> None:
    async with await Client.connect(tls_router.address, api_key=API_KEY, environ={}) as plaintext:
        with pytest.raises(UnavailableError):
            await plaintext.conversation().complete("hello")
    # TLS with the system roots does not trust the test CA.
    async with await Client.connect(
        tls_router.address, api_key=API_KEY, tls=TlsConfig(server_name=SERVER_NAME), environ={}
    ) as untrusting:
        with pytest.raises(UnavailableError):
            await untrusting.conversation().complete("hello")
    assert tls_router.record.generate_requests == []


async def test_mutual_tls_with_a_client_certificate(mtls_router: StandInRouter, certificates: Path) -> None:
    tls = TlsConfig.from_files(
        ca=certificates / "ca.pem",
        cert=certificates / "client.pem",
        key=certificates / "client.key",
        server_name=SERVER_NAME,
    )
    async with await Client.connect(mtls_router.address, api_key=API_KEY, tls=tls, environ={}) as client:
        assert (await client.conversation().complete("hello")).summary.turn == 1
    no_client_cert = TlsConfig.from_files(ca=certificates / "ca.pem", server_name=SERVER_NAME)
    async with await Client.connect(
        mtls_router.address, api_key=API_KEY, tls=no_client_cert, environ={}
    ) as client:
        with pytest.raises(UnavailableError):
            await client.conversation().complete("hello")
