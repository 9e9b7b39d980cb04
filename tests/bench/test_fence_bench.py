"""`kvferry bench fence`'s pure parts: a run is read from P's log lines (the connector's own format)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvferry.bench.fence import _from_log, print_table, runs_in_log
from kvferry.connector.fence import PULL_FENCE_LOG


def _line(**fields: object) -> str:
    return json.dumps({"ts": "2026-12-01T00:00:00Z", **fields})


def test_a_run_pairs_the_pull_with_its_fence(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "prefill.log"
    log.write_text(
        "\n".join(
            [
                "INFO vLLM says something else",
                _line(msg="kv pull", reader_role="kv_producer", request_id="other-t2", wall_ms=1.0),
                _line(
                    msg="kv pull",
                    reader_role="kv_producer",
                    request_id="cmpl-conv-t2-0",
                    bytes=64 * 2**20,
                    blocks=1024,
                    block_runs_as_listed=3,
                    wall_ms=400.0,
                    transfer_ms=250.0,
                ),
                _line(msg=PULL_FENCE_LOG, request_id="cmpl-conv-t2-0", fenced=False, fence_ms=2.0),
            ]
        )
    )
    run = _from_log(log, 0, "conv-t2", pulled_tokens=16384, prefill_seconds=0.5)
    assert run is not None
    assert (run.blocks, run.block_runs, run.pull_ms, run.fence_ms, run.fenced) == (1024, 3, 400.0, 2.0, False)
    assert run.fraction == pytest.approx(0.005) and run.fraction_of_transfer == pytest.approx(0.008)
    assert _from_log(log, 1, "missing-t2", pulled_tokens=0, prefill_seconds=0.0) is None

    print_table([run])
    assert "fence/pull 0.50 % (within the 2 % target)" in capsys.readouterr().out


def test_every_fenced_pull_of_a_server_log_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # As an engine run as a server writes them (a GPU stack run's logs): vLLM prefixes its process.
    prefix = "(EngineCore pid=1039) "

    def pull(request_id: str, blocks: int, wall_ms: float) -> str:
        fields = {"bytes": blocks * 2**20, "blocks": blocks, "wall_ms": wall_ms, "transfer_ms": wall_ms}
        return prefix + _line(msg="kv pull", reader_role="kv_producer", request_id=request_id, **fields)

    def fence(request_id: str, fence_ms: float) -> str:
        return prefix + _line(
            msg=PULL_FENCE_LOG, request_id=request_id, fenced=False, fence_ms=fence_ms, post_ms=0.05, polls=1
        )

    log = tmp_path / "engine-prefill-0.log"
    log.write_text(
        "\n".join(
            [
                pull("a", 125, 2.0),
                fence("a", 0.1),
                pull("unchecked", 500, 3.0),  # no generations were published: no verdict
                pull("b", 1024, 4.0),
                "(EngineCore pid=1039) INFO something of vLLM's",
                fence("b", 0.06),
            ]
        )
    )
    runs = runs_in_log(log, block_size=16)
    assert [(r.pulled_tokens, r.pull_ms, r.fence_ms, r.fence_polls) for r in runs] == [
        (2000, 2.0, 0.1, 1),
        (16384, 4.0, 0.06, 1),
    ]
    print_table(runs)
    out = capsys.readouterr().out
    assert "fence/pull 3.25 % (ABOVE the 2 % target)" in out
    assert "posting its reads 0.050 ms" in out
