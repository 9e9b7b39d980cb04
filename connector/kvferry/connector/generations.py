"""Block generations: the engine-side half of pull-time fencing (no vLLM, no NIXL here).

Every KV block of an engine has a generation, a 64-bit number that changes whenever the block goes
back to vLLM's free pool after a retention named it. A retention publishes its blocks' generations;
a prefill that pulled those blocks reads their generations again from the holder *after* its data
READ completed (:mod:`kvferry.connector.fence`) and drops what it pulled on any difference. Since a
block is bumped before vLLM can hand it to another request, equal generations prove the bytes were
not rewritten while they were read; no clock is involved.

The generations live in one small shared-memory file per worker (:class:`GenerationFile`), laid
out as three arrays of uint64::

    [ generations: num_blocks | landing: num_blocks | counters: COUNTER_SLOTS ]

- ``generations``: this engine's, written by the scheduler process (:class:`GenerationBook`) the
  moment a block returns to the pool, and read remotely over NIXL by prefill engines.
- ``landing``: where this worker's own fence READs put the holder's generations, one slot per local
  block id (a pulled block lands in one local block, so concurrent pulls never share a slot).
- ``counters``: the worker's fence counters, read by the scheduler for the engine's stats; the last
  slot holds the file's identity, a random number peers compare before they trust a mapping of it.

Why host memory, even on GPU engines: the scheduler (a CPU process) must make a bump visible
before it returns the block, with a plain store and no kernel launch or copy; NIXL's backends READ
host memory from any peer (UCX over RDMA or TCP, shared memory on one host); and the file is a few
bytes per block, so reading it costs one small transfer per run of blocks. A prefill engine on the
same host maps a holder's file read-only instead (:meth:`GenerationFile.map_peer`) and compares the
generations in place: no NIXL request to post (its fixed cost, ~0.1 ms, was most of a fence on one GPU).

Why a memfd: vLLM runs the scheduler and the workers in different processes; the worker creates
the file and registers it with its NIXL agent before the handshake metadata is built (so peers can
READ it), and the scheduler maps the same pages through ``/proc/<worker pid>/fd/<fd>``. Nothing is
left behind in /dev/shm when the engine dies.
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from kvferry.connector.peer_files import map_peer_file

Generations = npt.NDArray[np.uint64]

GENERATION_BYTES = 8
# Counter slots at the end of the file (worker writes, scheduler reads).
COUNTER_SLOTS = 8
FENCED_PULLS, CHECKED_PULLS = 0, 1
# The sequence number of the last host-tier demotion the worker copied (kvferry.connector.host_tier).
DEMOTED = 2
# The sequence number of a demotion whose copy failed; the worker counts no demotion done after it.
DEMOTE_FAILED = 3
# The file's identity (random, never 0): a peer that mapped a file through /proc checks it is the one the
# holder advertised, not another process's that took the same pid and fd.
IDENTITY = COUNTER_SLOTS - 1
# Generations start at a random base per engine incarnation, so a record from an engine that
# restarted never matches the new one's blocks. Below 2**52 (plus bumps) they stay exact in JSON
# numbers of any client (IEEE doubles), which carry them to the prefill engine.
_BASE_BITS = 52


def random_base() -> int:
    """An engine incarnation's first generation (every block starts there)."""
    return secrets.randbits(_BASE_BITS)


class GenerationError(RuntimeError):
    """The generation file cannot be created or shared; raised at engine start."""


@dataclass(frozen=True)
class GenerationArray:
    """Where a worker's generations are: what it tells its scheduler and its peers (handshake).

    ``address``/``device_id`` locate the generations in the worker's NIXL registration (DRAM);
    ``pid``/``fd`` let the engine's own scheduler, and peers on the same host, map the same file, whose
    ``identity`` they check (0: not advertised, an older holder: peers read over NIXL).
    """

    address: int
    num_blocks: int
    pid: int
    fd: int
    device_id: int = 0
    identity: int = 0

    @property
    def nbytes(self) -> int:
        return self.num_blocks * GENERATION_BYTES


