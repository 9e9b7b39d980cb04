"""Pull-time fencing, the reader's half: after a pull's data READ completed, READ the holder's generations
of exactly the pulled blocks and compare them with the ones its retention published.

Equal: no pulled block went back to the holder's pool since the retention was published, so no byte
was rewritten while it was read (the holder bumps a block's generation before vLLM can reuse it,
:mod:`kvferry.connector.generations`); the pull stands. Different, unreadable or not readable in
time: the pull is *fenced*: the connector reports it failed through vLLM's own load-failure path and
the scheduler recomputes the prompt (``kv_load_failure_policy: "recompute"``). A timing bug anywhere
upstream then costs a recompute, never a wrong answer.

The generation READ goes to the same NIXL agent(s) the data came from, as few descriptors as the block
ids allow (one per run consecutive on both sides, as the data is coalesced), into this worker's landing
array at the pulled blocks' local ids. It is posted as soon as vLLM sees the data done and waited for
briefly (``wait_seconds``, spinning on NIXL's status, which also drives its progress); a READ that takes
longer is checked again at the next poll.

Each checked pull is logged as one ``kv pull fence`` line (:data:`PULL_FENCE_LOG`): the faults
harness's oracle reads it beside the holder's ``generations bumped`` lines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
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

logger = logging.getLogger("kvferry.connector.fence")

PULL_FENCE_LOG = "kv pull fence"
# Expectations kept at most for pulls that never complete (a request aborted before its pull).
_MAX_EXPECTATIONS = 4096


BlockIds = Sequence[int] | npt.NDArray[np.int64]


def fence_runs(local_ids: BlockIds, remote_ids: BlockIds) -> npt.NDArray[np.int64]:
    """Rows (local start, remote start, length) of each maximal run of block pairs consecutive on both
    sides, in order."""
    local = np.asarray(local_ids, dtype=np.int64)
    remote = np.asarray(remote_ids, dtype=np.int64)
    if local.shape != remote.shape or local.ndim != 1:
        raise ValueError(f"{local.size} local block ids for {remote.size} remote ones")
    if local.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    breaks = np.flatnonzero((np.diff(local) != 1) | (np.diff(remote) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [local.size])))
    return np.stack([local[starts], remote[starts], lengths], axis=1)


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


@dataclass
class FenceCheck:
    """One pull being checked; becomes a verdict (``fenced`` set) when its reads are in."""

    request_id: str
    pulled: PulledBlocks
    expected: npt.NDArray[np.uint64]
    started: float
    # The pulled blocks' ids, as arrays (converted once: a pull lists hundreds of blocks).
    local_ids: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    runs: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros((0, 3), dtype=np.int64))
    reads: list[_Read] = field(default_factory=list)
    read: list[int] | None = None
    fenced: bool | None = None
    reason: str | None = None
    finished: float | None = None

    def fail(self, reason: str) -> None:
        if self.fenced is None:
            self.fenced, self.reason = True, reason

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "request_id": self.request_id,
            "remote_engine_id": self.pulled.remote_engine_id,
            "remote_request_id": self.pulled.remote_request_id,
            "block_ids": list(self.pulled.remote_block_ids),
            "generations": self.expected.tolist(),
            "fenced": self.fenced,
            "fence_ms": round(((self.finished or self.started) - self.started) * 1e3, 3),
            "unix_time": time.time(),
        }
        if self.fenced:
            out["generations_read"] = self.read
            out["reason"] = self.reason
        return out


class PullFence:
    """The reader's fence (one per worker): peers' generation arrays, pending checks, verdicts.

    ``agent`` is the worker's own NIXL agent (not vLLM's wrapped one: these READs are not KV and
    must not be coalesced or counted as pulls); ``file`` is this worker's generation file, whose
    ``landing`` array receives the holders' generations and whose counters the scheduler reports.
    """

    def __init__(
        self,
        agent: Any,
        file: GenerationFile,
        *,
        wait_seconds: float,
        timeout_seconds: float = 10.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._agent = agent
        self._file = file
        self._landing_address = int(file.landing.ctypes.data)
        self.wait_seconds = wait_seconds
        self.timeout_seconds = timeout_seconds
        self._clock = clock
        self._peers: dict[str | bytes, GenerationArray | None] = {}
        self._expected: dict[str, npt.NDArray[np.uint64]] = {}
        self._pending: dict[str, FenceCheck] = {}
        self.verdicts: list[FenceCheck] = []  # the latest few, for tests and benchmarks
        self._max_verdicts = 64

    # -- what the worker tells it -----------------------------------------------------------------

    def add_peer(self, agent_name: str | bytes, array: GenerationArray | None) -> None:
        """A holder's agent after the handshake, with the generation array it advertised (None: none)."""
        self._peers[agent_name] = array

    def expect(self, request_id: str, generations: Sequence[int]) -> None:
        """The generations a pull's retention published, aligned with its ``remote_block_ids``."""
        self._expected[request_id] = np.asarray(generations, dtype=np.uint64)
        while len(self._expected) > _MAX_EXPECTATIONS:
            self._expected.pop(next(iter(self._expected)))

    def expects(self, request_id: str) -> bool:
        return request_id in self._expected

    # -- after vLLM polled its transfers ----------------------------------------------------------

    def settle(
        self, done: set[str], failed: set[str], pulled: Callable[[str], PulledBlocks | None]
    ) -> tuple[set[str], set[str]]:
        """Checks the pulls vLLM just found done; returns (done, failed) as vLLM should see them.

        A fenced pull is reported done *and* failed (vLLM's load-failure path); a pull whose check is
        still running is held back and reported at a later call.
        """
        for request_id in failed:
            self._expected.pop(request_id, None)
        for request_id in done - failed:
            expected = self._expected.pop(request_id, None)
            if expected is None:
                continue
            blocks = pulled(request_id)
            if blocks is None or not blocks.local_block_ids:
                continue  # nothing was read (a full local prefix hit): nothing to fence
            self._pending[request_id] = self._start(request_id, blocks, expected)
        if not self._pending:
            return done, failed
        self._wait()
        done, failed = set(done), set(failed)
        for request_id, check in list(self._pending.items()):
            if check.fenced is None:
                done.discard(request_id)  # reported once its reads are in
                continue
            del self._pending[request_id]
            done.add(request_id)
            if check.fenced:
                failed.add(request_id)
            self._report(check)
        return done, failed

    # -- the generation READs ---------------------------------------------------------------------

    def _start(self, request_id: str, pulled: PulledBlocks, expected: npt.NDArray[np.uint64]) -> FenceCheck:
        started = self._clock()
        remote_ids = np.asarray(pulled.remote_block_ids, dtype=np.int64)
        local_ids = np.asarray(pulled.local_block_ids, dtype=np.int64)
        # vLLM pulls the tail of the retention's block list when P already holds part of it.
        expected = expected[-len(remote_ids) :] if len(expected) >= len(remote_ids) else expected
        check = FenceCheck(request_id, pulled, expected, started=started, local_ids=local_ids)
        if len(expected) != len(remote_ids) or len(local_ids) != len(remote_ids):
            check.fail(
                f"{len(expected)} generations for {len(remote_ids)} remote and {len(local_ids)} local blocks"
            )
            return check
        check.runs = fence_runs(local_ids, remote_ids)
        if not pulled.remote_agents:
            check.fail("no holder agent to read generations from")
            return check
        for agent_name in pulled.remote_agents:
            read = _Read(agent_name)
            check.reads.append(read)
            array = self._peers.get(agent_name)
            if array is None:
                check.fail("the holder advertised no generation array (fencing off, or not kvferry's)")
                return check
            if remote_ids.max() >= array.num_blocks or remote_ids.min() < 0:
                check.fail(f"remote block ids outside the holder's {array.num_blocks} blocks")
                return check
            try:
                read.handle = self._post(agent_name, array, check.runs)
            except Exception as error:  # NIXL refused the descriptors: unreadable means fenced
                check.fail(f"generation read not posted: {type(error).__name__}: {error}")
                return check
        return check

    def _post(self, agent_name: str | bytes, array: GenerationArray, runs: npt.NDArray[np.int64]) -> Any:
        # One descriptor per run: (landing slot | holder's generation, bytes, device).
        local_rows = np.empty((len(runs), 3), dtype=np.uint64)
        remote_rows = np.empty((len(runs), 3), dtype=np.uint64)
        local_rows[:, 0] = self._landing_address + runs[:, 0] * GENERATION_BYTES
        remote_rows[:, 0] = array.address + runs[:, 1] * GENERATION_BYTES
        local_rows[:, 1] = remote_rows[:, 1] = runs[:, 2] * GENERATION_BYTES
        local_rows[:, 2] = 0
        remote_rows[:, 2] = array.device_id
        agent = self._agent
        handle = agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs(local_rows, "DRAM"),
            agent.get_xfer_descs(remote_rows, "DRAM"),
            agent_name,
        )
        try:
            state = agent.transfer(handle)
        except Exception:
            self._release(handle)
            raise
        if state not in ("PROC", "DONE"):
            self._release(handle)
            raise RuntimeError(f"NIXL answered {state!r} to posting the read")
        return handle

    def _wait(self) -> None:
        """Polls the pending reads: at most ``wait_seconds`` now, then again at the next call."""
        give_up = self._clock() + self.wait_seconds
        while True:
            running = [check for check in self._pending.values() if check.fenced is None]
            for check in running:
                self._poll(check)
            if all(check.fenced is not None for check in running) or self._clock() >= give_up:
                return

    def _poll(self, check: FenceCheck) -> None:
        for read in check.reads:
            if read.done:
                continue
            try:
                state = self._agent.check_xfer_state(read.handle)
            except Exception as error:
                state = f"{type(error).__name__}: {error}"
            if state == "PROC":
                if self._clock() - check.started > self.timeout_seconds:
                    check.fail(f"generation read not done within {self.timeout_seconds:.0f} s")
                    self._release_all(check)
                return
            read.done = True
            self._release(read.handle)
            read.handle = None
            if state != "DONE":
                check.fail(f"generation read failed: {state}")
                self._release_all(check)
                return
        # Every holder agent answered: compare what landed with what the retention published.
        landed = self._file.landing[check.local_ids]
        if np.array_equal(landed, check.expected):
            check.fenced = False
        else:
            check.read = landed.tolist()
            check.fail("generations changed: the holder freed blocks since the retention was published")

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
        del self.verdicts[: -self._max_verdicts]
        if check.fenced:
            logger.warning(PULL_FENCE_LOG, extra=check.fields())
        else:
            logger.info(PULL_FENCE_LOG, extra=check.fields())

    def pending(self) -> Iterable[str]:
        return list(self._pending)
