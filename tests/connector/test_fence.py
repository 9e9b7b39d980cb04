"""The reader's fence (kvferry.connector.fence) with real NIXL agents (UCX, host memory): a holder whose
generation file is registered as the connector's worker registers it, and a reader that checks pulls the
way the worker's ``_pop_done_transfers`` does. The same path inside real engines: test_engines_fence.py."""

from __future__ import annotations

import dataclasses
import io
import itertools
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from kvferry.connector.fence import (
    PULL_FENCE_LOG,
    PulledBlocks,
    PullFence,
    block_generation_runs,
    expand_block_runs,
)
from kvferry.connector.generations import CHECKED_PULLS, FENCED_PULLS, GenerationFile
from kvferry.connector.logs import hand_over_held, log_json_lines_to, stop_logging_thread

nixl_api = pytest.importorskip("nixl._api")

BLOCKS = 64
_names = itertools.count()


def _agent(name: str) -> object:
    return nixl_api.nixl_agent(name, nixl_api.nixl_agent_config(backends=["UCX"]))


def _register(agent: object, file: GenerationFile) -> None:
    address, nbytes = file.registration()
    agent.register_memory(agent.get_reg_descs([(address, nbytes, 0, "")], "DRAM"))  # type: ignore[attr-defined]


@dataclass
class Pair:
    holder: GenerationFile
    reader: GenerationFile
    fence: PullFence
    holder_name: str | bytes

    def pulled(
        self, local: list[int], remote: list[int], agents: list[str | bytes] | None = None
    ) -> PulledBlocks:
        return PulledBlocks("holder", "r-1", local, remote, [self.holder_name] if agents is None else agents)

    def settle(self, request: str, pulled: PulledBlocks) -> tuple[set[str], set[str]]:
        return self.fence.settle({request}, set(), lambda _: pulled)


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    suffix = next(_names)
    holder_agent, reader_agent = _agent(f"gen-holder-{suffix}"), _agent(f"gen-reader-{suffix}")
    holder, reader = GenerationFile.create(BLOCKS), GenerationFile.create(BLOCKS)
    _register(holder_agent, holder)
    _register(reader_agent, reader)
    name = reader_agent.add_remote_agent(holder_agent.get_agent_metadata())  # type: ignore[attr-defined]
    fence = PullFence(reader_agent, reader, wait_seconds=0.5, map_same_host=False)
    fence.add_peer(name, holder.describe())
    holder.generations[:] = range(100, 100 + BLOCKS)
    yield Pair(holder, reader, fence, name)


def test_block_runs_join_consecutive_blocks_of_one_generation() -> None:
    runs = block_generation_runs([5, 6, 7, 8, 20, 21, 3], [9, 9, 9, 10, 10, 10, 10])
    assert runs == [[5, 3, 9], [8, 1, 10], [20, 2, 10], [3, 1, 10]]
    assert expand_block_runs(runs) == ([5, 6, 7, 8, 20, 21, 3], [9, 9, 9, 10, 10, 10, 10])
    assert block_generation_runs(list(range(1000)), [2**51] * 1000) == [[0, 1000, 2**51]]
    assert block_generation_runs([], []) == []
    with pytest.raises(ValueError):
        block_generation_runs([1], [])


def test_unchanged_generations_let_the_pull_stand(pair: Pair, caplog: pytest.LogCaptureFixture) -> None:
    remote = [10, 11, 12, 30, 31]
    pair.fence.expect("ok", [100 + b for b in remote])
    checked = int(pair.reader.counters[CHECKED_PULLS])
    with caplog.at_level("INFO", logger="kvferry.connector.fence"):
        done, failed = pair.settle("ok", pair.pulled([1, 2, 3, 4, 5], remote))
    assert (done, failed) == ({"ok"}, set())
    verdict = pair.fence.verdicts[-1]
    assert verdict.fenced is False and verdict.read is None
    assert pair.reader.counters[CHECKED_PULLS] == checked + 1
    line = next(r for r in caplog.records if r.getMessage() == PULL_FENCE_LOG)
    assert line.fenced is False and line.remote_engine_id == "holder"  # type: ignore[attr-defined]
    # Blocks and generations as runs: 10-12 share no generation (each block's is its own here).
    assert line.blocks == len(remote)  # type: ignore[attr-defined]
    assert expand_block_runs(line.block_runs) == (remote, [100 + b for b in remote])  # type: ignore[attr-defined]


