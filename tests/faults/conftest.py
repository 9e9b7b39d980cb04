"""The fault suite's fixtures: real services on an event loop of their own (kvferry.testing.LoopThread),
so that synchronous hypothesis tests can drive them."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from kvferry.registry.config import RegistryConfig
from kvferry.registry.server import Registry, create_registry
from kvferry.router.server import RouterConfig, RunningRouter, start_router
from kvferry.stack.etcd_process import EtcdProcess
from kvferry.testing.loop_thread import LoopThread
from kvferry.testing.standin_engine import StandInEngine
from kvferry.v1 import resources_pb2

from tests.fixtures.registry import TEST_TTLS
from tests.fixtures.router import router_api_keys

# Small, so that a fuzzed max_tokens stays cheap on the stand-ins.
FUZZ_MAX_MODEL_LEN = 512
FUZZ_MODEL = "fuzz-model"


@dataclass
class ServicesOnThread:
    """A registry, a router and a stand-in prefill + decode pair, running on ``loop``."""

    loop: LoopThread
    registry: Registry
    router: RunningRouter
    engines: list[StandInEngine]


@pytest.fixture(scope="module")
def services(etcd: EtcdProcess) -> Iterator[ServicesOnThread]:
    with LoopThread() as loop:

        async def start() -> ServicesOnThread:
            registry = await create_registry(
                RegistryConfig(
                    listen_address="127.0.0.1:0",
                    etcd_endpoints=(etcd.endpoint,),
                    key_prefix=f"/kvferry-fuzz-{uuid.uuid4().hex[:8]}/",
                    ttl=TEST_TTLS,
                    history_seconds=0,
                )
            )
            engines = [
                StandInEngine(
                    f"{name}-{uuid.uuid4().hex[:6]}",
                    role,
                    model=FUZZ_MODEL,
                    registry_address=registry.address,
                    max_model_len=FUZZ_MAX_MODEL_LEN,
                )
                for name, role in (
                    ("prefill", resources_pb2.ENGINE_ROLE_PREFILL),
                    ("decode", resources_pb2.ENGINE_ROLE_DECODE),
                )
            ]
            for engine in engines:
                await engine.start()
            router = await start_router(
                RouterConfig(registry_address=registry.address, startup_sync_seconds=5.0),
                api_keys=router_api_keys(),
            )
            return ServicesOnThread(loop=loop, registry=registry, router=router, engines=engines)

        running = loop.run(start())
        try:
            yield running
        finally:

            async def stop() -> None:
                await running.router.stop(grace_seconds=0.5)
                for engine in running.engines:
                    await engine.stop()
                await running.registry.stop(grace_seconds=0.5)

            loop.run(stop())
