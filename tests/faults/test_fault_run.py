"""The CI-sized fault run: every fault kind of issue 13 injected once while multi-turn conversations run
through real etcd (3 members), two registry replicas, sidecars and the router, with stand-in engines
that run the connector's real retention machinery; the oracle must find nothing.

The full figures (1,000 turns, 100 faults of every kind) come from ``kvferry bench faults``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kvferry.testing.fault_run import run_faults
from kvferry.testing.fault_stack import FaultKind, StackSettings

pytestmark = pytest.mark.timeout(300)


def test_every_fault_kind_once_serves_nothing_freed_and_leaks_nothing(tmp_path: Path) -> None:
    progress: list[str] = []
    result = run_faults(
        StackSettings(work_dir=tmp_path / "faults"), turns=150, faults_per_kind=1, progress=progress.append
    )
    summary = result.summary()
    assert summary["violations"] == [], summary
    assert result.faults == {kind.value: 1 for kind in FaultKind}
    turns = result.turns
    assert turns.sent == 150
    assert turns.answered >= 0.8 * turns.sent, summary
    assert turns.reused > 0, summary  # the run exercised reuse, not only recompute
    assert result.oracle.reads == result.oracle.pulls - result.oracle.failed_pulls
    assert result.held_blocks_at_end == 0
    assert result.oracle.leaked_blocks == 0
    # The run said what it was doing, phase by phase (the bench prints it).
    faults = len(FaultKind)
    assert any(line.startswith(f"faults {faults}/{faults} injected; turns ") for line in progress), progress
    assert progress[-1] == "checking the engines' logs (the oracle)", progress


def test_the_oracle_sees_a_decode_engine_that_frees_what_the_registry_serves(tmp_path: Path) -> None:
    """The negative control: a D broken on purpose (it frees every retention at once) must be caught."""
    result = run_faults(
        StackSettings(work_dir=tmp_path / "broken", unsafe_decode=True), turns=40, faults_per_kind=0, kinds=()
    )
    assert result.oracle.pulls > 0
    assert result.oracle.reads_after_free == result.oracle.reads
    assert result.oracle.wrong_kv_pulls > 0  # freed blocks were handed out again and overwritten
    assert any("served after freed" in problem for problem in result.oracle.violations())
