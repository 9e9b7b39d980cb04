"""The capacity workload of ``kvferry bench multiturn --workload capacity``: its sizing, the engine log
lines it reads and its statistics. Pure, no engine needed (the driver is
:mod:`kvferry.bench.multiturn_capacity_driver`).

Agents, each a multi-turn conversation with a tool gap between its turns (its retention renewed with
the SDK's keep-alive meanwhile, as the agent workload's reuse mode does), run against one prefill and
one decode engine whose KV cache's retention budget (``retained_kv_fraction``) holds only a few of them.
Two arms, on fresh stacks that differ only by the decode engine's host tier:

- ``hbm``: no host tier; a retention past the budget is evicted (least recently used first);
- ``host``: the same budget, plus ``host_pool_blocks`` of host memory and ``demote_after_seconds``
  shorter than the gap: idle retentions, and those past the budget, move to the pool, and the next turn
  pulls them from there.

Each arm runs every *level* (a number of agents at once). A turn after an agent's first is a hit when
it pulled the retained prefix (the router's ``pulled_tokens``, as the other workloads count it). An
arm's capacity is the most agents of a level it ran at a hit rate of at least 99 %.

From the decode engine's log: demotions (``moved to the host tier``, ``copied to the host pool``),
evictions as they are ordered (over the KV cache's budget; the pool full), frees (``freed retained
blocks``, ``reason`` and ``tier``); from the prefill engine's log the pulls that read the pool
(``kv pull fence`` naming a ``.host`` request). The copies and relocations give the demotion windows;
the inter-token latency of decodes is split by whether an inter-token interval overlaps one.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from kvferry.bench.multiturn_stats import percentile
from kvferry.bench.multiturn_workload import WorkloadSpec, plan_conversations
from kvferry.connector.fence import PULL_FENCE_LOG
from kvferry.connector.host_tier import HOST_REQUEST_SUFFIX
from kvferry.connector.logs import (
    COPIED_LOG,
    EVICTED_LOG,
    FREED_LOG,
    MOVED_LOG,
    POOL_FULL_LOG,
    READY_LOG,
    RETAINED_LOG,
)

SCHEMA = "kvferry.bench.multiturn-capacity/v1"

HBM = "hbm"  # the KV cache's retention budget alone
HOST = "host"  # the same budget and the host tier
ARMS = (HBM, HOST)

# Targets (issue 19).
TARGET_HIT_RATE = 0.99
TARGET_CAPACITY_RATIO = 10.0
TARGET_ITL_INCREASE = 0.10


# An inter-token interval seen by the client ends a relay later than the engine step that made the token:
# a demotion this much before the interval's start still counts as inside it.
RELAY_SLACK_S = 0.005


@dataclass(frozen=True)
class CapacitySizing:
    """The decode engine's budgets for one run (both arms)."""

    # Blocks of the largest retention a conversation makes (its last turn and reply), and of the smallest
    # (its first).
    conversation_blocks: int
    first_turn_blocks: int
    # The KV cache's blocks as expected from VLLM_CPU_KVCACHE_SPACE (the engine logs its own count).
    kv_blocks: int
    # Conversations the KV cache's retention budget holds at their largest.
    budget_conversations: int
    budget_blocks: int
    retained_kv_fraction: float
    host_pool_blocks: int
    demote_after_seconds: float


def conversation_blocks(spec: WorkloadSpec, block_size: int) -> tuple[int, int]:
    """Blocks of the smallest and the largest retention the conversations of ``spec`` make: the shortest
    first prompt and its reply, the longest last prompt and its reply."""
    plans = plan_conversations(spec)
    shortest = min(plan.turns[0].prompt_tokens for plan in plans)
    longest = max(plan.turns[-1].prompt_tokens for plan in plans)
    return (
        math.ceil((shortest + spec.reply_tokens) / block_size),
        math.ceil((longest + spec.reply_tokens) / block_size),
    )


