"""A conversation: one turn per call, the history kept for the caller, keep-alive and close."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING

from kvferry.sdk._errors import ErrorCode, RpcError
from kvferry.sdk._keepalive import KeepAlive
from kvferry.sdk._models import ChatMessage, ConversationInfo, Reply, SamplingParams
from kvferry.sdk._proto import Prompt
from kvferry.sdk._stream import TurnStream

if TYPE_CHECKING:
    from kvferry.sdk._client import Client

_log = logging.getLogger("kvferry.sdk")

# What ``send`` accepts: raw text, token ids, one chat message, or chat messages (``ChatMessage`` or
# OpenAI-style ``{"role": ..., "content": ...}`` dicts).
PromptInput = (
    str | ChatMessage | Mapping[str, str] | Sequence[int] | Sequence[ChatMessage | Mapping[str, str]]
)


def normalize_prompt(prompt: PromptInput) -> Prompt:
    """The prompt as the SDK holds it (text, or a tuple of token ids or messages); rejects empty or mixed."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty")
        return prompt
    if isinstance(prompt, ChatMessage | Mapping):
        return (_to_message(prompt),)
    items = list(prompt)
    if not items:
        raise ValueError("the prompt is empty")
    if all(isinstance(item, int) and not isinstance(item, bool) for item in items):
        return tuple(int(item) for item in items)  # type: ignore[arg-type]
    if all(isinstance(item, ChatMessage | Mapping) for item in items):
        return tuple(_to_message(item) for item in items)  # type: ignore[arg-type]
    raise TypeError("a prompt is text, a list of token ids, or a list of chat messages; not a mix")


def _to_message(item: ChatMessage | Mapping[str, str]) -> ChatMessage:
    if isinstance(item, ChatMessage):
        return item
    try:
        return ChatMessage(role=str(item["role"]), content=str(item["content"]))
    except KeyError as missing:
        raise ValueError(f"a chat message needs 'role' and 'content'; {missing} is missing") from None


def _kind(prompt: Prompt) -> str:
    if isinstance(prompt, str):
        return "text"
    return "chat messages" if isinstance(prompt[0], ChatMessage) else "token ids"


def extend_prompt(history: Prompt | None, new: Prompt) -> Prompt:
    """``history`` followed by ``new`` (both of the same kind)."""
    if history is None:
        return new
    if _kind(history) != _kind(new):
        raise TypeError(
            f"this conversation's history is {_kind(history)}; send {_kind(history)} too "
            f"(got {_kind(new)}), or use keep_history=False"
        )
    return history + new  # type: ignore[operator]


def append_reply(prompt: Prompt, reply: Reply) -> Prompt:
    """The history after a turn: the prompt followed by the assistant's reply, in the prompt's kind."""
    if isinstance(prompt, str):
        return prompt + reply.text
    if isinstance(prompt[0], ChatMessage):
        return (*prompt, ChatMessage.assistant(reply.text))  # type: ignore[return-value]
    # Token ids: exactly what the decode engine retains, so the next turn's prefix matches.
    return (*prompt, *reply.token_ids)  # type: ignore[return-value]


