"""Runs of consecutive block ids (pull descriptors on the connector's side, pull cost on the router's)."""

from __future__ import annotations

import math

from kvferry.pd.block_runs import consecutive_fraction, count_runs, mean_run_blocks


def test_runs_of_consecutive_ids_as_listed() -> None:
    assert count_runs([]) == 0
    assert count_runs([4]) == 1
    assert count_runs([1, 2, 10, 11]) == 2
    # Backwards is not consecutive: NIXL merges only ids that step +1.
    assert count_runs([7, 6, 5]) == 3


def test_mean_run_blocks() -> None:
    assert mean_run_blocks([]) == math.inf
    assert mean_run_blocks([5, 6, 7]) == 3
    assert mean_run_blocks([1, 3, 5]) == 1
    assert mean_run_blocks([1, 2, 10, 11]) == 2
    assert mean_run_blocks([7, 6, 5]) == 1


def test_consecutive_fraction() -> None:
    assert consecutive_fraction([3, 4, 5, 9, 10]) == 0.75
    assert consecutive_fraction([5, 4, 3]) == 0.0
    assert consecutive_fraction([7]) == 1.0
