"""The capacity workload's pure parts (no engines): its flags, sizing, the engine log lines it reads, the
inter-token latency split, per-level statistics, capacity, targets, the report and its combination."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from kvferry.bench import multiturn
from kvferry.bench.multiturn_agent import ToolTiming
from kvferry.bench.multiturn_capacity import (
    HBM,
    HOST,
    SCHEMA,
    CapacitySizing,
    CapacityTurn,
    EngineEvents,
    PoolCopy,
    build_capacity_report,
    capacity,
    check_capacity_targets,
    combine_capacity_reports,
    combined_capacity_markdown,
    default_levels,
    engine_events,
    level_table,
    log_lines,
    one_more_fits,
    parse_arms,
    parse_levels,
    size_decode,
    split_decode_itl,
    split_itl,
    summarize_level,
    unix_of,
)
from kvferry.bench.multiturn_capacity_driver import decode_settings, tool_seconds
from kvferry.bench.multiturn_workload import WorkloadSpec
from kvferry.connector.fence import PULL_FENCE_LOG
from kvferry.connector.logs import (
    COPIED_LOG,
    EVICTED_LOG,
    FREED_LOG,
    MOVED_LOG,
    POOL_FULL_LOG,
    READY_LOG,
    RETAINED_LOG,
)
from kvferry.connector.settings import KvferrySettings

DEFAULT = WorkloadSpec(conversations=20, turns=4, start_tokens=2048, target_tokens=2560, reply_tokens=32)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    multiturn.configure(parser)
    return parser.parse_args(list(argv))


def test_the_capacity_workload_takes_its_own_preset_and_the_usual_flags() -> None:
    args = _args("--workload", "capacity")
    assert multiturn._preset(args) == multiturn.CAPACITY_PRESETS["default"]
    assert args.arms == "hbm,host" and args.demote_after == 2.0 and args.capacity_levels == ""
    assert args.tool_seconds is None  # resolved per workload: 5,8 for capacity
    assert multiturn.TOOL_SECONDS["capacity"] == "5,8"
    quick = multiturn._preset(_args("--workload", "capacity", "--quick", "--conversations", "30"))
    assert quick["conversations"] == 30 and quick["turns"] == multiturn.CAPACITY_PRESETS["quick"]["turns"]
    assert "gap_samples" not in multiturn._preset(_args("--workload", "capacity", "--gap-samples", "4"))
    # The other workloads keep theirs.
    assert multiturn._preset(_args()) == multiturn.PRESETS["default"]


@pytest.mark.parametrize(
    "argv",
    [
        ("--capacity-levels", "0,5"),
        ("--capacity-levels", "two"),
        ("--arms", "hbm,disk"),
        ("--router", "127.0.0.1:1"),
        ("--tool-seconds", "8,5"),
        ("--turns", "1"),
        ("--kv-budget-conversations", "100000"),
    ],
)
def test_bad_capacity_flags_are_refused_before_anything_starts(
    argv: tuple[str, ...], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _args("--workload", "capacity", "--workdir", str(tmp_path / "stack"), *argv)
    assert multiturn.run(args) == 2
    assert capsys.readouterr().err
    assert not (tmp_path / "stack").exists()


def test_levels_and_arms() -> None:
    assert parse_levels("20, 2,3,2") == (2, 3, 20)
    assert default_levels(20, 2) == (2, 3, 20)
    assert default_levels(1, 1) == (1, 2)
    for bad in ("", "0", "a,b"):
        with pytest.raises(ValueError):
            parse_levels(bad)
    assert parse_arms("host, hbm,host") == (HOST, HBM)
    with pytest.raises(ValueError):
        parse_arms("")


def sizing_of_the_defaults() -> CapacitySizing:
    """The bench's default run: 4 GiB of 128 KiB blocks, a budget of 2 conversations, up to 20 agents."""
    return size_decode(
        DEFAULT,
        block_size=32,
        kv_bytes_per_token=4096,
        kv_cache_gib=4,
        budget_conversations=2,
        most_agents=20,
        demote_after_seconds=2.0,
    )


