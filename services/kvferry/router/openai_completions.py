"""OpenAI (legacy) completions requests: a prompt as text or token ids, and the sampling fields kvferry's
token path carries (:class:`kvferry.pd.engine_api.Sampling`). Any other field gets HTTP 400 naming it;
checks are strict, as for chat (:mod:`kvferry.router.openai_chat`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from kvferry.router import validation
from kvferry.router.openai_chat import load_json_object, validate
from kvferry.router.turns import Prompt, SamplingOptions, TextPrompt, TokenPrompt
from kvferry.runtime.errors import InvalidArgument
from pydantic import BaseModel, ConfigDict, Field


class _StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool | None = None


class CompletionBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str = Field("", max_length=256)
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    seed: validation.Int64 | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: _StreamOptions | None = None
    ignore_eos: bool | None = None
    user: str | None = None
    # kvferry's
    conversation_id: str | None = None
    prompt_cache_key: str | None = Field(None, min_length=1)
    retain: bool | None = None


@dataclass(frozen=True)
class CompletionCall:
    prompt: Prompt
    model: str
    sampling: SamplingOptions
    stream: bool
    include_usage: bool
    conversation_id: str | None
    prompt_cache_key: str | None
    retain: bool


def parse_completion_body(raw: bytes) -> CompletionCall:
    """A completions request body, checked. A token-id prompt (a turn's whole conversation: 25,000 ids) is
    checked while it is parsed, in C (~1.3 ms on the dev VM against ~3.7 ms to parse, then check each id);
    any other body, and any body that fails that check, is parsed and judged as :func:`parse_completion`
    does, so every error reads the same either way."""
    try:
        fields = msgspec.structs.asdict(_decode_token_id_body(raw))
    except (msgspec.DecodeError, RecursionError):
        return parse_completion(load_json_object(raw))
    token_ids = tuple(fields.pop("prompt"))
    if not token_ids:
        return parse_completion(load_json_object(raw))
    # msgspec reads every number exactly, as the standard library does: the model judges the same values.
    return _parse({name: value for name, value in fields.items() if value is not msgspec.UNSET}, token_ids)


def parse_completion(data: Mapping[str, Any]) -> CompletionCall:
    unknown = [name for name in data if name not in CompletionBody.model_fields]
    if unknown:
        raise InvalidArgument(
            f"{unknown[0]} is not supported on /v1/completions (it takes "
            f"{', '.join(sorted(CompletionBody.model_fields))}); /v1/chat/completions passes every field "
            "vLLM serves",
            param=unknown[0],
        )
    return _parse(data, _flat_token_ids(data.get("prompt")))


def _parse(data: Mapping[str, Any], token_ids: tuple[int, ...] | None) -> CompletionCall:
    # A token-id prompt (a turn's whole conversation: 25,000 ids) comes checked apart, at C speed (msgspec
    # while parsing, or ``_flat_token_ids``); the model checks every other field (validating the ids item by
    # item through the model's union takes ~4x as long).
    body = validate(CompletionBody, data if token_ids is None else {**data, "prompt": _CHECKED_APART})
    if body.n not in (None, 1):
        raise InvalidArgument("n must be 1: one answer continues the conversation", param="n")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return CompletionCall(
        prompt=TokenPrompt(token_ids) if token_ids is not None else _prompt(body.prompt),
        model=validation.model_name(body.model),
        sampling=validation.sampling(
            max_tokens=body.max_tokens,
            # OpenAI's default temperature is 1.
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop=stop,
            ignore_eos=bool(body.ignore_eos),
        ),
        stream=bool(body.stream),
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        conversation_id=body.conversation_id,
        prompt_cache_key=body.prompt_cache_key,
        retain=True if body.retain is None else body.retain,
    )


# What the model sees in place of a token-id prompt checked apart (never used).
_CHECKED_APART = "token ids checked apart"

# A body whose prompt is a flat list of token ids in range, every other field one the model knows (its values
# are the model's to check): anything else fails to decode and is judged by ``parse_completion``.
_TokenIdPromptBody = msgspec.defstruct(
    "_TokenIdPromptBody",
    [
        ("prompt", list[Annotated[int, msgspec.Meta(ge=0, le=validation.MAX_TOKEN_ID)]]),
        *((name, Any, msgspec.UNSET) for name in CompletionBody.model_fields if name != "prompt"),
    ],
    forbid_unknown_fields=True,
)
_decode_token_id_body = msgspec.json.Decoder(_TokenIdPromptBody).decode


def _flat_token_ids(prompt: object) -> tuple[int, ...] | None:
    """A non-empty flat list of integers (booleans are not) as checked token ids; None for any other prompt,
    which the model and ``_prompt`` judge."""
    if not isinstance(prompt, list) or not prompt or set(map(type, prompt)) != {int}:
        return None
    return validation.token_ids(prompt, param="prompt")


def _prompt(prompt: str | list[int] | list[str] | list[list[int]]) -> Prompt:
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
    return _prompt(prompt[0])  # type: ignore[arg-type]  # one text or one id list
