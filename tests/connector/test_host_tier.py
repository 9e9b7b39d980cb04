"""The host tier's pure parts: pool layout, remote rows, slots, orders, the copy (no vLLM, no NIXL)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvferry.connector.copies import CopyDone, CopyError, HostCopier, Run
from kvferry.connector.host_tier import (
    Demotions,
    HostPool,
    HostPoolLayout,
    HostTierError,
    SlotAllocator,
    due_demotions,
    extend_remote_rows,
    next_demotion_at,
)
from kvferry.connector.logs import COPIED_LOG
from kvferry.connector.retention import RetainedEntry

REGIONS = 3
KV_BLOCKS = 8
BLOCK_BYTES = (64, 64, 32)


def kv_cache() -> tuple[np.ndarray, np.ndarray]:
    """Host memory laid out as REGIONS regions of KV_BLOCKS blocks, and vLLM's rows for it."""
    memory = np.random.default_rng(0).integers(0, 255, sum(BLOCK_BYTES) * KV_BLOCKS, dtype=np.uint8)
    base = int(memory.ctypes.data)
    rows: list[tuple[int, int, int]] = []
    offset = 0
    for length in BLOCK_BYTES:
        rows.extend((base + offset + block * length, length, 0) for block in range(KV_BLOCKS))
        offset += KV_BLOCKS * length
    return memory, np.asarray(rows, dtype=np.uint64)


def block_bytes(rows: np.ndarray, block: int) -> bytes:
    import ctypes

    return b"".join(
        ctypes.string_at(int(rows[region * KV_BLOCKS + block, 0]), int(rows[region * KV_BLOCKS + block, 1]))
        for region in range(REGIONS)
    )


def test_copy_puts_each_block_of_every_region_in_its_slot() -> None:
    memory, rows = kv_cache()
    pool = HostPool(rows, [KV_BLOCKS] * REGIONS, slots=6)
    # A run on both sides (2,3 -> 0,1), then blocks that are not consecutive.
    copied, copy = pool.copy_in([2, 3, 7, 5], [0, 1, 4, 2])
    assert copied == 4 * sum(BLOCK_BYTES) and copy.done()
    for block, slot in ((2, 0), (3, 1), (7, 4), (5, 2)):
        assert pool.slot_bytes(slot) == block_bytes(rows, block)
    assert pool.slot_bytes(3) == b"\x01" * sum(BLOCK_BYTES)  # untouched (pages written at start)
    del memory


class RecordingCopier(HostCopier):
    """Copies as the host copier does and keeps the runs it was given."""

    def __init__(self) -> None:
        self.runs: list[Run] = []

    def start(self, runs: Sequence[Run], after: object | None = None) -> CopyDone:
        self.runs.extend(runs)
        return super().start(runs, after)


def interleaved_kv_cache() -> tuple[np.ndarray, np.ndarray]:
    """Two layers laid out blocks first: block b of a layer holds its K half, then its V half (48 bytes each);
    vLLM's rows list per layer its K region's blocks, then its V region's."""
    half, layers = 48, 2
    memory = np.random.default_rng(1).integers(0, 255, layers * KV_BLOCKS * 2 * half, dtype=np.uint8)
    base = int(memory.ctypes.data)
    rows = [
        (base + (layer * KV_BLOCKS + block) * 2 * half + kv * half, half, 0)
        for layer in range(layers)
        for kv in range(2)
        for block in range(KV_BLOCKS)
    ]
    return memory, np.asarray(rows, dtype=np.uint64)


def test_a_pool_over_interleaved_regions_interleaves_them_too_so_runs_copy_as_one_range_per_layer() -> None:
    memory, rows = interleaved_kv_cache()
    pool = HostPool(rows, [KV_BLOCKS] * 4, slots=6)
    # K and V of a layer: a slot footprint of 96 bytes, V 48 bytes after K; the layers one after the other.
    (k0, _, k0_stride), (v0, _, v0_stride), (k1, _, _), _ = pool.layout_regions
    assert (v0 - k0, k0_stride, v0_stride, k1 - k0) == (48, 96, 96, 6 * 96)
    copied, copy = pool.copy_in([2, 3, 4], [1, 2, 3])
    assert copy.done() and copied == 3 * 4 * 48
    for block, slot in ((2, 1), (3, 2), (4, 3)):
        expected = b"".join(
            bytes(memory[int(rows[r * KV_BLOCKS + block, 0]) - int(memory.ctypes.data) :][:48])
            for r in range(4)
        )
        assert pool.slot_bytes(slot) == expected
    # Blocks 2-4 to slots 1-3: one range per layer (K, V, K, V ... back to back on both sides).
    recorder = RecordingCopier()
    pool.copier = recorder
    pool.copy_in([2, 3, 4], [1, 2, 3])
    assert [n for _, _, n in recorder.runs] == [3 * 96, 3 * 96]