def test_a_bumped_block_fences_the_pull(pair: Pair, caplog: pytest.LogCaptureFixture) -> None:
    remote = [40, 41, 42]
    pair.fence.expect("stale", [100 + b for b in remote])
    pair.holder.generations[41] += 1  # the holder freed block 41 after publishing
    fenced = int(pair.reader.counters[FENCED_PULLS])
    with caplog.at_level("INFO", logger="kvferry.connector.fence"):
        done, failed = pair.settle("stale", pair.pulled([7, 8, 9], remote))
    assert done == {"stale"} and failed == {"stale"}  # vLLM: done, and failed to load
    verdict = pair.fence.verdicts[-1]
    assert verdict.fenced and verdict.read == [140, 142, 142]
    assert pair.reader.counters[FENCED_PULLS] == fenced + 1
    line = next(r for r in caplog.records if r.getMessage() == PULL_FENCE_LOG)
    assert line.levelname == "WARNING" and line.generations_read == [140, 142, 142]  # type: ignore[attr-defined]


def test_the_verdict_line_is_made_on_the_logging_thread_after_the_pull_is_reported(pair: Pair) -> None:
    root = logging.getLogger("kvferry")
    before = (root.handlers[:], root.level, root.propagate)
    sink = io.StringIO()
    remote = [50, 51, 52]
    pair.fence.expect("logged", [100 + b for b in remote])
    try:
        log_json_lines_to(sink)
        assert pair.settle("logged", pair.pulled([20, 21, 22], remote)) == ({"logged"}, set())
        reported = time.time()
        held = sink.getvalue()
        pair.fence.settle(set(), set(), lambda _: None)  # vLLM's next poll finishes no pull:
        assert sink.getvalue() == ""
        hand_over_held()  # the connector hands the line over then
    finally:
        stop_logging_thread()  # writes what was handed over
        root.handlers[:], root.level, root.propagate = before
    assert held == ""  # nothing of the line was made while the pull waited
    (line,) = (json.loads(text) for text in sink.getvalue().splitlines())
    assert line["msg"] == PULL_FENCE_LOG and line["request_id"] == "logged" and line["fenced"] is False
    assert expand_block_runs(line["block_runs"]) == (remote, [100 + b for b in remote])
    # The verdict's own time, not the time the line was made.
    assert reported - 1.0 < line["unix_time"] <= reported


def test_a_check_prepared_while_the_data_is_in_flight_reads_only_once_the_data_is_done(pair: Pair) -> None:
    # Runs of consecutive ids on both sides and a scattered one, as the worker prepares them right
    # after vLLM posted the data READ.
    local, remote = [1, 2, 3, 9, 12, 13], [20, 21, 22, 5, 60, 61]
    pair.fence.expect("early", [100 + b for b in remote])
    pair.fence.prepare("early", pair.pulled(local, remote))
    pair.holder.generations[21] += 1  # freed after the READ was prepared, before the data was done
    try:
        done, failed = pair.settle("early", pair.pulled([], []))  # the prepared check is the one used
    finally:
        pair.holder.generations[21] -= 1
    assert (done, failed) == ({"early"}, {"early"})
    verdict = pair.fence.verdicts[-1]
    assert verdict.read == [120, 122, 122, 105, 160, 161]
    assert verdict.prepare_seconds > 0 and verdict.fence_seconds > 0
    pair.fence.expect("again", [100 + b for b in remote])
    pair.fence.prepare("again", pair.pulled(local, remote))
    assert pair.settle("again", pair.pulled(local, remote)) == ({"again"}, set())


