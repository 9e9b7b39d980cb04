"""``kvferry health``, run as the probes run it (the real command in a subprocess), against a real gRPC
server of the service kit (TCP and unix socket) and a real HTTP server: exit 0 healthy, 1 not."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from aiohttp import web
from grpc_health.v1 import health_pb2
from kvferry.runtime.grpc_server import start_server

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


async def health(*args: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvferry.cli.main", "health", *args, stderr=asyncio.subprocess.PIPE
    )
    _, stderr = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode is not None
    return process.returncode, stderr.decode()


async def test_grpc_health_for_readiness_and_liveness() -> None:
    server, port, servicer = await start_server("127.0.0.1:0", [])
    address = f"127.0.0.1:{port}"
    try:
        assert await health(address) == (0, "")
        await servicer.set("", NOT_SERVING)
        code, message = await health(address)
        assert code == 1 and "NOT_SERVING" in message
        # Liveness: it answers, whatever it says.
        assert (await health(address, "--any-status"))[0] == 0
        await servicer.set("kvferry.v1.Example", SERVING)
        assert (await health(address, "--service", "kvferry.v1.Example"))[0] == 0
        code, message = await health(address, "--service", "no.such.Service")
        assert code == 1 and "NOT_FOUND" in message
        assert (await health(address, "--service", "no.such.Service", "--any-status"))[0] == 0
    finally:
        await server.stop(None)
    # Nobody there: no answer fails liveness too.
    code, message = await health(address, "--any-status", "--timeout", "1")
    assert code == 1 and "UNAVAILABLE" in message


async def test_grpc_health_over_a_unix_socket(tmp_path: Path) -> None:
    path = tmp_path / "sidecar.sock"
    server, _, _ = await start_server(f"unix:{path}", [])
    try:
        assert await health(f"unix:{path}") == (0, "")
    finally:
        await server.stop(None)


@pytest.mark.parametrize(("status", "ready"), [(200, True), (204, True), (503, False)])
async def test_http_health(status: int, ready: bool) -> None:
    async def answer(request: web.Request) -> web.Response:
        return web.Response(status=status, text="{}")

    app = web.Application()
    app.router.add_get("/health", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"http://127.0.0.1:{port}/health"
    try:
        code, message = await health(url)
        assert code == (0 if ready else 1), message
        if not ready:
            assert f"HTTP {status}" in message
        assert (await health(url, "--any-status"))[0] == 0
    finally:
        await runner.cleanup()
    code, message = await health(url, "--any-status", "--timeout", "1")
    assert code == 1 and "no answer" in message
