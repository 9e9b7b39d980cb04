"""kvferry.testing.fault_proxy against real sockets: latency, cut, black hole, sources refused."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from kvferry.testing.fault_proxy import FaultProxy, http_header

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def echo() -> AsyncIterator[str]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1024):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    server.close()


async def _round_trip(endpoint: str, payload: bytes, wait_seconds: float = 2.0) -> bytes:
    host, _, port = endpoint.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(payload)
        await writer.drain()
        return await asyncio.wait_for(reader.readexactly(len(payload)), wait_seconds)
    finally:
        writer.close()


async def test_forwards_and_adds_latency(echo: str) -> None:
    proxy = FaultProxy(echo)
    await proxy.start()
    try:
        assert await _round_trip(proxy.endpoint, b"hello") == b"hello"
        proxy.latency_seconds = 0.2
        started = time.monotonic()
        assert await _round_trip(proxy.endpoint, b"again") == b"again"
        assert time.monotonic() - started >= 0.4  # both directions
    finally:
        await proxy.stop()


async def test_cut_closes_connections_and_heal_restores(echo: str) -> None:
    proxy = FaultProxy(echo)
    await proxy.start()
    try:
        host, _, port = proxy.endpoint.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"x")
        assert await reader.readexactly(1) == b"x"
        proxy.cut()
        assert await asyncio.wait_for(reader.read(1), 2) == b""  # closed under the client
        writer.close()
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await _round_trip(proxy.endpoint, b"y")
        proxy.heal()
        assert await _round_trip(proxy.endpoint, b"z") == b"z"
    finally:
        await proxy.stop()


async def test_blackhole_stalls_without_closing_and_heal_delivers_what_was_held(echo: str) -> None:
    proxy = FaultProxy(echo)
    await proxy.start()
    try:
        proxy.blackhole()
        with pytest.raises(TimeoutError):
            await _round_trip(proxy.endpoint, b"lost", wait_seconds=0.5)
        host, _, port = proxy.endpoint.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"held")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.readexactly(4), 0.5)
        proxy.heal()
        assert await asyncio.wait_for(reader.readexactly(4), 2) == b"held"  # as TCP would, late
        writer.close()
        assert await _round_trip(proxy.endpoint, b"back") == b"back"
    finally:
        await proxy.stop()


async def test_blocked_sources_are_refused_by_their_header(echo: str) -> None:
    proxy = FaultProxy(echo, source_of=http_header("X-Server-From"))
    await proxy.start()
    try:
        from_a = b"POST /raft HTTP/1.1\r\nHost: x\r\nX-Server-From: a1\r\n\r\n"
        from_b = b"POST /raft HTTP/1.1\r\nHost: x\r\nX-Server-From: b2\r\n\r\n"
        assert await _round_trip(proxy.endpoint, from_a) == from_a
        proxy.block_sources({"a1"})
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await _round_trip(proxy.endpoint, from_a)
        assert await _round_trip(proxy.endpoint, from_b) == from_b
        assert proxy.refused == 1
    finally:
        await proxy.stop()