def size_decode(
    spec: WorkloadSpec,
    *,
    block_size: int,
    kv_bytes_per_token: int,
    kv_cache_gib: int,
    budget_conversations: int,
    most_agents: int,
    demote_after_seconds: float,
    host_pool_blocks: int | None = None,
) -> CapacitySizing:
    """The retention budget holds ``budget_conversations`` at their largest and an eighth of one more (at
    least 2 blocks); the pool (unless given) four times ``most_agents`` at their largest: a pool
    retention that the next turn superseded keeps its slots a grace (``release_grace_seconds``) after
    that turn's publish, while that turn's own retention moves in beside it.

    One conversation more than the budget's fits nowhere in it only when the conversations grow little:
    :func:`one_more_fits` says whether it would at their first turn."""
    if budget_conversations < 1:
        raise ValueError("the KV budget must hold at least one conversation")
    if most_agents < 1:
        raise ValueError("at least one agent")
    first, per = conversation_blocks(spec, block_size)
    kv_blocks = kv_cache_gib * 2**30 // (block_size * kv_bytes_per_token)
    budget = budget_conversations * per + max(2, per // 8)
    if budget > kv_blocks:
        raise ValueError(f"a budget of {budget} blocks does not fit a KV cache of {kv_blocks}")
    # Half a block over the target: int(kv_blocks * fraction) lands on it despite rounding.
    fraction = (budget + 0.5) / kv_blocks
    pool = host_pool_blocks if host_pool_blocks is not None else 4 * most_agents * per
    return CapacitySizing(
        conversation_blocks=per,
        first_turn_blocks=first,
        kv_blocks=kv_blocks,
        budget_conversations=budget_conversations,
        budget_blocks=budget,
        retained_kv_fraction=fraction,
        host_pool_blocks=pool,
        demote_after_seconds=demote_after_seconds,
    )


def one_more_fits(sizing: CapacitySizing) -> bool:
    """Whether one conversation more than the budget's fits it at their first turn (small conversations):
    then the level just past the budget is not all misses."""
    return (sizing.budget_conversations + 1) * sizing.first_turn_blocks <= sizing.budget_blocks


def default_levels(agents: int, budget_conversations: int) -> tuple[int, ...]:
    """What fits the budget, one more (past it), and the most agents."""
    return tuple(sorted({budget_conversations, budget_conversations + 1, agents}))


def parse_levels(value: str) -> tuple[int, ...]:
    """``"2,3,20"`` -> (2, 3, 20), ascending, each at least 1."""
    try:
        levels = sorted({int(part) for part in value.split(",") if part.strip()})
    except ValueError:
        raise ValueError(f"expected comma-separated agent counts, got {value!r}") from None
    if not levels or levels[0] < 1:
        raise ValueError(f"expected agent counts of at least 1, got {value!r}")
    return tuple(levels)


def parse_arms(value: str) -> tuple[str, ...]:
    arms = tuple(dict.fromkeys(a.strip() for a in value.split(",") if a.strip()))
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise ValueError(f"unknown arms {unknown or [value]}; choose among {', '.join(ARMS)}")
    return arms


# ---------------------------------------------------------------------------------------------
# What was measured
# ---------------------------------------------------------------------------------------------


@dataclass
class CapacityTurn:
    """One agent's turn."""

    arm: str
    agents: int  # the level
    agent: int
    turn: int
    conversation_id: str
    prompt_tokens: int
    ttft_ms: float
    pulled_tokens: int
    reuse: str
    # Unix time the turn was sent.
    sent_unix: float
    # Unix arrival time of each streamed chunk with tokens, and its tokens.
    chunks: list[tuple[float, int]] = field(default_factory=list)
    error: str = ""

    @property
    def hit(self) -> bool:
        return not self.error and self.pulled_tokens > 0


@dataclass
class PoolCopy:
    """One ``copied to the host pool`` line: the worker's copy of retentions into pool slots."""

    start: float  # Unix time
    end: float
    copy_ms: float
    conversations: tuple[str, ...]
    # A part of a longer move (the connector copies at most demote_blocks_per_step blocks a busy step).
    parts: int = 0


@dataclass
class EngineEvents:
    """What the engines' logs say of one arm's run."""

    # Demotions: conversation id and Unix time of each move to the pool (``moved to the host tier``).
    moved: list[tuple[str, float]] = field(default_factory=list)
    # Copies into the pool, in log order.
    copies: list[PoolCopy] = field(default_factory=list)

    def copy_windows(self) -> list[tuple[float, float]]:
        """Each copy into the pool (the worker, as a step starts)."""
        return sorted((c.start, c.end) for c in self.copies)

    def relocation_windows(self) -> list[tuple[float, float]]:
        """The milliseconds around each relocation's retain (the scheduler, once the copy is done; its
        report to the sidecar follows)."""
        return sorted((at - 0.001, at + 0.002) for _, at in self.moved)

    def demotion_windows(self) -> list[tuple[float, float]]:
        """When the decode engine worked on a demotion: its copies and its relocation."""
        return sorted([*self.copy_windows(), *self.relocation_windows()])

    # Frees: (conversation id, tier, reason); logged a grace after the registry confirmed the end, so
    # those of a run's last seconds are missing.
    freed: list[tuple[str, str, str]] = field(default_factory=list)
    # Evictions as ordered: from the KV cache (over its budget) and from the pool (full): conversation ids.
    evicted_kv: list[str] = field(default_factory=list)
    evicted_pool: list[str] = field(default_factory=list)
    # The prefill engine's checked pulls: (conversation id, from the pool, fenced).
    pulls: list[tuple[str, bool, bool]] = field(default_factory=list)
    # The decode connector's own figures at start (kv_blocks, retained_block_budget, host_pool_blocks).
    decode_ready: dict[str, Any] = field(default_factory=dict)


def log_lines(path: Path) -> Iterator[dict[str, Any]]:
    """A log's JSON lines (vLLM prefixes its engine process's lines, e.g. ``(EngineCore pid=1) ``)."""
    if not path.exists():
        return
    with open(path, encoding="utf-8", errors="replace") as lines:
        for line in lines:
            start = line.find('{"ts"')
            if start < 0:
                continue
            try:
                event = json.loads(line[start:])
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict):
                yield event


