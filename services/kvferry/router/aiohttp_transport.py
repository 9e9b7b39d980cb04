"""An httpx transport over aiohttp's connection pool, for the router's engine clients.

httpcore's pool scans every connection for every request (``_assign_requests_to_connections``); with
dozens of concurrent turns per engine that scan was the largest part of the router's CPU per turn.
aiohttp's connector hands out a kept-alive connection in constant time. ``kvferry.pd.engine_client`` stays the
one engine client: this only replaces the bytes-on-the-wire layer under its ``httpx.AsyncClient``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import httpx
from kvferry.runtime.tracing import trace_headers


class _ResponseStream(httpx.AsyncByteStream):
    def __init__(self, response: aiohttp.ClientResponse, url: httpx.URL) -> None:
        self._response = response
        self._url = url

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except TimeoutError as error:
            raise httpx.ReadTimeout(f"no bytes from {self._url} in time", request=None) from error  # type: ignore[arg-type]
        except aiohttp.ClientError as error:
            raise httpx.ReadError(f"reading from {self._url}: {error}", request=None) from error  # type: ignore[arg-type]

    async def aclose(self) -> None:
        # Closing before the body ended drops the connection: the engine sees its client go and aborts.
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """Sends httpx requests through one ``aiohttp.ClientSession`` (created lazily in the running loop)."""

    def __init__(self, *, max_connections: int, keepalive_seconds: float = 30.0) -> None:
        self._max_connections = max_connections
        self._keepalive_seconds = keepalive_seconds
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self._max_connections,
                    limit_per_host=0,
                    keepalive_timeout=self._keepalive_seconds,
                ),
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
            )
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = request.extensions.get("timeout", {})
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=timeouts.get("pool"),
            sock_connect=timeouts.get("connect"),
            sock_read=timeouts.get("read"),
        )
        body = await request.aread()
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw]
        # W3C trace context of the current span (the turn's), so engine spans join the turn's trace.
        headers.extend(trace_headers().items())
        try:
            response = await self._client().request(
                request.method,
                str(request.url),
                headers=headers,
                data=body or None,
                timeout=timeout,
                allow_redirects=False,
            )
        except aiohttp.ConnectionTimeoutError as error:
            raise httpx.ConnectTimeout(f"connecting to {request.url} timed out", request=request) from error
        except TimeoutError as error:
            # No response head within the read timeout (a prefill that takes too long).
            raise httpx.ReadTimeout(f"no answer from {request.url} in time", request=request) from error
        except aiohttp.ClientConnectionError as error:
            raise httpx.ConnectError(f"connecting to {request.url}: {error}", request=request) from error
        except aiohttp.ClientError as error:
            raise httpx.RemoteProtocolError(f"{request.url}: {error}", request=request) from error
        return httpx.Response(
            status_code=response.status,
            headers=list(response.raw_headers),
            stream=_ResponseStream(response, request.url),
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
