"""Pull-time fencing, the reader's half: after a pull's data READ completed, READ the holder's generations
of exactly the pulled blocks and compare them with the ones its retention published.

Equal: no pulled block went back to the holder's pool since the retention was published, so no byte
was rewritten while it was read (the holder bumps a block's generation before vLLM can reuse it,
:mod:`kvferry.connector.generations`); the pull stands. Different, unreadable or not readable in
time: the pull is *fenced*: the connector reports it failed through vLLM's own load-failure path and
the scheduler recomputes the prompt (``kv_load_failure_policy: "recompute"``). A timing bug anywhere
upstream then costs a recompute, never a wrong answer.

A holder on the same host (its generation file mappable through ``/proc``, its identity checked:
:meth:`GenerationFile.map_peer`) is not asked over NIXL: its generations are compared where they are,
read-only, once the data READ completed, with nothing to post (on one GPU, posting the generation READ
was most of the fence's ~0.1 ms). Otherwise the generation READ goes to the same NIXL agent(s) the data
came from, into this worker's landing array at the pulled blocks' local ids. Everything but the read
itself is made ready while the data is still in flight (:meth:`PullFence.prepare`, right after vLLM
posted the data READ): the block id arrays, the expected generations and NIXL's transfer request, built
by index from descriptor lists prepared once (one 8-byte descriptor per block: the landing array at
start, each holder's generation array at its handshake; NIXL merges runs of ids consecutive on both
sides into one descriptor). When vLLM sees the data done, what is left is posting that request, waiting
for it briefly (``wait_seconds``, spinning on NIXL's status, which also drives its progress; a READ that
takes longer is checked again at the next poll) and comparing. The read is posted only then: it must
start after the data READ completed.

Each checked pull is logged as one ``kv pull fence`` line (:data:`PULL_FENCE_LOG`), its blocks and
expected generations as runs (:func:`block_generation_runs`), for an oracle to read beside the holder's
``generations bumped`` lines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt
from kvferry.connector.generations import (
    CHECKED_PULLS,
    FENCED_PULLS,
    GENERATION_BYTES,
    GenerationArray,
    GenerationFile,
)
from kvferry.connector.logs import log_off_path

logger = logging.getLogger("kvferry.connector.fence")

PULL_FENCE_LOG = "kv pull fence"
# Expectations and prepared checks kept at most for pulls that never complete (a request aborted
# before or during its pull); the oldest go first.
_MAX_EXPECTATIONS = 4096
# Generation reads done but not yet released: released at a call that checks nothing, or once this many.
_MAX_SPENT = 16
# How vLLM's and NIXL's Python API name the local side of a prepared descriptor list.
_LOCAL_SIDE = "NIXL_INIT_AGENT"
_CHANGED = "generations changed: the holder freed blocks since the retention was published"


@dataclass(frozen=True)
class PulledBlocks:
    """What a finished pull read: block ids pair up (local i received remote i)."""

    remote_engine_id: str
    remote_request_id: str
    local_block_ids: Sequence[int]
    remote_block_ids: Sequence[int]
    # The holder's NIXL agents the data came from (each is asked for its generations).
    remote_agents: Sequence[str | bytes]


@dataclass
class _Read:
    agent_name: str | bytes
    handle: Any = None
    done: bool = False
    # The holder's generations mapped on this host: compared in place, no NIXL request.
    mapped: npt.NDArray[np.uint64] | None = None


@dataclass
class _Peer:
    """A holder agent's generation array and, once prepared, its descriptor list (one per block)."""

    array: GenerationArray | None
    descriptors: Any = None
    problem: str | None = None
    # The holder's file, mapped read-only when it runs on this host (no descriptors then).
    mapped: GenerationFile | None = None


