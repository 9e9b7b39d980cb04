"""``kvferry bench router`` end to end at a tiny size: its own etcd, registry, paced stand-in engines
and router processes, and the JSON it writes. Figures are not checked here (benchmarks print them)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

pytestmark = pytest.mark.timeout(300)


def _bench(tmp_path: Path, *options: str) -> dict[str, Any]:
    """``kvferry bench router OPTIONS`` run to its end; the report it wrote."""
    out = tmp_path / "bench-router.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvferry.cli.main",
            "bench",
            "router",
            *options,
            f"--work-dir={tmp_path / 'work'}",
            f"--output={out}",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def test_router_bench_runs_paced_stand_ins_and_reports_what_the_router_adds(tmp_path: Path) -> None:
    report = _bench(
        tmp_path,
        "--concurrency=2",
        "--samples=6",
        "--max-tokens=3",
        "--standin-prefill-us-per-token=5",
        "--standin-token-ms=2",
        "--paths=direct,router-noreuse",
    )
    assert report["standin_token_ms"] == 2 and report["standin_prefill_us_per_token"] == 5
    paths = {(level["path"], level["concurrency"]) for level in report["levels"]}
    assert paths == {("direct", 2), ("router-noreuse", 2)}
    assert all(level["turns"] >= 6 and level["ttft_p50_ms"] > 0 for level in report["levels"])
    (added,) = report["added"]
    assert added["path"] == "router-noreuse" and added["concurrency"] == 2


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_router_bench_measures_the_http_apis_with_reuse(tmp_path: Path, api: str) -> None:
    report = _bench(
        tmp_path,
        f"--api={api}",
        "--concurrency=1",
        "--samples=4",
        "--turns=2",
        "--max-tokens=3",
        "--paths=direct,router",
    )
    levels = {level["path"]: level for level in report["levels"]}
    assert set(levels) == {"direct", "router"} and report["api"] == api
    assert levels["router"]["turns"] >= 4 and levels["router"]["pulled_tokens"] > 0, "turn 2 reused turn 1"


def test_a_terminated_router_bench_stops_every_process_it_started(tmp_path: Path) -> None:
    """SIGTERM (``timeout``, a supervisor) unwinds the bench: its etcd, registry, stand-ins and routers stop
    with it rather than outliving it."""
    bench = psutil.Popen(
        [
            sys.executable,
            "-m",
            "kvferry.cli.main",
            "bench",
            "router",
            "--concurrency=1",
            "--samples=100000",
            "--standin-token-ms=2",
            "--paths=router-noreuse",
            f"--work-dir={tmp_path / 'work'}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    started: list[psutil.Process] = []
    try:
        # The router is the bench's last process: once it is up, every other one is too.
        deadline = time.monotonic() + 120
        while not any("router" in _args(child) for child in bench.children()):
            assert time.monotonic() < deadline and bench.poll() is None, "the bench never started its router"
            time.sleep(0.2)
        time.sleep(1)
        started = bench.children(recursive=True)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 128 + signal.SIGTERM
        _, alive = psutil.wait_procs(started, timeout=30)
        assert not _alive(alive), [_args(child) for child in alive]
    finally:
        if bench.poll() is None:
            started = started or bench.children(recursive=True)
            bench.kill()
        for child in _alive(started):
            child.kill()


def _args(process: psutil.Process) -> list[str]:
    try:
        return list(process.cmdline())
    except psutil.Error:  # gone meanwhile
        return []


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for process in processes:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.Error:  # gone
            pass
    return alive
