"""The gRPC front door: ``kvferry.v1.RouterService``. Thin: authenticate, validate, translate."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeVar

import grpc
from google.protobuf.json_format import MessageToDict
from kvferry.pd.chat import ChatDelta, ChatRequest
from kvferry.router.conversations import Conversations
from kvferry.router.summary import summary_proto
from kvferry.router.tenants import ApiKeys, Tenant
from kvferry.router.turns import (
    ChatOut,
    ChatPrompt,
    Prompt,
    SamplingOptions,
    TextOut,
    TextPrompt,
    TokenPrompt,
    TurnRequest,
    TurnRunner,
)
from kvferry.router.validation import CHAT_ROLES, conversation_id, model_name, sampling, token_ids
from kvferry.runtime import errors
from kvferry.runtime.errors import InvalidArgument
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
    s = request.sampling
    options = sampling(
        max_tokens=s.max_tokens or None,
        temperature=s.temperature,
        top_p=s.top_p or None,
        seed=s.seed or None,
        stop=list(s.stop),
        ignore_eos=s.ignore_eos,
    )
    prompt: Prompt
    kind = request.WhichOneof("prompt")
    if kind == "chat":
        prompt = ChatPrompt(chat_request_from_proto(request.chat, options))
    elif kind == "tokens":
        prompt = TokenPrompt(token_ids(request.tokens.token_ids, param="tokens.token_ids"))
    elif kind == "text":
        if not request.text:
            raise InvalidArgument("text is empty", param="text")
        prompt = TextPrompt(request.text)
    else:
        raise InvalidArgument("the prompt is missing: set one of chat, tokens or text", param="prompt")
    return TurnRequest(
        tenant=tenant,
        conversation_id=conv,
        model=model_name(request.model),
        prompt=prompt,
        sampling=options,
        retain=request.retain if request.HasField("retain") else True,
    )


_TOOL_CHOICE_MODES = {
    router_pb2.TOOL_CHOICE_MODE_AUTO: "auto",
    router_pb2.TOOL_CHOICE_MODE_NONE: "none",
    router_pb2.TOOL_CHOICE_MODE_REQUIRED: "required",
}


def chat_request_from_proto(chat: router_pb2.ChatPrompt, options: SamplingOptions) -> ChatRequest:
    """The OpenAI chat request the engines get for a gRPC chat prompt and its sampling (token ids in every
    delta; ``max_tokens`` is the turn's to set)."""
    if not chat.messages:
        raise InvalidArgument("chat.messages is empty: send at least one message", param="chat.messages")
    messages = []
    for index, m in enumerate(chat.messages):
        if m.role not in CHAT_ROLES:
            raise InvalidArgument(
                f"chat.messages[{index}].role is {m.role[:40]!r}; use one of {sorted(CHAT_ROLES)}",
                param=f"chat.messages[{index}].role",
            )
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in m.tool_calls
            ]
        for name in ("tool_call_id", "name", "reasoning"):
            if getattr(m, name):
                message[name] = getattr(m, name)
        messages.append(message)
    body: dict[str, Any] = {
        "messages": messages,
        "temperature": options.temperature,
        "top_p": options.top_p,
        "ignore_eos": options.ignore_eos,
        "return_token_ids": True,
    }
    if options.max_tokens is not None:
        body["max_tokens"] = options.max_tokens
    if options.seed is not None:
        body["seed"] = options.seed
    if options.stop:
        body["stop"] = list(options.stop)
    if chat.tools:
        body["tools"] = [_tool(index, tool) for index, tool in enumerate(chat.tools)]
    choice = chat.tool_choice.WhichOneof("choice")
    if choice == "function_name":
        body["tool_choice"] = {"type": "function", "function": {"name": chat.tool_choice.function_name}}
    elif choice == "mode" and chat.tool_choice.mode in _TOOL_CHOICE_MODES:
        body["tool_choice"] = _TOOL_CHOICE_MODES[chat.tool_choice.mode]
    elif chat.tools:
        body["tool_choice"] = "auto"
    if chat.HasField("chat_template_kwargs"):
        body["chat_template_kwargs"] = MessageToDict(chat.chat_template_kwargs)
    return ChatRequest(body)


def _tool(index: int, tool: router_pb2.Tool) -> dict[str, Any]:
    if not tool.name:
        raise InvalidArgument(f"chat.tools[{index}].name is empty", param=f"chat.tools[{index}].name")
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters_json:
        try:
            parameters = json.loads(tool.parameters_json)
        except ValueError as error:
            raise InvalidArgument(
                f"chat.tools[{index}].parameters_json is not JSON: {error}",
                param=f"chat.tools[{index}].parameters_json",
            ) from None
        if not isinstance(parameters, dict):
            raise InvalidArgument(
                f"chat.tools[{index}].parameters_json must be a JSON object (a JSON Schema)",
                param=f"chat.tools[{index}].parameters_json",
            )
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def _chat_delta(raw: bytes) -> router_pb2.TextDelta:
    delta = ChatDelta.from_event(json.loads(raw))
    return router_pb2.TextDelta(
        text=delta.content,
        token_ids=delta.token_ids,
        reasoning=delta.reasoning,
        tool_calls=[
            router_pb2.ToolCallDelta(index=c.index, id=c.id, name=c.name, arguments=c.arguments)
            for c in delta.tool_calls
        ],
    )


class RouterServicer(router_grpc.RouterServiceServicer):  # type: ignore[misc]
    def __init__(self, *, runner: TurnRunner, keys: ApiKeys, conversations: Conversations) -> None:
        self._runner = runner
        self._keys = keys
        self._conversations = conversations

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
                elif isinstance(event, ChatOut):
                    yield router_pb2.GenerateResponse(delta=_chat_delta(event.raw))
                else:
                    yield router_pb2.GenerateResponse(summary=summary_proto(event))

    @unary
    async def RenewConversation(
        self, request: router_pb2.RenewConversationRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RenewConversationResponse:
        async def renew(tenant: str, conv: str) -> router_pb2.RenewConversationResponse:
            expire = await self._conversations.renew(tenant, conv)
            return router_pb2.RenewConversationResponse(expire_time=to_timestamp(expire))

        return await self._conversation_call(context, request.conversation_id, renew)

    @unary
    async def CloseConversation(
        self, request: router_pb2.CloseConversationRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.CloseConversationResponse:
        async def close(tenant: str, conv: str) -> router_pb2.CloseConversationResponse:
            await self._conversations.close(tenant, conv)
            return router_pb2.CloseConversationResponse()

        return await self._conversation_call(context, request.conversation_id, close)

    @unary
    async def GetConversation(
        self, request: router_pb2.GetConversationRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.GetConversationResponse:
        async def get(tenant: str, conv: str) -> router_pb2.GetConversationResponse:
            record = await self._conversations.describe(tenant, conv)
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
        """Authenticates, then runs ``call(tenant, conversation_id)`` (which checks the id)."""
        tenant = self._tenant(context)
        return await call(tenant.name, raw_conversation_id)
