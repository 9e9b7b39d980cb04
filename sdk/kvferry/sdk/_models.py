"""The SDK's public data types: plain dataclasses, free of protobuf."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime


@dataclass(frozen=True)
class ChatMessage:
    """One chat message."""

    role: str
    content: str

    @classmethod
    def system(cls, content: str) -> ChatMessage:
        return cls("system", content)

    @classmethod
    def user(cls, content: str) -> ChatMessage:
        return cls("user", content)

    @classmethod
    def assistant(cls, content: str) -> ChatMessage:
        return cls("assistant", content)

    @classmethod
    def tool(cls, content: str) -> ChatMessage:
        return cls("tool", content)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample; zero values take the router's defaults (256 tokens, greedy, top_p 1)."""

    max_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 0.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


class ReuseDecision(enum.Enum):
    """How a turn reused the conversation's retained KV."""

    UNSPECIFIED = "unspecified"
    # No usable retention: the whole prompt was computed.
    NONE = "none"
    # The retained prefix was pulled from the decode engine.
    PULL = "pull"
    # A retention matched but the cost model chose to recompute.
    RECOMPUTE = "recompute"
    # Prefill was skipped: the decode engine already held the prefix.
    LOCAL = "local"


@dataclass(frozen=True)
class Chunk:
    """Generated text as it arrives."""

    text: str
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class TurnSummary:
    """What a finished turn cost and how it reused KV (the last event of a turn)."""

    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens whose KV was pulled from the retention vs computed.
    pulled_tokens: int
    recomputed_tokens: int
    # Time to first token seen by the router, and its prefill part.
    ttft_ms: float
    prefill_ms: float
    reuse: ReuseDecision
    prefill_engine_id: str
    decode_engine_id: str
    # `stop`, `length` or `abort`.
    finish_reason: str
    # The turn number now retained.
    turn: int


@dataclass(frozen=True)
class Reply:
    """A whole turn: the text, its token ids and the summary."""

    text: str
    token_ids: tuple[int, ...]
    summary: TurnSummary


@dataclass(frozen=True)
class ConversationInfo:
    """What the router retains for a conversation."""

    conversation_id: str
    turn: int
    num_tokens: int
    engine_id: str
    expire_time: datetime | None = field(default=None)
