"""Checks of client input shared by the gRPC and HTTP front ends, with messages a caller can act on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

from kvferry.router.turns import SamplingOptions
from kvferry.runtime.errors import InvalidArgument
from kvferry.runtime.ids import check_id
from pydantic import Field

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
MAX_MODEL_NAME = 256
MAX_STOP_STRINGS = 16
# vLLM holds token ids as int32 (its input_ids buffers), so no model has an id above this; larger
# ones (2^63 and up do not even fit the digest's int64) are the caller's mistake, not an engine's.
MAX_TOKEN_ID = 2**31 - 1
# One token id in a request model (chat's stop_token_ids...): the range :func:`token_ids` checks.
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
# vLLM keeps both in 64-bit (max_tokens in int32 buffers too): beyond these the engine answers with a raw
# validation dump instead of a message the caller can act on.
MAX_TOKENS = 2**31 - 1
SEED_RANGE = (-(2**63), 2**63 - 1)
# A signed 64-bit field of the OpenAI bodies (seed, priority): what vLLM's own types take.
Int64 = Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])]


def conversation_id(value: str, *, param: str = "conversation_id") -> str:
    problem = check_id("conversation_id", value)
    if problem is not None:
        raise InvalidArgument(problem, param=param)
    return value


def model_name(value: str) -> str:
    if len(value) > MAX_MODEL_NAME:
        raise InvalidArgument(
            f"model name is {len(value)} characters long; at most {MAX_MODEL_NAME}", param="model"
        )
    return value


def token_ids(ids: Sequence[int], *, param: str) -> tuple[int, ...]:
    """A token-id prompt, checked before the digest or any engine sees it."""
    # One pass over the caller's container (a protobuf repeated field converts each item), then C-speed
    # min()/max() over the tuple: about a third less than iterating the field three times.
    prompt = tuple(ids)
    if not prompt:
        raise InvalidArgument(f"{param} is empty: send at least one token id", param=param)
    if min(prompt) < 0 or max(prompt) > MAX_TOKEN_ID:
        index, token = next((i, t) for i, t in enumerate(prompt) if not 0 <= t <= MAX_TOKEN_ID)
        raise InvalidArgument(
            f"{param}[{index}] is {token}; token ids are non-negative and at most {MAX_TOKEN_ID}",
            param=param,
        )
    return prompt


def sampling(
    *,
    max_tokens: int | None,
    temperature: float,
    top_p: float | None,
    seed: int | None,
    stop: Sequence[str],
    ignore_eos: bool,
) -> SamplingOptions:
    if max_tokens is not None and not 1 <= max_tokens <= MAX_TOKENS:
        raise InvalidArgument(
            f"max_tokens must be within [1, {MAX_TOKENS}], got {max_tokens}", param="max_tokens"
        )
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise InvalidArgument(f"seed must fit in a signed 64-bit integer, got {seed}", param="seed")
    if not 0.0 <= temperature <= 2.0:
        raise InvalidArgument(f"temperature must be within [0, 2], got {temperature}", param="temperature")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise InvalidArgument(f"top_p must be within (0, 1], got {top_p}", param="top_p")
    if len(stop) > MAX_STOP_STRINGS or any(not s for s in stop):
        raise InvalidArgument(f"stop takes 1 to {MAX_STOP_STRINGS} non-empty strings", param="stop")
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p if top_p is not None else 1.0,
        seed=seed,
        stop=tuple(stop),
        ignore_eos=ignore_eos,
    )
