"""Typed async client for ONE vLLM engine's HTTP API in prefill/decode (P/D) mode.

This is the one way kvferry talks to engines over HTTP. The wire forms of ``kv_transfer_params`` are
:mod:`kvferry.pd.vllm_params` and :mod:`kvferry.pd.kvferry_params`; the requests and answers
:mod:`kvferry.pd.engine_api`; a turn's sequence of calls :mod:`kvferry.pd.sequence`.

How a turn flows (see docs/connector.md; a chat turn sends the same through ``/v1/chat/completions``, the
bodies :mod:`kvferry.pd.chat` builds):

1. Prefill: ``POST /v1/completions`` on P with the prompt's token ids, ``max_tokens=1`` and
   ``kv_transfer_params = {"do_remote_decode": true, ...}``. When the conversation has KV
   retained on a decode engine, the params also name D's blocks (``remote_block_ids``,
   ``remote_engine_id``, ...): P pulls that prefix from D (NIXL READ) and computes only the
   suffix. P answers with :class:`~kvferry.pd.vllm_params.KvHandoff` params pointing at P's blocks.
2. Decode: ``POST /v1/completions`` (streaming) on D with the same prompt and P's handoff
   params plus the kvferry mark. D pulls the prompt's KV from P and generates. When the
   request finishes, the kvferry connector in D retains the blocks and reports them to its
   sidecar, which publishes the retention to the registry. vLLM 0.32 does not put
   ``kv_transfer_params`` into streamed responses (only the non-streaming body has them), so
   the router learns about retentions from the registry, not from D's stream.
3. Next turn: the router turns the published retention into
   :class:`~kvferry.pd.reuse.RetainedKv` and pulls its prefix in step 1.

Cancelling a streaming decode (the consumer stops iterating or its task is cancelled) closes
the HTTP connection; vLLM aborts the request when its client disconnects.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from kvferry.pd.chat import ChatRequest
from kvferry.pd.engine_api import (
    DecodeChunk,
    DecodeRequest,
    DecodeResult,
    EngineHttpError,
    EngineUnavailableError,
    ModelInfo,
    PrefillRequest,
    PrefillResult,
    Usage,
)
from kvferry.pd.engine_metrics import EngineMetrics, parse_metrics
from kvferry.pd.json_codec import decode_json, encode_json
from kvferry.pd.kvferry_params import BlockGenerations
from kvferry.pd.vllm_params import KvHandoff
from yarl import URL

# An engine call's failures on the way (refused, reset, cut, timed out), as aiohttp raises them.
_TRANSPORT_ERRORS = (aiohttp.ClientError, TimeoutError)


@dataclass(frozen=True)
class HttpTimeouts:
    """Seconds. A call's connection and each of its reads are bounded (``read``: a stream stalls at most
    that); writing a request's body has no bound of its own."""

    connect: float = 3.0
    read: float = 120.0
    # Waiting for one of the client's connections to the engine to come free.
    pool: float = 10.0
    # Health and metadata calls (health, models, tokenize, metrics): each read.
    control: float = 5.0

    def for_generation(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(
            total=None, connect=self.pool, sock_connect=self.connect, sock_read=self.read
        )

    def for_control(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(
            total=None, connect=self.pool, sock_connect=self.connect, sock_read=self.control
        )


class VllmEngineClient:
    """Talks to one engine. Create once per engine and share; close with :meth:`aclose`.

    One aiohttp session per client, made in the running event loop on the first call: its connector hands out
    a kept-alive connection in constant time however many turns share the engine. ``headers``, when given,
    adds headers to every request (the router's: the turn's W3C trace context: engine spans join its trace).

    Implements :class:`kvferry.pd.engine_api.EngineApi`."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        timeouts: HttpTimeouts | None = None,
        max_connections: int = 64,
        headers: Callable[[], Mapping[str, str]] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeouts = timeouts or HttpTimeouts()
        self._generation_timeout = self.timeouts.for_generation()
        self._control_timeout = self.timeouts.for_control()
        self._max_connections = max_connections
        self._extra_headers = headers
        self._session: aiohttp.ClientSession | None = None
        self._closed = False
        # Request URLs by path, built once (parsing a URL is a noticeable part of building a request).
        self._urls: dict[str, URL] = {}

    async def __aenter__(self) -> VllmEngineClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def _url(self, path: str) -> URL:
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = URL(self.base_url + path)
        return url

    def _client(self) -> aiohttp.ClientSession:
        """The session. A call on a closed client (its engine left while a turn still held it) is the
        engine's failure, which callers retry elsewhere."""
        if self._closed:
            raise EngineUnavailableError(self.base_url, ConnectionError("the engine's client is closed"))
        session = self._session
        if session is None:
            session = self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self._max_connections, limit_per_host=0, keepalive_timeout=30.0
                ),
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
            )
        return session

    def _headers(self, request_id: str | None, *, body: bool) -> dict[str, str]:
        headers = {"Content-Type": "application/json"} if body else {}
        if request_id:
            headers["X-Request-Id"] = request_id
        if self._extra_headers is not None:
            headers.update(self._extra_headers())
        return headers

    def _unavailable(self, error: BaseException, timeout: aiohttp.ClientTimeout) -> EngineUnavailableError:
        """The engine's failure, its cause said in terms of this client's timeouts."""
        cause: BaseException = error
        if isinstance(error, aiohttp.ConnectionTimeoutError):
            cause = TimeoutError(
                f"no connection within {timeout.sock_connect} s (connect timeout), or none of the client's"
                f" free within {timeout.connect} s (pool timeout)"
            )
        elif isinstance(error, TimeoutError):
            cause = TimeoutError(f"no bytes within {timeout.sock_read} s (read timeout)")
        return EngineUnavailableError(
            self.base_url, cause, refused=isinstance(error, aiohttp.ClientConnectorError)
        )

    # -- control ----------------------------------------------------------------------------

    async def health(self) -> bool:
        """True when the engine answers /health with 200."""
        try:
            return await self.health_status() == 200
        except EngineUnavailableError:
            return False

    async def health_status(self) -> int:
        """The status /health answers with; :class:`EngineUnavailableError` when there is no answer."""
        status, _ = await self._call("GET", "/health", control=True)
        return status

    async def models(self) -> list[ModelInfo]:
        body = await self._get_json("/v1/models")
        return [
            ModelInfo(
                id=str(item["id"]),
                max_model_len=None if item.get("max_model_len") is None else int(item["max_model_len"]),
            )
            for item in body.get("data", [])
        ]

    async def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        body = await self._post_json(
            "/tokenize",
            {"model": self.model, "prompt": text, "add_special_tokens": add_special_tokens},
            control=True,
        )
        return list(map(int, body["tokens"]))

    async def render_chat(self, chat: ChatRequest) -> list[int]:
        """Token ids of the chat's prompt, rendered as the chat endpoint renders it."""
        body = await self._post_json("/tokenize", chat.tokenize_body(self.model), control=True)
        return list(map(int, body["tokens"]))

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        body = await self._post_json(
            "/detokenize", {"model": self.model, "tokens": list(token_ids)}, control=True
        )
        return str(body["prompt"])

    async def metrics(self) -> EngineMetrics:
        return parse_metrics(await self.metrics_text())

    async def metrics_text(self) -> str:
        """The engine's Prometheus exposition as is."""
        status, content = await self._call("GET", "/metrics", control=True)
        _raise_for_status(self.base_url, status, content)
        return content.decode("utf-8", "replace")

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Aborts requests by the ids given as X-Request-Id (vLLM's external ids)."""
        await self._post("/inference/v1/abort_requests", {"request_ids": list(request_ids)}, control=True)

    # -- generation -------------------------------------------------------------------------

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        """Computes the prompt on a prefill engine (pulling ``reuse`` first when given)."""
        if request.chat is not None:
            path, body = "/v1/chat/completions", request.chat.prefill_body(self.model)
        else:
            path, body = (
                "/v1/completions",
                {
                    "model": self.model,
                    "prompt": list(request.token_ids),
                    "max_tokens": 1,
                    "temperature": 0.0,
                    "stream": False,
                    "return_token_ids": True,
                },
            )
            if request.sampling is not None:
                body.update(request.sampling.to_body())
                body["max_tokens"] = 1
        body["kv_transfer_params"] = request.transfer_params()
        answer = await self._post_json(path, body, request_id=request.request_id)
        handoff = KvHandoff.from_params(answer.get("kv_transfer_params"))
        if handoff is None or not handoff.do_remote_prefill:
            raise EngineHttpError(
                self.base_url,
                200,
                "prefill answered without kv_transfer_params: is the engine a kvferry/Nixl prefill engine?",
            )
        choice = (answer.get("choices") or [{}])[0]
        return PrefillResult(
            handoff=handoff,
            first_token_ids=tuple(int(t) for t in choice.get("token_ids") or ()),
            usage=Usage.from_body(answer.get("usage")),
            first_text=str(choice.get("text") or ""),
            finish_reason=choice.get("finish_reason"),
        )

    async def decode_stream(self, request: DecodeRequest) -> AsyncGenerator[DecodeChunk, None]:
        """Streams the decode engine's output. Stop iterating (or cancel) to abort it."""
        path, body = self._decode_body(request, stream=True)
        parse = _chat_event if request.chat is not None else _completion_event
        session = self._client()
        timeout = self._generation_timeout
        try:
            response = await session.post(
                self._url(path),
                data=encode_json(body),
                headers=self._headers(request.request_id, body=True),
                timeout=timeout,
                allow_redirects=False,
            )
        except _TRANSPORT_ERRORS as error:
            raise self._unavailable(error, timeout) from error
        try:
            if response.status >= 400:
                _raise_for_status(self.base_url, response.status, await response.read())
            events = SseData()
            async for piece in response.content.iter_any():
                for data in events.feed(piece):
                    chunk = parse(self.base_url, data)
                    if chunk is not None:
                        yield chunk
        except _TRANSPORT_ERRORS as error:
            raise self._unavailable(error, timeout) from error
        finally:
            # Closing before the body ended drops the connection: the engine sees its client go and aborts.
            if response.content.at_eof():
                response.release()
            else:
                response.close()

    async def decode(self, request: DecodeRequest) -> DecodeResult:
        """Non-streaming decode; its answer names the blocks D retained (``retained``)."""
        path, body = self._decode_body(request, stream=False)
        answer = await self._post_json(path, body, request_id=request.request_id)
        params = answer.pop("kv_transfer_params", None)
        choice = (answer.get("choices") or [{}])[0]
        if request.chat is not None:
            text = str((choice.get("message") or {}).get("content") or "")
        else:
            text = str(choice.get("text") or "")
        return DecodeResult(
            token_ids=tuple(int(t) for t in choice.get("token_ids") or ()),
            text=text,
            finish_reason=choice.get("finish_reason"),
            usage=Usage.from_body(answer.get("usage")),
            retained=KvHandoff.from_params(params),
            retained_generations=BlockGenerations.from_params(params),
            body=answer if request.chat is not None else None,
        )

    def _decode_body(self, request: DecodeRequest, *, stream: bool) -> tuple[str, dict[str, Any]]:
        if request.chat is not None:
            path, body = "/v1/chat/completions", request.chat.decode_body(self.model, stream=stream)
        else:
            path, body = (
                "/v1/completions",
                {
                    "model": self.model,
                    "prompt": list(request.token_ids),
                    "stream": stream,
                    "return_token_ids": True,
                },
            )
            body.update(request.sampling.to_body())
            if stream:
                body["stream_options"] = {"include_usage": True}
        body["kv_transfer_params"] = request.transfer_params()
        return path, body

    # -- plumbing ---------------------------------------------------------------------------

    async def _call(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        control: bool,
        request_id: str | None = None,
    ) -> tuple[int, bytes]:
        """One request and its whole answer: (status, body bytes)."""
        session = self._client()
        timeout = self._control_timeout if control else self._generation_timeout
        try:
            async with session.request(
                method,
                self._url(path),
                data=None if body is None else encode_json(body),
                headers=self._headers(request_id, body=body is not None),
                timeout=timeout,
                allow_redirects=False,
            ) as response:
                return response.status, await response.read()
        except _TRANSPORT_ERRORS as error:
            raise self._unavailable(error, timeout) from error

    async def _get_json(self, path: str) -> dict[str, Any]:
        status, content = await self._call("GET", path, control=True)
        _raise_for_status(self.base_url, status, content)
        return _json_object(self.base_url, status, content)

    async def _post(
        self, path: str, body: Mapping[str, Any], *, control: bool = False, request_id: str | None = None
    ) -> tuple[int, bytes]:
        status, content = await self._call("POST", path, body, control=control, request_id=request_id)
        _raise_for_status(self.base_url, status, content)
        return status, content

    async def _post_json(
        self, path: str, body: Mapping[str, Any], *, control: bool = False, request_id: str | None = None
    ) -> dict[str, Any]:
        status, content = await self._post(path, body, control=control, request_id=request_id)
        return _json_object(self.base_url, status, content)


# ---------------------------------------------------------------------------------------------
# Parsing helpers (pure; tested without an engine)
# ---------------------------------------------------------------------------------------------


def _raise_for_status(url: str, status: int, content: bytes) -> None:
    if status < 400:
        return
    message = content.decode("utf-8", "replace")
    try:
        body = decode_json(content)
        error = body.get("error", body) if isinstance(body, dict) else body
        message = str(error.get("message", error)) if isinstance(error, dict) else str(error)
    except ValueError:
        pass
    raise EngineHttpError(url, status, message[:2000])


def _json_object(url: str, status: int, content: bytes) -> dict[str, Any]:
    try:
        body = decode_json(content)
    except ValueError:
        raise EngineHttpError(url, status, f"not JSON: {content[:200]!r}") from None
    if not isinstance(body, dict):
        raise EngineHttpError(url, status, f"expected a JSON object, got {type(body).__name__}")
    return body


class SseData:
    """The ``data:`` payloads of a server-sent event stream fed in pieces, however its bytes are split
    (keep-alives, comments and ``[DONE]`` left out). Not a generator: one less layer per relayed token."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, piece: bytes) -> list[bytes]:
        buffer = self._buffer + piece if self._buffer else piece
        found = []
        start = 0
        while (end := buffer.find(b"\n", start)) >= 0:
            line = buffer[start:end]
            start = end + 1
            if line.startswith(b"data:"):
                data = line[5:].strip()
                if data and data != b"[DONE]":
                    found.append(data)
        self._buffer = buffer[start:]
        return found


def _event(url: str, data: bytes) -> dict[str, Any]:
    """A stream event as JSON; an error event raises :class:`EngineHttpError`."""
    try:
        event = decode_json(data)
    except ValueError:
        raise EngineHttpError(url, 200, f"malformed stream event: {data[:200]!r}") from None
    if not isinstance(event, dict):
        raise EngineHttpError(url, 200, f"malformed stream event: {data[:200]!r}")
    if "error" in event:
        error = event["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        code = error.get("code", 500) if isinstance(error, dict) else 500
        raise EngineHttpError(url, int(code) if isinstance(code, int) else 500, str(message))
    return event


def _completion_event(url: str, data: bytes) -> DecodeChunk | None:
    """One event of a streamed completion -> chunk (None for an event with nothing in it)."""
    event = _event(url, data)
    usage = Usage.from_body(event.get("usage"))
    choices = event.get("choices") or []
    if not choices:
        return DecodeChunk(token_ids=(), text="", usage=usage) if usage else None
    choice = choices[0]
    return DecodeChunk(
        token_ids=tuple(int(t) for t in choice.get("token_ids") or ()),
        text=str(choice.get("text") or ""),
        finish_reason=choice.get("finish_reason"),
        usage=usage,
    )


# Every chat event but the last carries these bytes and no usage (vLLM 0.32 sets finish_reason explicitly;
# inside a JSON string the quote before the colon would be escaped, so only the field itself matches).
_NOT_FINISHED = b'"finish_reason":null'
_USAGE = b'"usage":{'


def _chat_event(url: str, data: bytes) -> DecodeChunk:
    """One event of a streamed chat completion -> chunk carrying it as is (``raw``). Only events that may
    end the stream, carry usage or report an error are parsed."""
    if _NOT_FINISHED in data and _USAGE not in data:
        return DecodeChunk((), "", raw=data)
    event = _event(url, data)
    usage = Usage.from_body(event.get("usage"))
    choices = event.get("choices") or []
    if not choices:
        # The trailing usage event: the caller reports usage its own way.
        return DecodeChunk((), "", usage=usage)
    return DecodeChunk((), "", finish_reason=choices[0].get("finish_reason"), usage=usage, raw=data)