def unix_of(ts: str) -> float:
    """``2026-12-06T08:17:21.123Z`` (the connector's ``ts``, UTC) as Unix time."""
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def engine_events(
    decode_lines: Iterable[Mapping[str, Any]], prefill_lines: Iterable[Mapping[str, Any]]
) -> EngineEvents:
    """Reads the decode and prefill engines' connector lines."""
    events = EngineEvents()
    conversation_of: dict[str, str] = {}
    copied: list[tuple[float, float, list[str], int]] = []
    for line in decode_lines:
        msg = line.get("msg")
        conversation = str(line.get("conversation_id", ""))
        if msg == READY_LOG:
            events.decode_ready = {
                k: line.get(k) for k in ("kv_blocks", "retained_block_budget", "host_pool_blocks")
            }
        elif msg == RETAINED_LOG:
            conversation_of[str(line.get("request_id"))] = conversation
        elif msg == MOVED_LOG:
            conversation_of[str(line.get("request_id"))] = conversation
            events.moved.append((conversation, unix_of(str(line["ts"]))))
        elif msg == COPIED_LOG:
            end = unix_of(str(line["ts"])) + 0.001  # ts is cut to the millisecond
            copy_ms = float(line.get("copy_ms") or 0.0)
            request_ids = [str(r) for r in line.get("request_ids", ())]
            copied.append((end - 0.001 - copy_ms / 1000, copy_ms, request_ids, int(line.get("parts") or 0)))
        elif msg == FREED_LOG:
            events.freed.append((conversation, str(line.get("tier", "")), str(line.get("reason", ""))))
        elif msg == EVICTED_LOG:
            events.evicted_kv.append(conversation)
        elif msg == POOL_FULL_LOG:
            events.evicted_pool.append(conversation)
    for start, copy_ms, request_ids, parts in copied:
        events.copies.append(
            PoolCopy(
                start=start,
                end=start + copy_ms / 1000 + 0.001,
                copy_ms=copy_ms,
                conversations=tuple(conversation_of.get(r, "") for r in request_ids),
                parts=parts,
            )
        )
    for line in prefill_lines:
        if line.get("msg") != PULL_FENCE_LOG:
            continue
        remote = str(line.get("remote_request_id", ""))
        from_pool = remote.endswith(HOST_REQUEST_SUFFIX)
        conversation = conversation_of.get(remote) or conversation_of.get(
            remote.removesuffix(HOST_REQUEST_SUFFIX), ""
        )
        events.pulls.append((conversation, from_pool, bool(line.get("fenced"))))
    return events


def _overlaps(windows: Sequence[tuple[float, float]], lo: float, hi: float) -> bool:
    return any(w_start <= hi and w_end >= lo for w_start, w_end in windows if w_start <= hi)


