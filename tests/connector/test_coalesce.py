"""Planning coalesced pulls (pure): descriptor counts and byte-for-byte equivalence on every layout."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from kvferry.connector.coalesce import (
    DescriptorList,
    PlanError,
    PullPlan,
    block_runs,
    first_block_pairs,
    plan_pull,
    segments_of,
)

PAGE = 1024
BLOCKS = 64
LAYERS = 3


def per_layer_list(base: int, *, layers: int = LAYERS, gap: int = 1 << 20) -> DescriptorList:
    """vLLM 0.32's dense layout: one region per layer, one descriptor per block (whole page)."""
    rows = [
        (base + layer * (BLOCKS * PAGE + gap) + b * PAGE, PAGE, 0)
        for layer in range(layers)
        for b in range(BLOCKS)
    ]
    return DescriptorList.of(rows)


def kv_split_list(base: int, *, layers: int = LAYERS, gap: int = 1 << 20) -> DescriptorList:
    """vLLM 0.25's FLASH_ATTN (blocks first): per layer, K halves of all blocks, then V halves."""
    half = PAGE // 2
    rows = []
    for layer in range(layers):
        start = base + layer * (BLOCKS * PAGE + gap)
        rows += [(start + b * PAGE, half, 0) for b in range(BLOCKS)]
        rows += [(start + b * PAGE + half, half, 0) for b in range(BLOCKS)]
    return DescriptorList.of(rows)


def cross_layer_list(base: int, *, layers: int = LAYERS) -> DescriptorList:
    """All layers of a block stored together: region = layer, stride = layers x page."""
    rows = [
        (base + b * layers * PAGE + layer * PAGE, PAGE, 0) for layer in range(layers) for b in range(BLOCKS)
    ]
    return DescriptorList.of(rows)


def indices(block_ids: Sequence[int], regions: int) -> list[int]:
    """vLLM's descriptor ids: region-major, the request's blocks in request order."""
    return [region * BLOCKS + b for region in range(regions) for b in block_ids]


def byte_map(plan_local: np.ndarray, plan_remote: np.ndarray) -> dict[int, int]:
    """Destination byte address -> source byte address, at PAGE/4 granularity."""
    step = PAGE // 4
    mapping: dict[int, int] = {}
    for (la, n, _), (ra, m, _) in zip(plan_local.tolist(), plan_remote.tolist(), strict=True):
        assert n == m
        for offset in range(0, n, step):
            assert la + offset not in mapping, "a destination byte is written twice"
            mapping[la + offset] = ra + offset
    return mapping


def assert_same_bytes(
    plan: PullPlan, local: DescriptorList, li: Sequence[int], remote: DescriptorList, ri: Sequence[int]
) -> None:
    listed = byte_map(local.rows[np.asarray(li)], remote.rows[np.asarray(ri)])
    assert byte_map(plan.local, plan.remote) == listed
    assert plan.total_bytes == sum(int(local.rows[i][1]) for i in li)
    assert plan.listed == len(li)


def run_case(
    local: DescriptorList,
    remote: DescriptorList,
    local_ids: Sequence[int],
    remote_ids: Sequence[int],
    regions: int,
) -> PullPlan:
    li, ri = indices(local_ids, regions), indices(remote_ids, regions)
    plan = plan_pull(local, li, remote, ri)
    assert_same_bytes(plan, local, li, remote, ri)
    return plan


def test_contiguous_ids_give_one_descriptor_per_layer() -> None:
    plan = run_case(per_layer_list(1 << 30), per_layer_list(1 << 40), range(3, 23), range(7, 27), LAYERS)
    assert plan.descriptors == LAYERS


def test_fragmented_ids_give_one_descriptor_per_layer_and_run() -> None:
    local_ids = list(range(1, 21))
    remote_ids = [*range(30, 35), *range(10, 15), 50, 52, 54, *range(40, 47)]
    plan = run_case(per_layer_list(1 << 30), per_layer_list(1 << 40), local_ids, remote_ids, LAYERS)
    runs = block_runs(local_ids, remote_ids)
    assert runs.runs_sorted == 6
    assert plan.descriptors == LAYERS * runs.runs_sorted


def test_fully_scattered_ids_degrade_to_per_block_descriptors() -> None:
    rng = np.random.default_rng(1)
    local_ids = [int(x) for x in rng.permutation(BLOCKS)[:30]]
    remote_ids = [int(x) for x in rng.permutation(BLOCKS)[:30]]
    plan = run_case(per_layer_list(1 << 30), per_layer_list(1 << 40), local_ids, remote_ids, LAYERS)
    assert plan.descriptors == LAYERS * block_runs(local_ids, remote_ids).runs_sorted
    assert plan.descriptors >= LAYERS * 25


