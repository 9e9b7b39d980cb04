"""Statistics and the JSON report of ``kvferry bench multiturn``: pure, no engine needed.

Turns are grouped into prompt-length buckets per mode; each bucket reports TTFT p50/p90, the prefill
split into compute and KV transfer, and tokens pulled versus recomputed. The summary compares the
modes at the longest bucket, checks the targets, and says where the time goes when one is missed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

SCHEMA = "kvferry.bench.multiturn/v1"

# Modes, in the order they alternate.
REUSE = "reuse"  # kvferry: the router with retention and reuse
RECOMPUTE = "recompute"  # the router, a fresh conversation each turn, nothing retained
VLLM = "vllm"  # vLLM's own: NixlConnector bidirectional, fixed TTL, the client keeps D's params
MODES = (REUSE, RECOMPUTE, VLLM)

# Gap-sweep arms.
FIXED_TTL = "fixed_ttl"
HEARTBEAT = "heartbeat"

# Targets (issue 6).
TARGET_RATIO = 0.3
TARGET_SPREAD = 2.0
TARGET_HIT_RATE = 0.99


@dataclass
class TurnRecord:
    """One measured turn."""

    mode: str
    conversation: int
    turn: int
    prompt_tokens: int
    # Client-side time to first token, ms.
    ttft_ms: float
    # The prefill engine's part (its HTTP call), ms.
    prefill_ms: float
    pulled_tokens: int
    recomputed_tokens: int
    # KV pulled from the decode engine by the prefill engine (its NIXL transfer time), ms / bytes.
    pull_ms: float | None = None
    pull_bytes: int | None = None
    # The decode engine's pull of the prompt's new KV from the prefill engine, ms.
    handoff_ms: float | None = None
    # The router's own TTFT (gRPC modes only), ms.
    router_ttft_ms: float | None = None
    # How the turn reused KV (router's decision, or "pull"/"none" for the vLLM mode).
    reuse: str = ""
    # Seconds since the run started.
    at_s: float = 0.0
    # False when other turns overlapped this one (engine-counter deltas are then shared).
    exclusive: bool = True

    @property
    def compute_ms(self) -> float | None:
        if self.pull_ms is None:
            return None
        return max(0.0, self.prefill_ms - self.pull_ms)


@dataclass
class GapRecord:
    arm: str
    gap_s: float
    conversation: int
    hit: bool
    pulled_tokens: int
    prompt_tokens: int
    reuse: str = ""


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), ``q`` in [0, 100]; NaN when empty."""
    if not values:
        return math.nan
    return float(np.percentile(values, q))


def bucket_of(prompt_tokens: int, width: int) -> int:
    """Lower edge of the prompt-length bucket holding ``prompt_tokens``.

    Buckets hold (low, low + width]: a conversation that ends exactly on a round target (16384)
    shares the top bucket with the turns just before it instead of sitting alone in the next one.
    """
    if width <= 0:
        raise ValueError("bucket width must be positive")
    return max(0, prompt_tokens - 1) // width * width


def bucket_label(low: int, width: int) -> str:
    return f"{_k(low)}-{_k(low + width)}"


def _k(tokens: int) -> str:
    if tokens == 0:
        return "0"
    return f"{tokens / 1024:g}k" if tokens % 512 == 0 else str(tokens)


def _median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return percentile(present, 50) if present else None


@dataclass
class ModeBucket:
    mode: str
    turns: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    prefill_p50_ms: float
    compute_p50_ms: float | None
    pull_p50_ms: float | None
    handoff_p50_ms: float | None
    router_ttft_p50_ms: float | None
    mean_prompt_tokens: float
    mean_pulled_tokens: float
    mean_recomputed_tokens: float
    # Turns after the first that pulled, and how many could have.
    pulls: int
    pull_candidates: int


@dataclass
class Bucket:
    low: int
    high: int
    label: str
    modes: dict[str, ModeBucket] = field(default_factory=dict)


