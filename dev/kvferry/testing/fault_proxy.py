"""A loopback TCP proxy that injects network faults between two kvferry parts.

Put it between a client and a server (a sidecar or router and the registry, a registry and etcd, one
etcd member and its peers) and, while traffic flows:

- ``latency_seconds``: every chunk waits this long before it is forwarded (both directions);
- :meth:`FaultProxy.cut`: every open connection is closed and new ones are closed at once (the far
  side is down: callers see connection errors at once);
- :meth:`FaultProxy.blackhole`: connections stay open but nothing passes until healed (a partition:
  calls time out, as across a dead switch);
- :meth:`FaultProxy.heal`: back to normal.

``source_of`` tells connections apart by their first bytes (etcd's peer requests name the member
that sends them in an ``X-Server-From`` header): connections whose source is in ``blocked_sources``
are refused, which is how :class:`kvferry.testing.etcd_cluster.EtcdCluster` partitions one member
from the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import Callable
from dataclasses import dataclass, field

_CHUNK = 65536
# How much of a connection's start ``source_of`` may look at (an HTTP request head fits).
_PEEK_BYTES = 8192


class Mode(enum.Enum):
    PASS = "pass"
    CUT = "cut"
    BLACKHOLE = "blackhole"


@dataclass(eq=False)
class _Connection:
    source: str | None
    writers: tuple[asyncio.StreamWriter, asyncio.StreamWriter]
    pipes: list[asyncio.Task[None]] = field(default_factory=list)

    def close(self) -> None:
        for writer in self.writers:
            with contextlib.suppress(Exception):
                writer.close()
        for pipe in self.pipes:
            pipe.cancel()


def http_header(name: str) -> Callable[[bytes], str | None]:
    """A ``source_of`` that reads one HTTP request header from a connection's first bytes."""
    wanted = name.lower().encode() + b":"

    def source_of(head: bytes) -> str | None:
        for line in head.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
            if line.lower().startswith(wanted):
                return line[len(wanted) :].strip().decode(errors="replace")
        return None

    return source_of


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    """A connection's first bytes, up to the end of an HTTP request head (or ``_PEEK_BYTES``)."""
    head = b""
    while b"\r\n\r\n" not in head and len(head) < _PEEK_BYTES:
        data = await reader.read(_PEEK_BYTES - len(head))
        if not data:
            break
        head += data
    return head


class FaultProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target`` (``host:port``), with the faults set on it.

    Runs on the event loop it is started on; the fault setters are plain methods safe to call from
    that loop (use ``LoopThread.run`` or ``loop.call_soon_threadsafe`` from elsewhere).
    """

    def __init__(
        self,
        target: str,
        *,
        port: int = 0,
        name: str = "",
        source_of: Callable[[bytes], str | None] | None = None,
    ) -> None:
        host, _, target_port = target.rpartition(":")
        self.target = (host, int(target_port))
        self.name = name or target
        self.port = port
        self.latency_seconds = 0.0
        self.mode = Mode.PASS
        self._passing = asyncio.Event()
        self._passing.set()
        self.blocked_sources: frozenset[str] = frozenset()
        self.block_unknown_sources = False
        self._source_of = source_of
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        # Connections seen, refused (cut, or a blocked source) and currently open.
        self.accepted = 0
        self.refused = 0

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port, reuse_address=True)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        self._close_where(lambda connection: True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
            self._server = None

    # -- faults ----------------------------------------------------------------------------------------

    def cut(self) -> None:
        self.mode = Mode.CUT
        self._passing.set()
        self._close_where(lambda connection: True)

    def blackhole(self) -> None:
        """Open connections stall (what is sent is held until :meth:`heal`); new ones are accepted and
        stall too: calls time out, as across a partition."""
        self.mode = Mode.BLACKHOLE
        self._passing.clear()

    def heal(self) -> None:
        self.mode = Mode.PASS
        self._passing.set()
        self.latency_seconds = 0.0
        self.block_sources(())

    def block_sources(
        self, sources: frozenset[str] | tuple[str, ...] | set[str], *, unknown: bool = False
    ) -> None:
        """Refuses (and closes) connections whose ``source_of`` is one of ``sources``; with
        ``unknown``, also those whose first bytes name no source (a client may send its unnamed
        requests first on a connection it goes on using for named ones, as etcd's prober and raft
        pipeline share one)."""
        self.blocked_sources = frozenset(sources)
        self.block_unknown_sources = unknown
        self._close_where(self._blocked)

    def _blocked(self, connection: _Connection) -> bool:
        if connection.source is None:
            return self.block_unknown_sources and self._source_of is not None
        return connection.source in self.blocked_sources

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    def _close_where(self, predicate: Callable[[_Connection], bool]) -> None:
        for connection in [c for c in self._connections if predicate(c)]:
            connection.close()
            self._connections.discard(connection)

    # -- forwarding ------------------------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode is Mode.CUT:
            self.refused += 1
            writer.close()
            return
        head = b""
        source: str | None = None
        if self._source_of is not None:
            try:
                head = await asyncio.wait_for(_read_head(reader), 10)
            except (OSError, TimeoutError):
                writer.close()
                return
            source = self._source_of(head)
            if self._blocked(_Connection(source=source, writers=(writer, writer))):
                self.refused += 1
                writer.close()
                return
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except OSError:
            self.refused += 1
            writer.close()
            return
        self.accepted += 1
        connection = _Connection(source=source, writers=(writer, upstream_writer))
        self._connections.add(connection)
        if head:
            upstream_writer.write(head)
        for pipe_reader, sink in ((reader, upstream_writer), (upstream_reader, writer)):
            pipe = asyncio.create_task(self._pipe(pipe_reader, sink, connection))
            connection.pipes.append(pipe)

    async def _pipe(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, connection: _Connection
    ) -> None:
        try:
            while data := await source.read(_CHUNK):
                if self.latency_seconds:
                    await asyncio.sleep(self.latency_seconds)
                # Held, not dropped: TCP retransmits across a partition, so what was sent arrives
                # after it heals (or never, when the connection dies first). Dropping bytes mid-stream
                # would corrupt it, which no network does to TCP.
                await self._passing.wait()
                sink.write(data)
                await sink.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            connection.close()
            self._connections.discard(connection)
