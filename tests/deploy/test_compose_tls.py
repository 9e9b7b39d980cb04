"""The compose stack's certificates (deploy/compose/tls-init.sh, run with the arguments the compose file gives
its `tls` service) against a real registry: each sidecar's certificate (the volume the compose file mounts
into it) lets it register its own engine id and no other, the router's acts as `router` and registers
nothing, and a second run keeps every certificate that is still good."""

from __future__ import annotations

import re
import shutil
import subprocess
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
import yaml  # type: ignore[import-untyped]
from kvferry.registry.config import RegistryConfig
from kvferry.runtime.tls import TlsFiles, open_channel
from kvferry.stack.etcd_process import EtcdProcess
from kvferry.v1 import registry_service_pb2 as registry
from kvferry.v1 import registry_service_pb2_grpc as registry_grpc
from kvferry.v1 import resources_pb2 as resources

from tests.fixtures.registry import TEST_TTLS, RegistryHandle, running_registry
from tests.registry.builders import engine

COMPOSE_DIR = Path(__file__).resolve().parents[2] / "deploy" / "compose"
TLS_MOUNT = "/etc/kvferry/tls"

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def _compose() -> dict[str, Any]:
    # ${VAR:-default} as compose reads it with no such variable set.
    text = re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", (COMPOSE_DIR / "docker-compose.yml").read_text())
    loaded: dict[str, Any] = yaml.safe_load(text)
    return loaded


def _make_certificates(root: Path) -> str:
    """Runs the compose file's `tls` service's script with its arguments, the volumes' folders under root."""
    service = _compose()["services"]["tls"]
    result = subprocess.run(
        ["sh", str(COMPOSE_DIR / "tls-init.sh"), *service["command"]],
        env={"PATH": "/usr/bin:/bin", "KVFERRY_TLS_ROOT": str(root)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stdout


def _identity_files(root: Path, service_name: str) -> TlsFiles:
    """The files a compose service sees at /etc/kvferry/tls: its volume's folder, as `tls` wrote it."""
    services = _compose()["services"]
    [volume] = [m.split(":")[0] for m in services[service_name]["volumes"] if m.split(":")[1] == TLS_MOUNT]
    [folder] = [m.split(":")[1] for m in services["tls"]["volumes"] if m.split(":")[0] == volume]
    directory = root / Path(folder).relative_to("/tls")
    return TlsFiles(directory / "tls.crt", directory / "tls.key", directory / "ca.crt")


def _flag(service: dict[str, Any], name: str) -> str:
    [value] = [str(arg).split("=", 1)[1] for arg in service["command"] if str(arg).startswith(f"--{name}=")]
    return value


@pytest_asyncio.fixture(loop_scope="session")
async def compose_registry(etcd: EtcdProcess, tmp_path: Path) -> AsyncIterator[tuple[RegistryHandle, Path]]:
    root = tmp_path / "tls"
    _make_certificates(root)
    config = RegistryConfig(
        listen_address="127.0.0.1:0",
        etcd_endpoints=(etcd.endpoint,),
        key_prefix=f"/kvferry-compose-tls-{uuid.uuid4().hex[:8]}/",
        ttl=TEST_TTLS,
        history_seconds=0,
        tls=_identity_files(root, "registry"),
    )
    async with running_registry(config) as handle:
        yield handle, root


async def _register(files: TlsFiles, address: str, engine_id: str) -> grpc.StatusCode:
    async with open_channel(address, files) as channel:
        request = registry.RegisterEngineRequest(engine=engine(engine_id, resources.ENGINE_ROLE_PREFILL))
        try:
            await registry_grpc.RegistryServiceStub(channel).RegisterEngine(request, timeout=5)
        except grpc.aio.AioRpcError as error:
            return error.code()
    return grpc.StatusCode.OK


async def test_each_compose_service_gets_its_role(compose_registry: tuple[RegistryHandle, Path]) -> None:
    running, root = compose_registry
    services = _compose()["services"]
    sidecars = [name for name, s in services.items() if s.get("command", [])[:2] == ["kvferry", "sidecar"]]
    assert sorted(sidecars) == ["decode-sidecar", "prefill-sidecar"]
    engine_ids = {name: _flag(services[name], "engine-id") for name in sidecars}
    for name, engine_id in engine_ids.items():
        files = _identity_files(root, name)
        assert await _register(files, running.address, engine_id) == grpc.StatusCode.OK
        for other in set(engine_ids.values()) - {engine_id}:
            assert await _register(files, running.address, other) == grpc.StatusCode.PERMISSION_DENIED

    router = _identity_files(root, "router")
    assert await _register(router, running.address, "prefill-0") == grpc.StatusCode.PERMISSION_DENIED
    async with open_channel(running.address, router) as channel:
        listed = await registry_grpc.RegistryServiceStub(channel).ListEngines(
            registry.ListEnginesRequest(), timeout=5
        )
    assert set(engine_ids.values()) <= {item.engine_id for item in listed.engines}


async def test_a_second_run_keeps_the_certificates_and_reissues_what_changed(tmp_path: Path) -> None:
    root = tmp_path / "tls"
    _make_certificates(root)
    router = _identity_files(root, "router")
    issued = router.cert.read_bytes(), (root / "ca" / "ca.crt").read_bytes()
    again = _make_certificates(root)
    assert "issued" not in again and again.count("kept") == len(_compose()["services"]["tls"]["command"])
    assert (router.cert.read_bytes(), (root / "ca" / "ca.crt").read_bytes()) == issued

    # The CA is new (its volume dropped): every certificate is issued again from it.
    shutil.rmtree(root / "ca")
    third = _make_certificates(root)
    assert "made a new CA" in third and "kept" not in third
    assert router.cert.read_bytes() != issued[0]
    assert router.ca.read_bytes() == (root / "ca" / "ca.crt").read_bytes() != issued[1]
