"""A FAST STAND-IN for one vLLM engine with kvferry's connector and sidecar (benchmarks and tests only;
not a model, not vLLM).

It speaks the part of vLLM's HTTP API the router uses (byte-level tokenizer, prefill/decode with
``kv_transfer_params``), answers at once (or at a set pace), registers itself in the registry and publishes
retentions as a kvferry decode engine would. ``kvferry bench router`` measures the router against it;
tests/router and tests/faults run the router against it (beside the real-engine tests of the same paths).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import uvicorn
from kvferry.pd import vllm_params
from kvferry.pd.digest import block_digests
from kvferry.pd.kvferry_params import ConversationMark
from kvferry.pd.vllm_params import KvHandoff, RemoteBlocks
from kvferry.v1 import registry_service_pb2 as registry_pb2
from kvferry.v1 import registry_service_pb2_grpc as registry_grpc
from kvferry.v1 import resources_pb2
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

log = logging.getLogger(__name__)


# Byte-level "tokenizer": token = byte + offset, so text and ids convert both ways without a vocab.
_TOKEN_OFFSET = 10
_CHAT_TEMPLATE_ROLE = "<|{role}|>\n"
_CHAT_TEMPLATE_END = "<|end|>\n"
_CHAT_GENERATION_PROMPT = "<|assistant|>\n"


def standin_tokenize(text: str) -> list[int]:
    return [b + _TOKEN_OFFSET for b in text.encode()]


def standin_detokenize(token_ids: Sequence[int]) -> str:
    return bytes((t - _TOKEN_OFFSET) % 256 for t in token_ids).decode(errors="replace")


def standin_render_chat(
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """The stand-in's chat template: tools first, then each message (its tool calls as
    ``<tool_call>{"name", "arguments"}</tool_call>``)."""
    text = ""
    if tools:
        text += _CHAT_TEMPLATE_ROLE.format(role="tools") + json.dumps(tools, sort_keys=True) + "\n"
        text += _CHAT_TEMPLATE_END
    for m in messages:
        content = m.get("content") or ""
        if not isinstance(content, str):
            content = "".join(part.get("text", "") for part in content)
        calls = "".join(
            "<tool_call>"
            + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
            + "</tool_call>"
            for c in m.get("tool_calls") or ()
        )
        text += _CHAT_TEMPLATE_ROLE.format(role=m["role"]) + content + calls + "\n" + _CHAT_TEMPLATE_END
    return text + (_CHAT_GENERATION_PROMPT if add_generation_prompt else "")


def standin_tool_call(body: Mapping[str, Any], output: Sequence[int]) -> dict[str, str] | None:
    """The call the stand-in makes: when ``tool_choice`` is "required" or names a function (guided decoding
    on a real engine), that function or the first tool; as guided decoding follows the function's schema,
    each required parameter gets the generated text, or an enum's first value (a function requiring
    none gets ``text``)."""
    choice = body.get("tool_choice")
    tools = body.get("tools") or []
    if isinstance(choice, dict):
        name = choice["function"]["name"]
    elif choice == "required" and tools:
        name = tools[0]["function"]["name"]
    else:
        return None
    function: Mapping[str, Any] = next(
        (t["function"] for t in tools if t.get("function", {}).get("name") == name), {}
    )
    parameters: Mapping[str, Any] = function.get("parameters") or {}
    properties: Mapping[str, Any] = parameters.get("properties") or {}
    text = standin_detokenize(output)
    # An enum parameter gets its first value (guided decoding can write nothing else).
    required = parameters.get("required") or ["text"]
    arguments = {key: (properties.get(key, {}).get("enum") or [text])[0] for key in required}
    return {"name": name, "arguments": json.dumps(arguments)}


def standin_generate(prompt_token_ids: Sequence[int], count: int) -> list[int]:
    """Deterministic output (lowercase letters and spaces), like greedy decoding: each token a function of
    everything before it (its length and last 256 tokens), so a continuation of the prompt and the first
    tokens equals the rest (what a decode after the prefill's token computes)."""
    context = list(prompt_token_ids)
    out: list[int] = []
    for _ in range(count):
        digest = hashlib.sha256(len(context).to_bytes(8, "little") + bytes(t % 256 for t in context[-256:]))
        b = digest.digest()[0]
        token = (97 + b % 27 if b % 27 < 26 else 32) + _TOKEN_OFFSET
        out.append(token)
        context.append(token)
    return out


@dataclass
class StandInCounters:
    prefill_requests: int = 0
    decode_requests: int = 0
    pulled_tokens: int = 0
    computed_tokens: int = 0
    aborted_requests: int = 0
    published_retentions: int = 0
    # The kv_transfer_params of every prefill (tests inspect what the router sent).
    prefill_params: list[dict[str, Any]] = field(default_factory=list)
    decode_params: list[dict[str, Any]] = field(default_factory=list)
    decode_headers: list[dict[str, str]] = field(default_factory=list)
    # Every /tokenize and chat body as received.
    tokenize_bodies: list[dict[str, Any]] = field(default_factory=list)
    chat_bodies: list[dict[str, Any]] = field(default_factory=list)


class StandInEngine:
    """A FAST STAND-IN for one vLLM engine with the kvferry connector and sidecar (tests/benchmarks).

    ``fail_prefills`` / ``fail_decodes`` make the next N requests of that kind fail with HTTP 500
    before any token; ``fail_decode_after_tokens`` cuts decode streams after that many tokens.
    ``crash()`` stops serving without deregistering (a killed engine: its lease runs out).
    """

    def __init__(
        self,
        engine_id: str,
        role: int,
        *,
        model: str = "standin-model",
        registry_address: str | None = None,
        block_size: int = 16,
        max_model_len: int = 8192,
        kv_compatibility_hash: str = "standin-kv-v1",
        engine_ttl_seconds: int = 5,
        retention_ttl_seconds: int = 120,
        decode_token_delay_seconds: float = 0.0,
        prefill_token_delay_seconds: float = 0.0,
        kv_recompute_threshold: int = 64,
        release_grace_seconds: float = 30.0,
    ) -> None:
        self.engine_id = engine_id
        # Published in its registry record, as a kvferry engine's sidecar does.
        self.release_grace_seconds = release_grace_seconds
        self.role = role
        self.model = model
        self.registry_address = registry_address
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.kv_compatibility_hash = kv_compatibility_hash
        self.engine_ttl_seconds = engine_ttl_seconds
        self.retention_ttl_seconds = retention_ttl_seconds
        self.decode_token_delay_seconds = decode_token_delay_seconds
        self.prefill_token_delay_seconds = prefill_token_delay_seconds
        self.kv_recompute_threshold = kv_recompute_threshold
        self.counters = StandInCounters()
        self.fail_prefills = 0
        self.fail_decodes = 0
        self.fail_decode_after_tokens: int | None = None
        self.port = 0
        self._server: _QuietUvicorn | None = None
        self._serve_task: asyncio.Task[None] | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._channel: grpc.aio.Channel | None = None
        self._registry: Any = None
        self._next_block = 0
        self._background: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def engine_proto(self) -> resources_pb2.Engine:
        return resources_pb2.Engine(
            engine_id=self.engine_id,
            role=self.role,  # type: ignore[arg-type]
            http_endpoint=self.url,
            nixl_host="127.0.0.1",
            nixl_port=1,
            model=self.model,
            kv_compatibility_hash=self.kv_compatibility_hash,
            block_size=self.block_size,
            kv_capacity_blocks=1_000_000,
            max_model_len=self.max_model_len,
            release_grace_seconds=self.release_grace_seconds,
        )

    async def start(self) -> None:
        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        sock.listen(1024)
        sock.setblocking(False)
        self.port = int(sock.getsockname()[1])
        app = Starlette(
            routes=[
                Route("/health", self._health, methods=["GET"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/tokenize", self._tokenize, methods=["POST"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/chat/completions", self._chat_completions, methods=["POST"]),
            ]
        )
        self._server = _QuietUvicorn(
            uvicorn.Config(
                app, lifespan="off", log_config=None, access_log=False, server_header=False, date_header=False
            )
        )
        self._serve_task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._serve_task.done():
                self._serve_task.result()
            await asyncio.sleep(0.005)
        if self.registry_address:
            self._channel = grpc.aio.insecure_channel(self.registry_address)
            self._registry = registry_grpc.RegistryServiceStub(self._channel)
            await self.register()
            self._heartbeat_task = asyncio.create_task(self._heartbeat())

    async def register(self) -> None:
        await self._registry.RegisterEngine(
            registry_pb2.RegisterEngineRequest(
                engine=self.engine_proto(), ttl_seconds=self.engine_ttl_seconds
            ),
            timeout=5,
        )

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.engine_ttl_seconds / 3)
            try:
                await self._registry.HeartbeatEngine(
                    registry_pb2.HeartbeatEngineRequest(engine_id=self.engine_id), timeout=2
                )
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.NOT_FOUND:
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        await self.register()

    async def deregister(self) -> None:
        if self._registry is not None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self._registry.DeregisterEngine(
                    registry_pb2.DeregisterEngineRequest(engine_id=self.engine_id), timeout=5
                )

    async def crash(self) -> None:
        """Stops answering at once, without deregistering (as if the process were killed)."""
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        if self._server is not None:
            self._server.should_exit = True
            self._server.force_exit = True
            for server in getattr(self._server, "servers", []):
                server.close()
        if self._serve_task is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self._serve_task, 5)

    async def stop(self, *, deregister: bool = True) -> None:
        if deregister:
            await self.deregister()
        await self.crash()
        for task in list(self._background):
            task.cancel()
        if self._channel is not None:
            await self._channel.close()

    # -- HTTP ---------------------------------------------------------------------------------

    async def _health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"data": [{"id": self.model, "max_model_len": self.max_model_len}]})

    async def _tokenize(self, request: Request) -> Response:
        body = await request.json()
        self.counters.tokenize_bodies.append(body)
        if "messages" in body:
            for message in body["messages"]:
                if message.get("role") not in ("system", "user", "assistant", "tool", "developer"):
                    return JSONResponse({"error": {"message": "bad role", "code": 400}}, status_code=400)
            text = standin_render_chat(
                body["messages"], body.get("add_generation_prompt", True), body.get("tools")
            )
        else:
            text = body.get("prompt", "")
        tokens = standin_tokenize(text)
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": self.max_model_len})

    async def _completions(self, request: Request) -> Response:
        body = await request.json()
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            return JSONResponse(
                {"error": {"message": "the stand-in takes token-id prompts", "code": 400}}, 400
            )
        if len(prompt) >= self.max_model_len:
            return JSONResponse({"error": {"message": "prompt too long", "code": 400}}, 400)
        params = body.get("kv_transfer_params") or {}
        request_id = request.headers.get("x-request-id") or f"standin-{time.monotonic_ns()}"
        if vllm_params.wants_remote_decode(params):
            return await self._prefill(prompt, params, request_id)
        self.counters.decode_headers.append(dict(request.headers))
        return await self._decode(request, prompt, params, body, request_id)

    async def _chat_completions(self, request: Request) -> Response:
        """vLLM's chat endpoint in P/D mode: the prompt from ``kv_transfer_params["prompt_token_ids"]``
        (else rendered), answers in the chat form, tool calls when ``tool_choice`` asks for one."""
        body = await request.json()
        self.counters.chat_bodies.append(body)
        params = dict(body.get("kv_transfer_params") or {})
        prompt = params.pop(vllm_params.PROMPT_TOKEN_IDS, None) or standin_tokenize(
            standin_render_chat(body["messages"], body.get("add_generation_prompt", True), body.get("tools"))
        )
        if len(prompt) >= self.max_model_len:
            return JSONResponse({"error": {"message": "prompt too long", "code": 400}}, 400)
        request_id = request.headers.get("x-request-id") or f"standin-{time.monotonic_ns()}"
        if vllm_params.wants_remote_decode(params):
            return await self._prefill(prompt, params, request_id, chat=True)
        self.counters.decode_headers.append(dict(request.headers))
        return await self._decode(request, prompt, params, body, request_id, chat=True)

    async def _prefill(
        self, prompt: list[int], params: dict[str, Any], request_id: str, *, chat: bool = False
    ) -> Response:
        self.counters.prefill_requests += 1
        self.counters.prefill_params.append(params)
        if self.fail_prefills > 0:
            self.fail_prefills -= 1
            return JSONResponse({"error": {"message": "injected prefill failure", "code": 500}}, 500)
        pulled = 0
        if vllm_params.names_remote_blocks(params):
            pulled = min(vllm_params.remote_num_tokens(params), len(prompt) - 1)
            if pulled < self.kv_recompute_threshold:
                pulled = 0
        computed = len(prompt) - pulled
        self.counters.pulled_tokens += pulled
        self.counters.computed_tokens += computed
        if self.prefill_token_delay_seconds:
            await asyncio.sleep(self.prefill_token_delay_seconds * computed)
        num_blocks = -(-len(prompt) // self.block_size)
        blocks = list(range(self._next_block, self._next_block + num_blocks))
        self._next_block += num_blocks
        first = standin_generate(prompt, 1)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": standin_detokenize(first)}
        else:
            choice.update(text=standin_detokenize(first), token_ids=first)
        return JSONResponse(
            {
                "id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}",
                "object": "chat.completion" if chat else "text_completion",
                "model": self.model,
                "choices": [choice],
                "usage": {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": 1,
                    "total_tokens": len(prompt) + 1,
                    "prompt_tokens_details": {"cached_tokens": pulled},
                },
                "kv_transfer_params": KvHandoff(
                    do_remote_prefill=True,
                    do_remote_decode=False,
                    blocks=RemoteBlocks(
                        engine_id=self.engine_id,
                        request_id=request_id,
                        block_ids=(tuple(blocks),),
                        host="127.0.0.1",
                        port=1,
                        num_tokens=len(prompt),
                    ),
                ).to_params(),
            }
        )

    async def _decode(
        self,
        request: Request,
        prompt: list[int],
        params: dict[str, Any],
        body: dict[str, Any],
        request_id: str,
        *,
        chat: bool = False,
    ) -> Response:
        self.counters.decode_requests += 1
        self.counters.decode_params.append(params)
        if self.fail_decodes > 0:
            self.fail_decodes -= 1
            return JSONResponse({"error": {"message": "injected decode failure", "code": 500}}, 500)
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        output = standin_generate(prompt, max_tokens)
        mark = ConversationMark.from_params(params)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(output)}
        call = standin_tool_call(body, output) if chat else None
        if not body.get("stream"):
            if self.decode_token_delay_seconds:
                for _ in output:
                    await asyncio.sleep(self.decode_token_delay_seconds)
                    if await request.is_disconnected():
                        self.counters.aborted_requests += 1
                        return Response(status_code=499)
            self._retain(mark, prompt, output, request_id)
            if not chat:
                choice = {
                    "index": 0,
                    "text": standin_detokenize(output),
                    "token_ids": output,
                    "finish_reason": "length",
                }
                return JSONResponse({"choices": [choice], "usage": usage})
            message: dict[str, Any] = {"role": "assistant", "content": standin_detokenize(output)}
            if call is not None:
                message.update(content=None, tool_calls=[_tool_call_body(request_id, call)])
            return JSONResponse(
                {
                    "id": f"chatcmpl-{request_id}",
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": self.model,
                    "choices": [{"index": 0, "message": message, "finish_reason": _finish(body, call)}],
                    "usage": usage,
                    "kv_transfer_params": {"do_remote_decode": True},
                }
            )
        stream = (
            self._chat_stream(prompt, output, mark, request_id, body, call)
            if chat
            else self._stream(prompt, output, mark, request_id)
        )
        return StreamingResponse(stream, media_type="text/event-stream")

    async def _chat_stream(
        self,
        prompt: list[int],
        output: list[int],
        mark: ConversationMark | None,
        request_id: str,
        body: dict[str, Any],
        call: dict[str, str] | None,
    ) -> AsyncIterator[bytes]:
        """vLLM's chat stream: a role chunk, content (or tool-call) deltas, the finish, the usage."""
        head = {"id": f"chatcmpl-{request_id}", "object": "chat.completion.chunk", "created": 1,
                "model": self.model}  # fmt: skip

        def event(delta: dict[str, Any], finish: str | None, tokens: list[int]) -> bytes:
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            if body.get("return_token_ids"):
                choice["token_ids"] = tokens
            return _sse_bytes({**head, "choices": [choice]})

        finished = False
        try:
            yield event({"role": "assistant", "content": ""}, None, [])
            for index, token in enumerate(output):
                if self.fail_decode_after_tokens is not None and index >= self.fail_decode_after_tokens:
                    raise ConnectionAbortedError("injected failure mid-stream")
                if self.decode_token_delay_seconds:
                    await asyncio.sleep(self.decode_token_delay_seconds)
                last = index == len(output) - 1
                if call is None:
                    yield event({"content": standin_detokenize([token])}, "length" if last else None, [token])
                    continue
                if index == 0:
                    first = {**_tool_call_body(request_id, call), "index": 0}
                    first["function"] = {"name": call["name"], "arguments": ""}
                    yield event({"tool_calls": [first]}, None, [token])
                if last:
                    arguments = {"index": 0, "function": {"arguments": call["arguments"]}}
                    yield event({"tool_calls": [arguments]}, _finish(body, call), [token])
            finished = True
            self._retain(mark, prompt, output, request_id)
            usage = {"prompt_tokens": len(prompt), "completion_tokens": len(output)}
            yield _sse_bytes({**head, "choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"
        finally:
            if not finished:
                self.counters.aborted_requests += 1

    async def _stream(
        self, prompt: list[int], output: list[int], mark: ConversationMark | None, request_id: str
    ) -> AsyncIterator[bytes]:
        finished = False
        try:
            for index, token in enumerate(output):
                if self.fail_decode_after_tokens is not None and index >= self.fail_decode_after_tokens:
                    raise ConnectionAbortedError("injected failure mid-stream")
                if self.decode_token_delay_seconds:
                    await asyncio.sleep(self.decode_token_delay_seconds)
                last = index == len(output) - 1
                yield _sse_bytes(
                    {
                        "choices": [
                            {
                                "index": 0,
                                "text": standin_detokenize([token]),
                                "token_ids": [token],
                                "finish_reason": "length" if last else None,
                            }
                        ]
                    }
                )
            finished = True
            self._retain(mark, prompt, output, request_id)
            yield _sse_bytes(
                {"choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(output)}}
            )
            yield b"data: [DONE]\n\n"
        finally:
            if not finished:
                self.counters.aborted_requests += 1

    def _retain(
        self, mark: ConversationMark | None, prompt: list[int], output: list[int], request_id: str
    ) -> None:
        """What the kvferry connector + sidecar do when a marked decode finishes: publish the retention."""
        if mark is None or self._registry is None:
            return
        tokens = prompt + output
        num_tokens = len(tokens) - 1  # the last sampled token has no KV yet
        num_blocks = -(-num_tokens // self.block_size)
        retention = resources_pb2.Retention(
            tenant=mark.tenant,
            conversation_id=mark.conversation_id,
            engine_id=self.engine_id,
            engine_request_id=request_id,
            block_ids=list(range(self._next_block, self._next_block + num_blocks)),
            num_tokens=num_tokens,
            block_digests=block_digests(
                tokens[:num_tokens], self.block_size, salt=self.kv_compatibility_hash
            ),
            turn=mark.turn,
            ttl_seconds=self.retention_ttl_seconds,
        )
        self._next_block += num_blocks
        task = asyncio.ensure_future(self._publish(retention))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _publish(self, retention: resources_pb2.Retention) -> None:
        try:
            await self._registry.PublishRetention(
                registry_pb2.PublishRetentionRequest(retention=retention), timeout=5
            )
            self.counters.published_retentions += 1
        except grpc.aio.AioRpcError as error:
            log.warning("stand-in publish failed", extra={"error": error.details()})


def _tool_call_body(request_id: str, call: Mapping[str, str]) -> dict[str, Any]:
    return {"id": f"call-{request_id}", "type": "function", "function": dict(call)}


def _finish(body: Mapping[str, Any], call: Mapping[str, str] | None) -> str:
    """vLLM's finish reasons: "tool_calls" for required tool calls, "stop" for a named one."""
    if call is None:
        return "length"
    return "tool_calls" if body.get("tool_choice") == "required" else "stop"


def _sse_bytes(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class _QuietUvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield
