"""kvferry.connector.copies: joining copy pieces into runs, and the host copier (the GPU copier is timed on a
GPU by tools/gpu/host_tier_copies.py)."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from kvferry.connector.copies import HostCopier, copier_for, merge_runs


def pieces(runs: list[tuple[int, int, int]]) -> set[tuple[int, int]]:
    """Every byte a set of copies moves, as (destination, source) pairs."""
    return {(d + i, s + i) for d, s, n in runs for i in range(n)}


def arrays(items: list[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    columns = np.asarray(items, dtype=np.uint64).reshape(-1, 3)
    return columns[:, 0], columns[:, 1], columns[:, 2]


def test_shuffled_pieces_of_one_range_are_one_copy() -> None:
    order = np.random.default_rng(0).permutation(50)
    items = [(1000 + 8 * int(i), 9000 + 8 * int(i), 8) for i in order]
    assert merge_runs(*arrays(items)) == [(1000, 9000, 400)]


def test_pieces_continuing_on_one_side_only_stay_apart() -> None:
    items = [(0, 100, 4), (4, 200, 4), (8, 204, 4)]
    assert merge_runs(*arrays(items)) == [(0, 100, 4), (4, 200, 8)]
    assert merge_runs(*arrays([])) == []


@given(
    st.lists(
        st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(1, 3)),
        min_size=1,
        max_size=30,
        unique_by=lambda t: t[0],
    )
)
def test_joined_copies_move_exactly_the_bytes_the_pieces_did(raw: list[tuple[int, int, int]]) -> None:
    # Pieces that do not overlap on the destination side (each byte written once).
    items = [(8 * d, 8 * s, n) for d, s, n in raw]
    runs = merge_runs(*arrays(items))
    assert pieces(runs) == pieces(items)
    assert len(runs) <= len(items)
    assert [d for d, _, _ in runs] == sorted(d for d, _, _ in runs)


def test_the_host_copier_copies_at_once_and_a_cpu_cache_gets_it() -> None:
    import torch

    source = np.arange(64, dtype=np.uint8)
    target = np.zeros(64, dtype=np.uint8)
    copy = HostCopier().start([(int(target.ctypes.data) + 8, int(source.ctypes.data), 16)])
    assert copy.done()
    assert target[8:24].tolist() == list(range(16))
    assert isinstance(copier_for([torch.zeros(4)]), HostCopier)


def test_a_gpu_copier_s_ranges_find_the_range_holding_a_run_and_swap_in_whole_on_add() -> None:
    """The GPU copier's address lookup (CudaCopier runs it; pure Python): the range that holds all of a run,
    the closest start first where ranges overlap; none for a run that spills over. A lookup under way keeps
    the lists it began with while another thread adds (a handshake maps a peer's pool beside a copy)."""
    from kvferry.connector.copies import _Ranges

    ranges = _Ranges()
    memory = {base: bytes((base + i) % 251 for i in range(100)) for base in (1000, 5000, 1040)}
    for base in (5000, 1000, 1040):
        ranges.add(base, 100, memoryview(memory[base]))

    def found(address: int, nbytes: int) -> bytes:
        view = ranges.slice(address, nbytes)
        assert view is not None
        return bytes(view)

    assert found(1010, 5) == memory[1000][10:15]
    assert found(1050, 5) == memory[1040][10:15]  # inside both: the closer start
    assert found(1090, 40) == memory[1040][50:90]  # past 1000's end, inside 1040's
    assert ranges.slice(5090, 20) is None and ranges.slice(10, 1) is None
    before = ranges._ranges
    ranges.add(9000, 10, memoryview(bytearray(10)))
    assert ranges._ranges is not before and before[0] == [1000, 1040, 5000]
