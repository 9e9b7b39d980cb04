"""``kvferry registry`` as an operator runs it: a process configured by flags and environment."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvferry.stack.etcd_process import EtcdProcess, free_port
from kvferry.v1 import registry_service_pb2 as api
from kvferry.v1.registry_service_pb2_grpc import RegistryServiceStub

from tests.registry.builders import register

pytestmark = pytest.mark.timeout(60)


async def test_the_registry_command_serves_health_and_the_api_then_stops_on_sigterm(
    etcd: EtcdProcess,
) -> None:
    port, metrics_port = free_port(), free_port()
    environ = dict(
        os.environ,
        KVFERRY_ETCD_ENDPOINTS=etcd.endpoint,
        KVFERRY_DEFAULT_ENGINE_TTL_SECONDS="7",
        KVFERRY_METRICS_ADDRESS=f"127.0.0.1:{metrics_port}",
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvferry.cli.main",
        "registry",
        "--listen",
        f"127.0.0.1:{port}",
        "--key-prefix",
        f"/kvferry-cli-{port}/",
        env=environ,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for _ in range(100):
                try:
                    status = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                    if status.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.aio.AioRpcError:
                    pass
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("kvferry registry never became SERVING")
            registered = await register(RegistryServiceStub(channel), "cli-engine")
            assert registered.ttl_seconds == 7  # the default came from the environment
            listed = await RegistryServiceStub(channel).ListEngines(api.ListEnginesRequest(), timeout=5)
            assert [e.engine_id for e in listed.engines] == ["cli-engine"]
        async with httpx.AsyncClient(timeout=5) as client:
            scraped = await client.get(f"http://127.0.0.1:{metrics_port}/metrics")
        assert scraped.status_code == 200
        assert 'kvferry_lease_renewals_total{kind="engine"} 0.0' in scraped.text
        assert 'method="RegisterEngine"' in scraped.text
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 10) == 0
        assert process.stderr is not None
        logs = (await process.stderr.read()).decode()
        assert '"msg": "registry serving"' in logs
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