def summarize_buckets(records: Sequence[TurnRecord], width: int) -> list[Bucket]:
    """Per prompt-length bucket and mode: TTFT p50/p90, the prefill split, tokens pulled/recomputed."""
    grouped: dict[int, dict[str, list[TurnRecord]]] = {}
    for record in records:
        grouped.setdefault(bucket_of(record.prompt_tokens, width), {}).setdefault(record.mode, []).append(
            record
        )
    buckets: list[Bucket] = []
    for low in sorted(grouped):
        bucket = Bucket(low=low, high=low + width, label=bucket_label(low, width))
        for mode in sorted(grouped[low], key=_mode_order):
            turns = grouped[low][mode]
            ttfts = [t.ttft_ms for t in turns]
            later = [t for t in turns if t.turn > 0]
            bucket.modes[mode] = ModeBucket(
                mode=mode,
                turns=len(turns),
                ttft_p50_ms=percentile(ttfts, 50),
                ttft_p90_ms=percentile(ttfts, 90),
                prefill_p50_ms=percentile([t.prefill_ms for t in turns], 50),
                compute_p50_ms=_median(t.compute_ms for t in turns),
                pull_p50_ms=_median(t.pull_ms for t in turns),
                handoff_p50_ms=_median(t.handoff_ms for t in turns),
                router_ttft_p50_ms=_median(t.router_ttft_ms for t in turns),
                mean_prompt_tokens=sum(t.prompt_tokens for t in turns) / len(turns),
                mean_pulled_tokens=sum(t.pulled_tokens for t in turns) / len(turns),
                mean_recomputed_tokens=sum(t.recomputed_tokens for t in turns) / len(turns),
                pulls=sum(1 for t in later if t.pulled_tokens > 0),
                pull_candidates=len(later),
            )
        buckets.append(bucket)
    return buckets


def _mode_order(mode: str) -> int:
    return MODES.index(mode) if mode in MODES else len(MODES)


def longest_common_bucket(buckets: Sequence[Bucket], modes: Sequence[str]) -> Bucket | None:
    """The longest bucket that holds turns of every mode in ``modes``."""
    for bucket in reversed(buckets):
        if all(m in bucket.modes for m in modes):
            return bucket
    return None


def shortest_bucket_with(buckets: Sequence[Bucket], mode: str) -> Bucket | None:
    for bucket in buckets:
        if mode in bucket.modes:
            return bucket
    return None


@dataclass
class TargetCheck:
    name: str
    target: str
    value: float | None
    met: bool | None
    # Where the time goes (always filled; most useful when the target is missed).
    explanation: str


@dataclass
class GapSummary:
    arm: str
    gap_s: float
    hits: int
    turns: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.turns if self.turns else math.nan


def summarize_gaps(records: Sequence[GapRecord]) -> list[GapSummary]:
    grouped: dict[tuple[str, float], list[GapRecord]] = {}
    for record in records:
        grouped.setdefault((record.arm, record.gap_s), []).append(record)
    return [
        GapSummary(arm=arm, gap_s=gap, hits=sum(r.hit for r in rs), turns=len(rs))
        for (arm, gap), rs in sorted(grouped.items(), key=lambda item: (item[0][0], item[0][1]))
    ]


