"""One engine's requests and answers in P/D mode, typed, and the port kvferry drives an engine through.

Pure: the HTTP client that speaks these over vLLM's OpenAI-compatible API is
:class:`kvferry.pd.engine_client.VllmEngineClient`; tests drive code written against :class:`EngineApi`
with fakes.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from kvferry.pd import vllm_params
from kvferry.pd.chat import ChatRequest
from kvferry.pd.kvferry_params import (
    DEVICE_TIER,
    BlockGenerations,
    ConversationMark,
    Mark,
    PeerAddress,
    PullOptions,
    mark_params,
    read_ms_params,
    tier_params,
)
from kvferry.pd.vllm_params import KvHandoff, RemoteBlocks


class EngineHttpError(Exception):
    """The engine answered with an error (HTTP status >= 400, or an error event in a stream)."""

    def __init__(self, url: str, status_code: int, message: str) -> None:
        super().__init__(f"{url}: HTTP {status_code}: {message}")
        self.url = url
        self.status_code = status_code
        self.message = message


class EngineUnavailableError(Exception):
    """The engine could not be reached, or did not answer within the timeout. ``refused``: no connection could
    be made at all (nothing listens at the engine's address), as against one that broke or timed out."""

    def __init__(self, url: str, cause: BaseException, *, refused: bool = False) -> None:
        super().__init__(f"{url}: engine unreachable: {type(cause).__name__}: {cause}")
        self.url = url
        self.refused = refused


# Every error an engine call raises for the engine's sake (not the caller's).
ENGINE_ERRORS = (EngineHttpError, EngineUnavailableError)


# -- kv_transfer_params of a turn's two requests ---------------------------------------------------------


def prefill_transfer_params(
    mark: ConversationMark | None,
    reuse: RemoteBlocks | None,
    *,
    read_ms: int | None,
    pull_options: PullOptions | None = None,
    generations: BlockGenerations | None = None,
    tier: str = DEVICE_TIER,
    peer: PeerAddress | None = None,
) -> dict[str, Any]:
    """``kv_transfer_params`` for a prefill request (P computes, D will pull), pulling ``reuse`` first within
    ``read_ms`` milliseconds (and checking its blocks' ``generations`` after the pull) from the holder's
    ``tier``; ``peer``: the engine P will pull from next (P handshakes with it ahead)."""
    params = vllm_params.prefill_params(reuse)
    params.update(mark_params(mark))
    if reuse is not None and read_ms is not None:
        params.update(read_ms_params(read_ms))
    if reuse is not None and generations is not None:
        params.update(generations.to_params())
    if reuse is not None:
        params.update(tier_params(tier))
    if pull_options is not None:
        params.update(pull_options.to_params())
    if peer is not None:
        params.update(peer.to_params())
    return params


def decode_transfer_params(
    handoff: KvHandoff, mark: Mark | None, *, pull_options: PullOptions | None = None
) -> dict[str, Any]:
    """``kv_transfer_params`` for a decode request: P's handoff plus the kvferry mark (and options for D's
    pull of the prompt from P)."""
    if not handoff.do_remote_prefill or handoff.blocks is None:
        raise ValueError("the prefill's handoff does not name blocks to pull (do_remote_prefill unset)")
    params = handoff.to_params()
    params.update(mark_params(mark))
    if pull_options is not None:
        params.update(pull_options.to_params())
    return params


# -- requests and answers --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    """Sampling options passed to the decode engine."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Stop strings (not part of the output).
    stop: tuple[str, ...] = ()

    def to_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "ignore_eos": self.ignore_eos,
        }
        if self.seed is not None:
            body["seed"] = self.seed
        if self.stop:
            body["stop"] = list(self.stop)
        if self.stop_token_ids:
            body["stop_token_ids"] = list(self.stop_token_ids)
        return body


@dataclass(frozen=True)
class PrefillRequest:
    # The prompt's token ids; with ``chat``, the ids its messages render to (forwarded to the engine).
    token_ids: tuple[int, ...]
    mark: ConversationMark | None = None
    # Pull this prefix from a decode engine instead of computing it.
    reuse: RemoteBlocks | None = None
    # Milliseconds left to start reading the reused retention (kvferry.pd.reuse.ReadWindow); required with
    # ``reuse`` and a mark. None without a mark: blocks vLLM holds on its own (its own expiry guards them).
    read_ms: int | None = None
    # Sent as X-Request-Id; vLLM's engine request id is derived from it.
    request_id: str | None = None
    pull_options: PullOptions | None = None
    # The generations the reused retention published for ``reuse``'s blocks (P checks them after the pull).
    generations: BlockGenerations | None = None
    # Which of the holder's tiers ``reuse``'s blocks are in (kvferry.pd.kvferry_params.PULL_TIERS).
    tier: str = DEVICE_TIER
    # Served through the chat endpoint (kvferry.pd.chat) instead of as a token-id completion.
    chat: ChatRequest | None = None
    # How P samples its one token: the turn's own settings when that token is the turn's first output
    # (kvferry.pd.sequence hands it over); None: greedy (the token is only a by-product of the prefill).
    sampling: Sampling | None = None
    # The engine this turn's KV goes to, which P will pull the conversation from next turn: P's connector
    # handshakes with it now, off that turn's time to first token.
    peer: PeerAddress | None = None

    def transfer_params(self) -> dict[str, Any]:
        if self.reuse is not None and self.mark is not None and self.read_ms is None:
            raise ValueError("a marked prefill that reuses a retention must carry its read window (read_ms)")
        params = prefill_transfer_params(
            self.mark,
            self.reuse,
            read_ms=self.read_ms,
            pull_options=self.pull_options,
            generations=self.generations,
            tier=self.tier,
            peer=self.peer,
        )
        if self.chat is not None and self.token_ids:
            params[vllm_params.PROMPT_TOKEN_IDS] = list(self.token_ids)
        return params


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens whose KV was not computed (local prefix cache + pulled); needs the engine's
    # --enable-prompt-tokens-details, else None.
    cached_tokens: int | None = None
    # The engine's usage object as it came (fields kvferry does not model, e.g. reasoning tokens).
    body: Mapping[str, Any] | None = field(default=None, compare=False)

    @classmethod
    def from_body(cls, raw: Mapping[str, Any] | None) -> Usage | None:
        if not raw:
            return None
        details = raw.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        return cls(
            prompt_tokens=int(raw.get("prompt_tokens") or 0),
            completion_tokens=int(raw.get("completion_tokens") or 0),
            cached_tokens=None if cached is None else int(cached),
            body=raw,
        )