def test_pool_layout_rows_address_the_slots_a_prefill_reads() -> None:
    _memory, rows = kv_cache()
    pool = HostPool(rows, [KV_BLOCKS] * REGIONS, slots=4)
    pool.copy_in([6], [3])[1].wait()
    layout = pool.layout()
    assert layout.first_block_id == KV_BLOCKS and layout.slots == 4
    pool_rows = layout.rows()
    assert pool_rows.shape == (REGIONS * 4, 3)
    import ctypes

    read = b"".join(
        ctypes.string_at(int(pool_rows[region * 4 + 3, 0]), int(pool_rows[region * 4 + 3, 1]))
        for region in range(REGIONS)
    )
    assert read == block_bytes(rows, 6)


def test_extended_rows_find_pool_slot_s_at_block_id_kv_blocks_plus_s() -> None:
    _memory, rows = kv_cache()
    layout = HostPoolLayout(
        first_block_id=KV_BLOCKS, slots=5, regions=((1000, 64, 64), (5000, 64, 128), (5064, 32, 128))
    )
    extended, per_region = extend_remote_rows(rows, [KV_BLOCKS] * REGIONS, layout)
    assert per_region == [KV_BLOCKS + 5] * REGIONS
    offsets = np.cumsum([0, *per_region[:-1]])
    # vLLM's descriptor index of (region r, block b) is offsets[r] + b.
    for region in range(REGIONS):
        for block in range(KV_BLOCKS):
            assert (extended[offsets[region] + block] == rows[region * KV_BLOCKS + block]).all()
        for slot in range(5):
            address, length, stride = layout.regions[region]
            assert extended[offsets[region] + KV_BLOCKS + slot].tolist() == [
                address + slot * stride,
                length,
                0,
            ]


def test_extended_rows_refuse_a_pool_unlike_the_kv_cache() -> None:
    _memory, rows = kv_cache()
    two_regions = HostPoolLayout(first_block_id=KV_BLOCKS, slots=2, regions=((1, 64, 64), (2, 64, 64)))
    with pytest.raises(HostTierError, match="regions"):
        extend_remote_rows(rows, [KV_BLOCKS] * REGIONS, two_regions)
    wrong_start = HostPoolLayout(first_block_id=KV_BLOCKS + 1, slots=2, regions=((1, 64, 64),) * REGIONS)
    with pytest.raises(HostTierError, match="starts at block"):
        extend_remote_rows(rows, [KV_BLOCKS] * REGIONS, wrong_start)


def test_pool_refuses_regions_of_unequal_block_counts() -> None:
    _memory, rows = kv_cache()
    with pytest.raises(HostTierError, match="same blocks"):
        HostPool(rows, [KV_BLOCKS - 1, KV_BLOCKS + 1, KV_BLOCKS], slots=2)
    with pytest.raises(HostTierError, match="at least one slot"):
        HostPool(rows, [KV_BLOCKS] * REGIONS, slots=0)


def test_slots_come_in_the_lowest_run_that_fits() -> None:
    slots = SlotAllocator(10)
    assert slots.allocate(3) == [0, 1, 2]
    assert slots.allocate(2) == [3, 4]
    slots.free([1])
    # 1 alone does not fit 3: the run from 5 does.
    assert slots.allocate(3) == [5, 6, 7]
    # No run of 3 left (1, 8, 9): the lowest free ones.
    assert slots.allocate(3) == [1, 8, 9]
    assert slots.allocate(1) is None
    assert slots.free_count == 0
    with pytest.raises(ValueError, match="not allocated"):
        slots.free([10])
    slots.free([0])
    with pytest.raises(ValueError, match="not allocated"):
        slots.free([0])