def test_a_failed_pull_drops_its_prepared_check(pair: Pair) -> None:
    pair.fence.expect("lost", [110])
    pair.fence.prepare("lost", pair.pulled([1], [10]))
    assert pair.fence.settle({"lost"}, {"lost"}, lambda _: None) == ({"lost"}, {"lost"})
    assert not pair.fence.expects("lost")
    # Nothing of it is left to post: a later completion of the same id is not checked.
    assert pair.settle("lost", pair.pulled([1], [10])) == ({"lost"}, set())


def test_a_holder_whose_descriptors_nixl_refuses_fences(pair: Pair) -> None:
    from kvferry.connector.generations import GenerationArray

    # An agent NIXL has no metadata of: it refuses to prepare the list.
    pair.fence.add_peer("bogus", GenerationArray(address=8, num_blocks=4, pid=1, fd=1))
    pair.fence.expect("bogus", [110])
    _, failed = pair.settle("bogus", pair.pulled([1], [1], agents=["bogus"]))
    assert failed == {"bogus"}
    assert "not prepared" in (pair.fence.verdicts[-1].reason or "")


def test_only_the_pulled_tail_is_checked(pair: Pair) -> None:
    # P already held the first two blocks (its own prefix cache): vLLM read only the last three.
    remote_all = [50, 51, 52, 53, 54]
    pair.fence.expect("tail", [1, 1] + [100 + b for b in remote_all[2:]])
    done, failed = pair.settle("tail", pair.pulled([20, 21, 22], remote_all[2:]))
    assert (done, failed) == ({"tail"}, set())


def test_a_holder_without_a_generation_array_fences(pair: Pair) -> None:
    pair.fence.expect("nobody", [110])
    _, failed = pair.settle("nobody", pair.pulled([1], [10], agents=["not-a-peer"]))
    assert failed == {"nobody"}
    assert "no generation array" in (pair.fence.verdicts[-1].reason or "")


def test_block_ids_beyond_the_holder_fence(pair: Pair) -> None:
    pair.fence.expect("beyond", [0])
    _, failed = pair.settle("beyond", pair.pulled([1], [BLOCKS]))
    assert failed == {"beyond"}


def test_generation_count_must_match_the_pulled_blocks(pair: Pair) -> None:
    pair.fence.expect("short", [110])
    _, failed = pair.settle("short", pair.pulled([1, 2], [10, 11]))
    assert failed == {"short"}


def test_pulls_without_expectations_and_failed_pulls_pass_through(pair: Pair) -> None:
    assert pair.settle("plain", pair.pulled([1], [10])) == ({"plain"}, set())
    pair.fence.expect("broken", [110])
    assert pair.fence.settle({"broken"}, {"broken"}, lambda _: None) == ({"broken"}, {"broken"})
    assert not pair.fence.expects("broken")


class _SlowAgent:
    """The real agent, whose reads look unfinished to the first ``polls`` status checks."""

    def __init__(self, agent: object, polls: int) -> None:
        self._agent = agent
        self.polls = polls

    def __getattr__(self, name: str) -> object:
        return getattr(self._agent, name)

    def check_xfer_state(self, handle: object) -> str:
        state: str = self._agent.check_xfer_state(handle)  # type: ignore[attr-defined]
        if self.polls > 0:
            self.polls -= 1
            return "PROC"
        return state


def test_a_read_not_done_in_time_is_reported_at_a_later_poll(pair: Pair) -> None:
    slow = PullFence(
        _SlowAgent(pair.fence._agent, polls=3), pair.reader, wait_seconds=0.0, map_same_host=False
    )
    slow.add_peer(pair.holder_name, pair.holder.describe())
    slow.expect("later", [110, 111])
    pulled = pair.pulled([3, 4], [10, 11])
    assert slow.settle({"later", "other"}, set(), lambda _: pulled) == ({"other"}, set())
    assert list(slow.pending()) == ["later"]
    answers = [slow.settle(set(), set(), lambda _: pulled) for _ in range(3)]
    assert answers[:2] == [(set(), set()), (set(), set())]
    assert answers[2] == ({"later"}, set())
    assert list(slow.pending()) == []
    # The verdict's line says how often NIXL was asked: three unfinished answers, then DONE.
    fields = slow.verdicts[-1].fields(0.0)
    assert fields["polls"] == 4
    assert 0.0 <= fields["post_ms"] <= fields["fence_ms"]


