"""A STAND-IN for the kvferry router's RouterService, for SDK tests of the wire protocol.

It is a real grpc.aio server (run in its own thread and event loop, so blocking SyncClient tests can
call it too) with an in-memory, scriptable servicer: it fails turns with UNAVAILABLE before or after
the first token, delays the first token, checks `authorization: Bearer <key>` per tenant, and keeps
conversations under a TTL that RenewConversation extends. It is not the router: the SDK's tests
against the real stack live in test_real_stack.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf import timestamp_pb2
from kvferry.runtime.grpc_server import start_server
from kvferry.v1 import router_service_pb2 as router_pb
from kvferry.v1 import router_service_pb2_grpc as router_grpc

_T = TypeVar("_T")
_SERVICE_NAME = router_pb.DESCRIPTOR.services_by_name["RouterService"].full_name


@dataclass
class StandInScript:
    """How the stand-in behaves; tests change it between calls."""

    reply_chunks: tuple[str, ...] = ("Hel", "lo", " there")
    # Generate calls still to fail with UNAVAILABLE before sending anything.
    unavailable_before_first_token: int = 0
    # Fail with UNAVAILABLE after this many deltas (None: never).
    unavailable_after_chunks: int | None = None
    # End the stream without a TurnSummary (a broken router).
    omit_summary: bool = False
    first_token_delay_seconds: float = 0.0
    control_delay_seconds: float = 0.0
    ttl_seconds: float = 30.0


@dataclass
class _Retention:
    token_ids: tuple[int, ...]
    turn: int
    expire_at: float


@dataclass
class StandInRecord:
    """What the stand-in saw."""

    generate_requests: list[router_pb.GenerateRequest] = field(default_factory=list)
    generate_metadata: list[dict[str, str]] = field(default_factory=list)
    renewals: list[tuple[str, float]] = field(default_factory=list)
    closes: list[str] = field(default_factory=list)


def render_prompt(request: router_pb.GenerateRequest) -> tuple[int, ...]:
    """The stand-in's "tokenizer": token ids as given, else one id per character."""
    kind = request.WhichOneof("prompt")
    if kind == "tokens":
        return tuple(request.tokens.token_ids)
    if kind == "text":
        return tuple(ord(c) for c in request.text)
    rendered = "".join(f"{m.role}: {m.content}\n" for m in request.chat.messages)
    return tuple(ord(c) for c in rendered)


def retained_after(request: router_pb.GenerateRequest, reply: str) -> tuple[int, ...]:
    """What the stand-in retains after a turn: prompt + reply, rendered as the next prompt will be."""
    if request.WhichOneof("prompt") == "chat":
        return render_prompt(request) + tuple(ord(c) for c in f"assistant: {reply}\n")
    return render_prompt(request) + tuple(ord(c) for c in reply)


