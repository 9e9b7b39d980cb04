"""``kvferry status``: the stack ``kvferry up`` runs (from any directory): its processes, their health,
and per engine what it retains: its own count of retained blocks, and from the registry (the snapshot
WatchAllRetentions starts with) each conversation it retains, with its turn, tokens and blocks."""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Mapping, Sequence

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvferry.router.registry_client import GrpcRegistry, RegistryUnavailable
from kvferry.runtime.errors import ServiceError
from kvferry.stack.processes import StackState, is_ours, session_members
from kvferry.stack.settings import add_workdir_flag
from kvferry.v1 import registry_service_pb2 as registry_pb2
from kvferry.v1 import registry_service_pb2_grpc as registry_grpc
from kvferry.v1 import resources_pb2

TIMEOUT_SECONDS = 2.0
# The snapshot of every live retention streams in pages: more time than one call.
SNAPSHOT_TIMEOUT_SECONDS = 10.0
CONVERSATIONS_SHOWN = 10


def configure(parser: argparse.ArgumentParser) -> None:
    add_workdir_flag(parser)


def run(args: argparse.Namespace) -> int:
    state = StackState.load(args.workdir)
    if not state.running():
        print(f"no stack runs from {args.workdir} (start one with `kvferry up`)")
        return 3
    print(f"stack in {args.workdir}")
    for line in supervision_lines(state, time.time()):
        print(line)
    print(asyncio.run(report(state.endpoints)))
    return 0


def supervision_lines(state: StackState, now: float) -> list[str]:
    """Whether the supervisor runs (and what to do when it does not), then each process: its state, how
    often the supervisor restarted it, and why it last exited."""
    supervisor = state.supervisor
    if supervisor is not None and is_ours(supervisor):
        lines = [
            f"  supervisor: kvferry up (pid {supervisor.pid}) running; it restarts a process that exits "
            f"and says so in {state.supervisor_log}"
        ]
    else:
        which = f"kvferry up (pid {supervisor.pid})" if supervisor is not None else "none recorded"
        lines = [
            f"  supervisor: {which} is NOT running: a process that exits now stays down. "
            "`kvferry down` stops what is left, then `kvferry up` starts a supervised stack again"
        ]
    lines.append(f"  {'process':<20} {'pid':>7} {'state':<10} {'restarts':>8}")
    for process in state.processes:
        if is_ours(process):
            condition = "running"
        elif session_members(process):
            condition = "leftovers"  # the leader died; its children still run
        else:
            condition = "exited"
        line = f"  {process.name:<20} {process.pid:>7} {condition:<10} {process.restarts:>8}"
        if process.last_exit:
            line += f"  last exit {max(0.0, now - process.last_exit_at):.0f} s ago: {process.last_exit}"
        lines.append(line)
    return lines


async def report(endpoints: Mapping[str, str]) -> str:
    """The health of the stack's services, then per engine its health and what it retains (the
    registry's view: each retained conversation, its turn, tokens and blocks)."""
    lines = ["  health:"]
    for name in ("registry", "router gRPC"):
        if name in endpoints:
            lines.append(f"    {name:<12} {await _grpc_health(endpoints[name])}")
    registry = endpoints.get("registry")
    if not registry:
        return "\n".join(lines)
    async with grpc.aio.insecure_channel(registry) as channel:
        try:
            listed = await GrpcRegistry(channel, timeout_seconds=TIMEOUT_SECONDS).list_engine_records()
            retentions = await live_retentions(registry_grpc.RegistryServiceStub(channel))
        except grpc.aio.AioRpcError as error:
            lines.append(f"  engines: the registry did not answer ({error.code().name}: {error.details()})")
            return "\n".join(lines)
        except (RegistryUnavailable, ServiceError, RuntimeError) as problem:
            lines.append(f"  engines: {problem}")
            return "\n".join(lines)
    engines = sorted(listed, key=lambda engine: engine.engine_id)
    lines.append(f"  engines (registered): {'none' if not engines else ''}")
    async with httpx.AsyncClient(timeout=TIMEOUT_SECONDS) as client:
        for engine in engines:
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
    lines += retention_lines([engine.engine_id for engine in engines], retentions, time.time())
    return "\n".join(lines)


async def live_retentions(
    stub: registry_grpc.RegistryServiceStub, timeout_seconds: float = SNAPSHOT_TIMEOUT_SECONDS
) -> list[resources_pb2.Retention]:
    """Every live retention: the snapshot WatchAllRetentions starts with, read up to SYNCED."""
    call = stub.WatchAllRetentions(registry_pb2.WatchAllRetentionsRequest(), timeout=timeout_seconds)
    found: dict[str, resources_pb2.Retention] = {}
    try:
        async for event in call:
            if event.type == registry_pb2.RETENTION_EVENT_TYPE_SYNCED:
                return list(found.values())
            if event.type == registry_pb2.RETENTION_EVENT_TYPE_PUBLISHED:
                found[event.retention.name] = event.retention
    finally:
        call.cancel()
    raise RuntimeError("the registry ended WatchAllRetentions before its snapshot was complete")


def retention_lines(
    engine_ids: Sequence[str],
    retentions: Sequence[resources_pb2.Retention],
    now: float,
    shown_per_engine: int = CONVERSATIONS_SHOWN,
) -> list[str]:
    """Per engine (every registered one, and any other a retention names): how many conversations and
    blocks it retains, then those conversations, newest first, up to ``shown_per_engine``."""
    by_engine: dict[str, list[resources_pb2.Retention]] = {engine_id: [] for engine_id in engine_ids}
    for retention in retentions:
        by_engine.setdefault(retention.engine_id, []).append(retention)
    total_blocks = sum(len(retention.block_ids) for retention in retentions)
    lines = [f"  retained (registry): {len(retentions)} conversations, {total_blocks} blocks"]
    for engine_id in sorted(by_engine):
        held = sorted(by_engine[engine_id], key=lambda r: r.publish_time.ToNanoseconds(), reverse=True)
        blocks = sum(len(retention.block_ids) for retention in held)
        tokens = sum(retention.num_tokens for retention in held)
        in_pool = sum(len(r.block_ids) for r in held if r.tier == resources_pb2.MEMORY_TIER_HOST)
        pool = f" ({in_pool} in the host pool)" if in_pool else ""
        lines.append(f"    {engine_id:<12} {len(held)} conversations, {blocks} blocks{pool}, {tokens} tokens")
        for retention in held[:shown_per_engine]:
            expires = retention.expire_time.ToNanoseconds() / 1e9 - now
            where = " in the host pool" if retention.tier == resources_pb2.MEMORY_TIER_HOST else ""
            lines.append(
                f"      {retention.tenant}/{retention.conversation_id}  turn {retention.turn}  "
                f"{retention.num_tokens} tokens  {len(retention.block_ids)} blocks{where}  "
                f"expires in {max(0.0, expires):.0f} s"
            )
        if len(held) > shown_per_engine:
            lines.append(f"      ... and {len(held) - shown_per_engine} more")
    return lines


async def _grpc_health(address: str) -> str:
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=TIMEOUT_SECONDS
            )
    except grpc.aio.AioRpcError as error:
        return f"{address} not answering ({error.code().name})"
    return f"{address} {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status).lower()}"
