"""Messages the registry tests send: a plausible engine and a retention with real digests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

import grpc
from kvferry.pd.digest import block_digests
from kvferry.registry.config import TtlPolicy
from kvferry.registry.engines import EngineStore
from kvferry.registry.etcd import EtcdGateway
from kvferry.registry.keys import KeyLayout
from kvferry.registry.metrics import RegistryMetrics
from kvferry.registry.reaper import EngineReaper
from kvferry.registry.retentions import RetentionStore
from kvferry.v1 import registry_service_pb2 as registry
from kvferry.v1 import registry_service_pb2_grpc as registry_grpc
from kvferry.v1 import resources_pb2 as resources

BLOCK_SIZE = 16


def engine(
    engine_id: str, role: resources.EngineRole.ValueType = resources.ENGINE_ROLE_DECODE
) -> resources.Engine:
    return resources.Engine(
        engine_id=engine_id,
        role=role,
        http_endpoint="http://127.0.0.1:8100",
        nixl_host="127.0.0.1",
        nixl_port=5600,
        model="qwen3-tiny",
        kv_compatibility_hash="abc123",
        block_size=BLOCK_SIZE,
        kv_capacity_blocks=4096,
        max_model_len=8192,
    )


def retention(
    tenant: str,
    conversation_id: str,
    engine_id: str,
    *,
    turn: int = 1,
    num_tokens: int = 40,
    ttl_seconds: int = 0,
) -> resources.Retention:
    tokens = list(range(num_tokens))
    blocks = -(-num_tokens // BLOCK_SIZE)
    return resources.Retention(
        tenant=tenant,
        conversation_id=conversation_id,
        engine_id=engine_id,
        engine_request_id=f"req-{conversation_id}-{turn}",
        block_ids=list(range(100, 100 + blocks)),
        num_tokens=num_tokens,
        block_digests=block_digests(tokens, BLOCK_SIZE),
        turn=turn,
        ttl_seconds=ttl_seconds,
    )


async def register(
    stub: registry_grpc.RegistryServiceStub, engine_id: str, *, ttl_seconds: int = 0
) -> registry.RegisterEngineResponse:
    response: registry.RegisterEngineResponse = await stub.RegisterEngine(
        registry.RegisterEngineRequest(engine=engine(engine_id), ttl_seconds=ttl_seconds), timeout=5
    )
    return response


async def publish(
    stub: registry_grpc.RegistryServiceStub, item: resources.Retention
) -> registry.PublishRetentionResponse:
    response: registry.PublishRetentionResponse = await stub.PublishRetention(
        registry.PublishRetentionRequest(retention=item), timeout=5
    )
    return response


async def get(
    stub: registry_grpc.RegistryServiceStub, tenant: str, conversation_id: str
) -> registry.GetRetentionResponse:
    response: registry.GetRetentionResponse = await stub.GetRetention(
        registry.GetRetentionRequest(tenant=tenant, conversation_id=conversation_id), timeout=5
    )
    return response


def as_published(retention: resources.Retention) -> resources.Retention:
    """``retention`` without its ``expire_time``: a lookup or renewal answers the lease's end as of then
    (etcd's whole seconds left), a publish the first end; everything else is the record as published."""
    copy = resources.Retention()
    copy.CopyFrom(retention)
    copy.ClearField("expire_time")
    return copy


async def status_of(call: Awaitable[Any]) -> grpc.StatusCode:
    """The status a call fails with (OK when it succeeds)."""
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


class EventStream:
    """A watch stream read in the background, so a test can wait for the events it expects."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.events: asyncio.Queue[Any] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, call: Any) -> EventStream:
        await call.initial_metadata()  # the watch is in place
        return cls(call)

    async def _read(self) -> None:
        async for item in self.call:
            await self.events.put(item)

    async def next(self, within: float = 10.0) -> Any:
        return await asyncio.wait_for(self.events.get(), within)

    async def next_matching(self, predicate: Any, within: float = 10.0) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while True:
            item = await self.next(max(0.01, deadline - loop.time()))
            if predicate(item):
                return item

    async def close(self) -> None:
        self.call.cancel()
        self._reader.cancel()
        try:
            await self._reader
        except (asyncio.CancelledError, Exception):
            pass

    async def __aenter__(self) -> EventStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def stream_items(call: Any) -> AsyncIterator[Any]:
    async for item in call:
        yield item


@dataclass(frozen=True)
class Stores:
    """The registry's stores over one gateway, wired as ``create_registry`` wires them, without gRPC
    and without the reaper's background task."""

    engines: EngineStore
    retentions: RetentionStore
    reaper: EngineReaper

    @classmethod
    def over(
        cls, gateway: EtcdGateway, layout: KeyLayout, ttl: TtlPolicy, metrics: RegistryMetrics | None = None
    ) -> Stores:
        reaper = EngineReaper(gateway, layout, metrics=metrics)
        return cls(
            EngineStore(gateway, layout, ttl, reaper, metrics=metrics),
            RetentionStore(gateway, layout, ttl, metrics=metrics),
            reaper,
        )
