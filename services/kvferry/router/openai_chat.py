"""OpenAI chat-completions requests at the front door: every field, what kvferry does with it, the checks.

:data:`FIELDS` is the conformance table (docs/router.md's chat field table is generated from it and checked
by tests/router/test_chat_fields.py): each field of OpenAI's chat API and of vLLM's chat endpoint is passed
to the engines unchanged, read by kvferry, or refused with HTTP 400 naming it; an unknown field is refused
too, so nothing is silently dropped. Checks are strict (a string is never taken for a boolean or a number)
and ranges are checked before any engine sees a value; what only the engine can judge (a JSON schema, a
template) it judges, and its 4xx reaches the client as a 400.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

import orjson
from kvferry.pd.chat import ChatRequest
from kvferry.router.validation import MAX_TOKENS, Int64, TokenId
from kvferry.runtime.errors import InvalidArgument
from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_STOP_STRINGS = 16


class Support(enum.Enum):
    PASSED = "passed"  # forwarded to the engines unchanged
    KVFERRY = "kvferry"  # read by kvferry, not forwarded
    REFUSED = "refused"  # HTTP 400 naming the field


@dataclass(frozen=True)
class ChatField:
    support: Support
    note: str = ""
    # The conformance test sends ``sample`` (accepted) and ``refused_sample`` (must get a 400 naming the
    # field: a refused field, a value out of range, a string where a number belongs).
    sample: Any = None
    refused_sample: Any = None
    # Values accepted of a field that is otherwise refused (``n``: 1 only).
    accepts: Callable[[Any], bool] | None = None


def _passed(sample: Any, refused: Any = None, note: str = "") -> ChatField:
    return ChatField(Support.PASSED, note, sample, refused)


def _refused(note: str, sample: Any = True) -> ChatField:
    return ChatField(Support.REFUSED, note, None, sample)


_NO_TRUNCATION = (
    "truncating would change the prompt whose prefix was proven; shorten the conversation instead"
)

# Every field, in OpenAI's order, then vLLM's, then kvferry's.
FIELDS: Mapping[str, ChatField] = {
    # -- OpenAI's chat completions API --
    "messages": _passed(
        [{"role": "user", "content": "hi"}],
        [{"role": "robot", "content": "hi"}],
        "text content (a string or text parts); assistant tool_calls, tool_call_id, name",
    ),
    "model": _passed("", 7, "empty: the only served model"),
    "audio": _refused("audio output: the router serves text", {"voice": "alloy", "format": "wav"}),
    "frequency_penalty": _passed(0.5, 3.0, "[-2, 2]"),
    "function_call": _refused("deprecated by OpenAI: use tool_choice", "auto"),
    "functions": _refused("deprecated by OpenAI: use tools", [{"name": "f"}]),
    "logit_bias": _passed({"100": -5.0}, {"100": 101.0}, "[-100, 100] per token"),
    "logprobs": _passed(True, "true"),
    "max_completion_tokens": _passed(5, 0, "neither sent: --default-max-tokens; must fit the context"),
    "max_tokens": _passed(5, "5", "as max_completion_tokens (which wins when both are sent)"),
    "metadata": _refused("only stored completions carry metadata; kvferry stores none", {"k": "v"}),
    "modalities": ChatField(
        Support.KVFERRY, '["text"] only', ["text"], ["text", "audio"], accepts=lambda v: v == ["text"]
    ),
    "moderation": _refused("OpenAI's moderation is not served", {}),
    "n": ChatField(
        Support.PASSED, "1 only: one answer continues the conversation", 1, 2, accepts=lambda v: v == 1
    ),
    "parallel_tool_calls": _passed(True, 1),
    "prediction": _refused("predicted outputs are not served", {"type": "content", "content": "x"}),
    "presence_penalty": _passed(-0.5, -2.5, "[-2, 2]"),
    "prompt_cache_key": ChatField(
        Support.KVFERRY,
        "the conversation when no X-Conversation-Id or conversation_id is sent (any string)",
        "pck-1",
        "",
    ),
    "prompt_cache_options": _refused(
        "kvferry keeps a conversation's KV while its lease lives: renew or "
        "close it (POST /v1/kvferry/conversations/{id}/renew, DELETE ...)",
        {},
    ),
    "prompt_cache_retention": _refused(
        "kvferry keeps a conversation's KV while its lease lives: renew or "
        "close it (POST /v1/kvferry/conversations/{id}/renew, DELETE ...)",
        "24h",
    ),
    "reasoning_effort": _passed(
        "low", "extreme", "rendered into the template by the engines (enable_thinking)"
    ),
    "response_format": _passed({"type": "json_object"}, {"type": "yaml"}, "guided decoding on the engines"),
    "safety_identifier": _refused("OpenAI's abuse monitoring is not served", "user-1"),
    "seed": _passed(7, 2**63, "64-bit"),
    "service_tier": ChatField(
        Support.KVFERRY,
        '"auto" or "default" (there is one tier)',
        "auto",
        "flex",
        accepts=lambda v: v in ("auto", "default"),
    ),
    "stop": _passed(["\n\n"], [""], f"1 to {MAX_STOP_STRINGS} non-empty strings"),
    "store": ChatField(
        Support.KVFERRY,
        "false only: chat completions are not stored (the Responses API stores responses)",
        False,
        True,
        accepts=lambda v: v is False,
    ),
    "stream": _passed(False, "yes"),
    "stream_options": _passed(
        {"include_usage": True},
        {"include_usage": "yes"},
        "usage comes in the last chunk when include_usage is set",
    ),
    "temperature": _passed(0.7, 2.5, "[0, 2]; default 1"),
    "tool_choice": _passed("auto", "sometimes"),
    "tools": _passed(
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        [{"type": "web_search"}],
        "function tools; parsed by the engines' tool-call parser",
    ),
    "top_logprobs": _passed(2, 21, "[0, 20]"),
    "top_p": _passed(0.9, 0.0, "(0, 1]"),
    "user": _passed("user-1", 5),
    "verbosity": _refused("not served by vLLM", "low"),
    "web_search_options": _refused("no built-in tools: define a function tool", {}),
    # -- vLLM's chat endpoint --
    "thinking_token_budget": _passed(64, "64"),
    "include_reasoning": _passed(True, "no"),
    "use_beam_search": ChatField(
        Support.PASSED,
        "false only: beam search is not served over prefill/decode",
        False,
        True,
        accepts=lambda v: v is False,
    ),
    "top_k": _passed(20, -2, "-1, 0 (off) or at least 1"),
    "min_p": _passed(0.1, 1.5, "[0, 1]"),
    "repetition_penalty": _passed(1.1, 0.0, "above 0"),
    "watermarking": _passed(False, "off"),
    "length_penalty": _passed(1.0, "1"),
    "stop_token_ids": _passed([151643], [-1]),
    "include_stop_str_in_output": _passed(False, 0),
    "ignore_eos": _passed(False, "false"),
    "min_tokens": _passed(0, -1),
    "skip_special_tokens": _passed(True, "true"),
    "spaces_between_special_tokens": _passed(True, "true"),
    "truncate_prompt_tokens": _refused(_NO_TRUNCATION, 16),
    "truncation_side": _refused(_NO_TRUNCATION, "left"),
    "prompt_logprobs": _refused(
        "prompt logprobs need every prompt token computed on one engine; a pulled prefix is not", 1
    ),
    "logprob_token_ids": _passed([1, 2], [-1], "with logprobs"),
    "allowed_token_ids": _passed([1, 2, 3], [-1]),
    "bad_words": _passed(["x"], [""]),
    "echo": _passed(False, "no"),
    "add_generation_prompt": _passed(True, "yes", "shapes the prompt: rendered by /tokenize too"),
    "continue_final_message": _passed(False, "no", "shapes the prompt: rendered by /tokenize too"),
    "add_special_tokens": _passed(False, "no", "shapes the prompt: rendered by /tokenize too"),
    "documents": _passed([{"title": "t", "text": "x"}], [{"title": 1}], "shapes the prompt"),
    "chat_template": _passed(
        None, 5, "shapes the prompt; engines refuse it unless --trust-request-chat-template"
    ),
    "chat_template_kwargs": _passed({"enable_thinking": False}, ["enable_thinking"], "shapes the prompt"),
    "media_io_kwargs": _passed({}, [], "unused: content is text"),
    "mm_processor_kwargs": _passed({}, [], "unused: content is text"),
    "structured_outputs": _passed({"regex": "[ab]+"}, "regex", "guided decoding on the engines"),
    "priority": _passed(0, 0.5),
    "request_id": _refused(
        "the router names each engine request (X-Request-Id); it returns its own id", "r-1"
    ),
    "session_id": _passed("s-1", 1),
    "return_tokens_as_token_ids": _passed(False, "no"),
    "return_token_ids": _passed(False, "no"),
    "routed_experts_prompt_start": _passed(0, -1),
    "return_token_offsets": _passed(False, "no", "only vLLM's render endpoints use it"),
    "return_prompt_text": _passed(False, "no"),
    "mm_payload": _passed("tensors", "all", "only vLLM's render endpoints use it"),
    "return_mm_kwargs": _passed(None, "no", "only vLLM's render endpoints use it"),
    "cache_salt": _passed("salt-1", "", "1-1024 characters"),
    "kv_transfer_params": _refused("the router's own: it pairs the prefill and decode engines", {}),
    "ec_transfer_params": _refused("encoder-cache disaggregation is not served", {}),
    "vllm_xargs": _passed({"k": 1}, {"k": {"nested": 1}}),
    "repetition_detection": _passed(None, "on"),
    "stream_interval": _passed(1, 0),
    # -- kvferry's own --
    "conversation_id": ChatField(
        Support.KVFERRY,
        "the conversation (as the X-Conversation-Id header); 1-128 of [A-Za-z0-9._:-]",
        "c-1",
        "has space",
    ),
    "retain": ChatField(Support.KVFERRY, "false: keep nothing of this turn for the next", True, "false"),
}

# -- the typed checks ----------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _Open(BaseModel):
    """An object whose other keys go to the engine as sent (the engine judges them)."""

    model_config = ConfigDict(strict=True, extra="allow")


Role = Literal["system", "developer", "user", "assistant", "tool"]
_Float = Annotated[float, Field(allow_inf_nan=False)]
_TokenIds = list[TokenId]


class _FunctionCall(_Open):
    name: str
    arguments: str


class _ToolCall(_Open):
    id: str
    type: Literal["function"] = "function"
    function: _FunctionCall


class _Message(_Open):
    role: Role
    # Text parts are checked by hand (:func:`_text_only`), for a message that names the part at fault.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class _Function(_Open):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _Tool(_Open):
    type: Literal["function"]
    function: _Function


class _NamedFunction(_Strict):
    name: str


class _NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _NamedFunction


class _ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]


class _StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class ChatBody(_Strict):
    """The typed view of a chat request's fields that are not refused outright."""

    messages: list[_Message] = Field(min_length=1)
    model: str = Field("", max_length=256)
    frequency_penalty: _Float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    logprobs: bool | None = None
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    modalities: list[str] | None = None
    n: int | None = None
    parallel_tool_calls: bool | None = None
    presence_penalty: _Float | None = Field(None, ge=-2, le=2)
    prompt_cache_key: str | None = Field(None, min_length=1)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    response_format: _ResponseFormat | None = None
    seed: Int64 | None = None
    service_tier: str | None = None
    stop: str | list[str] | None = None
    store: bool | None = None
    stream: bool | None = None
    stream_options: _StreamOptions | None = None
    temperature: _Float | None = Field(None, ge=0, le=2)
    tool_choice: Literal["none", "auto", "required"] | _NamedToolChoice | None = None
    tools: list[_Tool] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    top_p: _Float | None = Field(None, gt=0, le=1)
    user: str | None = None
    # vLLM's
    thinking_token_budget: int | None = Field(None, ge=0)
    include_reasoning: bool | None = None
    use_beam_search: bool | None = None
    top_k: int | None = Field(None, ge=-1)
    min_p: _Float | None = Field(None, ge=0, le=1)
    repetition_penalty: _Float | None = Field(None, gt=0)
    watermarking: bool | None = None
    length_penalty: _Float | None = None
    stop_token_ids: _TokenIds | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0)
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    logprob_token_ids: _TokenIds | None = None
    allowed_token_ids: _TokenIds | None = None
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = None
    echo: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = None
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    priority: Int64 | None = None
    session_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    routed_experts_prompt_start: int | None = Field(None, ge=0)
    return_token_offsets: bool | None = None
    return_prompt_text: bool | None = None
    mm_payload: Literal["tensors", "none"] | None = None
    return_mm_kwargs: bool | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    repetition_detection: dict[str, Any] | None = None
    stream_interval: int | None = Field(None, ge=1)
    # kvferry's
    conversation_id: str | None = None
    retain: bool | None = None


