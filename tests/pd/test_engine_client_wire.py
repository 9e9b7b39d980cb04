"""The engine client on real sockets that fail: a refused connection, an engine that never answers and a
stream cut mid-way are each the engine's failure (EngineUnavailableError), which the router retries."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest
from kvferry.pd.engine_api import DecodeRequest, EngineUnavailableError, PrefillRequest
from kvferry.pd.engine_client import HttpTimeouts, VllmEngineClient
from kvferry.pd.vllm_params import KvHandoff, RemoteBlocks


def client(url: str, read_timeout: float = 0.3, connect_timeout: float = 0.5) -> VllmEngineClient:
    return VllmEngineClient(
        url,
        "m",
        timeouts=HttpTimeouts(connect=connect_timeout, read=read_timeout),
        max_connections=4,
    )


async def test_refused_connection_is_unavailable() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with client(f"http://127.0.0.1:{port}") as engine:
        with pytest.raises(EngineUnavailableError) as failed:
            await engine.prefill(PrefillRequest(token_ids=(1, 2, 3)))
        assert failed.value.refused


async def test_engine_that_never_answers_times_out_as_unavailable() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            await reader.read(65536)
            await asyncio.sleep(5)
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        # A connect timeout a loaded machine cannot miss: the server accepts at once, the answer never comes.
        async with client(f"http://127.0.0.1:{port}", connect_timeout=10) as engine:
            with pytest.raises(EngineUnavailableError) as failed:
                await engine.prefill(PrefillRequest(token_ids=(1, 2, 3)))
            assert "no bytes within 0.3 s (read timeout)" in str(failed.value)
            assert not failed.value.refused  # a connection was made: the sidecar calls such an engine failing
    finally:
        server.close()


async def test_stream_cut_mid_way_is_unavailable() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        event = b'data: {"choices":[{"text":"a"}]}\n\n'
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            + f"{len(event):x}\r\n".encode()
            + event
            + b"\r\n"
        )
        await writer.drain()
        writer.transport.abort()

    server = await asyncio.start_server(cut, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    handoff = KvHandoff(
        do_remote_prefill=True,
        do_remote_decode=False,
        blocks=RemoteBlocks(engine_id="p", request_id="r", block_ids=((1,),), host="h", port=1),
    )
    try:
        async with client(f"http://127.0.0.1:{port}") as engine:
            chunks = []
            with pytest.raises(EngineUnavailableError):
                async for chunk in engine.decode_stream(DecodeRequest(token_ids=(1,), handoff=handoff)):
                    chunks.append(chunk)
            assert [c.text for c in chunks] == ["a"]
    finally:
        server.close()