class StandInRouterServicer(router_grpc.RouterServiceServicer):
    """In-memory stand-in for RouterService (see the module docstring)."""

    def __init__(self, api_keys: Mapping[str, str], script: StandInScript) -> None:
        self.api_keys = dict(api_keys)  # key -> tenant
        self.script = script
        self.record = StandInRecord()
        self._retentions: dict[tuple[str, str], _Retention] = {}

    async def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        metadata = {key: str(value) for key, value in context.invocation_metadata() or ()}
        header = metadata.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme != "Bearer" or key not in self.api_keys:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown API key")
        return self.api_keys[key]

    def _alive(self, tenant: str, conversation_id: str) -> _Retention | None:
        retention = self._retentions.get((tenant, conversation_id))
        if retention is None or retention.expire_at <= time.time():
            self._retentions.pop((tenant, conversation_id), None)
            return None
        return retention

    async def Generate(
        self, request: router_pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb.GenerateResponse]:
        self.record.generate_requests.append(request)
        self.record.generate_metadata.append(
            {key: str(value) for key, value in context.invocation_metadata() or ()}
        )
        tenant = await self._tenant(context)
        script = self.script
        if script.unavailable_before_first_token > 0:
            script.unavailable_before_first_token -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "stand-in: no engine yet")
        if script.first_token_delay_seconds:
            await asyncio.sleep(script.first_token_delay_seconds)
        prompt = render_prompt(request)
        retention = self._alive(tenant, request.conversation_id)
        pulled = 0
        if retention is not None and prompt[: len(retention.token_ids)] == retention.token_ids:
            pulled = len(retention.token_ids)
        for index, text in enumerate(script.reply_chunks):
            if script.unavailable_after_chunks is not None and index == script.unavailable_after_chunks:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "stand-in: decode engine lost")
            yield router_pb.GenerateResponse(
                delta=router_pb.TextDelta(text=text, token_ids=[ord(c) for c in text])
            )
        if script.omit_summary:
            return
        reply = "".join(script.reply_chunks)
        turn = (retention.turn if retention else 0) + 1
        if not request.HasField("retain") or request.retain:
            self._retentions[(tenant, request.conversation_id)] = _Retention(
                retained_after(request, reply), turn, time.time() + script.ttl_seconds
            )
        yield router_pb.GenerateResponse(
            summary=router_pb.TurnSummary(
                prompt_tokens=len(prompt),
                completion_tokens=len(reply),
                pulled_tokens=pulled,
                recomputed_tokens=len(prompt) - pulled,
                ttft_ms=1.5,
                prefill_ms=1.0,
                reuse=router_pb.REUSE_DECISION_PULL if pulled else router_pb.REUSE_DECISION_NONE,
                prefill_engine_id="standin-prefill",
                decode_engine_id="standin-decode",
                finish_reason="stop",
                turn=turn,
            )
        )

    async def RenewConversation(
        self, request: router_pb.RenewConversationRequest, context: grpc.aio.ServicerContext
    ) -> router_pb.RenewConversationResponse:
        tenant = await self._tenant(context)
        if self.script.control_delay_seconds:
            await asyncio.sleep(self.script.control_delay_seconds)
        retention = self._alive(tenant, request.conversation_id)
        if retention is None:
            await _abort_not_found(context, request.conversation_id)
        retention.expire_at = time.time() + self.script.ttl_seconds
        self.record.renewals.append((request.conversation_id, time.time()))
        return router_pb.RenewConversationResponse(expire_time=_timestamp(retention.expire_at))

    async def CloseConversation(
        self, request: router_pb.CloseConversationRequest, context: grpc.aio.ServicerContext
    ) -> router_pb.CloseConversationResponse:
        tenant = await self._tenant(context)
        self.record.closes.append(request.conversation_id)
        if self._retentions.pop((tenant, request.conversation_id), None) is None:
            await _abort_not_found(context, request.conversation_id)
        return router_pb.CloseConversationResponse()

    async def GetConversation(
        self, request: router_pb.GetConversationRequest, context: grpc.aio.ServicerContext
    ) -> router_pb.GetConversationResponse:
        tenant = await self._tenant(context)
        if self.script.control_delay_seconds:
            await asyncio.sleep(self.script.control_delay_seconds)
        retention = self._alive(tenant, request.conversation_id)
        if retention is None:
            await _abort_not_found(context, request.conversation_id)
        return router_pb.GetConversationResponse(
            conversation_id=request.conversation_id,
            turn=retention.turn,
            num_tokens=len(retention.token_ids),
            engine_id="standin-decode",
            expire_time=_timestamp(retention.expire_at),
        )


async def _abort_not_found(context: grpc.aio.ServicerContext, conversation_id: str) -> NoReturn:
    await context.abort(grpc.StatusCode.NOT_FOUND, f"nothing retained for {conversation_id}")
    raise AssertionError("abort returned")


def _timestamp(unix_seconds: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(unix_seconds * 1e9))
    return stamp


class StandInRouter:
    """The stand-in servicer served by a real grpc.aio server on 127.0.0.1, in a thread of its own."""

    def __init__(
        self, api_keys: Mapping[str, str], *, server_credentials: grpc.ServerCredentials | None = None
    ) -> None:
        self.servicer = StandInRouterServicer(api_keys, StandInScript())
        self._credentials = server_credentials
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="standin-router", daemon=True)
        self._server: grpc.aio.Server | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def script(self) -> StandInScript:
        return self.servicer.script

    @property
    def record(self) -> StandInRecord:
        return self.servicer.record

    def _run(self, make: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
        return asyncio.run_coroutine_threadsafe(make(), self._loop).result(timeout=30)

    def start(self) -> None:
        self._thread.start()

        async def serve() -> None:
            binding = (router_grpc.add_RouterServiceServicer_to_server, self.servicer, _SERVICE_NAME)
            if self._credentials is None:
                self._server, self.port, _ = await start_server("127.0.0.1:0", [binding])
                return
            # TLS: the shared builder binds plaintext only, so build this one by hand.
            self._server = grpc.aio.server()
            router_grpc.add_RouterServiceServicer_to_server(self.servicer, self._server)
            self.port = self._server.add_secure_port("127.0.0.1:0", self._credentials)
            await self._server.start()

        self._run(serve)

    def stop(self) -> None:
        async def shutdown() -> None:
            if self._server is not None:
                await self._server.stop(grace=None)

        self._run(shutdown)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
