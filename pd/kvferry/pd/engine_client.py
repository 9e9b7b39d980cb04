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

from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
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


@dataclass(frozen=True)
class HttpTimeouts:
    """Seconds; every call is bounded. ``read`` bounds each read, so a stream stalls at most that."""

    connect: float = 3.0
    read: float = 120.0
    write: float = 10.0
    pool: float = 10.0
    # Health and metadata calls (health, models, tokenize, metrics).
    control: float = 5.0

    def for_generation(self) -> httpx.Timeout:
        return httpx.Timeout(connect=self.connect, read=self.read, write=self.write, pool=self.pool)

    def for_control(self) -> httpx.Timeout:
        return httpx.Timeout(self.control, connect=self.connect)


class VllmEngineClient:
    """Talks to one engine. Create once per engine and share; close with :meth:`aclose`.

    Implements :class:`kvferry.pd.engine_api.EngineApi`."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        timeouts: HttpTimeouts | None = None,
        max_connections: int = 64,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeouts = timeouts or HttpTimeouts()
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=self.timeouts.for_generation(),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            transport=transport,
        )
        # Request URLs by path, parsed once: httpx parses a relative path and merges it with the base URL
        # on every request (about a third of building a turn's engine request).
        self._urls: dict[str, httpx.URL] = {}

    async def __aenter__(self) -> VllmEngineClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    def _url(self, path: str) -> httpx.URL:
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = httpx.URL(self.base_url + path)
        return url

    def _require_open(self) -> None:
        """A call on a closed client (its engine left while a turn still held it) is the engine's
        failure, which callers retry elsewhere, not httpx's RuntimeError."""
        if self._http.is_closed:
            raise EngineUnavailableError(self.base_url, ConnectionError("the engine's client is closed"))

    # -- control ----------------------------------------------------------------------------

    async def health(self) -> bool:
        """True when the engine answers /health with 200."""
        try:
            response = await self._http.get(self._url("/health"), timeout=self.timeouts.for_control())
        except httpx.HTTPError:
            return False
        return response.status_code == 200

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
        try:
            response = await self._http.get(self._url("/metrics"), timeout=self.timeouts.for_control())
        except httpx.HTTPError as error:
            raise EngineUnavailableError(self.base_url, error) from error
        _raise_for_status(self.base_url, response)
        return response.text

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
        headers = _request_headers(request.request_id)
        self._require_open()
        try:
            async with self._http.stream(
                "POST", self._url(path), content=encode_json(body), headers=headers
            ) as response:
                if response.status_code >= 400:
                    await response.aread()
                    _raise_for_status(self.base_url, response)
                events = SseData()
                async for piece in response.aiter_bytes():
                    for data in events.feed(piece):
                        chunk = parse(self.base_url, data)
                        if chunk is not None:
                            yield chunk
        except httpx.HTTPError as error:
            raise EngineUnavailableError(self.base_url, error) from error

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

    async def _get_json(self, path: str) -> dict[str, Any]:
        self._require_open()
        try:
            response = await self._http.get(self._url(path), timeout=self.timeouts.for_control())
        except httpx.HTTPError as error:
            raise EngineUnavailableError(self.base_url, error) from error
        _raise_for_status(self.base_url, response)
        return _json_object(self.base_url, response)

    async def _post(
        self, path: str, body: Mapping[str, Any], *, control: bool = False, request_id: str | None = None
    ) -> httpx.Response:
        timeout = self.timeouts.for_control() if control else self.timeouts.for_generation()
        self._require_open()
        try:
            response = await self._http.post(
                self._url(path),
                content=encode_json(body),
                timeout=timeout,
                headers=_request_headers(request_id),
            )
        except httpx.HTTPError as error:
            raise EngineUnavailableError(self.base_url, error) from error
        _raise_for_status(self.base_url, response)
        return response

    async def _post_json(
        self, path: str, body: Mapping[str, Any], *, control: bool = False, request_id: str | None = None
    ) -> dict[str, Any]:
        response = await self._post(path, body, control=control, request_id=request_id)
        return _json_object(self.base_url, response)


# ---------------------------------------------------------------------------------------------
# Parsing helpers (pure; tested without an engine)
# ---------------------------------------------------------------------------------------------


def _request_headers(request_id: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if request_id:
        headers["X-Request-Id"] = request_id
    return headers


def _raise_for_status(url: str, response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    message = response.text
    try:
        body = decode_json(response.content)
        error = body.get("error", body) if isinstance(body, dict) else body
        message = str(error.get("message", error)) if isinstance(error, dict) else str(error)
    except ValueError:
        pass
    raise EngineHttpError(url, response.status_code, message[:2000])


def _json_object(url: str, response: httpx.Response) -> dict[str, Any]:
    try:
        body = decode_json(response.content)
    except ValueError:
        raise EngineHttpError(url, response.status_code, f"not JSON: {response.text[:200]!r}") from None
    if not isinstance(body, dict):
        raise EngineHttpError(url, response.status_code, f"expected a JSON object, got {type(body).__name__}")
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
