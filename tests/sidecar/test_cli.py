"""``kvferry sidecar`` as an operator runs it: a separate process configured by flags and environment,
against the real registry and a STAND-IN engine (tests/fixtures/sidecar.py); SIGTERM deregisters."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvferry.v1 import sidecar_service_pb2_grpc as sidecar_grpc

from tests.fixtures.polling import eventually
from tests.fixtures.registry import RegistryHandle, unique
from tests.fixtures.sidecar import StandInEngineFactory
from tests.sidecar.helpers import find_engine, report, retention

pytestmark = pytest.mark.timeout(60)


async def test_help_documents_every_flag_with_its_environment_variable() -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvferry.cli.main", "sidecar", "--help", stdout=subprocess.PIPE
    )
    out, _ = await process.communicate()
    text = out.decode()
    assert process.returncode == 0
    for flag, env in (
        ("--engine-id", "KVFERRY_ENGINE_ID"),
        ("--registry", "KVFERRY_REGISTRY"),
        ("--listen", "KVFERRY_SIDECAR_LISTEN"),
        ("--ttl-seconds", "KVFERRY_ENGINE_TTL_SECONDS"),
        ("--metrics-address", "KVFERRY_METRICS_ADDRESS"),
    ):
        assert flag in text and env in text


async def test_runs_from_flags_and_environment_and_deregisters_on_sigterm(
    registry: RegistryHandle, stand_in_engine_factory: StandInEngineFactory
) -> None:
    engine = await stand_in_engine_factory()
    engine_id = unique("engine")
    socket_path = f"/tmp/kvferry-test-{uuid.uuid4().hex[:8]}/sidecar.sock"
    env = dict(os.environ)
    env.update(
        {
            "KVFERRY_ENGINE_ID": engine_id,
            "KVFERRY_ENGINE_ROLE": "decode",
            "KVFERRY_REGISTRY": registry.address,
            "KVFERRY_ENGINE_TTL_SECONDS": "2",
        }
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvferry.cli.main",
        "sidecar",
        "--engine-url",
        engine.url,
        "--kv-compatibility-hash",
        "cli-test",
        "--nixl-port",
        "5677",
        "--listen",
        f"unix:{socket_path}",
        "--engine-probe-interval",
        "0.2",
        env=env,
        stderr=subprocess.PIPE,
    )
    try:
        stored = await eventually(
            lambda: find_engine(registry.stub(), engine_id), within=30, what="registered"
        )
        assert (stored.nixl_port, stored.kv_compatibility_hash, stored.model) == (
            5677,
            "cli-test",
            engine.model,
        )

        async with grpc.aio.insecure_channel(f"unix:{socket_path}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            await eventually(lambda: _serving(health), within=10, what="health SERVING")
            published = await report(
                sidecar_grpc.SidecarServiceStub(channel), retention(unique("t"), unique("c"))
            )
            assert published.engine_id == engine_id

        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 15) == 0
        assert await find_engine(registry.stub(), engine_id) is None
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.stderr is not None
    logs = (await process.stderr.read()).decode()
    assert '"msg": "engine registered"' in logs and '"msg": "engine deregistered"' in logs


async def _serving(health: health_pb2_grpc.HealthStub) -> bool:
    response = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return bool(response.status == health_pb2.HealthCheckResponse.SERVING)


async def test_exits_with_an_actionable_error_when_the_registry_refuses_the_engine(
    registry: RegistryHandle, stand_in_engine_factory: StandInEngineFactory
) -> None:
    engine = await stand_in_engine_factory()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvferry.cli.main",
        "sidecar",
        "--engine-id",
        "bad id with spaces",
        "--role",
        "decode",
        "--engine-url",
        engine.url,
        "--kv-compatibility-hash",
        "h",
        "--registry",
        registry.address,
        "--listen",
        "127.0.0.1:0",
        "--engine-probe-interval",
        "0.2",
        stderr=subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 2
    assert "the registry refused engine" in err.decode()
