"""The OpenAI-compatible HTTP front door: ``/v1/chat/completions`` (through the engines' own chat endpoint),
``/v1/completions``, ``/v1/responses``, ``/v1/models``, the conversation calls under
``/v1/kvferry/conversations/{id}``, ``/health`` and ``/metrics``.

A conversation is named by the ``X-Conversation-Id`` header, a ``conversation_id`` body field, OpenAI's
``prompt_cache_key`` or (Responses) ``previous_response_id``, so the official ``openai`` client and the
frameworks built on it work unchanged. Without one a request is a one-off turn: nothing is looked up or
retained. Errors use OpenAI's error body.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Generator, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from kvferry.pd.chat import ChatDelta
from kvferry.pd.json_codec import decode_json, encode_json
from kvferry.router import validation
from kvferry.router.conversations import Conversations
from kvferry.router.engines import EngineTable
from kvferry.router.openai_chat import ChatCall, load_json_object, parse_chat
from kvferry.router.openai_completions import CompletionCall, parse_completion_body
from kvferry.router.openai_responses import (
    ResponseEvents,
    ResponsesCall,
    ResponseStore,
    StoredResponse,
    chain_conversation_id,
    chat_body,
    final_status,
    history_message,
    new_response_id,
    output_from_answer,
    parse_responses,
    response_object,
    sse_event,
)
from kvferry.router.tenants import ApiKeys, Tenant
from kvferry.router.turns import (
    ChatOut,
    ChatPrompt,
    MarkAhead,
    PreparedTurn,
    SamplingOptions,
    TextOut,
    TurnEvent,
    TurnRequest,
    TurnResult,
    TurnRunner,
)
from kvferry.runtime.errors import (
    ErrorKind,
    InvalidArgument,
    NotFound,
    RequestTooLarge,
    ServiceError,
    http_status,
    internal_error,
)
from kvferry.runtime.ids import check_id
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)

CONVERSATION_HEADER = "x-conversation-id"
# Non-streamed answers also say what the turn reused (streams say it in their usage chunk).
TURN_HEADER = "x-kvferry-turn"
PULLED_TOKENS_HEADER = "x-kvferry-pulled-tokens"
REUSE_HEADER = "x-kvferry-reuse"
_DONE = b"data: [DONE]\n\n"

TurnEvents = AsyncGenerator[TurnEvent | TurnResult, None]


class ClosingEvents(Protocol):
    """A turn's events being answered: iterate them, close them (which closes the turn)."""

    def __aiter__(self) -> AsyncIterator[TurnEvent | TurnResult]: ...

    async def aclose(self) -> None: ...


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


def _sse(payload: Mapping[str, Any]) -> bytes:
    return b"data: " + encode_json(payload) + b"\n\n"


def _error_event(error: BaseException) -> bytes:
    """An error after the stream began: OpenAI's error object as the stream's last event."""
    failure = error if isinstance(error, ServiceError) else internal_error(error, "router", "streaming")
    return _sse(
        {
            "error": {
                "message": failure.message,
                "type": _openai_error_type(failure),
                "param": failure.param,
                "code": http_status(failure),
            }
        }
    )