class GenerationFile:
    """One worker's shared generation file (see the module doc), created or attached."""

    def __init__(
        self,
        fd: int,
        num_blocks: int,
        *,
        owner: bool,
        writable: bool = True,
        mapping: mmap.mmap | None = None,
    ) -> None:
        """``fd``: the file, mapped here; or -1 with ``mapping``, the file already mapped (a peer's)."""
        if num_blocks <= 0:
            raise GenerationError(f"a generation file needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._fd = fd
        self._owner = owner
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        self._map = (
            mapping if mapping is not None else mmap.mmap(fd, self.file_bytes(num_blocks), access=access)
        )
        words: Generations = np.frombuffer(self._map, dtype=np.uint64)
        self.generations: Generations = words[:num_blocks]
        self.landing: Generations = words[num_blocks : 2 * num_blocks]
        self.counters: Generations = words[2 * num_blocks :]

    @staticmethod
    def file_bytes(num_blocks: int) -> int:
        return (2 * num_blocks + COUNTER_SLOTS) * GENERATION_BYTES

    @classmethod
    def create(cls, num_blocks: int) -> GenerationFile:
        fd = os.memfd_create("kvferry-generations", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, cls.file_bytes(num_blocks))
            file = cls(fd, num_blocks, owner=True)
        except BaseException:
            os.close(fd)
            raise
        file.counters[IDENTITY] = np.uint64(secrets.randbits(63) | 1)
        return file

    @classmethod
    def map_peer(cls, array: GenerationArray) -> tuple[GenerationFile | None, str]:
        """A holder's file mapped read-only, when the holder runs on this host and lets this process open
        its ``/proc/<pid>/fd`` (same user, same pid namespace); else None. With why, for the log."""
        if not array.identity:
            return None, "the holder advertises no file identity"
        mapping, why = map_peer_file(array.pid, array.fd, cls.file_bytes(array.num_blocks), writable=False)
        if mapping is None:
            return None, why
        file = cls(-1, array.num_blocks, owner=False, writable=False, mapping=mapping)
        if int(file.counters[IDENTITY]) != array.identity:
            file.close()
            return None, f"/proc/{array.pid}/fd/{array.fd} is another file (identity differs)"
        # The map goes with its last view (a reader's verdicts may hold some after the holder is gone).
        return file, ""

    @classmethod
    def attach(cls, array: GenerationArray) -> GenerationFile:
        """Maps a worker's file from another process of the same engine (same host)."""
        path = f"/proc/{array.pid}/fd/{array.fd}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as error:
            raise GenerationError(
                f"cannot map the worker's generation file {path} ({error.strerror}): kvferry's pull "
                "fencing needs the engine core and its workers on one host, able to open each other's "
                "/proc/<pid>/fd (same user); set kvferry.fence_pulls to false to run without it"
            ) from error
        try:
            return cls(fd, array.num_blocks, owner=False)
        except BaseException:
            os.close(fd)
            raise

    def describe(self) -> GenerationArray:
        return GenerationArray(
            address=int(self.generations.ctypes.data),
            num_blocks=self.num_blocks,
            pid=os.getpid(),
            fd=self._fd,
            identity=int(self.counters[IDENTITY]),
        )

    def registration(self) -> tuple[int, int]:
        """(address, bytes) of the whole file, for one NIXL registration (DRAM, device 0)."""
        return int(self.generations.ctypes.data), self.file_bytes(self.num_blocks)

    def close(self) -> None:
        # Views into the map must be dropped before it can close.
        del self.generations, self.landing, self.counters
        try:
            self._map.close()
        finally:
            if self._fd >= 0:
                os.close(self._fd)


class GenerationBook:
    """The scheduler's generations: what retentions publish, bumped as blocks return to the pool.

    The engine's worker files (:meth:`attach`, one per tensor-parallel rank; each peer reads the one of
    the worker whose KV it pulls) receive every bump before the block can be handed out again. Only
    blocks whose current generation some retention published are bumped (a block never published
    cannot be named in a pull); a published block another request still holds is bumped when the last
    holder lets it go, so retentions that share blocks (prefix caching) do not fence each other.

    Called on the engine core's thread (retain, free); :meth:`current` also from the sidecar link's
    thread, hence the lock.
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        base: int | None = None,
        on_bump: Callable[[list[int], list[int]], None] | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.base = random_base() if base is None else base
        self._values: Generations = np.full(num_blocks, self.base, dtype=np.uint64)
        self._files: list[GenerationFile] = []
        self._published: set[int] = set()
        self._on_bump = on_bump
        self._lock = threading.Lock()
        self.bumps_total = 0

    @property
    def enabled(self) -> bool:
        """Whether peers can read these generations (the workers' files are mapped)."""
        return bool(self._files)

    def attach(self, files: Sequence[GenerationFile]) -> None:
        """The workers' files (at engine start, before any block is published): they take the
        current generations and every bump from now on."""
        for file in files:
            if file.num_blocks != self.num_blocks:
                raise GenerationError(
                    f"a worker's generation file has {file.num_blocks} blocks, "
                    f"the scheduler {self.num_blocks}"
                )
        with self._lock:
            for file in files:
                file.generations[:] = self._values
            self._files.extend(files)

    def current(self, block_ids: Sequence[int]) -> list[int]:
        with self._lock:
            return [int(g) for g in self._values[np.asarray(block_ids, dtype=np.int64)]]

    def publish(self, block_ids: Iterable[int]) -> list[int]:
        """The generations a retention of ``block_ids`` publishes; they are bumped when the blocks
        return to the pool."""
        ids = list(block_ids)
        with self._lock:
            self._published.update(ids)
            return [int(g) for g in self._values[np.asarray(ids, dtype=np.int64)]]

    def on_freed(self, blocks: Iterable[Any]) -> list[int]:
        """After vLLM's ``free_blocks``: bumps every published block it returned to the pool (its
        ``ref_cnt`` reached 0). Returns the bumped block ids."""
        if not self._published:
            return []
        return self.bump(int(block.block_id) for block in blocks if block.ref_cnt == 0)

    def bump(self, block_ids: Iterable[int]) -> list[int]:
        """Bumps the published ones of ``block_ids``, about to be reused (returned to vLLM's pool, or host
        slots given back), in the shared files first. Returns the bumped ids."""
        with self._lock:
            freed = [block_id for block_id in block_ids if block_id in self._published]
            if not freed:
                return []
            ids = np.asarray(freed, dtype=np.int64)
            self._values[ids] += np.uint64(1)
            bumped = self._values[ids]
            # Written into the shared files before vLLM can hand the blocks out again (same thread).
            for file in self._files:
                file.generations[ids] = bumped
            self._published.difference_update(freed)
            self.bumps_total += len(freed)
            generations = [int(g) for g in bumped]
        if self._on_bump is not None:
            self._on_bump(freed, generations)
        return freed

    def counter(self, slot: int) -> int:
        """A worker counter (max over ranks: each rank checks the same pulls)."""
        return max((int(file.counters[slot]) for file in self._files), default=0)

    def counter_min(self, slot: int) -> int:
        """A worker counter every rank reached (each copies its own part of a demotion)."""
        return min((int(file.counters[slot]) for file in self._files), default=0)
