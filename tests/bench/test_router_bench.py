"""``kvferry bench router`` end to end at a tiny size: its own etcd, registry, paced stand-in engines
and router processes, and the JSON it writes. Figures are not checked here (benchmarks print them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)


def test_router_bench_runs_paced_stand_ins_and_reports_what_the_router_adds(tmp_path: Path) -> None:
    out = tmp_path / "bench-router.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvferry.cli.main",
            "bench",
            "router",
            "--concurrency=2",
            "--samples=6",
            "--max-tokens=3",
            "--standin-prefill-us-per-token=5",
            "--standin-token-ms=2",
            "--paths=direct,router-noreuse",
            f"--work-dir={tmp_path / 'work'}",
            f"--output={out}",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["standin_token_ms"] == 2 and report["standin_prefill_us_per_token"] == 5
    paths = {(level["path"], level["concurrency"]) for level in report["levels"]}
    assert paths == {("direct", 2), ("router-noreuse", 2)}
    assert all(level["turns"] >= 6 and level["ttft_p50_ms"] > 0 for level in report["levels"])
    (added,) = report["added"]
    assert added["path"] == "router-noreuse" and added["concurrency"] == 2
