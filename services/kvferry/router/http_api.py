"""The OpenAI-compatible HTTP front door: ``/v1/chat/completions``, ``/v1/completions`` (SSE streaming
and not), ``/v1/models`` and ``/health``.

The conversation id comes from the ``X-Conversation-Id`` header or a ``conversation_id`` body field,
so the official ``openai`` client works unchanged (``extra_headers`` / ``extra_body``). Without one a
request is a one-off turn: nothing is looked up or retained. Errors use OpenAI's error body.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, Literal, TypeVar

from kvferry.router import validation
from kvferry.router.engines import EngineTable
from kvferry.router.tenants import ApiKeys, Tenant
from kvferry.router.turns import (
    ChatPrompt,
    PreparedTurn,
    Prompt,
    TextOut,
    TextPrompt,
    TokenPrompt,
    TurnRequest,
    TurnResult,
    TurnRunner,
)
from kvferry.runtime.errors import (
    ErrorKind,
    InvalidArgument,
    RequestTooLarge,
    ServiceError,
    http_status,
    internal_error,
)
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)

CONVERSATION_HEADER = "x-conversation-id"
TURN_HEADER = "x-kvferry-turn"


class _Body(BaseModel):
    # Unknown OpenAI fields are ignored, as OpenAI-compatible servers do. Strict: "yes" is not a boolean
    # and "5" not a number (OpenAI answers 400 too); an integer is still a float.
    model_config = ConfigDict(extra="ignore", strict=True)


class _ContentPart(_Body):
    type: str
    text: str | None = None


class _Message(_Body):
    role: str
    content: str | list[_ContentPart] | None = None


class _StreamOptions(_Body):
    include_usage: bool = False


class _Generation(_Body):
    model: str = ""
    stream: bool = False
    stream_options: _StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    logprobs: Any = None
    ignore_eos: bool = False
    # kvferry's own fields (the openai client sends them through `extra_body`).
    conversation_id: str | None = None
    retain: bool | None = None


class _ChatBody(_Generation):
    messages: list[_Message]
    max_completion_tokens: int | None = None


class _CompletionBody(_Generation):
    prompt: str | list[int] | list[str] | list[list[int]]


# OpenAI's error ``type`` for each kind of failure (the HTTP status comes from the kit's table).
_OPENAI_ERROR_TYPES = {
    ErrorKind.UNAUTHENTICATED: "authentication_error",
    ErrorKind.PERMISSION_DENIED: "permission_error",
    ErrorKind.INVALID_ARGUMENT: "invalid_request_error",
    ErrorKind.NOT_FOUND: "not_found_error",
    # Another turn of the conversation is in flight (409): OpenAI's clients retry 409 with backoff.
    ErrorKind.ABORTED: "conflict_error",
    ErrorKind.UNAVAILABLE: "service_unavailable",
    ErrorKind.DEADLINE_EXCEEDED: "timeout",
    ErrorKind.INTERNAL: "internal_error",
}


def _openai_error_type(error: ServiceError) -> str:
    return _OPENAI_ERROR_TYPES.get(error.kind, "api_error")


def error_response(error: ServiceError) -> JSONResponse:
    code: str | None = error.kind.name.lower()
    if error.kind is ErrorKind.NOT_FOUND and error.param == "model":
        code = "model_not_found"
    return JSONResponse(
        {
            "error": {
                "message": error.message,
                "type": _openai_error_type(error),
                "param": error.param,
                "code": code,
            }
        },
        status_code=http_status(error),
        headers=(
            {"retry-after": str(error.retry_after_seconds)} if error.retry_after_seconds is not None else None
        ),
    )


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def usage_body(result: TurnResult) -> dict[str, Any]:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": result.pulled_tokens},
        "pulled_tokens": result.pulled_tokens,
        "recomputed_tokens": result.recomputed_tokens,
        "kvferry": {
            "reuse": result.reuse.value,
            "turn": result.turn,
            "ttft_ms": round(result.ttft_ms, 3),
            "prefill_ms": round(result.prefill_ms, 3),
            "prefill_engine_id": result.prefill_engine_id,
            "decode_engine_id": result.decode_engine_id,
        },
    }


class HttpApi:
    """Handlers bound to one router's parts; :meth:`app` builds the Starlette application."""

    def __init__(
        self,
        *,
        runner: TurnRunner,
        keys: ApiKeys,
        engines: EngineTable,
        registry_connected: Callable[[], bool],
        max_body_bytes: int,
        metrics_registry: CollectorRegistry | None = None,
    ) -> None:
        self._metrics_registry = metrics_registry
        self._runner = runner
        self._keys = keys
        self._engines = engines
        self._registry_connected = registry_connected
        self._max_body_bytes = max_body_bytes

    def app(self) -> Starlette:
        return Starlette(
            exception_handlers={Exception: _internal_error_response},
            routes=[
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
            ],
        )

    # -- endpoints ---------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        prefill = sum(1 for e in self._engines.all() if e.can_prefill)
        decode = sum(1 for e in self._engines.all() if e.can_decode)
        ready = prefill > 0 and decode > 0
        return JSONResponse(
            {
                "status": "ok" if ready else "no_engines",
                "registry_connected": self._registry_connected(),
                "engines": {"prefill": prefill, "decode": decode},
            },
            status_code=200 if ready else 503,
        )

    async def metrics(self, request: Request) -> Response:
        """Prometheus text (the same series as --metrics-address serves); no key needed, like /health."""
        if self._metrics_registry is None:
            return Response(status_code=404)
        return Response(generate_latest(self._metrics_registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        try:
            tenant = self._keys.authenticate(request.headers.get("authorization"))
        except ServiceError as error:
            return error_response(error)
        data = []
        for model in self._engines.models():
            if tenant.models is not None and model not in tenant.models:
                continue
            limits = [e.max_model_len for e in self._engines.all() if e.model == model and e.max_model_len]
            data.append(
                {
                    "id": model,
                    "object": "model",
                    "created": 0,
                    "owned_by": "kvferry",
                    "max_model_len": min(limits) if limits else None,
                }
            )
        return JSONResponse({"object": "list", "data": data})

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    # -- shared flow ---------------------------------------------------------------------------

    async def _generate(self, request: Request, kind: Literal["chat", "completion"]) -> Response:
        events: AsyncGenerator[TextOut | TurnResult, None] | None = None
        try:
            tenant = self._keys.authenticate(request.headers.get("authorization"))
            raw = await self._read_body(request)
            body: _ChatBody | _CompletionBody
            prompt: Prompt
            if kind == "chat":
                chat = _parse(_ChatBody, raw)
                messages = [_message(i, m) for i, m in enumerate(chat.messages)]
                body, prompt = chat, ChatPrompt(validation.chat_messages(messages))
            else:
                completion = _parse(_CompletionBody, raw)
                body, prompt = completion, _completion_prompt(completion.prompt)
            turn_request = _turn_request(body, prompt, tenant, request.headers.get(CONVERSATION_HEADER))
            turn = await self._runner.prepare(turn_request)
            events = self._runner.execute(turn)
            # Wait for the first event before answering: a failure up to here gets a real status.
            first = await anext(events)
        except ServiceError as error:
            if events is not None:
                await events.aclose()
            return error_response(error)
        headers = {CONVERSATION_HEADER: turn_request.conversation_id} if turn_request.conversation_id else {}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _ClosingStreamingResponse(
                self._stream(kind, turn, first, events, include_usage),
                media_type="text/event-stream",
                headers={**headers, "cache-control": "no-cache"},
            )
        # A client that goes away before the whole answer is ready aborts the turn, as in streaming.
        collect = asyncio.ensure_future(self._collect(kind, turn, first, events, headers))
        disconnected = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({collect, disconnected}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnected.cancel()
        if not collect.done():
            collect.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await collect
            return Response(status_code=499)  # nobody reads it: the client closed the connection
        return collect.result()

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused (413) as soon as it passes the limit: a declared Content-Length before any byte
        is read, a chunked body while it streams in, so no more than the limit is ever held."""
        limit = self._max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise RequestTooLarge(f"the request body is {declared} bytes; at most {limit} are accepted")
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestTooLarge(f"the request body is over {limit} bytes; at most {limit} are accepted")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _collect(
        self,
        kind: Literal["chat", "completion"],
        turn: PreparedTurn,
        first: TextOut | TurnResult,
        events: AsyncGenerator[TextOut | TurnResult, None],
        headers: dict[str, str],
    ) -> Response:
        texts: list[str] = []
        result: TurnResult | None = None
        try:
            event: TextOut | TurnResult = first
            while True:
                if isinstance(event, TextOut):
                    texts.append(event.text)
                else:
                    result = event
                try:
                    event = await anext(events)
                except StopAsyncIteration:
                    break
        except ServiceError as error:
            return error_response(error)
        finally:
            await events.aclose()
        assert result is not None
        text = "".join(texts)
        choice: dict[str, Any]
        if kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": result.finish_reason,
                "logprobs": None,
            }
        else:
            choice = {"index": 0, "text": text, "finish_reason": result.finish_reason, "logprobs": None}
        return JSONResponse(
            {
                "id": _response_id(kind, turn),
                "object": "chat.completion" if kind == "chat" else "text_completion",
                "created": int(time.time()),
                "model": result.model,
                "choices": [choice],
                "usage": usage_body(result),
            },
            headers={**headers, TURN_HEADER: str(result.turn)},
        )

    async def _stream(
        self,
        kind: Literal["chat", "completion"],
        turn: PreparedTurn,
        first: TextOut | TurnResult,
        events: AsyncGenerator[TextOut | TurnResult, None],
        include_usage: bool,
    ) -> AsyncGenerator[bytes, None]:
        response_id = _response_id(kind, turn)
        created = int(time.time())
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            return _sse(
                {
                    "id": response_id,
                    "object": obj,
                    "created": created,
                    "model": turn.model,
                    "choices": choices,
                }
                | extra
            )

        def piece(text: str, finish_reason: str | None, first_piece: bool = False) -> dict[str, Any]:
            if kind == "chat":
                delta: dict[str, Any] = {"content": text} if text or not finish_reason else {}
                if first_piece:
                    delta["role"] = "assistant"
                return {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}

        try:
            event: TextOut | TurnResult = first
            first_piece = True
            while True:
                if isinstance(event, TextOut):
                    yield chunk([piece(event.text, None, first_piece)])
                    first_piece = False
                else:
                    yield chunk([piece("", event.finish_reason)])
                    if include_usage:
                        yield chunk([], usage=usage_body(event))
                try:
                    event = await anext(events)
                except StopAsyncIteration:
                    break
            yield b"data: [DONE]\n\n"
        except Exception as error:
            failure = (
                error if isinstance(error, ServiceError) else internal_error(error, "router", "streaming")
            )
            yield _sse(
                {
                    "error": {
                        "message": failure.message,
                        "type": _openai_error_type(failure),
                        "param": failure.param,
                        "code": http_status(failure),
                    }
                }
            )
        finally:
            # Also runs when the client disconnects: closing the turn aborts its engine requests.
            await events.aclose()


async def _internal_error_response(request: Request, error: Exception) -> Response:
    return error_response(internal_error(error, "router", request.url.path))


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the request body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _response_id(kind: str, turn: PreparedTurn) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + turn.request_id


_BodyT = TypeVar("_BodyT", bound=_Body)


def _parse(model: type[_BodyT], raw: bytes) -> _BodyT:
    if not raw:
        raise InvalidArgument("the request body is empty: send a JSON object")
    try:
        return model.model_validate_json(raw)
    except ValidationError as error:
        problems = []
        for item in error.errors()[:5]:
            where = ".".join(str(part) for part in item["loc"]) or "body"
            problems.append(f"{where}: {item['msg']}")
        first_loc = error.errors()[0]["loc"] if error.errors() else ()
        raise InvalidArgument(
            "malformed request body: " + "; ".join(problems),
            param=str(first_loc[0]) if first_loc else None,
        ) from None


def _message(index: int, message: _Message) -> tuple[str, str]:
    content = message.content
    if content is None:
        return message.role, ""
    if isinstance(content, str):
        return message.role, content
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise InvalidArgument(
                f"messages[{index}].content has a {part.type!r} part; only text parts are supported",
                param=f"messages[{index}].content",
            )
        texts.append(part.text)
    return message.role, "".join(texts)


def _completion_prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> Prompt:
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidArgument("prompt is empty", param="prompt")
        return TextPrompt(prompt)
    if not prompt:
        raise InvalidArgument("prompt is empty", param="prompt")
    if all(isinstance(t, int) for t in prompt):
        return TokenPrompt(validation.token_ids([t for t in prompt if isinstance(t, int)], param="prompt"))
    if len(prompt) != 1:
        raise InvalidArgument(
            "batched prompts are not supported: send one prompt per request", param="prompt"
        )
    single = prompt[0]
    return _completion_prompt(single)  # type: ignore[arg-type]


def conversation_of(body_conversation: str | None, header_conversation: str | None) -> str | None:
    """A request's conversation id: the ``X-Conversation-Id`` header or the body's ``conversation_id``
    (refused when both are given and differ), checked; None for a one-off turn."""
    conv = body_conversation
    if header_conversation is not None:
        if conv is not None and conv != header_conversation:
            raise InvalidArgument(
                "the X-Conversation-Id header and the conversation_id field differ; send one",
                param="conversation_id",
            )
        conv = header_conversation
    if conv is not None:
        validation.conversation_id(conv)
    return conv


def _turn_request(
    body: _ChatBody | _CompletionBody, prompt: Prompt, tenant: Tenant, header_conversation: str | None
) -> TurnRequest:
    if body.n not in (None, 1):
        raise InvalidArgument("n must be 1: the router generates one choice per request", param="n")
    if body.logprobs:
        raise InvalidArgument("logprobs are not supported by the router", param="logprobs")
    conv = conversation_of(body.conversation_id, header_conversation)
    max_tokens = body.max_tokens
    if isinstance(body, _ChatBody) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return TurnRequest(
        tenant=tenant,
        conversation_id=conv,
        model=validation.model_name(body.model),
        prompt=prompt,
        sampling=validation.sampling(
            max_tokens=max_tokens,
            # OpenAI's default temperature is 1.
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop=stop,
            ignore_eos=body.ignore_eos,
        ),
        retain=True if body.retain is None else body.retain,
    )


class _ClosingStreamingResponse(StreamingResponse):
    """Closes its body generator however the response ends.

    Starlette cancels the response of a client that left; cancelled inside a send rather than inside
    the generator, the generator's cleanup (closing the turn, which aborts its engine requests) would
    otherwise wait for garbage collection.
    """

    def __init__(self, body: AsyncGenerator[bytes, None], **kwargs: Any) -> None:
        super().__init__(body, **kwargs)
        self._body = body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._body.aclose()