@dataclass
class FenceCheck:
    """One pull being checked: prepared while its data is in flight, posted when the data is done,
    a verdict (``fenced`` set) when its reads are in."""

    request_id: str
    pulled: PulledBlocks
    expected: npt.NDArray[np.uint64]
    prepared: float
    # The pulled blocks' local and remote ids (converted once: a pull lists hundreds of blocks).
    local_ids: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    remote_ids: slice | npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # Where their generations land in the landing array (a slice when the ids are one run, no copy)
    # and the expected generations' bytes: set at prepare, so that the verdict is one byte comparison.
    landed_at: slice | npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    expected_bytes: bytes = b""
    reads: list[_Read] = field(default_factory=list)
    # When the data was seen done and the reads posted (the fence's cost counts from here).
    started: float | None = None
    read: list[int] | None = None
    fenced: bool | None = None
    reason: str | None = None
    finished: float | None = None
    prepare_seconds: float = 0.0
    # Where the fence's time goes: posting its reads, and how often NIXL was asked whether they are in.
    posted: float | None = None
    polls: int = 0
    # The pulled blocks and their expected generations as the log line carries them (made at prepare).
    block_runs: list[list[int]] = field(default_factory=list)

    def fail(self, reason: str) -> None:
        if self.fenced is None:
            self.fenced, self.reason = True, reason

    @property
    def fence_seconds(self) -> float:
        """From the data seen done to the verdict: what the fence adds to the pull."""
        if self.started is None or self.finished is None:
            return 0.0
        return self.finished - self.started

    def fields(self, unix_time: float) -> dict[str, Any]:
        out: dict[str, Any] = {
            "request_id": self.request_id,
            "remote_engine_id": self.pulled.remote_engine_id,
            "remote_request_id": self.pulled.remote_request_id,
            "block_runs": self.block_runs,
            "blocks": len(self.pulled.remote_block_ids),
            "fenced": self.fenced,
            "fence_ms": round(self.fence_seconds * 1e3, 3),
            "prepare_ms": round(self.prepare_seconds * 1e3, 3),
            "post_ms": round((self.posted - self.started) * 1e3, 3)
            if self.posted is not None and self.started is not None
            else 0.0,
            "polls": self.polls,
            "generations_from": "shared memory" if any(r.mapped is not None for r in self.reads) else "nixl",
            "unix_time": unix_time,
        }
        if self.fenced:
            out["generations_read"] = self.read
            out["reason"] = self.reason
        return out


def block_generation_runs(
    block_ids: Sequence[int] | npt.NDArray[np.int64], generations: Sequence[int] | npt.NDArray[np.uint64]
) -> list[list[int]]:
    """``[[first block id, count, generation], ...]``: the maximal runs of consecutive block ids that
    share one generation, in order. The fence's log line carries a pull's blocks and expected
    generations in this form: lossless, and a few numbers for a pull of consecutive blocks where one
    number per block would cost more to write than the whole check (JSON of ~2,000 numbers: ~0.25 ms).
    """
    ids = np.asarray(block_ids, dtype=np.int64)
    values = np.asarray(generations, dtype=np.uint64)
    if ids.shape != values.shape or ids.ndim != 1:
        raise ValueError(f"{values.size} generations for {ids.size} block ids")
    if ids.size == 0:
        return []
    breaks = np.flatnonzero((np.diff(ids) != 1) | (values[1:] != values[:-1])) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [ids.size])))
    return [
        [first, count, generation]
        for first, count, generation in zip(
            ids[starts].tolist(), counts.tolist(), values[starts].tolist(), strict=True
        )
    ]


def expand_block_runs(runs: Iterable[Sequence[int]]) -> tuple[list[int], list[int]]:
    """(block ids, generations) of :func:`block_generation_runs`' runs (what a log reader wants)."""
    block_ids: list[int] = []
    generations: list[int] = []
    for first, count, generation in runs:
        block_ids.extend(range(first, first + count))
        generations.extend([generation] * count)
    return block_ids, generations