def test_ids_reversed_on_both_sides_merge_like_ascending_ones() -> None:
    # vLLM's free queue hands out freed blocks tail first: descending runs on both engines.
    local_ids = list(range(40, 20, -1))
    remote_ids = list(range(60, 40, -1))
    plan = run_case(per_layer_list(1 << 30), per_layer_list(1 << 40), local_ids, remote_ids, LAYERS)
    assert plan.descriptors == LAYERS
    runs = block_runs(local_ids, remote_ids)
    assert (runs.runs_as_listed, runs.runs_sorted) == (20, 1)


def test_ids_reversed_on_one_side_only_cannot_merge() -> None:
    local_ids = list(range(20, 40))
    remote_ids = list(range(60, 40, -1))
    plan = run_case(per_layer_list(1 << 30), per_layer_list(1 << 40), local_ids, remote_ids, LAYERS)
    assert plan.descriptors == LAYERS * 20


def test_mixed_directions_and_gaps() -> None:
    local_ids = [*range(1, 6), *range(20, 15, -1), 30, 31, 40]
    remote_ids = [*range(50, 55), *range(10, 5, -1), 3, 2, 60]
    plan = run_case(per_layer_list(1 << 30), per_layer_list(1 << 40), local_ids, remote_ids, LAYERS)
    # runs: 1-5/50-54, 16-20/6-10 (both reversed), 30/3, 31/2, 40/60
    assert block_runs(local_ids, remote_ids).runs_sorted == 5
    assert plan.descriptors == LAYERS * 5


def test_kv_halves_of_a_block_merge_with_the_layer_run() -> None:
    # NIXL cannot merge vLLM 0.25's K-only / V-only lists at all (not dense); by bytes, a run of
    # blocks is one contiguous range per layer, K and V together.
    plan = run_case(kv_split_list(1 << 30), kv_split_list(1 << 40), range(3, 23), range(7, 27), 2 * LAYERS)
    assert plan.descriptors == LAYERS
    plan = run_case(
        kv_split_list(1 << 30), kv_split_list(1 << 40), [1, 2, 3, 10, 11], [5, 6, 7, 30, 31], 2 * LAYERS
    )
    assert plan.descriptors == LAYERS * 2


def test_cross_layer_layout_gives_one_descriptor_per_run() -> None:
    plan = run_case(cross_layer_list(1 << 30), cross_layer_list(1 << 40), range(3, 23), range(7, 27), LAYERS)
    assert plan.descriptors == 1
    plan = run_case(
        cross_layer_list(1 << 30), cross_layer_list(1 << 40), [1, 2, 3, 10, 11], [5, 6, 7, 30, 31], LAYERS
    )
    assert plan.descriptors == 2


def test_descriptors_never_span_two_registrations() -> None:
    # Two layer tensors back to back in memory but registered separately.
    local = per_layer_list(1 << 30, gap=0)
    remote = per_layer_list(1 << 40, gap=0)
    li, ri = indices(range(BLOCKS), LAYERS), indices(range(BLOCKS), LAYERS)
    assert plan_pull(local, li, remote, ri).descriptors == 1
    ranges = [((1 << 30) + layer * BLOCKS * PAGE, BLOCKS * PAGE) for layer in range(LAYERS)]
    segmented = DescriptorList.of(local.rows, segments_of(local.rows, ranges))
    plan = plan_pull(segmented, li, remote, ri)
    assert plan.descriptors == LAYERS
    assert_same_bytes(plan, segmented, li, remote, ri)


def test_segments_of_marks_rows_outside_every_range() -> None:
    rows = np.asarray([(100, 10, 0), (110, 10, 0), (200, 10, 0), (295, 10, 0)], dtype=np.uint64)
    seg = segments_of(rows, [(200, 50), (100, 20), (290, 10)])
    assert seg[0] == seg[1] == 1 and seg[2] == 0
    assert seg[3] < 0  # crosses the end of its range
    unknown = segments_of(rows, [])
    assert len(set(unknown.tolist())) == 1


def test_devices_must_match_to_merge() -> None:
    local = DescriptorList.of([(0, 8, 0), (8, 8, 1)])
    remote = DescriptorList.of([(100, 8, 0), (108, 8, 0)])
    assert plan_pull(local, [0, 1], remote, [0, 1]).descriptors == 2