class Streamed(Protocol):
    """A streamed decode as its client saw it: the Unix arrival time of each chunk with tokens, and its
    tokens (a capacity turn, or any other decode measured beside demotions)."""

    @property
    def chunks(self) -> Sequence[tuple[float, int]]: ...


def split_itl(
    turns: Iterable[Streamed],
    windows: Sequence[tuple[float, float]],
    slack_s: float = RELAY_SLACK_S,
    *,
    excluding: Sequence[tuple[float, float]] = (),
) -> tuple[list[float], list[float]]:
    """Inter-token latencies (ms per token between consecutive chunks) of every turn's decode, split into
    those whose interval overlaps a window and the others; intervals overlapping one of ``excluding``
    are in neither."""
    ordered, other = sorted(windows), sorted(excluding)
    during: list[float] = []
    outside: list[float] = []
    for turn in turns:
        for (start, _), (end, tokens) in zip(turn.chunks, turn.chunks[1:], strict=False):
            itl = (end - start) * 1000 / max(1, tokens)
            lo, hi = start - slack_s, end
            if other and _overlaps(other, lo, hi):
                continue
            (during if _overlaps(ordered, lo, hi) else outside).append(itl)
    return during, outside


def split_decode_itl(
    turns: Iterable[Streamed], windows: Sequence[tuple[float, float]], slack_s: float = RELAY_SLACK_S
) -> tuple[list[float], list[float]]:
    """Each decode's own inter-token latency (ms per token from its first streamed token to its last),
    split into decodes that ran while a demotion window opened and decodes that ran with none."""
    ordered = sorted(windows)
    during: list[float] = []
    outside: list[float] = []
    for turn in turns:
        if len(turn.chunks) < 2:
            continue
        first, last = turn.chunks[0][0], turn.chunks[-1][0]
        tokens = sum(n for _, n in turn.chunks[1:])
        itl = (last - first) * 1000 / max(1, tokens)
        (during if _overlaps(ordered, first - slack_s, last) else outside).append(itl)
    return during, outside


@dataclass
class LevelSummary:
    arm: str
    agents: int
    # Turns after each agent's first (failed ones included, as misses), and those that pulled.
    reuse_turns: int
    hits: int
    failed: int
    hit_rate: float | None
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    ttft_hit_p50_ms: float | None
    ttft_miss_p50_ms: float | None
    mean_prompt_tokens: float | None
    # From the engines' logs, this level's conversations only.
    demoted: int
    evicted_kv: int
    evicted_pool: int
    pulls_from_pool: int
    fenced_pulls: int
    # Copies into the pool of this level's retentions (a move in parts copies more than once) and their time.
    copies: int
    copy_p50_ms: float | None
    # Inter-token latency, ms per token: all decodes, and split by demotion windows.
    itl_p50_ms: float | None
    itl_during_demotion_p50_ms: float | None
    itl_outside_p50_ms: float | None
    itl_during_demotion_n: int
    itl_outside_n: int


def _p(values: Sequence[float], q: float) -> float | None:
    return round(percentile(values, q), 2) if values else None


def summarize_level(
    arm: str, agents: int, turns: Sequence[CapacityTurn], events: EngineEvents
) -> LevelSummary:
    """One level of one arm: ``turns`` are its turns (others are left out), ``events`` the arm's."""
    mine = [t for t in turns if t.arm == arm and t.agents == agents]
    conversations = {t.conversation_id for t in mine}
    later = [t for t in mine if t.turn > 0]
    measured = [t for t in later if not t.error]
    hits = [t for t in measured if t.hit]
    misses = [t for t in measured if not t.hit]
    during, outside = split_itl(mine, events.demotion_windows())
    copies = [c for c in events.copies if conversations.intersection(c.conversations)]
    return LevelSummary(
        arm=arm,
        agents=agents,
        reuse_turns=len(later),
        hits=len(hits),
        failed=len(later) - len(measured),
        hit_rate=round(len(hits) / len(later), 4) if later else None,
        ttft_p50_ms=_p([t.ttft_ms for t in measured], 50),
        ttft_p95_ms=_p([t.ttft_ms for t in measured], 95),
        ttft_hit_p50_ms=_p([t.ttft_ms for t in hits], 50),
        ttft_miss_p50_ms=_p([t.ttft_ms for t in misses], 50),
        mean_prompt_tokens=round(statistics.fmean(t.prompt_tokens for t in measured), 1)
        if measured
        else None,
        demoted=sum(1 for c, _ in events.moved if c in conversations),
        evicted_kv=sum(1 for c in events.evicted_kv if c in conversations),
        evicted_pool=sum(1 for c in events.evicted_pool if c in conversations),
        pulls_from_pool=sum(1 for c, pool, _ in events.pulls if c in conversations and pool),
        fenced_pulls=sum(1 for c, _, fenced in events.pulls if c in conversations and fenced),
        copies=len(copies),
        copy_p50_ms=_p([c.copy_ms for c in copies], 50),
        itl_p50_ms=_p(during + outside, 50),
        itl_during_demotion_p50_ms=_p(during, 50),
        itl_outside_p50_ms=_p(outside, 50),
        itl_during_demotion_n=len(during),
        itl_outside_n=len(outside),
    )


