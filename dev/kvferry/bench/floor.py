"""``kvferry bench floor``: what this machine charges any asyncio process for the router's two unit costs,
with no HTTP framework, no parser and no kvferry code in the way.

- **relay**: one streamed chunk read from one socket and written to another (a relayed token: the router reads
  each of D's chunks and writes it to the client), paced as a decode streams, CPU per chunk;
- **exchange**: one ~1 KB request and ~1 KB answer on a kept-alive connection, CPU per exchange on the asking
  side (a turn's engine and registry calls, and the client's own request, are each one).

The peers (the chunks' source and sink, the exchange's server) run in a child process, so only this process's
CPU counts; it runs uvloop, as the router does. Read the router's figures (``kvferry bench router``: CPU per
turn and per relayed token) against these: a per-token target below the relay floor cannot be met by a router
process of this design on this machine, whatever its code does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, astuple, dataclass
from multiprocessing.connection import Connection

# A chat chunk as vLLM streams it (one token), and a request and answer of the size of a turn's small calls.
CHUNK = (
    b'data: {"id":"chatcmpl-0123456789abcdef","object":"chat.completion.chunk","created":1764547200,'
    b'"model":"tiny-qwen3","choices":[{"index":0,"delta":{"content":" token"},"logprobs":null,'
    b'"finish_reason":null}]}\n\n'
)
REQUEST = (
    b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
    b"content-length: 1000\r\n\r\n" + b"x" * 1000
)
ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n" + b"y" * 1000


@dataclass(frozen=True)
class Floor:
    relay_us_per_chunk: float
    exchange_us: float
    # What one timer wakeup costs (the pacing of the exchanges, taken out of exchange_us).
    wakeup_us: float


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chunks", type=int, default=2000, help="chunks relayed per round")
    parser.add_argument("--exchanges", type=int, default=2000, help="exchanges per round")
    parser.add_argument("--interval-ms", type=float, default=1.0, help="pacing of chunks and exchanges")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the figures are their medians")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object only")


def run(args: argparse.Namespace) -> int:
    for name in ("chunks", "exchanges", "rounds"):
        if getattr(args, name) < 1:
            raise SystemExit(f"kvferry bench floor: --{name} must be at least 1")
    if args.interval_ms < 0:
        raise SystemExit("kvferry bench floor: --interval-ms must not be negative")
    rounds = [measure(args.chunks, args.exchanges, args.interval_ms / 1000) for _ in range(args.rounds)]
    floor = Floor(
        *(round(statistics.median(values), 1) for values in zip(*map(astuple, rounds), strict=True))
    )
    if args.json:
        print(json.dumps(asdict(floor)))
        return 0
    paced = f"{args.interval_ms} ms apart"
    print(f"relay: {floor.relay_us_per_chunk} us CPU per chunk ({args.chunks} chunks, {paced})")
    print(f"exchange: {floor.exchange_us} us CPU per ~1 KB request and answer ({args.exchanges}, {paced})")
    print(f"a timer wakeup (the exchanges' pacing, taken out): {floor.wakeup_us} us")
    print(f"medians of {args.rounds} round(s); each round's: {json.dumps([asdict(r) for r in rounds])}")
    return 0


def measure(chunks: int, exchanges: int, interval: float) -> Floor:
    """One round of both, the peers in a child process started for it."""
    import uvloop

    spawn = multiprocessing.get_context("spawn")
    ours, theirs = spawn.Pipe()
    peers = spawn.Process(target=_serve_peers, args=(theirs, chunks, interval), daemon=True)
    peers.start()
    try:
        if not ours.poll(60):
            raise RuntimeError("the floor's peer process did not start within 60 s")
        source_port, answer_port = ours.recv()
        relay = uvloop.run(_relay(source_port, ours))
        exchange, wakeup = uvloop.run(_exchange(answer_port, exchanges, interval))
    finally:
        peers.kill()
        peers.join()
    return Floor(relay, exchange - wakeup, wakeup)


async def _relay(source_port: int, peers: Connection) -> float:
    """Relays the source's chunks to the sink; CPU microseconds per chunk read."""
    relayed: asyncio.Future[float] = asyncio.get_running_loop().create_future()

    async def serve_sink(sink_reader: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            await sink_reader.readexactly(1)
            source, source_writer = await asyncio.open_connection("127.0.0.1", source_port)
            source_writer.write(b"!")
            reads, started = 0, time.process_time()
            while chunk := await source.read(65536):
                sink.write(chunk)
                reads += 1
            relayed.set_result((time.process_time() - started) / max(reads, 1) * 1e6)
            source_writer.close()
        except Exception as error:  # the round fails at once, not at the wait's bound
            if not relayed.done():
                relayed.set_exception(error)
        finally:
            sink.close()

    server = await asyncio.start_server(serve_sink, "127.0.0.1", 0)
    peers.send(server.sockets[0].getsockname()[1])
    try:
        return await asyncio.wait_for(relayed, 600)
    finally:
        server.close()


async def _exchange(port: int, exchanges: int, interval: float) -> tuple[float, float]:
    """CPU microseconds per paced exchange, and per pacing wakeup alone."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def exchange() -> None:
        writer.write(REQUEST)
        await reader.readexactly(len(ANSWER))

    async def nothing() -> None:
        return None

    await _paced(exchange, 100, 0.0)  # warm
    try:
        return await _paced(exchange, exchanges, interval), await _paced(nothing, exchanges, interval)
    finally:
        writer.close()


async def _paced(call: Callable[[], Awaitable[None]], count: int, interval: float) -> float:
    started = time.process_time()
    for _ in range(count):
        await asyncio.sleep(interval)
        await call()
    return (time.process_time() - started) / count * 1e6


def _serve_peers(parent: Connection, chunks: int, interval: float) -> None:
    """The child: a source streaming ``chunks`` paced chunks to whoever connects, a server answering every
    request, and (once the parent says where its relay listens) a sink reading the relay to its end."""
    import uvloop

    uvloop.run(_peers(parent, chunks, interval))


async def _peers(parent: Connection, chunks: int, interval: float) -> None:
    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(1)
        for _ in range(chunks):
            await asyncio.sleep(interval)
            writer.write(CHUNK)
            await writer.drain()
        writer.close()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await reader.readexactly(len(REQUEST))
                writer.write(ANSWER)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    source = await asyncio.start_server(stream, "127.0.0.1", 0)
    answering = await asyncio.start_server(answer, "127.0.0.1", 0)
    parent.send((source.sockets[0].getsockname()[1], answering.sockets[0].getsockname()[1]))
    loop = asyncio.get_running_loop()
    relay_port: int = await loop.run_in_executor(None, parent.recv)
    sink, sink_writer = await asyncio.open_connection("127.0.0.1", relay_port)
    sink_writer.write(b"!")
    while await sink.read(65536):
        pass
    await asyncio.Event().wait()  # serves exchanges until the parent kills this process