def test_sizing_holds_the_budget_s_conversations_and_not_one_more() -> None:
    sizing = sizing_of_the_defaults()
    assert sizing.kv_blocks == 32768  # 4 GiB of 128 KiB blocks
    assert sizing.first_turn_blocks == 65  # 2048 + 32 tokens
    assert sizing.conversation_blocks == 81  # 2560 + 32
    assert sizing.budget_blocks == 2 * 81 + 10
    # As the connector computes it: int(num_blocks * retained_kv_fraction).
    assert int(sizing.kv_blocks * sizing.retained_kv_fraction) == sizing.budget_blocks
    assert not one_more_fits(sizing)  # 3 x 65 > 172: a third conversation never fits
    assert sizing.host_pool_blocks == 4 * 20 * 81
    settings = KvferrySettings(**decode_settings(HOST, sizing))
    settings.validate()
    assert settings.host_pool_blocks == sizing.host_pool_blocks and settings.demote_after_seconds == 2.0
    assert decode_settings(HBM, sizing) == {"retained_kv_fraction": sizing.retained_kv_fraction}

    growing = WorkloadSpec(conversations=4, turns=4, start_tokens=1024, target_tokens=4096, reply_tokens=32)
    small = size_decode(
        growing,
        block_size=32,
        kv_bytes_per_token=4096,
        kv_cache_gib=1,
        budget_conversations=2,
        most_agents=4,
        demote_after_seconds=1.0,
        host_pool_blocks=100,
    )
    assert one_more_fits(small) and small.host_pool_blocks == 100
    with pytest.raises(ValueError, match="does not fit"):
        size_decode(
            DEFAULT,
            block_size=32,
            kv_bytes_per_token=4096,
            kv_cache_gib=1,
            budget_conversations=200,
            most_agents=20,
            demote_after_seconds=2.0,
        )


def test_tool_gaps_are_seeded_per_level_agent_and_turn_not_per_arm() -> None:
    timing = ToolTiming(5.0, 8.0)
    gaps = [tool_seconds(0, 20, agent, turn, timing) for agent in range(20) for turn in range(3)]
    assert all(5.0 <= g <= 8.0 for g in gaps) and len(set(gaps)) > 30
    assert tool_seconds(0, 20, 3, 1, timing) == tool_seconds(0, 20, 3, 1, timing)
    assert tool_seconds(0, 20, 3, 1, timing) != tool_seconds(1, 20, 3, 1, timing)


T0 = 1_800_000_000.0