def capacity(levels: Sequence[LevelSummary], arm: str, min_hit_rate: float = TARGET_HIT_RATE) -> int | None:
    """The most agents of a level ``arm`` ran at a hit rate of at least ``min_hit_rate`` (None: none did)."""
    passing = [
        s.agents for s in levels if s.arm == arm and s.hit_rate is not None and s.hit_rate >= min_hit_rate
    ]
    return max(passing, default=None)


@dataclass
class CapacityTargets:
    capacity: dict[str, int | None]
    # The host arm's capacity over the hbm arm's (None: one is unknown).
    ratio: float | None
    ratio_met: bool | None
    # Whether the host arm kept its largest level (then its capacity is at least that: not searched past).
    host_at_largest_level: bool
    # The host arm's ITL during demotions over outside them, minus one (all its levels' decodes).
    itl_increase: float | None
    itl_met: bool | None
    itl_during_n: int
    itl_outside_n: int
    # Per decode: the ITL of whole decodes that a demotion ran beside over that of decodes with none.
    decode_itl_increase: float | None
    decode_itl_met: bool | None
    decodes_during_n: int
    decodes_outside_n: int
    # The interval measure over the intervals with a copy into the pool, and over those with a relocation's
    # retain and no copy.
    itl_increase_copy: float | None
    itl_during_copy_n: int
    itl_increase_relocation_only: float | None
    itl_during_relocation_only_n: int
    explanation: str


def check_capacity_targets(
    levels: Sequence[LevelSummary], turns: Sequence[CapacityTurn], events: Mapping[str, EngineEvents]
) -> CapacityTargets:
    caps = {arm: capacity(levels, arm) for arm in ARMS if any(s.arm == arm for s in levels)}
    hbm, host = caps.get(HBM), caps.get(HOST)
    ratio = round(host / hbm, 2) if hbm and host else None
    largest = max((s.agents for s in levels if s.arm == HOST), default=0)
    host_turns = [t for t in turns if t.arm == HOST]
    host_events = events.get(HOST, EngineEvents())
    during, outside = split_itl(host_turns, host_events.demotion_windows())
    increase = itl_increase(during, outside)
    decodes_during, decodes_outside = split_decode_itl(host_turns, host_events.demotion_windows())
    decode_increase = itl_increase(decodes_during, decodes_outside)
    copying, _ = split_itl(host_turns, host_events.copy_windows())
    relocating, _ = split_itl(
        host_turns, host_events.relocation_windows(), excluding=host_events.copy_windows()
    )
    parts = []
    if ratio is not None:
        parts.append(
            f"at >= {TARGET_HIT_RATE:.0%} hit rate the host tier kept {host} agents against {hbm} "
            f"with the KV cache's budget alone: {ratio:g}x (target >= {TARGET_CAPACITY_RATIO:g}x)"
            + (
                "; the host arm kept the largest level run, so its capacity is at least that"
                if host == largest
                else ""
            )
        )
    elif len(caps) < len(ARMS):
        parts.append(f"capacity per arm {caps}: one arm run, no ratio")
    else:
        parts.append(f"capacity per arm {caps}: no ratio (an arm kept no level at >= {TARGET_HIT_RATE:.0%})")
    if increase is not None:
        parts.append(
            f"host arm ITL p50 during demotions {percentile(during, 50):.1f} ms ({len(during)} intervals) "
            f"vs outside {percentile(outside, 50):.1f} ms ({len(outside)}): {increase:+.1%} "
            f"(target <= +{TARGET_ITL_INCREASE:.0%})"
        )
        if decode_increase is not None:
            parts.append(
                f"per decode: {percentile(decodes_during, 50):.1f} ms per token for the "
                f"{len(decodes_during)} decodes a demotion ran beside vs "
                f"{percentile(decodes_outside, 50):.1f} for the {len(decodes_outside)} with none: "
                f"{decode_increase:+.1%}"
            )
        for name, split in (("with a copy", copying), ("with a relocation and no copy", relocating)):
            if split:
                parts.append(
                    f"intervals {name}: {percentile(split, 50):.1f} ms, "
                    f"{itl_increase(split, outside):+.1%} ({len(split)})"
                )
    else:
        parts.append("no decode interval overlapped a demotion: ITL during demotions not measured")
    return CapacityTargets(
        capacity=caps,
        ratio=ratio,
        ratio_met=None if ratio is None else ratio >= TARGET_CAPACITY_RATIO,
        host_at_largest_level=host is not None and host == largest,
        itl_increase=increase,
        itl_met=None if increase is None else increase <= TARGET_ITL_INCREASE,
        itl_during_n=len(during),
        itl_outside_n=len(outside),
        decode_itl_increase=decode_increase,
        decode_itl_met=None if decode_increase is None else decode_increase <= TARGET_ITL_INCREASE,
        decodes_during_n=len(decodes_during),
        decodes_outside_n=len(decodes_outside),
        itl_increase_copy=itl_increase(copying, outside),
        itl_during_copy_n=len(copying),
        itl_increase_relocation_only=itl_increase(relocating, outside),
        itl_during_relocation_only_n=len(relocating),
        explanation="; ".join(parts),
    )


