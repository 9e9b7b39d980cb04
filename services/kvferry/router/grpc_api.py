"""The gRPC front door: ``kvferry.v1.RouterService``. Thin: authenticate, validate, translate."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import TypeVar

import grpc
from kvferry.router.registry_client import RegistryApi, RegistryUnavailable
from kvferry.router.summary import summary_proto
from kvferry.router.tenants import ApiKeys, Tenant
from kvferry.router.turns import (
    ChatPrompt,
    Prompt,
    TextOut,
    TextPrompt,
    TokenPrompt,
    TurnRequest,
    TurnRunner,
)
from kvferry.router.validation import chat_messages, conversation_id, model_name, sampling, token_ids
from kvferry.runtime import errors
from kvferry.runtime.errors import InvalidArgument, NotFound, Unavailable
from kvferry.runtime.timestamps import to_timestamp
from kvferry.v1 import router_service_pb2 as router_pb2
from kvferry.v1 import router_service_pb2_grpc as router_grpc

log = logging.getLogger(__name__)

_T = TypeVar("_T")

SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name

unary = errors.unary("router")
streaming = errors.streaming("router")


def turn_request_from_proto(request: router_pb2.GenerateRequest, tenant: Tenant) -> TurnRequest:
    conv = conversation_id(request.conversation_id)
    prompt: Prompt
    kind = request.WhichOneof("prompt")
    if kind == "chat":
        prompt = ChatPrompt(chat_messages([(m.role, m.content) for m in request.chat.messages]))
    elif kind == "tokens":
        prompt = TokenPrompt(token_ids(request.tokens.token_ids, param="tokens.token_ids"))
    elif kind == "text":
        if not request.text:
            raise InvalidArgument("text is empty", param="text")
        prompt = TextPrompt(request.text)
    else:
        raise InvalidArgument("the prompt is missing: set one of chat, tokens or text", param="prompt")
    s = request.sampling
    options = sampling(
        max_tokens=s.max_tokens or None,
        temperature=s.temperature,
        top_p=s.top_p or None,
        seed=s.seed or None,
        stop=list(s.stop),
        ignore_eos=s.ignore_eos,
    )
    return TurnRequest(
        tenant=tenant,
        conversation_id=conv,
        model=model_name(request.model),
        prompt=prompt,
        sampling=options,
        retain=request.retain if request.HasField("retain") else True,
    )


class RouterServicer(router_grpc.RouterServiceServicer):  # type: ignore[misc]
    def __init__(self, *, runner: TurnRunner, keys: ApiKeys, registry: RegistryApi) -> None:
        self._runner = runner
        self._keys = keys
        self._registry = registry

    def _tenant(self, context: grpc.aio.ServicerContext) -> Tenant:
        authorization = None
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                authorization = value if isinstance(value, str) else value.decode()
        return self._keys.authenticate(authorization)

    @streaming
    async def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        tenant = self._tenant(context)
        turn = await self._runner.prepare(turn_request_from_proto(request, tenant))
        # Closed explicitly when the client goes away: that aborts the engine requests at once.
        async with aclosing(self._runner.execute(turn)) as events:
            async for event in events:
                if isinstance(event, TextOut):
                    yield router_pb2.GenerateResponse(
                        delta=router_pb2.TextDelta(text=event.text, token_ids=event.token_ids)
                    )
                else:
                    yield router_pb2.GenerateResponse(summary=summary_proto(event))

    @unary
    async def RenewConversation(
        self, request: router_pb2.RenewConversationRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RenewConversationResponse:
        async def renew(tenant: str, conv: str) -> router_pb2.RenewConversationResponse:
            expire = await self._registry_call(self._registry.renew_retention(tenant, conv))
            if expire is None:
                raise _nothing_retained(conv)
            return router_pb2.RenewConversationResponse(expire_time=to_timestamp(expire))

        return await self._conversation_call(context, request.conversation_id, renew)

    @unary
    async def CloseConversation(
        self, request: router_pb2.CloseConversationRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.CloseConversationResponse:
        async def close(tenant: str, conv: str) -> router_pb2.CloseConversationResponse:
            # Idempotent: closing what is already gone (expired, closed) succeeds.
            await self._registry_call(self._registry.release_retention(tenant, conv))
            return router_pb2.CloseConversationResponse()

        return await self._conversation_call(context, request.conversation_id, close)

    @unary
    async def GetConversation(
        self, request: router_pb2.GetConversationRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.GetConversationResponse:
        async def get(tenant: str, conv: str) -> router_pb2.GetConversationResponse:
            record = await self._registry_call(self._registry.get_retention(tenant, conv))
            if record is None:
                raise _nothing_retained(conv)
            return router_pb2.GetConversationResponse(
                conversation_id=conv,
                turn=record.turn,
                num_tokens=record.num_tokens,
                engine_id=record.engine_id,
                expire_time=to_timestamp(record.expire_time),
            )

        return await self._conversation_call(context, request.conversation_id, get)

    async def _conversation_call(
        self,
        context: grpc.aio.ServicerContext,
        raw_conversation_id: str,
        call: Callable[[str, str], Awaitable[_T]],
    ) -> _T:
        """Authenticates, checks the conversation id, runs ``call(tenant, conversation_id)``."""
        tenant = self._tenant(context)
        return await call(tenant.name, conversation_id(raw_conversation_id))

    @staticmethod
    async def _registry_call(call: Awaitable[_T]) -> _T:
        try:
            return await call
        except RegistryUnavailable as error:
            raise Unavailable(f"the registry is unavailable, retry shortly ({error})") from None


def _nothing_retained(conv: str) -> NotFound:
    return NotFound(
        f"conversation {conv!r} has nothing retained (it expired, was closed, or has not finished a turn); "
        "its next turn recomputes the prompt",
    )