def test_slots_given_back_in_any_order_merge_into_runs_again() -> None:
    slots = SlotAllocator(12)
    taken = [slots.allocate(3) or [] for _ in range(4)]
    assert taken == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    for run in (taken[2], taken[0], taken[1]):  # out of order; 9..11 stay out
        slots.free(reversed(run))
    assert slots.free_count == 9
    # One run again: nine slots from 0 fit a run of nine.
    assert slots.allocate(9) == list(range(9))
    slots.free([4])
    with pytest.raises(ValueError, match="not allocated"):
        slots.free([4])
    with pytest.raises(ValueError, match="not allocated"):
        slots.free([-1])


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 6)), max_size=60))
def test_slots_are_never_handed_out_twice_and_all_come_back(steps: list[tuple[bool, int]]) -> None:
    slots = SlotAllocator(16)
    out: list[list[int]] = []
    for allocate, count in steps:
        if allocate or not out:
            got = slots.allocate(count)
            held = {slot for run in out for slot in run}
            if got is None:
                assert count > 16 - len(held)
                continue
            assert len(got) == count and not held & set(got) and all(0 <= slot < 16 for slot in got)
            out.append(got)
        else:
            slots.free(out.pop(count % len(out)))
        assert slots.free_count == 16 - sum(len(run) for run in out)
    for run in out:
        slots.free(run)
    assert slots.allocate(16) == list(range(16))


def test_orders_go_out_with_a_step_and_finish_by_the_workers_counter() -> None:
    demotions = Demotions(SlotAllocator(4))
    first = demotions.order("r1", [7, 8])
    second = demotions.order("r2", [3])
    assert first is not None and second is not None
    assert demotions.order("r3", [1, 2]) is None  # one slot left
    assert demotions.busy("r1") and not demotions.busy("r3")
    assert [d.request_id for d in demotions.take_unsent()] == ["r1", "r2"]
    assert demotions.take_unsent() == []
    assert demotions.completed(0) == []
    assert [d.request_id for d in demotions.completed(first.sequence)] == ["r1"]
    assert [d.request_id for d in demotions.completed(second.sequence)] == ["r2"]
    assert not demotions.busy("r2")
    assert "r1" in demotions.ordered


def entry(request_id: str, blocks: int, created_at: float, published: bool = True) -> RetainedEntry:
    return RetainedEntry(
        request_id=request_id,
        tenant="t",
        conversation_id=request_id,
        turn=1,
        block_ids=tuple(range(blocks)),
        num_tokens=blocks * 32,
        block_digests=(),
        created_at=created_at,
        last_used=created_at,
        last_contact=created_at,
        published=published,
    )


def published(e: RetainedEntry) -> bool:
    return e.published


def test_retentions_move_when_idle_long_enough_or_over_the_kv_cache_budget() -> None:
    # Least recently used first, as the table lists them.
    live = [entry("old", 4, 0.0), entry("mid", 4, 50.0), entry("new", 4, 90.0, published=False)]
    idle = due_demotions(live, now=100.0, demote_after_seconds=60.0, budget_blocks=100, movable=published)
    assert [e.request_id for e in idle] == ["old"]
    # 12 blocks live against a budget of 6: the oldest movable ones go until 6 fit (old, then mid); the
    # unpublished one cannot move (its record is not in the registry yet) but counts.
    over = due_demotions(live, now=60.0, demote_after_seconds=600.0, budget_blocks=6, movable=published)
    assert [e.request_id for e in over] == ["old", "mid"]
    assert (
        due_demotions(live, now=60.0, demote_after_seconds=600.0, budget_blocks=12, movable=published) == []
    )


def test_the_next_move_is_when_the_oldest_movable_retention_turns_idle() -> None:
    live = [entry("unpublished", 4, 5.0, published=False), entry("a", 4, 10.0), entry("b", 4, 20.0)]
    assert next_demotion_at(live, demote_after_seconds=30.0, movable=published) == 40.0
    assert next_demotion_at(live[:1], demote_after_seconds=30.0, movable=published) is None


def test_a_free_block_shortfall_moves_the_least_recently_used_until_it_is_covered() -> None:
    live = [entry("a", 4, 0.0), entry("b", 4, 10.0), entry("c", 4, 20.0)]
    # Under the budget and none idle, but 5 free blocks missing under the watermark: a and b go.
    due = due_demotions(
        live, now=30.0, demote_after_seconds=600.0, budget_blocks=100, movable=published, shortfall_blocks=5
    )
    assert [e.request_id for e in due] == ["a", "b"]