def test_a_read_that_never_finishes_fences_at_the_timeout(pair: Pair) -> None:
    now = [0.0]
    stuck = PullFence(
        _SlowAgent(pair.fence._agent, polls=10**9),
        pair.reader,
        wait_seconds=0.0,
        timeout_seconds=5.0,
        clock=lambda: now[0],
        map_same_host=False,
    )
    stuck.add_peer(pair.holder_name, pair.holder.describe())
    stuck.expect("stuck", [110])
    pulled = pair.pulled([3], [10])
    assert stuck.settle({"stuck"}, set(), lambda _: pulled) == (set(), set())
    now[0] = 6.0
    assert stuck.settle(set(), set(), lambda _: pulled) == ({"stuck"}, {"stuck"})
    assert "within 5 s" in (stuck.verdicts[-1].reason or "")


def test_the_generation_array_rides_in_vllm_s_handshake_payload() -> None:
    # What a worker hands its scheduler and the side channel serves: vLLM's own decoder ignores the
    # extra field (a plain NixlConnector peer still decodes it), kvferry's reads it.
    import msgspec
    from kvferry.connector.connector import KvferryHandshakePayload
    from kvferry.connector.generations import GenerationArray
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlHandshakePayload

    array = GenerationArray(address=0x7F00_0000_1000, num_blocks=64, pid=1234, fd=17, identity=99)
    wire = msgspec.msgpack.Encoder().encode(
        KvferryHandshakePayload("hash", b"agent", kvferry_generations=array)
    )
    assert msgspec.msgpack.Decoder(NixlHandshakePayload).decode(wire) == NixlHandshakePayload(
        "hash", b"agent"
    )
    ours = msgspec.msgpack.Decoder(KvferryHandshakePayload).decode(wire)
    assert ours.kvferry_generations == array
    assert (
        msgspec.msgpack.Decoder(KvferryHandshakePayload)
        .decode(msgspec.msgpack.Encoder().encode(NixlHandshakePayload("hash", b"agent")))
        .kvferry_generations
        is None
    )


def test_a_pull_s_blocks_come_from_vllm_s_request_state() -> None:
    from types import SimpleNamespace

    from kvferry.connector import vllm_internals

    remote = SimpleNamespace(engine_id="d-0", request_id="cmpl-r", block_ids=[[30, 31, 32, 33]])
    worker = SimpleNamespace(
        _recving_metadata={"p": SimpleNamespace(local_block_ids=[[5, 6]], remote=remote)},
        _remote_agents={"d-0": {(0, 0): "agent-0"}},
    )
    pulled = vllm_internals.pulled_blocks(worker, "p")
    assert pulled is not None
    # P held the first two blocks already: vLLM read the remote tail.
    assert (list(pulled.local_block_ids), list(pulled.remote_block_ids)) == ([5, 6], [32, 33])
    assert (pulled.remote_engine_id, pulled.remote_request_id, list(pulled.remote_agents)) == (
        "d-0",
        "cmpl-r",
        ["agent-0"],
    )
    assert vllm_internals.pulled_blocks(worker, "unknown") is None
    remote.block_ids = [40, 41]  # a flat list is one group
    worker._recving_metadata["p"].local_block_ids = [[1, 2]]
    flat = vllm_internals.pulled_blocks(worker, "p")
    assert flat is not None and list(flat.remote_block_ids) == [40, 41]


def test_a_failed_pull_leaves_the_retry_nothing_to_pull() -> None:
    from types import SimpleNamespace

    from kvferry.connector import vllm_internals
    from kvferry.pd import vllm_params

    params = {
        "do_remote_decode": True,
        **vllm_params.RemoteBlocks("d", "r", ((1, 2),), "h", 5, num_tokens=64).to_params(),
        "kvferry_generations": [3, 4],
    }
    request = SimpleNamespace(kv_transfer_params=params)
    vllm_internals.compute_after_failed_pull(request)
    assert not vllm_params.names_remote_blocks(params) and "kvferry_generations" not in params
    assert params["do_remote_decode"] is True  # D still pulls the prompt from this prefill afterwards


