"""Planning coalesced KV pulls: the fewest, largest NIXL descriptors that move the same bytes.

Pure (numpy, no NIXL, no vLLM). vLLM describes a pull as two index lists into descriptor lists
it prepared once per engine: one descriptor per KV region (layer, or layer x K/V) x block, the
i-th local descriptor receiving the i-th remote one. NIXL merges neighbours only when their
indices are consecutive on both sides *and* each prepared list is dense (descriptor length ==
block stride), so vLLM's pulls stay one descriptor per region x block whenever

- the block ids run backwards (vLLM's free queue hands freed blocks out tail first), or
- the layout is not dense per region: K and V halves of one block interleaved (vLLM 0.25's
  FLASH_ATTN, blocks first), or all layers of a block stored together (cross-layer layouts).

:func:`plan_pull` works on the bytes instead: it sorts the (destination, source) pairs by
destination address and joins each pair with the next when both sides continue in memory, on
the same device and, where known, in the same registered memory range. The result moves
exactly the bytes vLLM's pair list moves (every byte of every pair, each to the same place) as
one descriptor per maximal run, whatever the layout: a layer x K/V region per run of blocks,
or a whole layer, or all layers of a run where memory allows. Runs that are not contiguous on
both sides stay separate, down to vLLM's own per-block descriptors.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import numpy.typing as npt

Rows = npt.NDArray[np.uint64]
Indices = npt.NDArray[np.int64]

# Columns of a descriptor row, as NIXL's Nx3 arrays have them.
ADDRESS, LENGTH, DEVICE = 0, 1, 2


class PlanError(ValueError):
    """The pair list cannot be coalesced safely; the caller posts vLLM's own descriptors."""


@dataclass(frozen=True)
class DescriptorList:
    """A prepared descriptor list: one row (address, length, device id) per descriptor.

    ``segments`` (optional, one id per row): rows with different ids lie in different registered
    memory ranges, so no descriptor may span them. None when the caller does not know.
    """

    rows: Rows
    segments: npt.NDArray[np.int64] | None = None

    @classmethod
    def of(cls, rows: object, segments: object = None) -> DescriptorList:
        array = np.asarray(rows, dtype=np.uint64)
        if array.ndim != 2 or array.shape[1] != 3:
            raise PlanError(f"descriptor rows must be N x 3 (address, length, device), got {array.shape}")
        seg = None if segments is None else np.asarray(segments, dtype=np.int64)
        if seg is not None and seg.shape != (array.shape[0],):
            raise PlanError("one segment id per descriptor row is needed")
        return cls(rows=array, segments=seg)

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    # Contiguous columns: a pull gathers ~100k rows, which is several times faster per column.
    @cached_property
    def addresses(self) -> Rows:
        return np.ascontiguousarray(self.rows[:, ADDRESS])

    @cached_property
    def lengths(self) -> Rows:
        return np.ascontiguousarray(self.rows[:, LENGTH])

    @cached_property
    def devices(self) -> Rows | None:
        """Device id per row; None when every row is on one device."""
        column = self.rows[:, DEVICE]
        return None if column.size == 0 or bool(np.all(column == column[0])) else np.ascontiguousarray(column)


@dataclass(frozen=True)
class PullPlan:
    """Descriptors to post: ``local[i]`` receives ``remote[i]`` (same length)."""

    local: Rows
    remote: Rows
    # Descriptors vLLM listed for the same pull (one per region x block).
    listed: int
    total_bytes: int

    @property
    def descriptors(self) -> int:
        return int(self.local.shape[0])


def plan_pull(
    local: DescriptorList,
    local_indices: Sequence[int] | npt.NDArray[np.integer],
    remote: DescriptorList,
    remote_indices: Sequence[int] | npt.NDArray[np.integer],
) -> PullPlan:
    """The coalesced form of vLLM's pull ``local[local_indices[i]] <- remote[remote_indices[i]]``.

    Raises :class:`PlanError` where coalescing could change what lands where (mismatched
    lengths, overlapping destinations, indices out of range): the caller then posts vLLM's list.
    """
    li = _indices(local_indices, len(local), "local")
    ri = _indices(remote_indices, len(remote), "remote")
    if li.shape != ri.shape:
        raise PlanError(f"{li.size} local but {ri.size} remote descriptors")
    empty = np.empty((0, 3), dtype=np.uint64)
    if li.size == 0:
        return PullPlan(local=empty, remote=empty, listed=0, total_bytes=0)
    laddr, lengths, raddr = local.addresses[li], local.lengths[li], remote.addresses[ri]
    if not np.array_equal(lengths, remote.lengths[ri]):
        raise PlanError("a local and a remote descriptor of one pair differ in length")
    # Destinations are distinct blocks, so their order is free: sorting by destination puts each
    # pair next to the only pair it could continue into.
    order: npt.NDArray[np.intp] | None = None
    if li.size > 1 and not bool(np.all(laddr[1:] > laddr[:-1])):
        order = np.argsort(laddr, kind="stable")
        laddr, lengths, raddr = laddr[order], lengths[order], raddr[order]
    lend = laddr + lengths
    if np.any(laddr[1:] < lend[:-1]):
        raise PlanError("two destinations overlap")
    joins = (laddr[1:] == lend[:-1]) & (raddr[1:] == raddr[:-1] + lengths[:-1])
    for side, indices in ((local, li), (remote, ri)):
        for per_row in (side.devices, side.segments):
            if per_row is not None:
                values = per_row[indices] if order is None else per_row[indices][order]
                joins &= values[1:] == values[:-1]
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    run_lengths = np.add.reduceat(lengths, starts).astype(np.uint64)
    out_local = np.stack([laddr[starts], run_lengths, _column(local.rows, li, order, starts)], axis=1)
    out_remote = np.stack([raddr[starts], run_lengths, _column(remote.rows, ri, order, starts)], axis=1)
    return PullPlan(
        local=np.ascontiguousarray(out_local, dtype=np.uint64),
        remote=np.ascontiguousarray(out_remote, dtype=np.uint64),
        listed=int(li.size),
        total_bytes=int(run_lengths.sum()),
    )