def test_a_busy_step_takes_a_few_blocks_of_an_order_and_its_final_part_puts_it_in_flight() -> None:
    demotions = Demotions(SlotAllocator(16))
    big = demotions.order("big", list(range(10)))
    small = demotions.order("small", [20, 21])
    assert big is not None and small is not None
    first = demotions.take_unsent(4)
    assert [(d.request_id, d.block_ids, d.final) for d in first] == [("big", (0, 1, 2, 3), False)]
    assert first[0].slots == big.slots[:4]
    assert demotions.busy("big") and not demotions.in_flight
    second = demotions.take_unsent(8)
    assert [(d.request_id, len(d.block_ids), d.final) for d in second] == [
        ("big", 6, True),
        ("small", 2, True),
    ]
    assert second[0].slots == big.slots[4:]
    # In flight whole: completion frees or publishes every slot of the order.
    assert demotions.in_flight[big.sequence] == big
    assert demotions.take_unsent(4) == []
    assert [d.request_id for d in demotions.completed(small.sequence)] == ["big", "small"]


def test_an_idle_step_takes_every_waiting_order_whole() -> None:
    demotions = Demotions(SlotAllocator(16))
    demotions.order("a", list(range(7)))
    demotions.order("b", list(range(5)))
    assert [(d.request_id, d.final) for d in demotions.take_unsent()] == [("a", True), ("b", True)]


def test_cancelled_orders_come_back_whole_with_their_slots_and_no_order_goes_out_after() -> None:
    """After a worker failed a copy: the order in flight, the one half sent and the one not sent yet, each
    whole."""
    allocator = SlotAllocator(16)
    demotions = Demotions(allocator)
    sent = demotions.order("sent", [1, 2])
    half = demotions.order("half", list(range(10, 16)))
    waiting = demotions.order("waiting", [30])
    assert sent is not None and half is not None and waiting is not None
    assert [d.final for d in demotions.take_unsent(4)] == [True, False]  # sent whole, half's first 2 blocks
    cancelled = demotions.cancel()
    assert cancelled == [sent, half, waiting]
    for demotion in cancelled:
        allocator.free(demotion.slots)
    assert allocator.free_count == 16
    assert demotions.stopped and demotions.take_unsent() == [] and not demotions.busy("half")


def moving_worker(copier: HostCopier) -> tuple[Any, np.ndarray, np.ndarray]:
    """A decode worker with its demotion state alone (no vLLM): a pool of 4 slots over a small KV cache, and
    its generation file; with the KV cache's rows and the memory they point into (the caller keeps it)."""
    from kvferry.connector.connector import KvferryWorker
    from kvferry.connector.generations import GenerationFile

    memory, rows = kv_cache()
    worker = KvferryWorker.__new__(KvferryWorker)
    worker.host_pool = HostPool(rows, [KV_BLOCKS] * REGIONS, slots=4, copier=copier)
    worker.generation_file = GenerationFile.create(KV_BLOCKS + 4)
    worker._mover = None
    worker._moved_lock = threading.Lock()
    worker._move_failed = False
    return worker, rows, memory


class HeldCopy:
    """A copy that is done only once the test lets it be (as a GPU's, still on its stream)."""

    def __init__(self) -> None:
        self.released = threading.Event()

    def done(self) -> bool:
        return self.released.is_set()

    def wait(self) -> None:
        assert self.released.wait(10), "the copy was never let through"


class HeldCopier(HostCopier):
    """Copies as the host copier does, but the copy counts as done only once the test lets it (a GPU's); says
    on which thread the move was ordered (checkpoint) and on which its copies started."""

    name = "held"
    synchronous = False

    def __init__(self) -> None:
        self.copy = HeldCopy()
        self.threads: list[tuple[str, str]] = []

    def checkpoint(self) -> object | None:
        self.threads.append(("checkpoint", threading.current_thread().name))
        return "the step's work so far"

    def start(self, runs: Sequence[Run], after: object | None = None) -> CopyDone:
        assert after == "the step's work so far"
        self.threads.append(("start", threading.current_thread().name))
        super().start(runs, after)
        return self.copy