def test_unsafe_pair_lists_are_refused() -> None:
    local = per_layer_list(1 << 30)
    remote = per_layer_list(1 << 40)
    with pytest.raises(PlanError, match="overlap"):
        plan_pull(local, [1, 1], remote, [2, 3])
    with pytest.raises(PlanError, match="out of range"):
        plan_pull(local, [len(local)], remote, [0])
    with pytest.raises(PlanError, match="local but"):
        plan_pull(local, [1, 2], remote, [1])
    short = DescriptorList.of([(0, 8, 0)])
    with pytest.raises(PlanError, match="length"):
        plan_pull(short, [0], DescriptorList.of([(0, 16, 0)]), [0])
    with pytest.raises(PlanError, match="N x 3"):
        DescriptorList.of([(1, 2)])


def test_an_empty_pull_plans_nothing() -> None:
    plan = plan_pull(per_layer_list(0), [], per_layer_list(1 << 40), [])
    assert plan.descriptors == 0 and plan.total_bytes == 0


def test_block_run_statistics() -> None:
    assert block_runs([], []).runs_sorted == 0
    runs = block_runs([5, 6, 7, 1, 2], [10, 11, 12, 3, 4])
    assert (runs.blocks, runs.runs_as_listed, runs.runs_sorted) == (5, 2, 2)
    assert runs.mean_run_blocks == 2.5
    with pytest.raises(ValueError):
        block_runs([1], [])


def layer_ranges(base: int, *, layers: int = LAYERS, gap: int = 1 << 20) -> list[tuple[int, int]]:
    """The registrations behind per_layer_list / kv_split_list: one per layer, from its block 0."""
    return [(base + layer * (BLOCKS * PAGE + gap), BLOCKS * PAGE) for layer in range(layers)]


def with_segments(listed: DescriptorList, ranges: list[tuple[int, int]]) -> DescriptorList:
    return DescriptorList.of(listed.rows, segments_of(listed.rows, ranges))


def test_first_block_pairs_read_each_region_s_block_0_into_the_local_block_0() -> None:
    # The peer has more blocks per region than this engine (another KV cache size): regions still match.
    ranges = layer_ranges(1 << 30)
    remote_rows = [
        ((1 << 40) + layer * (3 * BLOCKS * PAGE) + b * PAGE, PAGE, 0)
        for layer in range(LAYERS)
        for b in range(2 * BLOCKS)
    ]
    local, remote = first_block_pairs(
        with_segments(per_layer_list(1 << 30), ranges), ranges, DescriptorList.of(remote_rows)
    )
    assert local.tolist() == [[start, PAGE, 0] for start, _ in ranges]
    assert remote.tolist() == [[(1 << 40) + layer * 3 * BLOCKS * PAGE, PAGE, 0] for layer in range(LAYERS)]


def test_first_block_pairs_take_the_first_half_of_a_kv_split_block() -> None:
    ranges = layer_ranges(1 << 30)
    local, remote = first_block_pairs(
        with_segments(kv_split_list(1 << 30), ranges), ranges, kv_split_list(1 << 40)
    )
    assert local.tolist() == [[start, PAGE // 2, 0] for start, _ in ranges]
    assert [row[0] for row in remote.tolist()] == [start for start, _ in layer_ranges(1 << 40)]


def test_first_block_pairs_of_a_cross_layer_layout_is_one_read() -> None:
    ranges = [(1 << 30, BLOCKS * LAYERS * PAGE)]
    local, remote = first_block_pairs(
        with_segments(cross_layer_list(1 << 30), ranges), ranges, cross_layer_list(1 << 40)
    )
    assert local.tolist() == [[1 << 30, PAGE, 0]]
    assert remote.tolist() == [[1 << 40, PAGE, 0]]


def test_first_block_pairs_refuse_lists_that_do_not_match_the_assumption() -> None:
    ranges = layer_ranges(1 << 30)
    local = with_segments(per_layer_list(1 << 30), ranges)
    with pytest.raises(PlanError, match="registered ranges are not known"):
        first_block_pairs(per_layer_list(1 << 30), ranges, per_layer_list(1 << 40))
    with pytest.raises(PlanError, match="do not split"):
        first_block_pairs(local, ranges, DescriptorList.of(per_layer_list(1 << 40).rows[:-1]))
    # A registration that begins before a region's block 0: that first row may be a request's block.
    early = [(start - PAGE, length + PAGE) for start, length in ranges]
    with pytest.raises(PlanError, match="does not start its registered range"):
        first_block_pairs(with_segments(per_layer_list(1 << 30), early), early, per_layer_list(1 << 40))
    # Rows outside every registration.
    with pytest.raises(PlanError, match="outside every registered range"):
        first_block_pairs(
            with_segments(per_layer_list(1 << 30), ranges[:1]), ranges[:1], per_layer_list(1 << 40)
        )
