"""OpenAI's Responses API on kvferry's chat turn: a response is one chat turn through the engines' chat
endpoint (:mod:`kvferry.router.openai_chat`), so it takes the same turn path and the same reuse.

- ``input`` items become chat messages: message items, ``function_call`` items (the assistant's tool calls)
  and ``function_call_output`` items (``tool`` messages); ``instructions`` lead as a system message (they
  are not carried over to the next response, as OpenAI defines).
- ``previous_response_id`` continues a stored response: its conversation (input and output as chat
  messages) comes first, and its kvferry conversation is this response's, so the retained KV is reused.
- ``store`` (default true) keeps the response (:class:`ResponseStore`) for ``previous_response_id`` and
  ``GET /v1/responses/{id}``.
- The chat answer becomes output items (reasoning, message, function calls); streamed, the chat chunks
  become Responses events (:class:`ResponseEvents`).
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvferry.pd.chat import ChatDelta
from kvferry.pd.json_codec import encode_json
from kvferry.router.openai_chat import validate
from kvferry.router.validation import MAX_TOKENS, Int64
from kvferry.runtime.errors import InvalidArgument, NotFound
from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _Open(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class _FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class _Format(_Open):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class _Text(_Strict):
    format: _Format | None = None
    verbosity: Literal["medium"] | None = None


class _Reasoning(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: None = None
    generate_summary: None = None


class ResponsesBody(_Strict):
    """The fields of ``POST /v1/responses`` kvferry serves; any other gets a 400 naming it. Fields with a
    value that asks for nothing kvferry lacks (``include: []``, ``truncation: "disabled"``,
    ``background: false``, ``service_tier: "auto"``) are accepted."""

    model: str = Field("", max_length=256)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool | None = None
    tools: list[_FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | _NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    text: _Text | None = None
    reasoning: _Reasoning | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = None
    prompt_cache_key: str | None = Field(None, min_length=1)
    include: list[str] | None = Field(None, max_length=0)
    truncation: Literal["disabled"] | None = None
    background: Literal[False] | None = None
    service_tier: Literal["auto", "default"] | None = None
    stream_options: dict[str, Literal[False]] | None = None
    # kvferry's
    conversation_id: str | None = None
    retain: bool | None = None
    # vLLM's chat fields that Responses clients send through extra_body
    chat_template_kwargs: dict[str, Any] | None = None
    seed: Int64 | None = None


@dataclass(frozen=True)
class StoredResponse:
    """A response kept for ``previous_response_id``: its conversation and what ``GET`` returns."""

    tenant: str
    response_id: str
    # The kvferry conversation the chain's turns run in.
    conversation_id: str
    # The chain's conversation as chat messages: every input (instructions apart) and output so far.
    messages: tuple[dict[str, Any], ...]
    response: Mapping[str, Any]
    stored_at: float


class ResponseStore:
    """Stored responses of this router process, by tenant and id; the oldest go first past ``capacity``,
    each lives ``ttl_seconds``. Router replicas do not share it: send a chain's turns to one replica, or
    name the conversation (then a response's input carries the whole history)."""

    def __init__(self, *, capacity: int = 10_000, ttl_seconds: float = 3600.0) -> None:
        self._capacity = capacity
        self._ttl = ttl_seconds
        self._items: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()

    def put(self, record: StoredResponse) -> None:
        key = (record.tenant, record.response_id)
        self._items[key] = record
        self._items.move_to_end(key)
        while len(self._items) > self._capacity:
            self._items.popitem(last=False)

    def get(self, tenant: str, response_id: str, *, now: float | None = None) -> StoredResponse:
        record = self._items.get((tenant, response_id))
        if record is not None and (now or time.time()) - record.stored_at > self._ttl:
            del self._items[(tenant, response_id)]
            record = None
        if record is None:
            raise NotFound(
                f"response {response_id[:80]!r} is not stored here (never stored, store=false, expired after "
                f"{self._ttl:.0f} s, deleted, or stored by another router replica)",
                param="previous_response_id",
            )
        return record

    def delete(self, tenant: str, response_id: str) -> bool:
        return self._items.pop((tenant, response_id), None) is not None

    def __len__(self) -> int:
        return len(self._items)


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


def chain_conversation_id(response_id: str) -> str:
    """The kvferry conversation a chain started by ``response_id`` runs in (a valid conversation id)."""
    return "resp:" + response_id.removeprefix("resp_")


# -- request -> chat -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResponsesCall:
    body: ResponsesBody
    # The new input as chat messages (to store after the previous response's).
    input_messages: tuple[dict[str, Any], ...]


def parse_responses(data: Mapping[str, Any]) -> ResponsesCall:
    body = validate(ResponsesBody, data)
    return ResponsesCall(body=body, input_messages=tuple(input_messages(body.input)))


def chat_body(call: ResponsesCall, history: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The chat-completions request of a response (checked again by :func:`~kvferry.router.openai_chat.
    parse_chat`, as any chat request)."""
    body = call.body
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    messages += [*history, *call.input_messages]
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "stream": bool(body.stream)}
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    if body.tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": {
                    k: v
                    for k, v in (
                        ("name", t.name),
                        ("description", t.description),
                        ("parameters", t.parameters),
                        ("strict", t.strict),
                    )
                    if v is not None
                },
            }
            for t in body.tools
        ]
    if isinstance(body.tool_choice, _NamedFunction):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    for name, value in (
        ("parallel_tool_calls", body.parallel_tool_calls),
        ("max_completion_tokens", body.max_output_tokens),
        ("temperature", body.temperature),
        ("top_p", body.top_p),
        ("user", body.user),
        ("seed", body.seed),
        ("chat_template_kwargs", body.chat_template_kwargs),
        ("reasoning_effort", body.reasoning.effort if body.reasoning else None),
    ):
        if value is not None:
            chat[name] = value
    text_format = body.text.format if body.text else None
    if text_format is not None and text_format.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif text_format is not None and text_format.type == "json_schema":
        schema: dict[str, Any] = {"name": text_format.name or "response", "schema": text_format.schema_ or {}}
        if text_format.strict is not None:
            schema["strict"] = text_format.strict
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    return chat


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items as chat messages (text content only, as for chat)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidArgument(
                    f"{where}.role must be user, assistant, system or developer", param=f"{where}.role"
                )
            message: dict[str, Any] = {
                "role": role,
                "content": _text(item.get("content"), f"{where}.content"),
            }
            if role == "assistant" and reasoning:
                message["reasoning"] = "".join(reasoning)
            reasoning = []
            messages.append(message)
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _string(item, "name", where),
                    "arguments": _string(item, "arguments", where),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning:
                    message["reasoning"] = "".join(reasoning)
                reasoning = []
                messages.append(message)
        elif kind == "function_call_output":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(item, "call_id", where),
                    "content": _text(item.get("output"), f"{where}.output"),
                }
            )
        elif kind == "reasoning":
            reasoning += [part.get("text", "") for part in item.get("content") or item.get("summary") or ()]
        else:
            raise InvalidArgument(
                f"{where} is a {kind!r} item: kvferry serves message, function_call, function_call_output "
                "and reasoning items (text only)",
                param=f"{where}.type",
            )
    return messages


def _string(item: Mapping[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise InvalidArgument(f"{where}.{name} must be a string", param=f"{where}.{name}")
    return value


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidArgument(f"{where} must be a string or a list of text parts", param=where)
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise InvalidArgument(
                f"{where}[{index}] is a {kind!r} part: kvferry serves text (its reuse check compares token "
                "ids, which do not show what a picture or a file holds)",
                param=f"{where}[{index}]",
            )
        texts.append(part["text"])
    return "".join(texts)


# -- chat answer -> response -------------------------------------------------------------------------


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def message_item(text: str, *, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id or _item_id("msg"),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text else [],
    }


def reasoning_item(text: str, *, item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id or _item_id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def function_call_item(
    call_id: str, name: str, arguments: str, *, item_id: str | None = None
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id or _item_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def output_from_answer(answer: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The output items of a (non-streamed) chat completion."""
    message = (answer.get("choices") or [{}])[0].get("message") or {}
    items = []
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning:
        items.append(reasoning_item(reasoning))
    if message.get("content"):
        items.append(message_item(message["content"]))
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        items.append(
            function_call_item(call.get("id") or _item_id("call"), function["name"], function["arguments"])
        )
    return items


def history_message(output: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A response's output as the assistant message the next turn's prompt renders."""
    message: dict[str, Any] = {"role": "assistant", "content": None}
    for item in output:
        if item["type"] == "message":
            message["content"] = "".join(part["text"] for part in item["content"])
        elif item["type"] == "reasoning":
            message["reasoning"] = "".join(part["text"] for part in item["content"])
        elif item["type"] == "function_call":
            message.setdefault("tool_calls", []).append(
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]},
                }
            )
    return message


def usage(chat_usage: Mapping[str, Any]) -> dict[str, Any]:
    """Responses' usage object from a chat usage (kvferry's figures kept)."""
    completion_details = chat_usage.get("completion_tokens_details") or {}
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": completion_details.get("reasoning_tokens") or 0},
        "total_tokens": chat_usage["total_tokens"],
        **{k: chat_usage[k] for k in ("pulled_tokens", "recomputed_tokens", "kvferry") if k in chat_usage},
    }


def response_object(
    call: ResponsesCall,
    *,
    response_id: str,
    model: str,
    created_at: float,
    status: str,
    output: Sequence[Mapping[str, Any]],
    finish_reason: str | None = None,
    chat_usage: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    body = call.body
    tool_choice: Any = body.tool_choice or "auto"
    if isinstance(tool_choice, _NamedFunction):
        tool_choice = tool_choice.model_dump()
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if finish_reason == "length" else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "model": model,
        "output": list(output),
        "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
        "service_tier": "default",
        "store": True if body.store is None else body.store,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)}
        if body.text and body.text.format
        else {"format": {"type": "text"}},
        "tool_choice": tool_choice,
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": "disabled",
        "usage": usage(chat_usage) if chat_usage is not None else None,
        "user": body.user,
    }


def final_status(finish_reason: str) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


# -- streamed chat -> Responses events ---------------------------------------------------------------------


@dataclass
class _OpenItem:
    index: int
    item: dict[str, Any]
    text: list[str] = field(default_factory=list)


class ResponseEvents:
    """Turns a chat stream's deltas into the Responses API's streamed events, item by item: reasoning, the
    message's text, each tool call (a new item opens when the kind of delta changes)."""

    def __init__(self, response: dict[str, Any]) -> None:
        self._response = response
        self._sequence = 0
        self.output: list[dict[str, Any]] = []
        self._open: _OpenItem | None = None
        self._calls: dict[int, _OpenItem] = {}

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=self._response),
            self._event("response.in_progress", response=self._response),
        ]

    def add(self, delta: ChatDelta) -> Iterator[dict[str, Any]]:
        if delta.reasoning:
            yield from self._text("reasoning", delta.reasoning)
        if delta.content:
            yield from self._text("message", delta.content)
        for piece in delta.tool_calls:
            yield from self._call(piece.index, piece.id, piece.name, piece.arguments)

    def finish(self) -> Iterator[dict[str, Any]]:
        yield from self._close()
        for index in sorted(self._calls):
            yield from self._close_call(self._calls[index])
        self._calls.clear()

    def end(self, response: dict[str, Any]) -> dict[str, Any]:
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return self._event(kind, response=response)

    def error(self, message: str, code: str | None) -> dict[str, Any]:
        return self._event("error", message=message, code=code, param=None)

    def _text(self, kind: str, text: str) -> Iterator[dict[str, Any]]:
        if self._open is not None and self._open.item["type"] != kind:
            yield from self._close()
        if self._open is None:
            item = (
                message_item("", status="in_progress")
                if kind == "message"
                else reasoning_item("") | {"content": []}
            )
            self._open = _OpenItem(len(self.output), item)
            self.output.append(item)
            yield self._event("response.output_item.added", output_index=self._open.index, item=item)
            part = {"type": "output_text", "text": "", "annotations": []} if kind == "message" else None
            if part is not None:
                yield self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=self._open.index,
                    content_index=0,
                    part=part,
                )
        self._open.text.append(text)
        kind_name = "output_text" if kind == "message" else "reasoning_text"
        yield self._event(
            f"response.{kind_name}.delta",
            item_id=self._open.item["id"],
            output_index=self._open.index,
            content_index=0,
            delta=text,
            **({"logprobs": []} if kind == "message" else {}),
        )

    def _close(self) -> Iterator[dict[str, Any]]:
        if self._open is None:
            return
        opened, self._open = self._open, None
        text = "".join(opened.text)
        item_id = opened.item["id"]
        if opened.item["type"] == "message":
            done = message_item(text, item_id=item_id)
            part = done["content"][0]
            yield self._event(
                "response.output_text.done",
                item_id=item_id,
                output_index=opened.index,
                content_index=0,
                text=text,
                logprobs=[],
            )
            yield self._event(
                "response.content_part.done",
                item_id=item_id,
                output_index=opened.index,
                content_index=0,
                part=part,
            )
        else:
            done = reasoning_item(text, item_id=item_id)
            yield self._event(
                "response.reasoning_text.done",
                item_id=item_id,
                output_index=opened.index,
                content_index=0,
                text=text,
            )
        self.output[opened.index] = done
        yield self._event("response.output_item.done", output_index=opened.index, item=done)

    def _call(self, index: int, call_id: str, name: str, arguments: str) -> Iterator[dict[str, Any]]:
        opened = self._calls.get(index)
        if opened is None:
            yield from self._close()
            item = function_call_item(call_id or _item_id("call"), name, "") | {"status": "in_progress"}
            opened = self._calls[index] = _OpenItem(len(self.output), item)
            self.output.append(item)
            yield self._event("response.output_item.added", output_index=opened.index, item=item)
        if arguments:
            opened.text.append(arguments)
            yield self._event(
                "response.function_call_arguments.delta",
                item_id=opened.item["id"],
                output_index=opened.index,
                delta=arguments,
            )

    def _close_call(self, opened: _OpenItem) -> Iterator[dict[str, Any]]:
        arguments = "".join(opened.text)
        item = opened.item
        done = function_call_item(item["call_id"], item["name"], arguments, item_id=item["id"])
        self.output[opened.index] = done
        yield self._event(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=opened.index,
            name=item["name"],
            arguments=arguments,
        )
        yield self._event("response.output_item.done", output_index=opened.index, item=done)


def sse_event(event: Mapping[str, Any]) -> bytes:
    return b"event: " + str(event["type"]).encode() + b"\ndata: " + encode_json(event) + b"\n\n"