def test_a_worker_counts_a_move_done_only_once_its_copy_is_and_never_waits_for_it_in_the_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The decode worker's part of a demotion (kvferry.connector.connector.KvferryWorker._demote): a copy
    still running when the step's call returns is waited for by the worker's own thread, which then counts
    the order done in the shared counter the scheduler reads. The step's thread does not even plan the copies:
    it orders the move after its own work so far, and that thread starts them. The line says the step's share
    apart from the whole copy."""
    from kvferry.connector.generations import DEMOTED
    from kvferry.connector.host_tier import Demotion

    copier = HeldCopier()
    worker, rows, _memory = moving_worker(copier)
    caplog.set_level(logging.INFO, logger="kvferry.connector")
    worker._demote([Demotion(sequence=3, request_id="r1", block_ids=(1, 2), slots=(0, 1))])
    assert int(worker.generation_file.counters[DEMOTED]) == 0
    time.sleep(0.05)  # the copy is held past the step's call
    copier.copy.released.set()
    deadline = time.monotonic() + 10
    while int(worker.generation_file.counters[DEMOTED]) != 3:
        assert time.monotonic() < deadline, "the move was never counted done"
        time.sleep(0.01)
    assert worker._mover is not None
    worker._mover.shutdown()
    (line,) = [r for r in caplog.records if r.getMessage() == COPIED_LOG]
    assert line.copy_ms >= 50 > line.step_ms  # type: ignore[attr-defined]
    step = threading.current_thread().name
    assert copier.threads[0] == ("checkpoint", step)
    assert copier.threads[1][0] == "start" and copier.threads[1][1].startswith("kvferry-host-moves")
    pool = worker.host_pool
    assert pool.slot_bytes(0) == block_bytes(rows, 1) and pool.slot_bytes(1) == block_bytes(rows, 2)


class FailingCopier(HostCopier):
    """Fails its first copy; counts the copies it was asked for."""

    name = "failing"

    def __init__(self, synchronous: bool) -> None:
        self.synchronous = synchronous
        self.starts = 0

    def start(self, runs: Sequence[Run], after: object | None = None) -> CopyDone:
        self.starts += 1
        if self.starts == 1:
            raise CopyError("the GPU refused the copy")
        return super().start(runs, after)


@pytest.mark.parametrize("synchronous", [True, False])
def test_after_a_failed_copy_no_later_move_is_copied_or_counted_done(synchronous: bool) -> None:
    """The done counter means "every order up to N": had a later order counted done, the scheduler would
    publish the failed one's slots, never written, and pulls of them would pass the fence. The worker says
    which order failed and copies nothing after (the scheduler then cancels what it has not seen done)."""
    from kvferry.connector.generations import DEMOTE_FAILED, DEMOTED
    from kvferry.connector.host_tier import Demotion

    copier = FailingCopier(synchronous)
    worker, _rows, _memory = moving_worker(copier)
    worker._demote([Demotion(sequence=1, request_id="r1", block_ids=(1, 2), slots=(0, 1))])
    worker._demote([Demotion(sequence=2, request_id="r2", block_ids=(3,), slots=(2,))])
    if worker._mover is not None:
        worker._mover.shutdown()  # waits for both
    counters = worker.generation_file.counters
    assert (int(counters[DEMOTE_FAILED]), int(counters[DEMOTED])) == (1, 0)
    assert copier.starts == 1


def test_a_pull_naming_blocks_its_holder_cannot_address_here_fails_instead_of_reading_another_region(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prefill whose handshake could not add a holder's pool (vLLM still addresses only that holder's KV
    cache) fails a pull of the holder's host-tier blocks, to recompute: vLLM would compute those blocks'
    descriptors into the next region. A pull within reach goes on to vLLM."""
    from types import SimpleNamespace

    from kvferry.connector import vllm_internals
    from kvferry.connector.connector import KvferryWorker
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorWorker

    failed: list[str] = []
    posted: list[str] = []
    monkeypatch.setattr(vllm_internals, "fail_pull", lambda worker, request_id: failed.append(request_id))
    monkeypatch.setattr(
        NixlPullConnectorWorker,
        "_read_blocks_for_req",
        lambda self, request_id, meta: posted.append(request_id),
    )
    worker = KvferryWorker.__new__(KvferryWorker)  # the pull's checks alone; no vLLM
    worker._read_deadlines = {}
    worker._pull_options = {}
    worker.fence = None
    worker._recving_transfers = {}
    worker.dst_num_blocks = {"holder": KV_BLOCKS}
    worker.pulls = SimpleNamespace(set_context=lambda context: None)  # type: ignore[assignment]

    def meta(remote_ids: list[int]) -> SimpleNamespace:
        remote = SimpleNamespace(engine_id="holder", block_ids=[remote_ids], request_id="d-1")
        return SimpleNamespace(remote=remote, local_block_ids=[list(range(len(remote_ids)))])

    worker._read_blocks_for_req("beyond", meta([3, KV_BLOCKS + 2]))
    worker._read_blocks_for_req("within", meta([3, KV_BLOCKS - 1]))
    assert (failed, posted) == (["beyond"], ["within"])
    # Once the pool is added, vLLM addresses its slots after the KV cache's blocks: the same pull goes on.
    worker.dst_num_blocks["holder"] = KV_BLOCKS + 4
    worker._read_blocks_for_req("in the pool", meta([3, KV_BLOCKS + 2]))
    assert posted == ["within", "in the pool"]
