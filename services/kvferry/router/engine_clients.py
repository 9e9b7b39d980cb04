"""One shared :class:`~kvferry.pd.engine_client.VllmEngineClient` per registered engine."""

from __future__ import annotations

import asyncio

from kvferry.pd.engine_client import HttpTimeouts, VllmEngineClient
from kvferry.router.engines import EngineInfo
from kvferry.runtime.tracing import trace_headers


class EngineClients:
    """Engine HTTP clients by engine id; a client is replaced when its engine's endpoint or model
    changes, and closed when the engine leaves."""

    def __init__(self, *, timeouts: HttpTimeouts, max_connections: int) -> None:
        self._timeouts = timeouts
        self._max_connections = max_connections
        self._clients: dict[str, VllmEngineClient] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def get(self, engine: EngineInfo) -> VllmEngineClient:
        client = self._clients.get(engine.engine_id)
        if client is not None and client.base_url == engine.http_endpoint and client.model == engine.model:
            return client
        if client is not None:
            self._close_later(client)
        client = VllmEngineClient(
            engine.http_endpoint,
            engine.model,
            timeouts=self._timeouts,
            max_connections=self._max_connections,
            # W3C trace context of the current span (the turn's), so engine spans join the turn's trace.
            headers=trace_headers,
        )
        self._clients[engine.engine_id] = client
        return client

    def forget(self, engine_id: str) -> None:
        client = self._clients.pop(engine_id, None)
        if client is not None:
            self._close_later(client)

    def _close_later(self, client: VllmEngineClient) -> None:
        task = asyncio.ensure_future(client.aclose())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def aclose(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(c.aclose() for c in clients), *self._closing, return_exceptions=True)