class PullFence:
    """The reader's fence (one per worker): peers' generation arrays, prepared and pending checks,
    verdicts.

    ``agent`` is the worker's own NIXL agent (not vLLM's wrapped one: these READs are not KV and
    must not be coalesced or counted as pulls); ``file`` is this worker's generation file, whose
    ``landing`` array receives the holders' generations and whose counters the scheduler reports.
    The file must be registered with ``agent`` before the first peer is added. ``map_same_host``: holders
    on this host are read through their mapped file (False: always over NIXL).
    """

    def __init__(
        self,
        agent: Any,
        file: GenerationFile,
        *,
        wait_seconds: float,
        timeout_seconds: float = 10.0,
        clock: Callable[[], float] = time.perf_counter,
        map_same_host: bool = True,
    ) -> None:
        self._agent = agent
        self.map_same_host = map_same_host
        self._file = file
        self.wait_seconds = wait_seconds
        self.timeout_seconds = timeout_seconds
        self._clock = clock
        self._landing: Any = None  # the landing array's descriptor list, prepared with the first peer
        self._peers: dict[str | bytes, _Peer] = {}
        self._expected: dict[str, npt.NDArray[np.uint64]] = {}
        self._prepared: dict[str, FenceCheck] = {}
        self._pending: dict[str, FenceCheck] = {}
        self._spent: list[Any] = []  # generation reads done, their handles not yet released
        self.verdicts: list[FenceCheck] = []  # the latest few, for tests and benchmarks
        self._max_verdicts = 64

    # -- what the worker tells it -----------------------------------------------------------------

    def add_peer(self, agent_name: str | bytes, array: GenerationArray | None) -> None:
        """A holder's agent after the handshake, with the generation array it advertised (None: none).

        Prepares the descriptor lists the checks index into: one 8-byte descriptor per block of the
        holder's generations and (once) of this worker's landing array. A list NIXL refuses leaves the
        peer unreadable: its pulls are fenced, with the reason.
        """
        peer = _Peer(array)
        self._peers[agent_name] = peer
        if array is None:
            return
        if self.map_same_host:
            peer.mapped, why_not = GenerationFile.map_peer(array)
            logger.info(
                "reading a holder's generations from shared memory (same host)"
                if peer.mapped is not None
                else "reading a holder's generations over NIXL",
                extra={"agent": str(agent_name), **({"why": why_not} if why_not else {})},
            )
            if peer.mapped is not None:
                return
        try:
            if self._landing is None:
                self._landing = self._agent.prep_xfer_dlist(
                    _LOCAL_SIDE,
                    _block_rows(int(self._file.landing.ctypes.data), self._file.num_blocks, 0),
                    "DRAM",
                )
            peer.descriptors = self._agent.prep_xfer_dlist(
                agent_name, _block_rows(array.address, array.num_blocks, array.device_id), "DRAM"
            )
        except Exception as error:
            peer.problem = f"generation descriptors not prepared: {type(error).__name__}: {error}"
            logger.warning(
                "could not prepare a holder's generation descriptors; pulls from it will be fenced",
                extra={"agent": str(agent_name), "error": peer.problem},
            )

    def expect(self, request_id: str, generations: Sequence[int]) -> None:
        """The generations a pull's retention published, aligned with its ``remote_block_ids``."""
        self._expected[request_id] = np.asarray(generations, dtype=np.uint64)
        while len(self._expected) > _MAX_EXPECTATIONS:
            self._expected.pop(next(iter(self._expected)))

    def expects(self, request_id: str) -> bool:
        return request_id in self._expected

    def prepare(self, request_id: str, pulled: PulledBlocks | None) -> None:
        """Right after a pull's data READ was posted: readies its check (arrays, NIXL request), so
        that little is left to do once the data is done. Posts nothing."""
        expected = self._expected.get(request_id)
        if expected is None or pulled is None or not pulled.local_block_ids:
            return
        self._drop_prepared(request_id)
        self._prepared[request_id] = self._build(request_id, pulled, expected)
        while len(self._prepared) > _MAX_EXPECTATIONS:
            self._drop_prepared(next(iter(self._prepared)))

    # -- after vLLM polled its transfers ----------------------------------------------------------

    def settle(
        self, done: set[str], failed: set[str], pulled: Callable[[str], PulledBlocks | None]
    ) -> tuple[set[str], set[str]]:
        """Checks the pulls vLLM just found done; returns (done, failed) as vLLM should see them (the
        sets given when nothing changes).

        A fenced pull is reported done *and* failed (vLLM's load-failure path); a pull whose check is
        still running is held back and reported at a later call.
        """
        # Earlier verdicts' reads are released at a call that checks no pull (most of vLLM's polls, once a
        # step), not while a pull waits for its verdict (their lines are handed over then too: the connector).
        if not done:
            if self._spent:
                self._release_spent()
        elif len(self._spent) >= _MAX_SPENT:
            self._release_spent()
        for request_id in failed:
            self._expected.pop(request_id, None)
            self._drop_prepared(request_id)
        now = self._clock() if done else 0.0
        for request_id in done:
            if request_id in failed:
                continue
            expected = self._expected.pop(request_id, None)
            if expected is None:
                self._drop_prepared(request_id)
                continue
            check = self._prepared.pop(request_id, None)
            if check is None:  # not prepared while the data was in flight: prepared now
                blocks = pulled(request_id)
                if blocks is None or not blocks.local_block_ids:
                    continue  # nothing was read (a full local prefix hit): nothing to fence
                check = self._build(request_id, blocks, expected)
            self._start(check, now)
            self._pending[request_id] = check
        if not self._pending:
            return done, failed
        self._wait(now if done else self._clock())
        # Copied only when vLLM must see something else than it gave (a check still running or fenced).
        out_done, out_failed = done, failed
        settled: list[str] = []
        for request_id, check in self._pending.items():
            if check.fenced is None:
                if request_id in out_done:
                    out_done = set(out_done) if out_done is done else out_done
                    out_done.discard(request_id)  # reported once its reads are in
                continue
            settled.append(request_id)
            if request_id not in out_done:
                out_done = set(out_done) if out_done is done else out_done
                out_done.add(request_id)
            if check.fenced and request_id not in out_failed:
                out_failed = set(out_failed) if out_failed is failed else out_failed
                out_failed.add(request_id)
            self._report(check)
        for request_id in settled:
            del self._pending[request_id]
        return out_done, out_failed

    # -- the generation READs ---------------------------------------------------------------------

    def _build(self, request_id: str, pulled: PulledBlocks, expected: npt.NDArray[np.uint64]) -> FenceCheck:
        """A check with its NIXL requests made but not posted (or already failed, with the reason)."""
        prepared = self._clock()
        remote_ids = np.asarray(pulled.remote_block_ids, dtype=np.int64)
        local_ids = np.asarray(pulled.local_block_ids, dtype=np.int64)
        # vLLM pulls the tail of the retention's block list when P already holds part of it.
        expected = expected[-len(remote_ids) :] if len(expected) >= len(remote_ids) else expected
        check = FenceCheck(request_id, pulled, expected, prepared=prepared, local_ids=local_ids)
        try:
            if len(expected) == len(remote_ids):
                check.block_runs = block_generation_runs(remote_ids, expected)
            self._make_reads(check, remote_ids)
        finally:
            check.prepare_seconds = self._clock() - prepared
        if check.fenced is not None:
            self._release_all(check)
        return check

    def _make_reads(self, check: FenceCheck, remote_ids: npt.NDArray[np.int64]) -> None:
        local_ids = check.local_ids
        if len(check.expected) != len(remote_ids) or len(local_ids) != len(remote_ids):
            expected = len(check.expected)
            check.fail(
                f"{expected} generations for {len(remote_ids)} remote and {len(local_ids)} local blocks"
            )
            return
        if not check.pulled.remote_agents:
            check.fail("no holder agent to read generations from")
            return
        if local_ids.min() < 0 or local_ids.max() >= self._file.num_blocks:
            check.fail(f"local block ids outside this worker's {self._file.num_blocks} blocks")
            return
        check.landed_at = _as_run(local_ids)
        check.remote_ids = _as_run(remote_ids)
        check.expected_bytes = check.expected.astype(self._file.landing.dtype).tobytes()
        local_index = local_ids.astype(np.int32)
        remote_index = remote_ids.astype(np.int32)
        for agent_name in check.pulled.remote_agents:
            read = _Read(agent_name)
            check.reads.append(read)
            peer = self._peers.get(agent_name)
            if peer is None or peer.array is None:
                check.fail("the holder advertised no generation array (fencing off, or not kvferry's)")
                return
            if remote_ids.max() >= peer.array.num_blocks or remote_ids.min() < 0:
                check.fail(f"remote block ids outside the holder's {peer.array.num_blocks} blocks")
                return
            if peer.mapped is not None:
                read.mapped = peer.mapped.generations
                continue
            if peer.descriptors is None:
                check.fail(peer.problem or "the holder's generation descriptors are not prepared")
                return
            try:
                read.handle = self._agent.make_prepped_xfer(
                    "READ", self._landing, local_index, peer.descriptors, remote_index
                )
            except Exception as error:  # NIXL refused the request: unreadable means fenced
                check.fail(f"generation read not prepared: {type(error).__name__}: {error}")
                return

    def _start(self, check: FenceCheck, seen: float) -> None:
        """The data was ``seen`` done: posts the check's reads (only now: they must follow the data READ)."""
        check.started = seen
        if check.fenced is not None:
            return
        for read in check.reads:
            if read.mapped is not None:
                continue  # compared in place once polled
            try:
                state = self._agent.transfer(read.handle)
            except Exception as error:
                state = f"{type(error).__name__}: {error}"
            if state not in ("PROC", "DONE"):
                check.fail(f"generation read not posted: NIXL answered {state!r}")
                self._release_all(check)
                return
        check.posted = self._clock()

    def _wait(self, now: float) -> None:
        """Polls the pending reads: at most ``wait_seconds`` from ``now``, then again at the next call."""
        give_up = now + self.wait_seconds
        while True:
            running = False
            for check in self._pending.values():
                if check.fenced is None:
                    self._poll(check)
                    running = running or check.fenced is None
            if not running or self._clock() >= give_up:
                return

    def _poll(self, check: FenceCheck) -> None:
        for read in check.reads:
            if read.done:
                continue
            if read.mapped is not None:
                # The data READ is done (this runs after it was seen done): a block the holder freed since
                # the retention was published shows its bumped generation here.
                read.done = True
                found = read.mapped[check.remote_ids]
                if found.tobytes() != check.expected_bytes:
                    check.read = found.tolist()
                    check.fail(_CHANGED)
                    return
                continue
            check.polls += 1
            try:
                state = self._agent.check_xfer_state(read.handle)
            except Exception as error:
                state = f"{type(error).__name__}: {error}"
            if state == "PROC":
                if self._clock() - (check.started or check.prepared) > self.timeout_seconds:
                    check.fail(f"generation read not done within {self.timeout_seconds:.0f} s")
                    self._release_all(check)
                return
            read.done = True
            self._spent.append(read.handle)  # released later, off any pull's path
            read.handle = None
            if state != "DONE":
                check.fail(f"generation read failed: {state}")
                self._release_all(check)
                return
        # Every holder agent answered: compare what landed with what the retention published.
        if all(read.mapped is not None for read in check.reads):
            check.fenced = False
            return
        landed = self._file.landing[check.landed_at]
        if landed.tobytes() == check.expected_bytes:
            check.fenced = False
        else:
            check.read = landed.tolist()
            check.fail(_CHANGED)

    def _release_spent(self) -> None:
        spent, self._spent = self._spent, []
        for handle in spent:
            self._release(handle)

    def _drop_prepared(self, request_id: str) -> None:
        check = self._prepared.pop(request_id, None)
        if check is not None:
            self._release_all(check)

    def _release_all(self, check: FenceCheck) -> None:
        for read in check.reads:
            if read.handle is not None:
                self._release(read.handle)
                read.handle = None

    def _release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as error:  # a handle NIXL will not release stays with NIXL; log and go on
            logger.warning(
                "could not release a generation read", extra={"error": f"{type(error).__name__}: {error}"}
            )

    # -- reporting --------------------------------------------------------------------------------

    def _report(self, check: FenceCheck) -> None:
        check.finished = self._clock()
        counters = self._file.counters
        counters[CHECKED_PULLS] += np.uint64(1)
        if check.fenced:
            counters[FENCED_PULLS] += np.uint64(1)
        self.verdicts.append(check)
        if len(self.verdicts) > self._max_verdicts:
            del self.verdicts[0]
        # The line is made on the logging thread later: the pull is reported done without waiting for it.
        level = logging.WARNING if check.fenced else logging.INFO
        log_off_path(logger, level, PULL_FENCE_LOG, partial(self._line, check))

    def _line(self, check: FenceCheck) -> tuple[float, dict[str, Any]]:
        """The verdict's Unix time and its log line's fields (called when the line is made)."""
        unix_time = time.time() - (self._clock() - (check.finished or 0.0))
        return unix_time, check.fields(unix_time)

    def pending(self) -> Iterable[str]:
        return list(self._pending)


def _as_run(ids: npt.NDArray[np.int64]) -> slice | npt.NDArray[np.int64]:
    """``ids`` as a slice when they are one run of consecutive ids (indexing then copies nothing)."""
    first, count = int(ids[0]), len(ids)
    if count == 1 or (int(ids[-1]) - first == count - 1 and bool((np.diff(ids) == 1).all())):
        return slice(first, first + count)
    return ids


def _block_rows(address: int, num_blocks: int, device_id: int) -> npt.NDArray[np.uint64]:
    """One descriptor row (address, bytes, device) per block of a generation-sized array."""
    rows = np.empty((num_blocks, 3), dtype=np.uint64)
    rows[:, 0] = address + np.arange(num_blocks, dtype=np.uint64) * GENERATION_BYTES
    rows[:, 1] = GENERATION_BYTES
    rows[:, 2] = device_id
    return rows