def itl_increase(during: Sequence[float], outside: Sequence[float]) -> float | None:
    """p50 of ``during`` over p50 of ``outside``, minus one (None: either is empty)."""
    if not during or not outside:
        return None
    return round(percentile(during, 50) / percentile(outside, 50) - 1, 4)


def build_capacity_report(
    *,
    created: str,
    config: Mapping[str, Any],
    model: Mapping[str, Any],
    workload: WorkloadSpec,
    sizing: CapacitySizing,
    arms: Sequence[str],
    levels_run: Sequence[int],
    turns: Sequence[CapacityTurn],
    events: Mapping[str, EngineEvents],
    notes: Sequence[str],
) -> dict[str, Any]:
    summaries = [
        summarize_level(arm, agents, turns, events.get(arm, EngineEvents()))
        for arm in arms
        for agents in levels_run
    ]
    targets = check_capacity_targets(summaries, turns, events)
    return {
        "schema": SCHEMA,
        "created": created,
        "config": dict(config),
        "model": dict(model),
        "workload": asdict(workload),
        "sizing": asdict(sizing),
        "arms": list(arms),
        "levels": [asdict(s) for s in summaries],
        "targets": asdict(targets),
        "decode_ready": {arm: e.decode_ready for arm, e in events.items()},
        "notes": list(notes),
        "turns": [asdict(t) for t in turns],
    }


# ---------------------------------------------------------------------------------------------
# Printing and combining
# ---------------------------------------------------------------------------------------------

_COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("arm", "arm", 5),
    ("agents", "agents", 6),
    ("reuse_turns", "turns", 5),
    ("hit_rate", "hit rate", 8),
    ("ttft_p50_ms", "TTFT p50", 8),
    ("ttft_p95_ms", "p95", 7),
    ("ttft_hit_p50_ms", "hit p50", 7),
    ("ttft_miss_p50_ms", "miss p50", 8),
    ("demoted", "demoted", 7),
    ("evicted_kv", "evict KV", 8),
    ("evicted_pool", "evict pool", 10),
    ("pulls_from_pool", "pool pulls", 10),
    ("copy_p50_ms", "copy ms", 7),
    ("itl_p50_ms", "ITL p50", 7),
    ("itl_during_demotion_p50_ms", "ITL demo", 8),
    ("itl_outside_p50_ms", "ITL other", 9),
)


