"""A blocking wrapper: the async client runs on a private event loop in one background thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from datetime import datetime
from types import TracebackType
from typing import Any, TypeVar

from kvferry.sdk._client import Client
from kvferry.sdk._config import ClientConfig, Deadlines, TlsConfig
from kvferry.sdk._conversation import Conversation, PromptInput
from kvferry.sdk._keepalive import KeepAlive, KeepAliveSettings
from kvferry.sdk._models import ChatMessage, Chunk, ConversationInfo, Reply, SamplingParams, TurnSummary
from kvferry.sdk._proto import Prompt
from kvferry.sdk._retry import RetryPolicy
from kvferry.sdk._stream import TurnStream

_T = TypeVar("_T")


class _LoopThread:
    """An event loop running forever in a daemon thread; ``run`` submits a coroutine and waits."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvferry-sdk-loop", daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        if threading.current_thread() is self._thread:
            coroutine.close()
            raise RuntimeError("a SyncClient call was made from its own loop thread")
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result()
        except BaseException:
            # Interrupted (e.g. KeyboardInterrupt): do not leave the call running behind our back.
            future.cancel()
            raise

    def call(self, function: Callable[[], _T]) -> _T:
        """Runs a plain function on the loop thread (objects bound to the loop are touched only there)."""

        async def wrapped() -> _T:
            return function()

        return self.run(wrapped())

    def stop(self) -> None:
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


def _refuse_inside_event_loop() -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError("SyncClient blocks its caller; inside async code use kvferry.sdk.Client instead")


class SyncClient:
    """Blocking twin of ``Client`` for scripts and sync agent frameworks."""

    def __init__(self, runner: _LoopThread, client: Client) -> None:
        self._runner = runner
        self._client = client

    @classmethod
    def connect(
        cls,
        address: str | None = None,
        *,
        api_key: str | None = None,
        tls: bool | TlsConfig | None = None,
        retry: RetryPolicy | None = None,
        deadlines: Deadlines | None = None,
        keep_alive: KeepAliveSettings | None = None,
        config: ClientConfig | None = None,
        environ: Mapping[str, str] | None = None,
        wait_ready_seconds: float | None = None,
    ) -> SyncClient:
        """Same arguments as ``Client.connect``."""
        _refuse_inside_event_loop()
        runner = _LoopThread()
        try:
            client = runner.run(
                Client.connect(
                    address,
                    api_key=api_key,
                    tls=tls,
                    retry=retry,
                    deadlines=deadlines,
                    keep_alive=keep_alive,
                    config=config,
                    environ=environ,
                    wait_ready_seconds=wait_ready_seconds,
                )
            )
        except BaseException:
            runner.stop()
            raise
        return cls(runner, client)

    @property
    def config(self) -> ClientConfig:
        return self._client.config

    def close(self) -> None:
        """Closes the channel and stops the loop thread."""
        try:
            self._runner.run(self._client.close())
        finally:
            self._runner.stop()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def conversation(
        self,
        id: str | None = None,
        *,
        history: PromptInput | None = None,
        keep_history: bool = True,
        model: str = "",
        sampling: SamplingParams | None = None,
    ) -> SyncConversation:
        conversation = self._client.conversation(
            id, history=history, keep_history=keep_history, model=model, sampling=sampling
        )
        return SyncConversation(self._runner, conversation)

    def renew_conversation(self, conversation_id: str) -> datetime:
        return self._runner.run(self._client.renew_conversation(conversation_id))

    def close_conversation(self, conversation_id: str) -> None:
        self._runner.run(self._client.close_conversation(conversation_id))

    def get_conversation(self, conversation_id: str) -> ConversationInfo:
        return self._runner.run(self._client.get_conversation(conversation_id))


def loop_and_client(client: SyncClient) -> tuple[_LoopThread, Client]:
    """For the SDK's own adapters: the loop thread a SyncClient runs on, and its async client (to be used
    only through that thread's ``run``)."""
    return client._runner, client._client


class SyncTurnStream:
    """Blocking twin of ``TurnStream``: iterate chunks, then read ``summary``."""

    def __init__(self, runner: _LoopThread, stream: TurnStream) -> None:
        self._runner = runner
        self._stream = stream

    def __iter__(self) -> Iterator[Chunk]:
        return self

    def __next__(self) -> Chunk:
        got, chunk = self._runner.run(_next_or_end(self._stream))
        if not got or chunk is None:
            raise StopIteration
        return chunk

    @property
    def finished(self) -> bool:
        return self._stream.finished

    @property
    def text(self) -> str:
        return self._stream.text

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self._stream.token_ids

    @property
    def summary(self) -> TurnSummary:
        return self._stream.summary

    @property
    def reply(self) -> Reply:
        return self._stream.reply

    def collect(self) -> Reply:
        return self._runner.run(self._stream.collect())

    def close(self) -> None:
        self._runner.call(self._stream.cancel)

    def __enter__(self) -> SyncTurnStream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


async def _next_or_end(stream: TurnStream) -> tuple[bool, Chunk | None]:
    # StopAsyncIteration cannot cross run_coroutine_threadsafe cleanly: return a flag instead.
    try:
        return True, await stream.__anext__()
    except StopAsyncIteration:
        return False, None


class SyncKeepAlive:
    """Blocking twin of ``KeepAlive``: ``with conversation.keep_alive(): run_tool()``."""

    def __init__(self, runner: _LoopThread, keep_alive: KeepAlive) -> None:
        self._runner = runner
        self._keep_alive = keep_alive

    def __enter__(self) -> KeepAlive:
        # The renewals run on the loop thread while the caller's thread runs the tool.
        return self._runner.run(self._keep_alive.__aenter__())

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._runner.run(self._keep_alive.stop())


class SyncConversation:
    """Blocking twin of ``Conversation``."""

    def __init__(self, runner: _LoopThread, conversation: Conversation) -> None:
        self._runner = runner
        self._conversation = conversation

    @property
    def id(self) -> str:
        return self._conversation.id

    @property
    def history(self) -> Prompt | None:
        return self._conversation.history

    @property
    def messages(self) -> list[ChatMessage]:
        return self._conversation.messages

    @property
    def closed(self) -> bool:
        return self._conversation.closed

    @property
    def last_reply(self) -> Reply | None:
        return self._conversation.last_reply

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
    ) -> SyncTurnStream:
        """Same as ``Conversation.send``; iterate the result for chunks."""
        stream = self._runner.call(
            lambda: self._conversation.send(
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
        )
        return SyncTurnStream(self._runner, stream)

    def complete(
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
        """Same as ``Conversation.complete``: the whole reply."""
        return self._runner.run(
            self._conversation.complete(
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
        )

    def keep_alive(self, interval: float | None = None) -> SyncKeepAlive:
        keep_alive = self._runner.call(lambda: self._conversation.keep_alive(interval))
        return SyncKeepAlive(self._runner, keep_alive)

    def renew(self) -> datetime:
        return self._runner.run(self._conversation.renew())

    def info(self) -> ConversationInfo:
        return self._runner.run(self._conversation.info())

    def close(self) -> None:
        self._runner.run(self._conversation.close())

    def __enter__(self) -> SyncConversation:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