def check_targets(
    buckets: Sequence[Bucket], gaps: Sequence[GapSummary], *, ttl_seconds: float | None
) -> list[TargetCheck]:
    checks: list[TargetCheck] = []
    longest = longest_common_bucket(buckets, (REUSE, RECOMPUTE))
    if longest is None:
        checks.append(
            TargetCheck(
                "ratio", f"<= {TARGET_RATIO}", None, None, "no bucket holds both reuse and recompute turns"
            )
        )
    else:
        on, off = longest.modes[REUSE], longest.modes[RECOMPUTE]
        ratio = on.ttft_p50_ms / off.ttft_p50_ms if off.ttft_p50_ms else math.nan
        checks.append(
            TargetCheck(
                "ratio",
                f"reuse/recompute TTFT p50 at the longest bucket <= {TARGET_RATIO}",
                ratio,
                ratio <= TARGET_RATIO,
                f"bucket {longest.label}: reuse {on.ttft_p50_ms:.0f} ms ({_split(on)}) vs recompute "
                f"{off.ttft_p50_ms:.0f} ms ({_split(off)})",
            )
        )
    shortest = shortest_bucket_with(buckets, REUSE)
    longest_on = next((b for b in reversed(buckets) if REUSE in b.modes), None)
    if shortest is None or longest_on is None:
        checks.append(TargetCheck("spread", f"<= {TARGET_SPREAD}x", None, None, "no reuse turns"))
    else:
        short, long_ = shortest.modes[REUSE], longest_on.modes[REUSE]
        spread = long_.ttft_p50_ms / short.ttft_p50_ms if short.ttft_p50_ms else math.nan
        checks.append(
            TargetCheck(
                "spread",
                f"reuse TTFT p50, longest bucket / shortest bucket <= {TARGET_SPREAD}",
                spread,
                spread <= TARGET_SPREAD,
                f"{shortest.label}: {short.ttft_p50_ms:.0f} ms ({_split(short)}); {longest_on.label}: "
                f"{long_.ttft_p50_ms:.0f} ms ({_split(long_)}). With reuse a turn still computes its new "
                "suffix, and each suffix token attends to the whole context: that part grows with length",
            )
        )
    checks.append(reuse_hit_rate(buckets))
    beats = [g for g in gaps if g.arm == HEARTBEAT]
    if not beats:
        checks.append(TargetCheck("hit_rate", f">= {TARGET_HIT_RATE:.0%}", None, None, "no gap sweep ran"))
    else:
        worst = min(beats, key=lambda g: g.hit_rate)
        fixed = {g.gap_s: g for g in gaps if g.arm == FIXED_TTL}
        lost = [
            f"{g.gap_s:g} s: {fixed[g.gap_s].hits}/{fixed[g.gap_s].turns}" for g in beats if g.gap_s in fixed
        ]
        checks.append(
            TargetCheck(
                "hit_rate",
                f"hit rate with heartbeats >= {TARGET_HIT_RATE:.0%} at every gap",
                worst.hit_rate,
                worst.hit_rate >= TARGET_HIT_RATE,
                f"worst heartbeated gap {worst.gap_s:g} s: {worst.hits}/{worst.turns}; fixed TTL"
                + (f" ({ttl_seconds:g} s)" if ttl_seconds else "")
                + " without heartbeats: "
                + ", ".join(lost),
            )
        )
    return checks


def reuse_hit_rate(buckets: Sequence[Bucket]) -> TargetCheck:
    """Reuse-mode turns after a conversation's first that pulled its KV, over all such turns."""
    reuse = [b.modes[REUSE] for b in buckets if REUSE in b.modes]
    pulls = sum(m.pulls for m in reuse)
    candidates = sum(m.pull_candidates for m in reuse)
    target = f"reuse-mode turns after the first that pulled the conversation's KV >= {TARGET_HIT_RATE:.0%}"
    if not candidates:
        return TargetCheck("reuse_hit_rate", target, None, None, "no reuse turn after a first one")
    rate = pulls / candidates
    return TargetCheck(
        "reuse_hit_rate",
        target,
        rate,
        rate >= TARGET_HIT_RATE,
        f"{pulls} of {candidates} turns pulled; the others recomputed their whole prompt",
    )


def _split(mode: ModeBucket) -> str:
    parts = [f"prefill {mode.prefill_p50_ms:.0f}"]
    if mode.compute_p50_ms is not None:
        parts.append(f"of which compute {mode.compute_p50_ms:.0f}")
    if mode.pull_p50_ms is not None:
        parts.append(f"KV pull {mode.pull_p50_ms:.0f}")
    rest = mode.ttft_p50_ms - mode.prefill_p50_ms
    parts.append(f"decode side {rest:.0f}")
    if mode.handoff_p50_ms is not None:
        parts.append(f"of which P->D KV {mode.handoff_p50_ms:.0f}")
    return ", ".join(parts) + f" ms; {mode.mean_recomputed_tokens:.0f} tokens computed"


# ---------------------------------------------------------------------------------------------
# The JSON report
# ---------------------------------------------------------------------------------------------

REQUIRED_KEYS: Mapping[str, type | tuple[type, ...]] = {
    "schema": str,
    "created": str,
    "config": dict,
    "model": dict,
    "workload": dict,
    "modes": list,
    "notes": list,
    "turns": list,
    "buckets": list,
    "summary": dict,
    "gap_sweep": dict,
    "targets": list,
    "plots": list,
}
TURN_KEYS = (
    "mode",
    "conversation",
    "turn",
    "prompt_tokens",
    "ttft_ms",
    "prefill_ms",
    "pulled_tokens",
    "recomputed_tokens",
)
BUCKET_MODE_KEYS = (
    "turns",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "prefill_p50_ms",
    "mean_pulled_tokens",
    "mean_recomputed_tokens",
)
MODEL_KEYS = ("name", "kv_bytes_per_token", "prefill_ms_per_token")