def _column(
    rows: Rows, indices: Indices, order: npt.NDArray[np.intp] | None, starts: npt.NDArray[np.intp]
) -> Rows:
    """The device ids of the planned descriptors (one per run start)."""
    picked = indices if order is None else indices[order]
    devices: Rows = rows[picked[starts], DEVICE]
    return devices


def _indices(values: Sequence[int] | npt.NDArray[np.integer], size: int, side: str) -> Indices:
    array = np.asarray(values, dtype=np.int64).reshape(-1)
    if array.size and (array.min() < 0 or array.max() >= size):
        raise PlanError(f"{side} descriptor index out of range (list of {size})")
    return array


def segments_of(rows: Rows, ranges: Sequence[tuple[int, int]]) -> npt.NDArray[np.int64]:
    """For each descriptor row, the index of the registered range ``(start, length)`` holding it.

    -1 where no single range holds the whole descriptor (such rows never join another).
    """
    if not ranges:
        return np.full(rows.shape[0], -1, dtype=np.int64)
    ordered = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    starts = np.asarray([ranges[i][0] for i in ordered], dtype=np.uint64)
    ends = np.asarray([ranges[i][0] + ranges[i][1] for i in ordered], dtype=np.uint64)
    ids = np.asarray(ordered, dtype=np.int64)
    addresses = rows[:, ADDRESS]
    slot = np.searchsorted(starts, addresses, side="right").astype(np.int64) - 1
    found = slot >= 0
    safe = np.where(found, slot, 0)
    inside = found & (addresses + rows[:, LENGTH] <= ends[safe])
    result = np.where(inside, ids[safe], -1)
    # Rows outside every range get distinct negative ids so that they never join.
    outside = np.flatnonzero(~inside)
    result[outside] = -1 - np.arange(outside.size, dtype=np.int64)
    return result


@dataclass(frozen=True)
class BlockRuns:
    """How consecutive a pull's block ids are (a block id pair: local[i] receives remote[i])."""

    blocks: int
    # Runs NIXL can merge from vLLM's order: both ids step +1 from one pair to the next.
    runs_as_listed: int
    # Runs kvferry merges: pairs sorted by local id, both ids step +1 (backward runs on both
    # sides count as runs too).
    runs_sorted: int

    @property
    def mean_run_blocks(self) -> float:
        return self.blocks / self.runs_sorted if self.runs_sorted else 0.0


def block_runs(local_ids: Sequence[int], remote_ids: Sequence[int]) -> BlockRuns:
    if len(local_ids) != len(remote_ids):
        raise ValueError("local and remote block id lists differ in length")
    pairs = list(zip(local_ids, remote_ids, strict=True))
    if not pairs:
        return BlockRuns(blocks=0, runs_as_listed=0, runs_sorted=0)

    def runs(seq: list[tuple[int, int]]) -> int:
        return 1 + sum(1 for (l0, r0), (l1, r1) in itertools.pairwise(seq) if (l1, r1) != (l0 + 1, r0 + 1))

    return BlockRuns(blocks=len(pairs), runs_as_listed=runs(pairs), runs_sorted=runs(sorted(pairs)))


def first_block_pairs(
    local: DescriptorList, registered: Sequence[tuple[int, int]], remote: DescriptorList
) -> tuple[Rows, Rows]:
    """A READ that touches every region of a peer once: each local registered range's first block
    receives the same region's first block on the peer (rows: local, remote).

    vLLM registers each KV region from its block 0, which its block pool never hands to a request (the
    null block), so writing there changes nothing a request reads. Both lists hold the regions in the
    same order, one equal share of rows each (the coalescer's assumption: same vLLM, layout and
    config). Raises :class:`PlanError` when the lists do not look like that.
    """
    if local.segments is None or not registered:
        raise PlanError("the local registered ranges are not known")
    segments = local.segments
    # Regions in row order; a region's rows must be one contiguous share of the list.
    order = [int(s) for s in dict.fromkeys(segments.tolist()) if s >= 0]
    if not order or int(np.count_nonzero(segments >= 0)) != len(local):
        raise PlanError("some local rows lie outside every registered range")
    share, rest = divmod(len(local), len(order))
    if rest or any(bool(np.any(segments[i * share : (i + 1) * share] != s)) for i, s in enumerate(order)):
        raise PlanError("the local rows are not one equal share per registered range")
    remote_share, remote_rest = divmod(len(remote), len(order))
    if remote_rest or remote_share == 0:
        raise PlanError(f"{len(remote)} remote rows do not split into {len(order)} regions")
    local_rows, remote_rows = [], []
    for i, segment in enumerate(order):
        mine = local.rows[i * share : (i + 1) * share]
        first = mine[int(np.argmin(mine[:, ADDRESS]))]
        if int(first[ADDRESS]) != registered[segment][0]:
            raise PlanError("a region's first row does not start its registered range")
        theirs = remote.rows[i * remote_share : (i + 1) * remote_share]
        local_rows.append(first)
        remote_rows.append(theirs[int(np.argmin(theirs[:, ADDRESS]))])
    local_out = np.array(local_rows, dtype=np.uint64)
    remote_out = np.array(remote_rows, dtype=np.uint64)
    length = np.minimum(local_out[:, LENGTH], remote_out[:, LENGTH])
    local_out[:, LENGTH] = length
    remote_out[:, LENGTH] = length
    return local_out, remote_out
