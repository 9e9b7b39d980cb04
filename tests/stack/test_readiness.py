"""The stack's readiness waits against a real registry, and their errors when nothing serves.

The engine and router waits run for real in ``test_up_down.py`` (``kvferry up``) and the engine tests.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from kvferry.stack.etcd_process import free_port
from kvferry.stack.readiness import grpc_serving, wait_router_ready

from tests.fixtures.registry import RegistryHandle


async def test_grpc_serving_returns_for_a_serving_registry(registry: RegistryHandle) -> None:
    await grpc_serving("registry", registry.address, timeout_seconds=5)


async def test_grpc_serving_times_out_with_the_address_when_nothing_listens() -> None:
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(TimeoutError, match=f"registry at {address} not serving within 1 s"):
        await grpc_serving("registry", address, timeout_seconds=1)


@pytest.fixture
def exited_process() -> subprocess.Popen[bytes]:
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    process.wait()
    return process


async def test_grpc_serving_stops_waiting_when_the_server_process_exits(
    exited_process: subprocess.Popen[bytes],
) -> None:
    process = exited_process
    with pytest.raises(RuntimeError, match="router exited with code 3 while starting"):
        await grpc_serving("router", f"127.0.0.1:{free_port()}", timeout_seconds=30, process=process)


def test_wait_router_ready_times_out_with_a_hint() -> None:
    with pytest.raises(TimeoutError, match="knew no prefill and decode engine within 1 s"):
        wait_router_ready(f"http://127.0.0.1:{free_port()}", timeout_seconds=1)
