"""A chat turn in OpenAI's form, served through the engines' own chat endpoint, as vLLM's disaggregated
proxy serves it: templates, tool-call and reasoning parsers and structured outputs run in the engines.

The three bodies one chat turn sends (pure; :class:`kvferry.pd.engine_client.VllmEngineClient` posts them):

- ``/tokenize`` gets the fields that shape the prompt (:meth:`ChatRequest.tokenize_body`), rendered the way
  the chat endpoint renders them: its ids are what the router's prefix check digests.
- P gets the request with ``max_tokens`` 1, not streamed (:meth:`ChatRequest.prefill_body`); D gets it as
  the client sent it (:meth:`ChatRequest.decode_body`).
- Both get those checked ids in ``kv_transfer_params["prompt_token_ids"]`` (vLLM's decode-side token reuse,
  :data:`kvferry.pd.vllm_params.PROMPT_TOKEN_IDS`): the engines compute exactly the prompt whose prefix was
  proven against the retention (rule 2 of the design), and skip rendering it again. Tool and reasoning
  parsers and structured outputs still run on the request's fields.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Fields of a chat-completions request that shape the rendered prompt, as vLLM's /tokenize names them.
_TOKENIZE_FIELDS = (
    "messages",
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "mm_processor_kwargs",
    "media_io_kwargs",
)
# Chat fields vLLM's chat endpoint hands its template as keyword arguments (vLLM 0.32
# ``ChatCompletionRequest.build_chat_params``); /tokenize takes them inside chat_template_kwargs.
_TEMPLATE_ARGUMENT_FIELDS = ("documents", "reasoning_effort")
# Fields P does not need: its one token is thrown away (D generates the answer), and these would only
# cost P time or make P render the messages again (echo).
_NOT_FOR_PREFILL = (
    "stream_options",
    "min_tokens",
    "echo",
    "return_prompt_text",
    "logprobs",
    "top_logprobs",
    "logprob_token_ids",
)


@dataclass(frozen=True)
class ChatMessage:
    """A plain text message (the common case; :class:`ChatRequest` takes any OpenAI message)."""

    role: str
    content: str

    def to_body(self) -> dict[str, Any]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True)
class ChatRequest:
    """One chat-completions request in OpenAI's JSON form: ``messages``, ``tools``, sampling and vLLM's extra
    fields, as the client sent them (checked by the caller). ``stream``, ``stream_options`` and
    ``kv_transfer_params`` are the sequence's own and are set per engine."""

    body: Mapping[str, Any]

    @classmethod
    def of(cls, messages: Sequence[ChatMessage], **fields: Any) -> ChatRequest:
        return cls({"messages": [m.to_body() for m in messages], **fields})

    def tokenize_body(self, model: str) -> dict[str, Any]:
        """vLLM's /tokenize request rendering this chat's prompt as its chat endpoint does."""
        body: dict[str, Any] = {"model": model}
        for name in _TOKENIZE_FIELDS:
            if name in self.body:
                body[name] = self.body[name]
        body.setdefault("add_special_tokens", False)  # the chat endpoint's default (/tokenize's is True)
        kwargs = template_arguments(self.body)
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        return body

    def prefill_body(self, model: str) -> dict[str, Any]:
        """P's request: one token, not streamed (its KV is what D pulls)."""
        body = {k: v for k, v in self.body.items() if k not in _NOT_FOR_PREFILL}
        body.update(model=model, stream=False, max_tokens=1, n=1, return_token_ids=False)
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        return body

    def decode_body(self, model: str, *, stream: bool) -> dict[str, Any]:
        """D's request: the client's, streamed or not; a stream always ends with its usage (the caller
        counts the completion's tokens from it)."""
        body = dict(self.body)
        body.update(model=model, stream=stream)
        if stream:
            body["stream_options"] = {**(self.body.get("stream_options") or {}), "include_usage": True}
        else:
            body.pop("stream_options", None)
        return body


def template_arguments(body: Mapping[str, Any]) -> dict[str, Any]:
    """The template's keyword arguments as vLLM's chat endpoint builds them: the request's
    ``chat_template_kwargs``, overridden by ``documents`` and ``reasoning_effort`` when set, and
    ``enable_thinking`` following ``reasoning_effort`` unless the kwargs set it."""
    kwargs = dict(body.get("chat_template_kwargs") or {})
    for name in _TEMPLATE_ARGUMENT_FIELDS:
        value = body.get(name)
        if value is not None:
            kwargs[name] = value
    effort = body.get("reasoning_effort")
    if effort is not None and "enable_thinking" not in (body.get("chat_template_kwargs") or {}):
        kwargs["enable_thinking"] = effort != "none"
    return kwargs


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a streamed tool call: ``index`` names the call; ``id`` and ``name`` come with its first
    piece, ``arguments`` (JSON text) in pieces."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(frozen=True)
class ChatDelta:
    """What one streamed chat event adds to the assistant's message (vLLM's ``delta``)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None

    @classmethod
    def from_event(cls, event: Mapping[str, Any]) -> ChatDelta:
        """The first choice's delta of a ``chat.completion.chunk`` event."""
        choices = event.get("choices") or []
        if not choices:
            return cls()
        choice = choices[0]
        delta = choice.get("delta") or {}
        calls = []
        for call in delta.get("tool_calls") or ():
            function = call.get("function") or {}
            calls.append(
                ToolCallDelta(
                    index=int(call.get("index") or 0),
                    id=str(call.get("id") or ""),
                    name=str(function.get("name") or ""),
                    arguments=str(function.get("arguments") or ""),
                )
            )
        return cls(
            content=str(delta.get("content") or ""),
            # vLLM < 0.30 named it reasoning_content.
            reasoning=str(delta.get("reasoning") or delta.get("reasoning_content") or ""),
            tool_calls=tuple(calls),
            token_ids=tuple(int(t) for t in choice.get("token_ids") or ()),
            finish_reason=choice.get("finish_reason"),
        )