def _ts(unix: float) -> str:
    from datetime import UTC, datetime

    return (
        datetime.fromtimestamp(unix, UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{int(unix * 1000) % 1000:03d}Z"
    )


def _line(msg: str, at: float, **fields: Any) -> dict[str, Any]:
    return {"ts": _ts(at), "level": "info", "logger": "kvferry.connector", "msg": msg, **fields}


def _decode_log() -> list[dict[str, Any]]:
    return [
        _line(READY_LOG, T0, kv_blocks=32768, retained_block_budget=172, host_pool_blocks=6480),
        _line(RETAINED_LOG, T0 + 1, request_id="r-a1", conversation_id="a"),
        _line(RETAINED_LOG, T0 + 2, request_id="r-b1", conversation_id="b"),
        _line(COPIED_LOG, T0 + 4.010, request_ids=["r-a1"], blocks=65, copy_ms=5.0),
        _line(
            MOVED_LOG, T0 + 4.02, request_id="r-a1.host", relocates="r-a1", conversation_id="a", slots=[0, 64]
        ),
        _line(RETAINED_LOG, T0 + 9, request_id="r-a2", conversation_id="a"),
        _line(RETAINED_LOG, T0 + 9.5, request_id="r-c1", conversation_id="c"),
        # A move in two parts (the connector's demote_blocks_per_step on a busy step).
        _line(COPIED_LOG, T0 + 11.0, request_ids=["r-c1"], parts=1, blocks=32, copy_ms=0.4),
        _line(COPIED_LOG, T0 + 12.0, request_ids=["r-c1"], parts=0, blocks=38, copy_ms=0.5),
        _line(
            MOVED_LOG,
            T0 + 12.01,
            request_id="r-c1.host",
            relocates="r-c1",
            conversation_id="c",
            slots=[0, 69],
        ),
        _line(COPIED_LOG, T0 + 13.0, request_ids=["r-a2"], blocks=65, copy_ms=0.7),
        _line(
            MOVED_LOG,
            T0 + 13.01,
            request_id="r-a2.host",
            relocates="r-a2",
            conversation_id="a",
            slots=[0, 64],
        ),
        _line(EVICTED_LOG, T0 + 5, request_id="r-b1", conversation_id="b"),
        _line(POOL_FULL_LOG, T0 + 6, request_id="r-a1.host", conversation_id="a"),
        _line(FREED_LOG, T0 + 40, request_id="r-a1", conversation_id="a", tier="device", reason="superseded"),
    ]


def _prefill_log() -> list[dict[str, Any]]:
    return [
        _line(PULL_FENCE_LOG, T0 + 7, remote_request_id="r-a1.host", fenced=False),
        _line(PULL_FENCE_LOG, T0 + 8, remote_request_id="r-b1", fenced=True),
    ]


def test_engine_events_from_the_connector_s_lines(tmp_path: Path) -> None:
    log = tmp_path / "decode.log"
    lines = [f"(EngineCore pid=7) {json.dumps(e)}" for e in _decode_log()]
    log.write_text("\n".join(["INFO vllm says hello", *lines, '{"ts": cut short']) + "\n")
    decode = list(log_lines(log))
    assert len(decode) == len(_decode_log())
    assert list(log_lines(tmp_path / "missing.log")) == []
    events = engine_events(decode, _prefill_log())
    assert events.decode_ready == {"kv_blocks": 32768, "retained_block_budget": 172, "host_pool_blocks": 6480}
    assert [c for c, _ in events.moved] == ["a", "c", "a"]
    first = events.copies[0]
    assert first.end == pytest.approx(T0 + 4.011, abs=1e-3)
    assert first.end - first.start == pytest.approx(0.006, abs=1e-3)
    assert first.conversations == ("a",) and first.copy_ms == 5.0
    assert [c.conversations for c in events.copies] == [("a",), ("c",), ("c",), ("a",)]
    assert [c.parts for c in events.copies] == [0, 1, 0, 0]
    assert len(events.copy_windows()) == 4 and len(events.relocation_windows()) == 3
    assert events.evicted_kv == ["b"] and events.evicted_pool == ["a"]
    assert events.freed == [("a", "device", "superseded")]
    assert events.pulls == [("a", True, False), ("b", False, True)]
    assert len(events.demotion_windows()) == 7  # 4 copies, 3 relocations
    assert unix_of("2027-01-15T08:00:00.250Z") == pytest.approx(1800000000.25)


def _turn(
    arm: str,
    agents: int,
    agent: int,
    turn: int,
    *,
    pulled: int,
    ttft: float,
    chunks: list[tuple[float, int]] | None = None,
    error: str = "",
) -> CapacityTurn:
    return CapacityTurn(
        arm=arm,
        agents=agents,
        agent=agent,
        turn=turn,
        conversation_id=f"{arm}-{agents}-{agent}",
        prompt_tokens=2100 + 170 * turn,
        ttft_ms=ttft,
        pulled_tokens=pulled,
        reuse="pull" if pulled else "none",
        sent_unix=T0,
        chunks=chunks or [],
        error=error,
    )


def test_itl_split_by_demotion_windows() -> None:
    # Tokens every 20 ms; a copy from +45 to +50 ms lands in the interval (40, 60] ms, made 30 ms long.
    chunks = [(T0 + 0.000, 1), (T0 + 0.020, 1), (T0 + 0.040, 1), (T0 + 0.070, 1), (T0 + 0.090, 2)]
    turn = _turn(HOST, 1, 0, 1, pulled=2048, ttft=100, chunks=chunks)
    during, outside = split_itl([turn], [(T0 + 0.045, T0 + 0.050)])
    assert during == pytest.approx([30.0])
    assert outside == pytest.approx([20.0, 20.0, 10.0])  # the last chunk held 2 tokens
    # A window just before an interval's start still counts (the relay's slack), one well before not.
    assert split_itl([turn], [(T0 + 0.016, T0 + 0.0175)])[0] == pytest.approx([20.0, 20.0])
    assert split_itl([turn], [(T0 - 1.0, T0 - 0.9)])[0] == []
    # Intervals overlapping an excluded window count on neither side.
    during, outside = split_itl([turn], [(T0 + 0.045, T0 + 0.050)], excluding=[(T0 + 0.001, T0 + 0.002)])
    assert during == pytest.approx([30.0]) and outside == pytest.approx([20.0, 10.0])


def test_decode_itl_split_by_demotion_windows() -> None:
    steady = _turn(HOST, 1, 0, 1, pulled=2048, ttft=100, chunks=[(T0 + 0.01 * i, 1) for i in range(11)])
    slowed = _turn(
        HOST,
        1,
        1,
        1,
        pulled=2048,
        ttft=100,
        chunks=[(T0 + 10 + 0.01 * i + (0.03 if i > 4 else 0), 1) for i in range(11)],
    )
    lone = _turn(HOST, 1, 2, 1, pulled=2048, ttft=100, chunks=[(T0 + 20, 32)])
    during, outside = split_decode_itl([steady, slowed, lone], [(T0 + 10.042, T0 + 10.07)])
    assert during == pytest.approx([13.0])  # 130 ms over 10 tokens
    assert outside == pytest.approx([10.0])  # a one-chunk decode has no ITL


def _run_turns(miss_ttft: float = 900.0) -> list[CapacityTurn]:
    """The hbm arm keeps 2 agents, not 3 or 20; the host arm keeps every level."""
    turns = []
    for arm in (HBM, HOST):
        for agents in (2, 3, 20):
            for agent in range(agents):
                for turn in range(4):
                    hit = turn > 0 and (arm == HOST or agents == 2)
                    start = T0 + 1000 * agents + 100 * turn + agent  # levels run one after another
                    chunks = [(start + 0.02 * i, 1) for i in range(4)]
                    turns.append(
                        _turn(
                            arm,
                            agents,
                            agent,
                            turn,
                            pulled=2048 if hit else 0,
                            ttft=150.0 if hit else miss_ttft,
                            chunks=chunks,
                        )
                    )
    return turns


def _events() -> dict[str, EngineEvents]:
    host = EngineEvents(
        moved=[("host-20-0", T0 + 20_050)],
        # During the decode of level 20's agent 0, turn 1 (it starts at T0 + 20,100): its second interval.
        copies=[PoolCopy(T0 + 20_100.025, T0 + 20_100.03, 5.0, ("host-20-0",))],
        pulls=[("host-20-0", True, False)],
    )
    hbm = EngineEvents(evicted_kv=["hbm-20-1", "hbm-20-2", "hbm-3-0"])
    return {HBM: hbm, HOST: host}


def test_level_statistics_capacity_and_targets() -> None:
    turns = _run_turns()
    # One failed turn: a miss.
    turns.append(_turn(HOST, 3, 9, 1, pulled=0, ttft=float("nan"), error="RpcError: unavailable"))
    events = _events()
    kept = summarize_level(HBM, 2, turns, events[HBM])
    assert (kept.reuse_turns, kept.hits, kept.hit_rate) == (6, 6, 1.0)
    assert kept.ttft_p50_ms == 150.0 and kept.ttft_miss_p50_ms is None
    lost = summarize_level(HBM, 20, turns, events[HBM])
    assert lost.hit_rate == 0.0 and lost.evicted_kv == 2 and lost.ttft_p50_ms == 900.0
    host3 = summarize_level(HOST, 3, turns, events[HOST])
    assert host3.failed == 1 and host3.hit_rate == pytest.approx(9 / 10)
    host20 = summarize_level(HOST, 20, turns, events[HOST])
    assert host20.hit_rate == 1.0 and host20.demoted == 1 and host20.pulls_from_pool == 1
    assert host20.itl_during_demotion_n == 1 and host20.itl_p50_ms == pytest.approx(20.0)
    assert (host20.copies, host20.copy_p50_ms) == (1, 5.0)

    levels = [summarize_level(a, n, turns, events[a]) for a in (HBM, HOST) for n in (2, 3, 20)]
    assert capacity(levels, HBM) == 2 and capacity(levels, HOST) == 20
    assert capacity(levels, HOST, min_hit_rate=1.01) is None
    targets = check_capacity_targets(levels, turns, events)
    assert targets.capacity == {HBM: 2, HOST: 20}
    assert targets.ratio == 10.0 and targets.ratio_met is True and targets.host_at_largest_level
    assert targets.itl_during_n == 1 and targets.itl_increase == pytest.approx(0.0, abs=1e-6)
    assert targets.itl_met is True
    # One decode ran beside the copy (its intervals all 20 ms here); the failed turn streamed nothing.
    assert targets.decodes_during_n == 1 and targets.decodes_outside_n == (2 + 3 + 20) * 4 - 1
    assert targets.decode_itl_increase == pytest.approx(0.0, abs=1e-6) and targets.decode_itl_met is True
    assert targets.itl_increase_copy == pytest.approx(0.0, abs=1e-6) and targets.itl_during_copy_n == 1
    assert targets.itl_increase_relocation_only is None and targets.itl_during_relocation_only_n == 0
    assert "10x" in targets.explanation

    only_hbm = check_capacity_targets([s for s in levels if s.arm == HBM], turns, {HBM: events[HBM]})
    assert only_hbm.ratio is None and only_hbm.ratio_met is None and only_hbm.itl_met is None
    assert "one arm run" in only_hbm.explanation


def _report(miss_ttft: float = 900.0) -> dict[str, Any]:
    sizing = sizing_of_the_defaults()
    return build_capacity_report(
        created="2026-12-06T00:00:00+00:00",
        config={"command": "kvferry bench multiturn --workload capacity"},
        model={"name": "bench-qwen3"},
        workload=DEFAULT,
        sizing=sizing,
        arms=(HBM, HOST),
        levels_run=(2, 3, 20),
        turns=_run_turns(miss_ttft),
        events=_events(),
        notes=["a note"],
    )


def test_report_round_trips_as_json_and_prints() -> None:
    report = json.loads(json.dumps(_report()))
    assert report["schema"] == SCHEMA
    assert [(lv["arm"], lv["agents"]) for lv in report["levels"]] == [
        (HBM, 2),
        (HBM, 3),
        (HBM, 20),
        (HOST, 2),
        (HOST, 3),
        (HOST, 20),
    ]
    assert report["targets"]["capacity"] == {HBM: 2, HOST: 20}
    table = level_table(report["levels"])
    assert "hit rate" in table and "100.0%" in table and "0.0%" in table


def test_runs_combine_into_medians(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reports = [_report(900.0), _report(1100.0), _report(1000.0)]
    combined = combine_capacity_reports(reports)
    assert combined["runs"] == 3
    hbm20 = next(lv for lv in combined["levels"] if lv["arm"] == HBM and lv["agents"] == 20)
    assert hbm20["ttft_p50_ms"] == 1000.0 and hbm20["hit_rate"] == 0.0
    assert combined["targets"]["ratio"]["median"] == 10.0
    assert combined["targets"]["capacity"] == {HBM: [2, 2, 2], HOST: [20, 20, 20]}
    markdown = combined_capacity_markdown(combined)
    assert markdown.startswith("Median of 3 runs") and "| hbm | 20 |" in markdown
    with pytest.raises(ValueError):
        combine_capacity_reports([{"schema": "kvferry.bench.multiturn/v1"}])

    paths = []
    for i, report in enumerate(reports):
        paths.append(tmp_path / f"capacity-{i}.json")
        paths[-1].write_text(json.dumps(report))
    assert multiturn.run(_args("--combine", *map(str, paths))) == 0
    out = capsys.readouterr().out
    assert "capacity ratio host/hbm: median 10x (runs 10x, 10x, 10x)" in out
    assert "(per interval): median +0.0% (runs +0.0%, +0.0%, +0.0%)" in out