def build_report(
    *,
    created: str,
    config: Mapping[str, Any],
    model: Mapping[str, Any],
    workload: Mapping[str, Any],
    modes: Sequence[str],
    notes: Sequence[str],
    turns: Sequence[TurnRecord],
    bucket_width: int,
    gap_records: Sequence[GapRecord],
    gap_config: Mapping[str, Any],
    plots: Sequence[str] = (),
) -> dict[str, Any]:
    buckets = summarize_buckets(turns, bucket_width)
    gaps = summarize_gaps(gap_records)
    ttl = gap_config.get("ttl_seconds")
    targets = check_targets(buckets, gaps, ttl_seconds=float(ttl) if ttl else None)
    longest = longest_common_bucket(buckets, [m for m in modes if m in (REUSE, RECOMPUTE)] or modes)
    summary: dict[str, Any] = {"longest_bucket": longest.label if longest else None}
    if longest is not None:
        base = longest.modes.get(RECOMPUTE)
        for mode, stats in longest.modes.items():
            summary[f"{mode}_ttft_p50_ms"] = stats.ttft_p50_ms
            if base is not None and base.ttft_p50_ms and mode != RECOMPUTE:
                summary[f"{mode}_over_recompute"] = stats.ttft_p50_ms / base.ttft_p50_ms
    for check in targets:
        summary[check.name] = check.value
    return {
        "schema": SCHEMA,
        "created": created,
        "config": dict(config),
        "model": dict(model),
        "workload": dict(workload),
        "modes": list(modes),
        "notes": list(notes),
        "turns": [asdict(t) | {"compute_ms": t.compute_ms} for t in turns],
        "buckets": [
            {
                "low": b.low,
                "high": b.high,
                "label": b.label,
                "modes": {m: asdict(s) for m, s in b.modes.items()},
            }
            for b in buckets
        ],
        "summary": _finite(summary),
        "gap_sweep": {
            **dict(gap_config),
            "records": [asdict(r) for r in gap_records],
            "summary": [asdict(g) | {"hit_rate": _finite_value(g.hit_rate)} for g in gaps],
        },
        "targets": [asdict(t) | {"value": _finite_value(t.value)} for t in targets],
        "plots": list(plots),
    }


def _finite_value(value: float | None) -> float | None:
    return None if value is None or (isinstance(value, float) and not math.isfinite(value)) else value


def _finite(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _finite_value(v) if isinstance(v, float) else v for k, v in values.items()}


def validate_report(report: Mapping[str, Any]) -> list[str]:
    """What is wrong with a report (empty: it follows the schema)."""
    problems: list[str] = []
    for key, kind in REQUIRED_KEYS.items():
        if key not in report:
            problems.append(f"missing key {key!r}")
        elif not isinstance(report[key], kind):
            problems.append(f"{key!r} must be {kind}, got {type(report[key]).__name__}")
    if problems:
        return problems
    if report["schema"] != SCHEMA:
        problems.append(f"schema is {report['schema']!r}, expected {SCHEMA!r}")
    for key in MODEL_KEYS:
        if key not in report["model"]:
            problems.append(f"model lacks {key!r}")
    unknown_modes = set(report["modes"]) - set(MODES)
    if unknown_modes:
        problems.append(f"unknown modes {sorted(unknown_modes)}")
    for index, turn in enumerate(report["turns"]):
        missing = [k for k in TURN_KEYS if k not in turn]
        if missing:
            problems.append(f"turns[{index}] lacks {missing}")
        elif turn["mode"] not in report["modes"]:
            problems.append(f"turns[{index}] has mode {turn['mode']!r} not in modes")
    for index, bucket in enumerate(report["buckets"]):
        if not {"low", "high", "label", "modes"} <= set(bucket):
            problems.append(f"buckets[{index}] lacks low/high/label/modes")
            continue
        for mode, stats in bucket["modes"].items():
            missing = [k for k in BUCKET_MODE_KEYS if k not in stats]
            if missing:
                problems.append(f"buckets[{index}].modes[{mode!r}] lacks {missing}")
    for index, target in enumerate(report["targets"]):
        if not {"name", "target", "value", "met", "explanation"} <= set(target):
            problems.append(f"targets[{index}] lacks name/target/value/met/explanation")
    for key in ("records", "summary"):
        if key not in report["gap_sweep"]:
            problems.append(f"gap_sweep lacks {key!r}")
    return problems


