"""ServiceHost: one lifecycle for every service, the same clean-up whether it stops or its start fails."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvferry.runtime.host import Service, ServiceHost, run_service
from prometheus_client import CollectorRegistry

pytestmark = pytest.mark.timeout(30)


async def test_stop_runs_every_step_newest_first_even_past_a_failing_one() -> None:
    host = ServiceHost("test")
    ran: list[str] = []

    def step(name: str, fail: bool = False) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            ran.append(name)
            if fail:
                raise RuntimeError(f"{name} broke")

        return run

    host.on_stop("first", step("first"))
    host.on_stop("second", step("second", fail=True))
    host.on_stop("third", step("third"))
    await asyncio.gather(host.stop(), host.stop())
    assert ran == ["third", "second", "first"], (
        "each step once, newest first, a failure does not stop the rest"
    )


async def test_a_failed_start_stops_what_had_started() -> None:
    host = ServiceHost("test")
    endpoint = None
    with pytest.raises(RuntimeError, match="bad configuration"):
        async with host.starting():
            endpoint = await host.serve_grpc("127.0.0.1:0", [])
            host.spawn(asyncio.sleep(3600), "forever")
            raise RuntimeError("bad configuration")
    assert endpoint is not None
    # The server is gone: nothing listens on its port any more.
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", endpoint.port)) != 0
    assert not host.failed.done(), "a task cancelled by stop is no failure"


async def test_a_taken_address_fails_the_start_and_frees_the_rest() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        host = ServiceHost("test")
        metrics_port = None
        with pytest.raises(OSError):
            async with host.starting():
                metrics_port = (await host.serve_metrics(CollectorRegistry(), "127.0.0.1:0")).port
                await host.serve_grpc(f"127.0.0.1:{port}", [])
    assert metrics_port is not None
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", metrics_port)) != 0, "the metrics endpoint was stopped"


async def test_a_background_task_that_ends_resolves_failed() -> None:
    host = ServiceHost("test")

    async def broken() -> None:
        raise ValueError("the registry refused engine 'x'")

    host.spawn(broken(), "broken")
    error = await asyncio.wait_for(host.failed, 5)
    assert isinstance(error, ValueError)
    await host.stop()


async def test_stop_ends_a_task_that_swallows_its_first_cancellation() -> None:
    host = ServiceHost("test")
    swallowed = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            swallowed.set()  # as asyncio.wait_for may on Python 3.11: the loop runs on
        await asyncio.sleep(3600)

    task = host.spawn(stubborn(), "stubborn")
    await asyncio.sleep(0)
    await asyncio.wait_for(host.stop(), 5)
    assert swallowed.is_set() and task.cancelled(), "cancelled again, it ended"


async def test_stop_gives_up_on_a_task_that_never_ends_and_stops_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    host = ServiceHost("test", task_stop_seconds=0.5)
    endpoint = await host.serve_grpc("127.0.0.1:0", [])

    released = False

    async def immortal() -> None:
        while not released:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass

    task = host.spawn(immortal(), "immortal")
    await asyncio.sleep(0)
    await asyncio.wait_for(host.stop(), 5)
    assert not task.done()
    assert any(
        record.levelname == "ERROR" and "kvferry-test-immortal" in str(getattr(record, "error", ""))
        for record in caplog.records
    ), "the task that did not end is named in an error"
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", endpoint.port)) != 0, "the steps after it still ran"
    released = True  # let it go: the test's loop outlives it
    task.cancel()
    await asyncio.wait({task}, timeout=5)
    assert task.done()


async def test_stop_turns_health_not_serving_before_the_grace_period() -> None:
    host = ServiceHost("test", grace_seconds=0.2)
    endpoint = await host.serve_grpc("127.0.0.1:0", [])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{endpoint.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        serving = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert serving.status == health_pb2.HealthCheckResponse.SERVING
        await host.stop()
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)


def test_run_service_refuses_a_bad_start_with_exit_2_and_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    async def start() -> Service:
        raise ValueError("unknown cost profile 'h100'; known: ['cpu']")

    assert run_service("test", start) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "kvferry test: error: unknown cost profile 'h100'; known: ['cpu']"
    ]