@dataclass(frozen=True)
class PrefillResult:
    handoff: KvHandoff
    first_token_ids: tuple[int, ...]
    usage: Usage | None
    # P's one token as text, and why P stopped there ("length": the token budget of one; "stop": the
    # token ends the answer, e.g. end of sequence).
    first_text: str = ""
    finish_reason: str | None = None


@dataclass(frozen=True)
class DecodeRequest:
    token_ids: tuple[int, ...]
    handoff: KvHandoff
    # A conversation mark retains the decode's blocks; a release mark frees them at the end; none
    # leaves them to vLLM (held for its decoder_kv_blocks_ttl).
    mark: Mark | None = None
    # Ignored with ``chat``: the chat request carries its sampling fields.
    sampling: Sampling = field(default_factory=Sampling)
    request_id: str | None = None
    # Served through the chat endpoint (kvferry.pd.chat) instead of as a token-id completion.
    chat: ChatRequest | None = None

    def transfer_params(self) -> dict[str, Any]:
        params = decode_transfer_params(self.handoff, self.mark)
        if self.chat is not None and self.token_ids:
            params[vllm_params.PROMPT_TOKEN_IDS] = list(self.token_ids)
        return params


# "tool_calls": a chat answer whose message calls tools (a normal end, like "stop").
FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"] | str
# The finish reasons of a decode that ran to its end (its blocks are retained when marked).
NORMAL_FINISH_REASONS = frozenset({"stop", "length", "tool_calls"})


# Slotted, not frozen: one is built per streamed token (a frozen dataclass's __init__ costs several times
# more).
@dataclass(slots=True)
class DecodeChunk:
    """One streamed piece of the decode: new tokens, and on the last one the finish reason.

    A chat stream's chunk is the engine's event as it came (``raw``, the JSON after ``data:``), for relaying
    as is: only its finish reason and usage are read, ``token_ids`` and ``text`` stay empty
    (:func:`kvferry.pd.engine_client.chat_delta` reads the rest). Its trailing usage-only event comes
    with ``raw`` empty and ``usage`` set."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None = None
    # Only on the trailing usage chunk (then token_ids is empty), or on every chunk of a chat stream with
    # stream_options.continuous_usage_stats.
    usage: Usage | None = None
    raw: bytes = b""


@dataclass(frozen=True)
class DecodeResult:
    """A non-streaming decode: D's own returned params name the blocks it retained."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None
    usage: Usage | None
    retained: KvHandoff | None
    # A chat decode: the engine's chat completion as it came, without its kv_transfer_params (``text``:
    # its message's content).
    body: Mapping[str, Any] | None = None
    # The generations D published with the retained blocks (None: it does not fence pulls).
    retained_generations: BlockGenerations | None = None


@dataclass(frozen=True)
class ModelInfo:
    id: str
    max_model_len: int | None


# -- the port --------------------------------------------------------------------------------------------


class EngineApi(Protocol):
    """What kvferry asks of one engine to run turns on it (the HTTP client
    :class:`~kvferry.pd.engine_client.VllmEngineClient`, or a fake in tests). Engine failures raise
    :class:`EngineHttpError` / :class:`EngineUnavailableError`."""

    @property
    def base_url(self) -> str: ...

    async def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    async def render_chat(self, chat: ChatRequest) -> list[int]:
        """Token ids of the chat's prompt, rendered through the model's chat template as the engine's chat
        endpoint renders it (:meth:`~kvferry.pd.chat.ChatRequest.tokenize_body`)."""
        ...

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        """Computes the prompt with ``max_tokens=1`` (pulling ``request.reuse`` first when given)."""
        ...

    def decode_stream(self, request: DecodeRequest) -> AsyncGenerator[DecodeChunk, None]:
        """Streams the decode; closing the generator aborts the request on the engine."""
        ...

    async def decode(self, request: DecodeRequest) -> DecodeResult:
        """Non-streaming decode; its answer names the blocks D retained."""
        ...