# ---------------------------------------------------------------------------------------------
# Several runs: the median of each figure (``kvferry bench multiturn --combine a.json b.json ...``)
# ---------------------------------------------------------------------------------------------

COMBINED_FIELDS = ("ttft_p50_ms", "ttft_p90_ms", "prefill_p50_ms", "compute_p50_ms", "pull_p50_ms",
                   "handoff_p50_ms", "mean_pulled_tokens", "mean_recomputed_tokens")  # fmt: skip


def combine_reports(reports: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Median over runs of every bucket figure, target value and gap hit count."""
    if not reports:
        raise ValueError("no reports to combine")
    buckets: dict[str, dict[str, dict[str, list[float]]]] = {}
    order: list[str] = []
    for report in reports:
        for bucket in report["buckets"]:
            if bucket["label"] not in buckets:
                order.append(bucket["label"])
            per_mode = buckets.setdefault(bucket["label"], {})
            for mode, stats in bucket["modes"].items():
                fields = per_mode.setdefault(mode, {})
                for name in COMBINED_FIELDS:
                    if stats.get(name) is not None:
                        fields.setdefault(name, []).append(float(stats[name]))
                fields.setdefault("turns", []).append(float(stats["turns"]))
    targets: dict[str, list[float]] = {}
    for report in reports:
        for target in report["targets"]:
            if target["value"] is not None:
                targets.setdefault(target["name"], []).append(float(target["value"]))
    gaps: dict[tuple[str, float], list[tuple[int, int]]] = {}
    for report in reports:
        for row in report["gap_sweep"].get("summary", []):
            gaps.setdefault((row["arm"], row["gap_s"]), []).append((row["hits"], row["turns"]))
    return {
        "runs": len(reports),
        "buckets": [
            {
                "label": label,
                "modes": {
                    mode: {name: percentile(values, 50) for name, values in fields.items()}
                    for mode, fields in sorted(buckets[label].items(), key=lambda item: _mode_order(item[0]))
                },
            }
            for label in order
        ],
        "targets": {
            name: {"median": percentile(v, 50), "min": min(v), "max": max(v), "values": v}
            for name, v in targets.items()
        },
        "gaps": [
            {"arm": arm, "gap_s": gap, "hits": sum(h for h, _ in rows), "turns": sum(t for _, t in rows)}
            for (arm, gap), rows in sorted(gaps.items())
        ],
    }


def combined_markdown(combined: Mapping[str, Any]) -> str:
    """The combined figures as Markdown tables (docs/benchmark.md)."""
    lines = [
        f"Median of {combined['runs']} runs (each figure: the median over runs of that run's p50).",
        "",
        "| bucket | mode | TTFT p50 | TTFT p90 | prefill | compute | KV pull D->P | decode side | P->D KV "
        "| pulled | computed |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for bucket in combined["buckets"]:
        for mode, s in bucket["modes"].items():

            def f(name: str, s: Mapping[str, float] = s) -> str:
                value = s.get(name)
                return "-" if value is None or not math.isfinite(value) else f"{value:.0f}"

            decode_side = s["ttft_p50_ms"] - s["prefill_p50_ms"]
            lines.append(
                f"| {bucket['label']} | {mode} | {f('ttft_p50_ms')} | {f('ttft_p90_ms')} "
                f"| {f('prefill_p50_ms')} "
                f"| {f('compute_p50_ms')} | {f('pull_p50_ms')} | {decode_side:.0f} | {f('handoff_p50_ms')} "
                f"| {f('mean_pulled_tokens')} | {f('mean_recomputed_tokens')} |"
            )
    lines += ["", "| target | median | min | max |", "|---|---:|---:|---:|"]
    for name, t in combined["targets"].items():
        lines.append(f"| {name} | {t['median']:.3g} | {t['min']:.3g} | {t['max']:.3g} |")
    if not combined["gaps"]:
        return "\n".join(lines)
    lines += ["", "| gap (s) | fixed TTL hits | heartbeat hits |", "|---:|---:|---:|"]
    by_gap: dict[float, dict[str, str]] = {}
    for row in combined["gaps"]:
        by_gap.setdefault(row["gap_s"], {})[row["arm"]] = f"{row['hits']}/{row['turns']}"
    for gap, arms in sorted(by_gap.items()):
        lines.append(f"| {gap:g} | {arms.get(FIXED_TTL, '-')} | {arms.get(HEARTBEAT, '-')} |")
    return "\n".join(lines)