@pytest.mark.parametrize(
    ("generations", "problem"),
    [
        (None, None),  # an older router: the pull is not checked
        ([3, 4], None),
        ([3], "1 generations for 2 remote blocks"),
        ([3, -1], "must be a list of integers in [0, 2**53)"),
        ([3, 2**53], "must be a list of integers in [0, 2**53)"),
        ("3,4", "must be a list of integers"),
    ],
)
def test_a_pull_s_generations_must_fit_its_remote_blocks(generations: object, problem: str | None) -> None:
    """P declines (recomputes) a pull whose generations it could not compare block for block."""
    from kvferry.connector.connector import _generations_problem
    from kvferry.pd import vllm_params

    params: dict[str, object] = {
        "do_remote_decode": True,
        **vllm_params.RemoteBlocks("d", "r", ((1, 2),), "h", 5, num_tokens=64).to_params(),
    }
    if generations is not None:
        params["kvferry_generations"] = generations
    found = _generations_problem(params)
    assert (found is None) if problem is None else (found is not None and problem in found)


@pytest.fixture
def mapped_pair(pair: Pair) -> PullFence:
    """A reader on the holder's host: it maps the holder's generation file (this process's own, here)."""
    fence = PullFence(pair.fence._agent, pair.reader, wait_seconds=0.5)
    fence.add_peer(pair.holder_name, pair.holder.describe())
    return fence


def test_a_holder_on_the_same_host_is_read_through_shared_memory(pair: Pair, mapped_pair: PullFence) -> None:
    """No NIXL request for the generations (nothing to post); the same verdicts as over NIXL."""
    remote = [20, 21, 22, 23]
    mapped_pair.expect("mapped-ok", [100 + b for b in remote])
    assert mapped_pair.settle({"mapped-ok"}, set(), lambda _: pair.pulled([1, 2, 3, 4], remote)) == (
        {"mapped-ok"},
        set(),
    )
    verdict = mapped_pair.verdicts[-1]
    assert verdict.fenced is False
    assert all(read.handle is None and read.mapped is not None for read in verdict.reads)
    assert verdict.fields(0.0)["generations_from"] == "shared memory" and verdict.polls == 0
    # A block the holder freed since the retention was published fences the pull (scattered ids too).
    remote = [24, 30, 25]
    mapped_pair.expect("mapped-stale", [100 + b for b in remote])
    pair.holder.generations[30] += 1
    try:
        done, failed = mapped_pair.settle({"mapped-stale"}, set(), lambda _: pair.pulled([5, 6, 7], remote))
    finally:
        pair.holder.generations[30] -= 1
    assert done == failed == {"mapped-stale"}
    assert mapped_pair.verdicts[-1].read == [124, 131, 125]


def test_a_file_that_is_not_the_advertised_one_is_read_over_nixl(pair: Pair) -> None:
    """The pid and fd may name another file (another process took them): its identity differs, so the
    reader falls back to NIXL's READ; a holder that advertises no identity (older) is read over NIXL."""
    array = pair.holder.describe()
    for advertised in (
        dataclasses.replace(array, identity=array.identity ^ 1),
        dataclasses.replace(array, identity=0),
    ):
        mapped, why = GenerationFile.map_peer(advertised)
        assert mapped is None and why
        fence = PullFence(pair.fence._agent, pair.reader, wait_seconds=0.5)
        fence.add_peer(pair.holder_name, advertised)
        fence.expect("fallback", [110, 111])
        assert fence.settle({"fallback"}, set(), lambda _: pair.pulled([3, 4], [10, 11])) == (
            {"fallback"},
            set(),
        )
        verdict = fence.verdicts[-1]
        assert verdict.fenced is False and verdict.fields(0.0)["generations_from"] == "nixl"
    mapped, why = GenerationFile.map_peer(dataclasses.replace(array, pid=2**22 + 17))
    assert mapped is None and "/proc/" in why