def _cell(value: Any, key: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if key == "hit_rate":
        return f"{value:.1%}"
    if key.startswith("itl") or key == "copy_p50_ms":
        return f"{value:.1f}"
    if isinstance(value, float):
        return f"{value:.0f}"
    return str(value)


def level_table(levels: Sequence[Mapping[str, Any]]) -> str:
    """The per-level table as fixed-width text (ms; hit rate over turns after each agent's first)."""
    header = " ".join(f"{title:>{width}}" for _, title, width in _COLUMNS)
    rows = [header, "-" * len(header)]
    for level in levels:
        rows.append(" ".join(f"{_cell(level.get(key), key):>{width}}" for key, _, width in _COLUMNS))
    return "\n".join(rows)


def level_markdown(levels: Sequence[Mapping[str, Any]]) -> str:
    head = "| " + " | ".join(title for _, title, _ in _COLUMNS) + " |"
    rule = "|" + "|".join("---" if i < 1 else "---:" for i in range(len(_COLUMNS))) + "|"
    rows = [head, rule]
    for level in levels:
        rows.append("| " + " | ".join(_cell(level.get(key), key) for key, _, _ in _COLUMNS) + " |")
    return "\n".join(rows)


def combine_capacity_reports(reports: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The median over runs of every per-level figure and of the targets' values."""
    if not reports:
        raise ValueError("nothing to combine")
    for report in reports:
        if report.get("schema") != SCHEMA:
            raise ValueError(f"not a capacity report: schema {report.get('schema')!r}")
    keys = [(lv["arm"], lv["agents"]) for lv in reports[0]["levels"]]
    combined_levels = []
    for arm, agents in keys:
        runs = [lv for r in reports for lv in r["levels"] if lv["arm"] == arm and lv["agents"] == agents]
        level: dict[str, Any] = {"arm": arm, "agents": agents, "runs": len(runs)}
        for key, value in runs[0].items():
            if key in level or not isinstance(value, int | float) or isinstance(value, bool):
                continue
            present = [r[key] for r in runs if isinstance(r.get(key), int | float)]
            level[key] = statistics.median(present) if present else None
        combined_levels.append(level)
    targets: dict[str, Any] = {}
    for key in (
        "ratio",
        "itl_increase",
        "decode_itl_increase",
        "itl_increase_copy",
        "itl_increase_relocation_only",
    ):
        values = [r["targets"][key] for r in reports if r["targets"].get(key) is not None]
        targets[key] = {
            "median": statistics.median(values) if values else None,
            "runs": [r["targets"].get(key) for r in reports],
        }
    targets["capacity"] = {
        arm: [r["targets"]["capacity"].get(arm) for r in reports] for arm in reports[0]["targets"]["capacity"]
    }
    return {"schema": SCHEMA, "runs": len(reports), "levels": combined_levels, "targets": targets}


def combined_capacity_markdown(combined: Mapping[str, Any]) -> str:
    lines = [f"Median of {combined['runs']} runs (each figure: the median over runs).", ""]
    lines.append(level_markdown(combined["levels"]))
    targets = combined["targets"]
    lines.append("")
    lines.append(
        "capacity per run: " + ", ".join(f"{arm} {values}" for arm, values in targets["capacity"].items())
    )
    for key, title in (
        ("ratio", "capacity ratio host/hbm"),
        ("itl_increase", "ITL during demotions vs outside (per interval)"),
        ("decode_itl_increase", "ITL of decodes beside a demotion vs none (per decode)"),
        ("itl_increase_copy", "... intervals with a copy into the pool"),
        ("itl_increase_relocation_only", "... intervals with a relocation and no copy"),
    ):
        t = targets[key]

        def shown(value: float | None, key: str = key) -> str:
            if value is None:
                return "-"
            return f"{value:g}x" if key == "ratio" else f"{value:+.1%}"

        runs = ", ".join(shown(v) for v in t["runs"])
        lines.append(f"{title}: median {shown(t['median'])} (runs {runs})")
    return "\n".join(lines)


__all__ = [
    "ARMS",
    "HBM",
    "HOST",
    "SCHEMA",
    "CapacitySizing",
    "CapacityTargets",
    "CapacityTurn",
    "EngineEvents",
    "LevelSummary",
    "PoolCopy",
    "Streamed",
    "build_capacity_report",
    "capacity",
    "check_capacity_targets",
    "combine_capacity_reports",
    "combined_capacity_markdown",
    "conversation_blocks",
    "default_levels",
    "engine_events",
    "itl_increase",
    "level_markdown",
    "level_table",
    "log_lines",
    "one_more_fits",
    "parse_arms",
    "parse_levels",
    "size_decode",
    "split_decode_itl",
    "split_itl",
    "summarize_level",
    "unix_of",
]
