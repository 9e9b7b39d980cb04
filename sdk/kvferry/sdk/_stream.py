"""One turn's stream: chunks as they arrive, the summary at the end, retries only before the first event."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

import grpc
from kvferry.sdk._errors import ErrorCode, RpcError, error_from_rpc, make_error
from kvferry.sdk._models import Chunk, Reply, TurnSummary
from kvferry.sdk._proto import chunk_from_proto, summary_from_proto
from kvferry.sdk._retry import RetryPolicy

_log = logging.getLogger("kvferry.sdk")

GENERATE_METHOD = "kvferry.v1.RouterService/Generate"

# Opens one Generate call with the given timeout in seconds (a grpc.aio.UnaryStreamCall).
OpenCall = Callable[[float], Any]


class TurnStream:
    """The chunks of one turn, as an async iterator; ``summary`` once the iteration ended.

    The call starts on the first ``__anext__``. Its deadline covers the whole stream, retries
    included. UNAVAILABLE is retried (with the retry policy's backoff) only while no event has
    arrived; after that any failure is raised as the SDK's typed ``RpcError``. Leaving the iteration
    early: ``await stream.aclose()`` (or ``async with``) cancels the call.
    """

    def __init__(
        self,
        conversation_id: str,
        open_call: OpenCall,
        *,
        retry: RetryPolicy,
        timeout_seconds: float,
        on_finish: Callable[[Reply], None] | None = None,
    ) -> None:
        if timeout_seconds <= 0:
            raise ValueError(f"timeout must be positive, got {timeout_seconds}")
        self.conversation_id = conversation_id
        self.attempts = 0
        self._open_call = open_call
        self._retry = retry
        self._timeout_seconds = timeout_seconds
        self._on_finish = on_finish
        self._deadline: float | None = None
        self._call: Any = None
        self._events = 0
        self._text: list[str] = []
        self._token_ids: list[int] = []
        self._summary: TurnSummary | None = None
        self._finished = False
        self._closed = False
        self._error: RpcError | None = None

    # Iteration

    def __aiter__(self) -> TurnStream:
        return self

    async def __anext__(self) -> Chunk:
        if self._finished or self._closed:
            raise StopAsyncIteration
        if self._error is not None:
            raise self._error
        if self._deadline is None:
            self._deadline = time.monotonic() + self._timeout_seconds
        while True:
            if self._call is None:
                self.attempts += 1
                self._call = self._open_call(max(self._deadline - time.monotonic(), 0.001))
            try:
                response = await self._call.read()
            except grpc.aio.AioRpcError as rpc_error:
                self._call = None
                error = error_from_rpc(rpc_error, method=GENERATE_METHOD, chunks_received=self._events)
                delay = self._retry.retry_delay(
                    error,
                    failed_attempts=self.attempts,
                    seconds_left=self._deadline - time.monotonic(),
                    unit_random=random.random(),
                )
                if delay is None:
                    self._error = error
                    raise error from rpc_error
                _log.info(
                    "turn not started, retrying in %.2fs: %s",
                    delay,
                    error,
                    extra={"conversation_id": self.conversation_id, "attempt": self.attempts},
                )
                await asyncio.sleep(delay)
                continue
            if response is grpc.aio.EOF:
                self._call = None
                return self._end_of_stream()
            self._events += 1
            event = response.WhichOneof("event")
            if event == "delta":
                chunk = chunk_from_proto(response.delta)
                self._text.append(chunk.text)
                self._token_ids.extend(chunk.token_ids)
                return chunk
            if event == "summary":
                self._summary = summary_from_proto(response.summary)
            # Other events come from a newer router; this client skips them.

    def _end_of_stream(self) -> Chunk:
        if self._summary is None:
            self._error = make_error(
                ErrorCode.INTERNAL,
                "the router ended the turn without a TurnSummary (is it a kvferry router?)",
                method=GENERATE_METHOD,
                chunks_received=self._events,
            )
            raise self._error
        self._finished = True
        if self._on_finish is not None:
            self._on_finish(self.reply)
        raise StopAsyncIteration

    # Results

    @property
    def finished(self) -> bool:
        """True once the whole turn, summary included, arrived."""
        return self._finished

    @property
    def text(self) -> str:
        """The text received so far."""
        return "".join(self._text)

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The token ids received so far."""
        return tuple(self._token_ids)

    @property
    def summary(self) -> TurnSummary:
        """The turn's summary; available once the iteration ended."""
        if self._summary is None or not self._finished:
            raise RuntimeError("the turn has not finished: iterate the stream to its end first")
        return self._summary

    @property
    def reply(self) -> Reply:
        """The whole turn; available once the iteration ended."""
        return Reply(text=self.text, token_ids=self.token_ids, summary=self.summary)

    async def collect(self) -> Reply:
        """Reads the rest of the turn and returns all of it."""
        async for _ in self:
            pass
        return self.reply

    # Early exit

    @property
    def active(self) -> bool:
        """True while the turn may still produce chunks."""
        return not (self._finished or self._closed or self._error is not None)

    def cancel(self) -> None:
        """Stops the turn (cancelling the call if it is running); the history is left unchanged."""
        self._closed = True
        call, self._call = self._call, None
        if call is not None:
            call.cancel()

    async def aclose(self) -> None:
        """Same as ``cancel``, for ``async with`` and async-generator-style callers."""
        self.cancel()

    async def __aenter__(self) -> TurnStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()