@dataclass(frozen=True)
class ChatCall:
    """A checked chat request: what kvferry reads, and what goes to the engines."""

    chat: ChatRequest
    model: str
    stream: bool
    include_usage: bool
    # The client's max_completion_tokens (or max_tokens); None: the router's default.
    max_tokens: int | None
    conversation_id: str | None
    prompt_cache_key: str | None
    retain: bool


def load_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object (NaN and Infinity are not JSON).

    orjson parses a turn's body (25,000 token ids: ~0.6 ms against ~2 ms) unless it holds a run of 19 digits
    or more: orjson reads an integer beyond 64 bits as a float, which would change what validation says of
    it. The standard library parses those, and what orjson refuses, so errors read the same either way.
    """
    if not raw:
        raise InvalidArgument("the request body is empty: send a JSON object")
    try:
        long_number = _LONG_DIGIT_RUN in raw.translate(_DIGITS_AS_ONES)
        data = _standard_loads(raw) if long_number else orjson.loads(raw)
    except orjson.JSONDecodeError:
        data = _standard_loads(raw)
    if not isinstance(data, dict):
        raise InvalidArgument(f"the request body must be a JSON object, not {type(data).__name__}")
    return data


# Digits enough to pass 64 bits, either sign (2**63 has 19), found at C speed (a regular expression
# takes ~10x as long over a body of digits).
_DIGITS_AS_ONES = bytes.maketrans(b"0123456789", b"1" * 10)
_LONG_DIGIT_RUN = b"1" * 19


def _standard_loads(raw: bytes) -> Any:
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as error:
        raise InvalidArgument(f"the request body is not valid JSON: {error}") from None


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def parse_chat(data: Mapping[str, Any]) -> ChatCall:
    """Checks a chat request (every field known, none refused, types and ranges) -> :class:`ChatCall`."""
    for name in data:
        field = FIELDS.get(name)
        if field is None:
            raise InvalidArgument(
                f"unknown field {name!r}: kvferry serves OpenAI's chat fields and vLLM's "
                "(see docs/router.md, chat fields) and refuses the rest rather than drop them",
                param=name,
            )
        if field.support is Support.REFUSED:
            raise InvalidArgument(f"{name} is not supported by kvferry: {field.note}", param=name)
    body = validate(ChatBody, data)
    for name, value in data.items():
        accepts = FIELDS[name].accepts
        if accepts is not None and value is not None and not accepts(value):
            raise InvalidArgument(
                f"{name}={json.dumps(value)} is not supported by kvferry: {FIELDS[name].note}", param=name
            )
    _check_messages(body.messages)
    if isinstance(body.stop, list) and (len(body.stop) > MAX_STOP_STRINGS or not all(body.stop)):
        raise InvalidArgument(f"stop takes 1 to {MAX_STOP_STRINGS} non-empty strings", param="stop")
    if body.stop == "":
        raise InvalidArgument("stop must not be empty", param="stop")
    forwarded = {k: v for k, v in data.items() if FIELDS[k].support is Support.PASSED}
    return ChatCall(
        chat=ChatRequest(forwarded),
        model=body.model,
        stream=bool(body.stream),
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        max_tokens=body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
        conversation_id=body.conversation_id,
        prompt_cache_key=body.prompt_cache_key,
        retain=True if body.retain is None else body.retain,
    )


_Model = TypeVar("_Model", bound=BaseModel)


def validate(model: type[_Model], data: Mapping[str, Any]) -> _Model:
    """``data`` checked against ``model``; problems become one 400 naming the first field at fault."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        problems = error.errors(include_url=False)
        described = []
        for item in problems[:5]:
            where = _location(item["loc"]) or "body"
            message = "unknown field" if item["type"] == "extra_forbidden" else item["msg"]
            described.append(f"{where}: {message}")
        raise InvalidArgument(
            "invalid request: " + "; ".join(described), param=_location(problems[0]["loc"]) or None
        ) from None


def _location(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _check_messages(messages: list[_Message]) -> None:
    """Text content only: the prefix check digests token ids, and a picture behind a placeholder token
    could change while its ids stay the same."""
    for index, message in enumerate(messages):
        if isinstance(message.content, list):
            for part_index, part in enumerate(message.content):
                where = f"messages[{index}].content[{part_index}]"
                kind = part.get("type")
                if kind != "text":
                    raise InvalidArgument(
                        f"{where} is a {kind!r} part: kvferry serves text (its reuse check compares token "
                        "ids, which do not show what a picture or a sound holds)",
                        param=where,
                    )
                if not isinstance(part.get("text"), str):
                    raise InvalidArgument(f"{where}.text must be a string", param=f"{where}.text")
