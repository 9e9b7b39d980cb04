"""Bucket statistics, target checks and the JSON report schema (no engines)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from kvferry.bench.multiturn_stats import (
    FIXED_TTL,
    HEARTBEAT,
    RECOMPUTE,
    REUSE,
    SCHEMA,
    VLLM,
    GapRecord,
    TurnRecord,
    bucket_label,
    bucket_of,
    build_report,
    check_targets,
    combine_reports,
    combined_markdown,
    percentile,
    summarize_buckets,
    summarize_gaps,
    validate_report,
)


def _turn(
    mode: str,
    tokens: int,
    ttft: float,
    *,
    turn: int = 1,
    pulled: int = 0,
    pull_ms: float | None = None,
    prefill: float | None = None,
) -> TurnRecord:
    return TurnRecord(
        mode=mode,
        conversation=0,
        turn=turn,
        prompt_tokens=tokens,
        ttft_ms=ttft,
        prefill_ms=prefill if prefill is not None else ttft * 0.8,
        pulled_tokens=pulled,
        recomputed_tokens=tokens - pulled,
        pull_ms=pull_ms,
        handoff_ms=5.0,
    )


def test_percentile_interpolates_like_numpy() -> None:
    values = [10.0, 20.0, 30.0, 40.0]
    assert percentile(values, 50) == 25.0
    assert percentile(values, 90) == pytest.approx(37.0)
    assert percentile(values, 0) == 10.0
    assert percentile(values, 100) == 40.0
    assert percentile([5.0], 90) == 5.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_buckets_by_width() -> None:
    assert bucket_of(2048, 2048) == 0
    assert bucket_of(2049, 2048) == 2048
    assert bucket_of(4096, 2048) == 2048
    assert bucket_of(16384, 2048) == 14336
    assert bucket_of(0, 2048) == 0
    assert bucket_label(2048, 2048) == "2k-4k"
    assert bucket_label(1000, 500) == "1000-1500"
    with pytest.raises(ValueError):
        bucket_of(10, 0)


def test_summarize_buckets_per_mode() -> None:
    records = [
        _turn(REUSE, 2100, 100.0, turn=0),
        _turn(REUSE, 3000, 120.0, pulled=2048, pull_ms=10.0),
        _turn(RECOMPUTE, 2100, 110.0, turn=0),
        _turn(RECOMPUTE, 3000, 200.0),
        _turn(REUSE, 16500, 300.0, pulled=16000, pull_ms=50.0, prefill=250.0),
        _turn(RECOMPUTE, 16500, 2000.0, prefill=1900.0),
    ]
    buckets = summarize_buckets(records, 2048)
    assert [b.label for b in buckets] == ["2k-4k", "16k-18k"]
    first = buckets[0].modes[REUSE]
    assert first.turns == 2
    assert first.ttft_p50_ms == 110.0
    assert first.pulls == 1 and first.pull_candidates == 1
    assert first.mean_pulled_tokens == 1024.0
    long_reuse = buckets[1].modes[REUSE]
    assert long_reuse.compute_p50_ms == 200.0
    assert long_reuse.pull_p50_ms == 50.0
    assert buckets[1].modes[RECOMPUTE].compute_p50_ms is None
    assert list(buckets[0].modes) == [REUSE, RECOMPUTE]


def test_targets_met_and_missed() -> None:
    records = [
        _turn(REUSE, 2100, 200.0, turn=0),
        _turn(REUSE, 16500, 300.0, pulled=16000, pull_ms=40.0),
        _turn(RECOMPUTE, 2100, 210.0, turn=0),
        _turn(RECOMPUTE, 16500, 2000.0),
    ]
    gaps = summarize_gaps(
        [GapRecord(HEARTBEAT, 5.0, i, True, 1000, 1300) for i in range(4)]
        + [GapRecord(FIXED_TTL, 5.0, i, i < 1, 1000 if i < 1 else 0, 1300) for i in range(4)]
    )
    checks = {c.name: c for c in check_targets(summarize_buckets(records, 2048), gaps, ttl_seconds=10)}
    assert checks["ratio"].value == pytest.approx(0.15)
    assert checks["ratio"].met is True
    assert checks["spread"].value == pytest.approx(1.5)
    assert checks["spread"].met is True
    assert checks["hit_rate"].value == 1.0 and checks["hit_rate"].met is True
    assert (
        "fixed TTL (10 s)" in checks["hit_rate"].explanation and "5 s: 1/4" in checks["hit_rate"].explanation
    )

    slow = [*records[:1], _turn(REUSE, 16500, 900.0, pulled=16000, pull_ms=300.0), *records[2:]]
    checks = {c.name: c for c in check_targets(summarize_buckets(slow, 2048), [], ttl_seconds=None)}
    assert checks["ratio"].met is False
    assert checks["spread"].met is False
    assert "KV pull 300" in checks["ratio"].explanation
    assert checks["hit_rate"].met is None


def test_gap_summary_rates() -> None:
    rows = summarize_gaps(
        [GapRecord(FIXED_TTL, 1.0, 0, True, 1, 2), GapRecord(FIXED_TTL, 1.0, 1, False, 0, 2)]
    )
    assert rows[0].hit_rate == 0.5 and rows[0].turns == 2


def _report() -> dict[str, object]:
    records = [
        _turn(REUSE, 2100, 200.0, turn=0),
        _turn(REUSE, 16500, 300.0, pulled=16000, pull_ms=40.0),
        _turn(RECOMPUTE, 2100, 210.0, turn=0),
        _turn(RECOMPUTE, 16500, 2000.0),
        _turn(VLLM, 16500, 400.0, pulled=16000),
    ]
    return build_report(
        created="2026-11-30T00:00:00+00:00",
        config={"parallel": 1},
        model={"name": "bench-qwen3", "kv_bytes_per_token": 4096, "prefill_ms_per_token": 0.12},
        workload={"conversations": 1},
        modes=[REUSE, RECOMPUTE, VLLM],
        notes=["a note"],
        turns=records,
        bucket_width=2048,
        gap_records=[GapRecord(HEARTBEAT, 5.0, 0, True, 1000, 1300)],
        gap_config={"ttl_seconds": 10, "gaps_s": [5.0], "per_gap": 1},
    )


def test_report_follows_the_schema_and_is_json() -> None:
    report = _report()
    assert validate_report(report) == []
    assert report["schema"] == SCHEMA
    again = json.loads(json.dumps(report, allow_nan=False))
    assert validate_report(again) == []
    summary = again["summary"]
    assert summary["longest_bucket"] == "16k-18k"
    assert summary["reuse_over_recompute"] == pytest.approx(0.15)
    assert summary["vllm_over_recompute"] == pytest.approx(0.2)
    assert "recompute_over_recompute" not in summary  # always 1
    assert again["turns"][1]["compute_ms"] == pytest.approx(200.0)


def test_schema_problems_are_named() -> None:
    report = _report()
    del report["summary"]
    assert validate_report(report) == ["missing key 'summary'"]
    report = _report()
    report["turns"][0]["mode"] = "other"  # type: ignore[index]
    report["model"] = {"name": "x"}
    problems = validate_report(report)
    assert any("model lacks 'kv_bytes_per_token'" in p for p in problems)
    assert any("turns[0] has mode 'other'" in p for p in problems)
    report = _report()
    report["schema"] = "other/v0"
    assert validate_report(report) == ["schema is 'other/v0', expected 'kvferry.bench.multiturn/v1'"]


def test_plots_from_a_report(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from kvferry.bench.multiturn_plots import write_plots

    written = write_plots(_report(), tmp_path, "multiturn")
    assert [p.name for p in written] == [
        "multiturn-ttft_vs_length.png",
        "multiturn-prefill_breakdown.png",
        "multiturn-hit_rate_vs_gap.png",
    ]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in written)


def test_combine_takes_medians_over_runs() -> None:
    first, second, third = _report(), _report(), _report()
    second["buckets"][0]["modes"][REUSE]["ttft_p50_ms"] = 300.0  # type: ignore[index]
    third["buckets"][0]["modes"][REUSE]["ttft_p50_ms"] = 100.0  # type: ignore[index]
    combined = combine_reports([first, second, third])
    assert combined["runs"] == 3
    assert combined["buckets"][0]["modes"][REUSE]["ttft_p50_ms"] == 200.0
    assert combined["targets"]["ratio"]["median"] == pytest.approx(0.15)
    assert combined["gaps"] == [{"arm": HEARTBEAT, "gap_s": 5.0, "hits": 3, "turns": 3}]
    table = combined_markdown(combined)
    assert "Median of 3 runs" in table and "| 2k-4k | reuse | 200 |" in table
    assert "| 5 | - | 3/3 |" in table
    # Runs without a gap sweep (the agent workload's) print no empty gap table.
    assert "gap (s)" not in combined_markdown({**combined, "gaps": []})
    with pytest.raises(ValueError):
        combine_reports([])
