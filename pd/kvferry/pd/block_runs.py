"""How consecutive a list of KV block ids is: shared by the connector (its pulls post one NIXL descriptor per
run of consecutive blocks and KV region, and its pull log reports the runs) and the router (whose cost model
prices the extra descriptors of a fragmented retention)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence


def count_runs(block_ids: Sequence[int]) -> int:
    """Maximal runs of ids that step by +1, as listed (0 for no ids)."""
    if not block_ids:
        return 0
    return 1 + sum(1 for prev, cur in itertools.pairwise(block_ids) if cur != prev + 1)


def mean_run_blocks(block_ids: Sequence[int]) -> float:
    """Mean length of the runs of consecutive ids in ``block_ids`` (as listed); inf for no ids.

    The runs on the pulling side matter too; where its ids are unknown, the holder's are an upper bound.
    """
    if not block_ids:
        return math.inf
    return len(block_ids) / count_runs(block_ids)


def consecutive_fraction(block_ids: Sequence[int]) -> float:
    """Share of neighbouring ids in ``block_ids`` that step by +1 (1.0: one ascending run)."""
    if len(block_ids) < 2:
        return 1.0
    return (len(block_ids) - count_runs(block_ids)) / (len(block_ids) - 1)