def usage_body(result: TurnResult) -> dict[str, Any]:
    """OpenAI's usage object (the decode engine's, with its details) and kvferry's reuse figures."""
    engine = result.engine_usage or {}
    return {
        **engine,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
        "prompt_tokens_details": {
            **(engine.get("prompt_tokens_details") or {}),
            "cached_tokens": result.pulled_tokens,
        },
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


def result_headers(result: TurnResult) -> dict[str, str]:
    return {
        TURN_HEADER: str(result.turn),
        PULLED_TOKENS_HEADER: str(result.pulled_tokens),
        REUSE_HEADER: result.reuse.value,
    }


class HttpApi:
    """Handlers bound to one router's parts; :meth:`app` builds the Starlette application."""

    def __init__(
        self,
        *,
        runner: TurnRunner,
        keys: ApiKeys,
        engines: EngineTable,
        conversations: Conversations,
        responses: ResponseStore,
        registry_connected: Callable[[], bool],
        max_body_bytes: int,
        index_synced: Callable[[], bool] = lambda: True,
        metrics_registry: CollectorRegistry | None = None,
    ) -> None:
        self._metrics_registry = metrics_registry
        self._runner = runner
        self._keys = keys
        self._engines = engines
        self._conversations = conversations
        self._responses = responses
        self._registry_connected = registry_connected
        self._index_synced = index_synced
        self._max_body_bytes = max_body_bytes

    def app(self) -> Starlette:
        conversation = "/v1/kvferry/conversations/{conversation_id}"
        return Starlette(
            exception_handlers={Exception: _internal_error_response},
            routes=[
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/responses", self.create_response, methods=["POST"]),
                Route("/v1/responses/{response_id}", self.get_response, methods=["GET"]),
                Route("/v1/responses/{response_id}", self.delete_response, methods=["DELETE"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route(conversation, self.describe_conversation, methods=["GET"]),
                Route(conversation, self.close_conversation, methods=["DELETE"]),
                Route(conversation + "/renew", self.renew_conversation, methods=["POST"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
            ],
        )

    # -- endpoints ---------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        prefill = sum(1 for e in self._engines.all() if e.can_prefill)
        decode = sum(1 for e in self._engines.all() if e.can_decode)
        synced = self._index_synced()
        ready = prefill > 0 and decode > 0 and synced
        return JSONResponse(
            {
                "status": "ok" if ready else "no_engines" if synced else "retention_index_not_synced",
                "registry_connected": self._registry_connected(),
                "retention_index_synced": synced,
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
            tenant = self._tenant(request)
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

    async def renew_conversation(self, request: Request) -> Response:
        async def renew(tenant: Tenant, conv: str) -> Response:
            expire = await self._conversations.renew(tenant.name, conv)
            return JSONResponse({"conversation_id": conv, "expire_time": round(expire, 3)})

        return await self._conversation_call(request, renew)

    async def close_conversation(self, request: Request) -> Response:
        async def close(tenant: Tenant, conv: str) -> Response:
            await self._conversations.close(tenant.name, conv)
            return JSONResponse({"conversation_id": conv, "closed": True})

        return await self._conversation_call(request, close)

    async def describe_conversation(self, request: Request) -> Response:
        async def describe(tenant: Tenant, conv: str) -> Response:
            record = await self._conversations.describe(tenant.name, conv)
            return JSONResponse(
                {
                    "conversation_id": conv,
                    "turn": record.turn,
                    "num_tokens": record.num_tokens,
                    "engine_id": record.engine_id,
                    "expire_time": round(record.expire_time, 3),
                }
            )

        return await self._conversation_call(request, describe)

    async def chat_completions(self, request: Request) -> Response:
        received = time.perf_counter()
        try:
            tenant = self._tenant(request)
            async with self._mark_ahead(request, tenant) as ahead:
                call = parse_chat(load_json_object(await self._read_body(request)))
                turn_request = self._chat_turn(request, tenant, call, received)
                return await self._serve(
                    request,
                    turn_request,
                    lambda turn, events: self._relay_chat(turn, events, call.include_usage),
                    self._chat_answer,
                    ahead,
                )
        except ServiceError as error:
            return error_response(error)

    async def completions(self, request: Request) -> Response:
        received = time.perf_counter()
        try:
            tenant = self._tenant(request)
            async with self._mark_ahead(request, tenant) as ahead:
                call = parse_completion_body(await self._read_body(request))
                turn_request = self._completion_turn(request, tenant, call, received)
                return await self._serve(
                    request,
                    turn_request,
                    lambda turn, events: self._stream_completion(turn, events, call.include_usage),
                    self._completion_answer,
                    ahead,
                )
        except ServiceError as error:
            return error_response(error)

    async def create_response(self, request: Request) -> Response:
        received = time.perf_counter()
        try:
            tenant = self._tenant(request)
            async with self._mark_ahead(request, tenant) as ahead:
                return await self._create_response(request, tenant, ahead, received)
        except ServiceError as error:
            return error_response(error)

    async def _create_response(
        self, request: Request, tenant: Tenant, ahead: MarkAhead | None, received: float
    ) -> Response:
        try:
            call = parse_responses(load_json_object(await self._read_body(request)))
            previous = None
            if call.body.previous_response_id is not None:
                previous = self._responses.get(tenant.name, call.body.previous_response_id)
            history = previous.messages if previous is not None else ()
            chat = parse_chat(chat_body(call, history))
            responding = _Responding(call, new_response_id(), history, tenant.name, int(time.time()))
            conversation = conversation_of(
                request.headers.get(CONVERSATION_HEADER),
                call.body.conversation_id,
                call.body.prompt_cache_key,
            )
            if conversation is None and previous is not None:
                conversation = previous.conversation_id
            if conversation is None and responding.store:
                conversation = chain_conversation_id(responding.response_id)
            responding.conversation_id = conversation
            turn_request = dataclasses.replace(
                self._chat_turn(request, tenant, chat, received), conversation_id=conversation
            )
        except ServiceError as error:
            return error_response(error)
        return await self._serve(
            request,
            turn_request,
            lambda turn, events: self._stream_response(events, responding),
            lambda turn, events: self._response_answer(events, responding),
            ahead,
        )

    async def get_response(self, request: Request) -> Response:
        try:
            tenant = self._tenant(request)
            record = self._responses.get(tenant.name, request.path_params["response_id"])
        except ServiceError as error:
            error.param = None
            return error_response(error)
        return JSONResponse(dict(record.response))

    async def delete_response(self, request: Request) -> Response:
        try:
            tenant = self._tenant(request)
        except ServiceError as error:
            return error_response(error)
        response_id = request.path_params["response_id"]
        if not self._responses.delete(tenant.name, response_id):
            return error_response(NotFound(f"response {response_id[:80]!r} is not stored"))
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    # -- requests to turns --------------------------------------------------------------------

    def _tenant(self, request: Request) -> Tenant:
        return self._keys.authenticate(request.headers.get("authorization"))

    def _chat_turn(self, request: Request, tenant: Tenant, call: ChatCall, received: float) -> TurnRequest:
        return TurnRequest(
            tenant=tenant,
            conversation_id=conversation_of(
                request.headers.get(CONVERSATION_HEADER), call.conversation_id, call.prompt_cache_key
            ),
            model=call.model,
            prompt=ChatPrompt(call.chat),
            sampling=SamplingOptions(max_tokens=call.max_tokens),
            retain=call.retain,
            stream=call.stream,
            received_at=received,
        )

    def _completion_turn(
        self, request: Request, tenant: Tenant, call: CompletionCall, received: float
    ) -> TurnRequest:
        return TurnRequest(
            tenant=tenant,
            conversation_id=conversation_of(
                request.headers.get(CONVERSATION_HEADER), call.conversation_id, call.prompt_cache_key
            ),
            model=call.model,
            prompt=call.prompt,
            sampling=call.sampling,
            retain=call.retain,
            stream=call.stream,
            received_at=received,
        )

    def _mark_ahead(self, request: Request, tenant: Tenant) -> AbstractAsyncContextManager[MarkAhead | None]:
        """The turn's mark, asked for now when the ``X-Conversation-Id`` header names the conversation (the
        header is the turn's conversation whenever it is sent): its round trip overlaps reading and
        checking the body. A header that is not a conversation id is refused later, as without it."""
        header = request.headers.get(CONVERSATION_HEADER)
        if header is None or check_id("conversation_id", header) is not None:
            return contextlib.nullcontext()
        return self._runner.mark_ahead(tenant, header)

    async def _conversation_call(
        self, request: Request, call: Callable[[Tenant, str], Awaitable[Response]]
    ) -> Response:
        try:
            return await call(self._tenant(request), request.path_params["conversation_id"])
        except ServiceError as error:
            return error_response(error)

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

    # -- the shared flow ------------------------------------------------------------------------

    async def _serve(
        self,
        request: Request,
        turn_request: TurnRequest,
        stream: Callable[[PreparedTurn, ClosingEvents], AsyncGenerator[bytes, None]],
        answer: Callable[[PreparedTurn, ClosingEvents], Awaitable[Response]],
        ahead: MarkAhead | None,
    ) -> Response:
        """Runs the turn; a failure before its first output gets a real status, later ones end the stream.
        A client that goes away aborts the turn (its engine requests) in both forms."""
        try:
            turn = await self._runner.prepare(turn_request, ahead)
        except ServiceError as error:
            return error_response(error)
        headers = {CONVERSATION_HEADER: turn_request.conversation_id} if turn_request.conversation_id else {}
        if turn_request.stream:
            started = self._runner.execute(turn)
            try:
                # Wait for the first event before answering: a failure up to here gets a real status.
                first = await anext(started)
            except ServiceError as error:
                await started.aclose()
                return error_response(error)
            events = _Resumed(first, started)
            return _ClosingStreamingResponse(
                stream(turn, events),
                events,
                media_type="text/event-stream",
                headers={**headers, "cache-control": "no-cache"},
            )
        collect = asyncio.ensure_future(answer(turn, self._runner.execute(turn)))
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
        response = collect.result()
        response.headers.update(headers)
        return response

    # -- chat -----------------------------------------------------------------------------------

    async def _relay_chat(
        self, turn: PreparedTurn, events: ClosingEvents, include_usage: bool
    ) -> AsyncGenerator[bytes, None]:
        """The decode engine's chunks as it sent them; the usage chunk (when asked for) carries kvferry's
        figures and comes once the turn's retention is published."""
        head: dict[str, Any] | None = None
        try:
            async for event in events:
                if isinstance(event, ChatOut):
                    if head is None:
                        head = decode_json(event.raw)
                    yield b"data: " + event.raw + b"\n\n"
                elif isinstance(event, TurnResult) and include_usage:
                    yield _sse(
                        {
                            "id": head["id"] if head else "chatcmpl-" + turn.request_id,
                            "object": "chat.completion.chunk",
                            "created": head["created"] if head else int(time.time()),
                            "model": head["model"] if head else turn.model,
                            "choices": [],
                            "usage": usage_body(event),
                        }
                    )
            yield _DONE
        except Exception as error:
            yield _error_event(error)
        finally:
            # Also runs when the client disconnects: closing the turn aborts its engine requests.
            await events.aclose()

    async def _chat_answer(self, turn: PreparedTurn, events: ClosingEvents) -> Response:
        result = await _result(events)
        if isinstance(result, ServiceError):
            return error_response(result)
        assert result.answer is not None
        return JSONResponse({**result.answer, "usage": usage_body(result)}, headers=result_headers(result))

    # -- responses ------------------------------------------------------------------------------

    async def _response_answer(self, events: ClosingEvents, responding: _Responding) -> Response:
        result = await _result(events)
        if isinstance(result, ServiceError):
            return error_response(result)
        assert result.answer is not None
        response = responding.response(result, output_from_answer(result.answer))
        self._store(responding, response)
        return JSONResponse(response, headers=result_headers(result))

    async def _stream_response(
        self, events: ClosingEvents, responding: _Responding
    ) -> AsyncGenerator[bytes, None]:
        """The chat stream as Responses events: the response is created, its items open, grow and close,
        and it completes (stored, when asked) once the turn's retention is published."""
        builder = ResponseEvents(responding.response(None, []))
        try:
            for event in builder.start():
                yield sse_event(event)
            async for turn_event in events:
                if isinstance(turn_event, ChatOut):
                    for event in builder.add(ChatDelta.from_event(decode_json(turn_event.raw))):
                        yield sse_event(event)
                elif isinstance(turn_event, TurnResult):
                    for event in builder.finish():
                        yield sse_event(event)
                    response = responding.response(turn_event, builder.output)
                    self._store(responding, response)
                    yield sse_event(builder.end(response))
        except Exception as error:
            if not isinstance(error, ServiceError):
                error = internal_error(error, "router", "responses stream")
            yield sse_event(builder.error(error.message, error.kind.name.lower()))
        finally:
            await events.aclose()

    def _store(self, responding: _Responding, response: dict[str, Any]) -> None:
        if not responding.store or responding.conversation_id is None:
            return
        messages = (*responding.history, *responding.call.input_messages, history_message(response["output"]))
        self._responses.put(
            StoredResponse(
                tenant=responding.tenant,
                response_id=responding.response_id,
                conversation_id=responding.conversation_id,
                messages=messages,
                response=response,
                stored_at=time.time(),
            )
        )

    # -- completions ----------------------------------------------------------------------------

    async def _stream_completion(
        self, turn: PreparedTurn, events: ClosingEvents, include_usage: bool
    ) -> AsyncGenerator[bytes, None]:
        response_id = "cmpl-" + turn.request_id
        created = int(time.time())

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            return _sse(
                {
                    "id": response_id,
                    "object": "text_completion",
                    "created": created,
                    "model": turn.model,
                    "choices": choices,
                }
                | extra
            )

        try:
            async for event in events:
                if isinstance(event, TextOut):
                    yield chunk([{"index": 0, "text": event.text, "finish_reason": None, "logprobs": None}])
                elif isinstance(event, TurnResult):
                    yield chunk(
                        [{"index": 0, "text": "", "finish_reason": event.finish_reason, "logprobs": None}]
                    )
                    if include_usage:
                        yield chunk([], usage=usage_body(event))
            yield _DONE
        except Exception as error:
            yield _error_event(error)
        finally:
            await events.aclose()

    async def _completion_answer(self, turn: PreparedTurn, events: ClosingEvents) -> Response:
        texts: list[str] = []
        result = await _result(events, on_text=texts.append)
        if isinstance(result, ServiceError):
            return error_response(result)
        return JSONResponse(
            {
                "id": "cmpl-" + turn.request_id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": result.model,
                "choices": [
                    {
                        "index": 0,
                        "text": "".join(texts),
                        "finish_reason": result.finish_reason,
                        "logprobs": None,
                    }
                ],
                "usage": usage_body(result),
            },
            headers=result_headers(result),
        )


def conversation_of(
    header_id: str | None, body_id: str | None, prompt_cache_key: str | None = None
) -> str | None:
    """The conversation a request belongs to: the ``X-Conversation-Id`` header (``header_id``) or the
    body's ``conversation_id`` (they must agree when both are sent), else OpenAI's ``prompt_cache_key`` (as
    is when it is a valid conversation id, else ``pck:`` and a digest of it). The endpoint picker reads
    requests with it too."""
    if header_id is not None and body_id is not None and header_id != body_id:
        raise InvalidArgument(
            "the X-Conversation-Id header and the conversation_id field differ; send one",
            param="conversation_id",
        )
    if header_id is not None:
        return validation.conversation_id(header_id, param=CONVERSATION_HEADER)
    if body_id is not None:
        return validation.conversation_id(body_id)
    if prompt_cache_key is not None:
        if check_id("prompt_cache_key", prompt_cache_key) is None:
            return prompt_cache_key
        # OpenAI's key is any string; a conversation id is not: one stable id per key.
        return "pck:" + hashlib.sha256(prompt_cache_key.encode()).hexdigest()[:40]
    return None


@dataclasses.dataclass
class _Responding:
    """One ``POST /v1/responses`` under way."""

    call: ResponsesCall
    response_id: str
    history: tuple[dict[str, Any], ...]
    tenant: str
    created_at: int
    conversation_id: str | None = None

    @property
    def store(self) -> bool:
        return self.call.body.store is not False

    def response(self, result: TurnResult | None, output: list[dict[str, Any]]) -> dict[str, Any]:
        return response_object(
            self.call,
            response_id=self.response_id,
            model=result.model if result is not None else self.call.body.model,
            created_at=self.created_at,
            status=final_status(result.finish_reason) if result is not None else "in_progress",
            output=output,
            finish_reason=result.finish_reason if result is not None else None,
            chat_usage=usage_body(result) if result is not None else None,
        )


class _Resumed:
    """The turn's events again from the first (already taken); closing it closes the turn. Hands out the
    turn's own awaitables rather than wrapping them in a generator: one less layer per relayed token."""

    def __init__(self, first: TurnEvent | TurnResult, rest: TurnEvents) -> None:
        self._first: TurnEvent | TurnResult | None = first
        self._rest = rest

    def __aiter__(self) -> _Resumed:
        return self

    def __anext__(self) -> Awaitable[TurnEvent | TurnResult]:
        if self._first is not None:
            first, self._first = self._first, None
            return _Ready(first)
        return self._rest.__anext__()

    async def aclose(self) -> None:
        await self._rest.aclose()


class _Ready:
    """An awaitable that is done: its value at once."""

    def __init__(self, value: TurnEvent | TurnResult) -> None:
        self._value = value

    def __await__(self) -> Generator[Any, None, TurnEvent | TurnResult]:
        return self._value
        yield  # a generator, done at its first step


async def _result(
    events: ClosingEvents, on_text: Callable[[str], object] | None = None
) -> TurnResult | ServiceError:
    """Runs the turn to its end: its result, or the error that ended it."""
    result: TurnResult | None = None
    try:
        async for event in events:
            if isinstance(event, TurnResult):
                result = event
            elif isinstance(event, TextOut) and on_text is not None:
                on_text(event.text)
    except ServiceError as error:
        return error
    finally:
        await events.aclose()
    assert result is not None
    return result


async def _internal_error_response(request: Request, error: Exception) -> Response:
    return error_response(internal_error(error, "router", request.url.path))


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the request body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _ClosingStreamingResponse(StreamingResponse):
    """Closes its body generator, then the turn's events, however the response ends.

    Starlette cancels the response of a client that left; cancelled inside a send rather than inside
    the generator, the generator's cleanup (closing the turn, which aborts its engine requests) would
    otherwise wait for garbage collection. Cancelled before the generator started (the client left before
    the first byte), the generator has no cleanup to run: closing ``events`` ends the turn then, giving back
    its tenant slot and its conversation's mark at once. Closing them twice is harmless.
    """

    def __init__(self, body: AsyncGenerator[bytes, None], events: ClosingEvents, **kwargs: Any) -> None:
        super().__init__(body, **kwargs)
        self._body = body
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._body.aclose()
            finally:
                await self._events.aclose()