class Conversation:
    """One conversation with the router, keyed by ``id``.

    With ``keep_history`` (the default) each ``send`` takes only the turn's new input (a user
    message, text or token ids): the conversation sends the whole history, and appends the input and
    the assistant's reply to it once the turn finished. A failed or abandoned turn leaves the history
    unchanged. With ``keep_history=False`` each ``send`` takes the whole prompt.
    """

    def __init__(
        self,
        client: Client,
        conversation_id: str,
        *,
        history: PromptInput | None = None,
        keep_history: bool = True,
        model: str = "",
        sampling: SamplingParams | None = None,
    ) -> None:
        self._client = client
        self._id = conversation_id
        self._history: Prompt | None = normalize_prompt(history) if history is not None else None
        self._keep_history = keep_history
        self._model = model
        self._sampling = sampling or SamplingParams()
        self._turn: TurnStream | None = None
        self._keep_alives: list[KeepAlive] = []
        self._closed = False
        self.last_reply: Reply | None = None

    @property
    def id(self) -> str:
        return self._id

    @property
    def history(self) -> Prompt | None:
        """The history sent with the next turn: text, token ids, or chat messages (None before any)."""
        return self._history

    @property
    def messages(self) -> list[ChatMessage]:
        """The chat history as messages (empty unless the conversation is in chat messages)."""
        if self._history is None or isinstance(self._history, str) or _kind(self._history) != "chat messages":
            return []
        return list(self._history)  # type: ignore[arg-type]

    @property
    def closed(self) -> bool:
        return self._closed

    def send(
        self,
        prompt: PromptInput,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
        ignore_eos: bool | None = None,
        retain: bool | None = None,
        deadline_seconds: float | None = None,
    ) -> TurnStream:
        """Starts a turn; iterate the returned stream for chunks, then read its ``summary``.

        Sampling arguments left None take the conversation's defaults; ``retain=False`` asks the
        router not to keep this turn's KV; ``deadline_seconds`` bounds the whole turn (default: the
        client's ``Deadlines``). Starting a turn while the previous one still streams cancels it.
        """
        if self._closed:
            raise RuntimeError(f"conversation {self._id} is closed; start a new one")
        new = normalize_prompt(prompt)
        full = extend_prompt(self._history, new) if self._keep_history else new
        sampling = self._sampling_with(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop=stop,
            ignore_eos=ignore_eos,
        )
        previous = self._turn
        if previous is not None and previous.active:
            _log.debug("cancelling the previous unfinished turn", extra={"conversation_id": self._id})
            previous.cancel()
        history_before = self._history

        def on_finish(reply: Reply) -> None:
            self.last_reply = reply
            # Commit only if no other turn committed meanwhile.
            if self._keep_history and self._history is history_before:
                self._history = append_reply(full, reply)

        self._turn = self._client.generate(
            self._id,
            full,
            sampling=sampling,
            model=self._model,
            retain=retain,
            deadline_seconds=deadline_seconds,
            on_finish=on_finish,
        )
        return self._turn

    async def complete(
        self,
        prompt: PromptInput,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
        ignore_eos: bool | None = None,
        retain: bool | None = None,
        deadline_seconds: float | None = None,
    ) -> Reply:
        """Runs a whole turn and returns the reply (text, token ids, summary)."""
        stream = self.send(
            prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop=stop,
            ignore_eos=ignore_eos,
            retain=retain,
            deadline_seconds=deadline_seconds,
        )
        async with stream:
            return await stream.collect()

    def keep_alive(self, interval: float | None = None) -> KeepAlive:
        """``async with conversation.keep_alive():`` renews the retained KV in the background.

        With no ``interval``, it renews at a third of the lease's remaining time, learnt from each
        renewal's expire time. Renewing starts at once and stops when the block exits.
        """
        if self._closed:
            raise RuntimeError(f"conversation {self._id} is closed")
        keep_alive = self._client.keep_alive(self._id, interval=interval)
        self._keep_alives = [k for k in self._keep_alives if k.running]
        self._keep_alives.append(keep_alive)
        return keep_alive

    async def renew(self) -> datetime:
        """Renews the retained KV once; returns the lease's new end."""
        return await self._client.renew_conversation(self._id)

    async def info(self) -> ConversationInfo:
        """What the router retains for this conversation (raises NotFoundError when nothing)."""
        return await self._client.get_conversation(self._id)

    async def close(self) -> None:
        """Ends the conversation: stops keep-alives and releases the retained KV at once.

        Idempotent; a conversation with nothing retained closes quietly.
        """
        if self._closed:
            return
        self._closed = True
        for keep_alive in self._keep_alives:
            await keep_alive.stop()
        self._keep_alives.clear()
        if self._turn is not None and self._turn.active:
            self._turn.cancel()
        try:
            await self._client.close_conversation(self._id)
        except RpcError as error:
            if error.code is not ErrorCode.NOT_FOUND:
                raise

    async def __aenter__(self) -> Conversation:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    def _sampling_with(
        self,
        *,
        max_tokens: int | None,
        temperature: float | None,
        top_p: float | None,
        seed: int | None,
        stop: Sequence[str] | None,
        ignore_eos: bool | None,
    ) -> SamplingParams:
        overrides: dict[str, object] = {
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "seed": seed,
            "stop": tuple(stop) if stop is not None else None,
            "ignore_eos": ignore_eos,
        }
        given = {key: value for key, value in overrides.items() if value is not None}
        return dataclasses.replace(self._sampling, **given)  # type: ignore[arg-type]
