"""``kvferry status``: the stack ``kvferry up`` runs (from any directory): its processes, their health,
and per engine what it retains."""

from __future__ import annotations

import argparse
import asyncio

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvferry.stack.processes import StackState, is_ours, session_members
from kvferry.stack.settings import add_workdir_flag
from kvferry.v1 import registry_service_pb2 as registry_pb2
from kvferry.v1 import registry_service_pb2_grpc as registry_grpc
from kvferry.v1 import resources_pb2

TIMEOUT_SECONDS = 2.0


def configure(parser: argparse.ArgumentParser) -> None:
    add_workdir_flag(parser)


def run(args: argparse.Namespace) -> int:
    state = StackState.load(args.workdir)
    if not state.running():
        print(f"no stack runs from {args.workdir} (start one with `kvferry up`)")
        return 3
    print(f"stack in {args.workdir}")
    supervisor = state.supervisor
    if supervisor is not None:
        print(
            f"  supervisor: kvferry up (pid {supervisor.pid}) {'running' if is_ours(supervisor) else 'gone'}"
        )
    print(f"  {'process':<20} {'pid':>7} {'state':<10} {'restarts':>8}")
    for process in state.processes:
        if is_ours(process):
            condition = "running"
        elif session_members(process):
            condition = "leftovers"  # the leader died; its children still run
        else:
            condition = "exited"
        print(f"  {process.name:<20} {process.pid:>7} {condition:<10} {process.restarts:>8}")
    print(asyncio.run(_health(state.endpoints)))
    return 0


async def _health(endpoints: dict[str, str]) -> str:
    lines = ["  health:"]
    for name in ("registry", "router gRPC"):
        if name in endpoints:
            lines.append(f"    {name:<12} {await _grpc_health(endpoints[name])}")
    registry = endpoints.get("registry")
    if not registry:
        return "\n".join(lines)
    try:
        async with grpc.aio.insecure_channel(registry) as channel:
            reply = await registry_grpc.RegistryServiceStub(channel).ListEngines(
                registry_pb2.ListEnginesRequest(page_size=1000), timeout=TIMEOUT_SECONDS
            )
    except grpc.aio.AioRpcError as error:
        lines.append(f"    engines: the registry did not answer ({error.code().name})")
        return "\n".join(lines)
    lines.append(f"  engines (registered): {'none' if not reply.engines else ''}")
    async with httpx.AsyncClient(timeout=TIMEOUT_SECONDS) as client:
        for engine in reply.engines:
            try:
                healthy = (await client.get(f"{engine.http_endpoint}/health")).status_code == 200
            except httpx.HTTPError:
                healthy = False
            role = resources_pb2.EngineRole.Name(engine.role).removeprefix("ENGINE_ROLE_").lower()
            lines.append(
                f"    {engine.engine_id:<12} {role:<8} {engine.http_endpoint:<24} "
                f"{'healthy' if healthy else 'unhealthy':<10} retained blocks {engine.stats.retained_blocks}"
                f" of {engine.kv_capacity_blocks}"
            )
    return "\n".join(lines)


async def _grpc_health(address: str) -> str:
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=TIMEOUT_SECONDS
            )
    except grpc.aio.AioRpcError as error:
        return f"{address} not answering ({error.code().name})"
    return f"{address} {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status).lower()}"
