"""PullCoalescer with real NIXL agents (UCX on host memory), driven the way vLLM's pull worker does.

No vLLM here: a holder and a reader agent with KV-like buffers; the reader's agent is wrapped as
the connector wraps vLLM's. Every pull is checked byte for byte and by NIXL's own descriptor
count. The same wrapper inside real engines is tested in test_engines_coalesced.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from kvferry.connector.coalesce import PlanError, block_runs
from kvferry.connector.copies import HostCopier
from kvferry.connector.host_tier import HostPool, MappedHostPool, extend_remote_rows
from kvferry.connector.nixl_pulls import PoolList, PullCoalescer, PullContext, PullRecord

nixl_api = pytest.importorskip("nixl._api")

BLOCKS = 48
LAYERS = 4
PAGE = 2048  # bytes of one layer's block (K and V)
_names = itertools.count()


@dataclass
class Side:
    agent: object
    caches: list[np.ndarray]  # one [BLOCKS, PAGE] uint8 array per layer

    def rows(self, layout: str) -> np.ndarray:
        """The descriptor rows vLLM would prepare for this layout."""
        rows: list[tuple[int, int, int]] = []
        for cache in self.caches:
            base = cache.ctypes.data
            if layout == "per_layer":  # vLLM 0.32: one region per layer, whole pages
                rows += [(base + b * PAGE, PAGE, 0) for b in range(BLOCKS)]
            else:  # vLLM 0.25 FLASH_ATTN, blocks first: K halves, then V halves, per layer
                half = PAGE // 2
                rows += [(base + b * PAGE, half, 0) for b in range(BLOCKS)]
                rows += [(base + b * PAGE + half, half, 0) for b in range(BLOCKS)]
        return np.asarray(rows, dtype=np.uint64)


@dataclass
class Pair:
    reader: PullCoalescer
    holder: Side
    local: Side
    records: list[PullRecord]
    handles: dict[str, tuple[object, object]]
    # What nixl's add_remote_agent returned (bytes), as vLLM passes it on.
    holder_name: str | bytes

    def prepare(self, layout: str) -> tuple[object, object]:
        if layout not in self.handles:
            # The same calls, in the same order, as vLLM's register_local_xfer_handler / add_remote_agent.
            local = self.reader.prep_xfer_dlist(
                "NIXL_INIT_AGENT", self.reader.get_xfer_descs(self.local.rows(layout), "DRAM")
            )
            remote = self.reader.prep_xfer_dlist(
                self.holder_name, self.reader.get_xfer_descs(self.holder.rows(layout), "DRAM")
            )
            self.handles[layout] = (local, remote)
        return self.handles[layout]

    def pull(
        self,
        local_ids: Sequence[int],
        remote_ids: Sequence[int],
        *,
        layout: str = "per_layer",
        coalesce: bool | None = None,
    ) -> PullRecord:
        regions = LAYERS if layout == "per_layer" else 2 * LAYERS
        li = np.asarray([r * BLOCKS + b for r in range(regions) for b in local_ids], dtype=np.int64)
        ri = np.asarray([r * BLOCKS + b for r in range(regions) for b in remote_ids], dtype=np.int64)
        for cache in self.local.caches:
            cache[:] = 0xEE  # poison
        local_h, remote_h = self.prepare(layout)
        self.read(
            local_h,
            li,
            remote_h,
            ri,
            coalesce=coalesce,
            digest=True,
            local_block_ids=local_ids,
            remote_block_ids=remote_ids,
        )
        for local_cache, holder_cache in zip(self.local.caches, self.holder.caches, strict=True):
            assert np.array_equal(local_cache[list(local_ids)], holder_cache[list(remote_ids)])
            untouched = sorted(set(range(BLOCKS)) - set(local_ids))
            assert (local_cache[untouched] == 0xEE).all()
        return self.records[-1]

    def read(self, local_h: object, li: np.ndarray, remote: object, ri: np.ndarray, **context: Any) -> None:
        """One READ as vLLM's pull worker posts it (its context set around the call), seen to its end, and the
        holder's notice of it."""
        request = f"req-{next(_names)}"
        self.reader.set_context(PullContext(request, **context))
        try:
            handle = self.reader.make_prepped_xfer(
                "READ", local_h, li, remote, ri, notif_msg=f"{request}:1".encode()
            )
        finally:
            self.reader.set_context(None)
        self.finish(handle)
        assert self._wait_notice(request) == [f"{request}:1"]

    def finish(self, handle: object) -> None:
        """Posts a prepared READ and polls it to DONE, then releases it, as vLLM does."""
        assert self.reader.transfer(handle) in ("DONE", "PROC")
        deadline = time.monotonic() + 20
        while (state := self.reader.check_xfer_state(handle)) == "PROC":
            assert time.monotonic() < deadline, "pull did not finish"
        assert state == "DONE"
        self.reader.get_xfer_telemetry(handle)
        self.reader.release_xfer_handle(handle)

    def _wait_notice(self, request: str) -> list[str]:
        deadline = time.monotonic() + 10
        seen: list[str] = []
        while time.monotonic() < deadline:
            for messages in self.holder.agent.get_new_notifs().values():  # type: ignore[attr-defined]
                seen += [m.decode() for m in messages]
            if any(s.startswith(request) for s in seen):
                return [s for s in seen if s.startswith(request)]
            time.sleep(0.01)
        return seen


def _agent(name: str) -> object:
    config = nixl_api.nixl_agent_config(backends=["UCX"], capture_telemetry=True)
    return nixl_api.nixl_agent(name, config)


def _caches(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, size=(BLOCKS, PAGE), dtype=np.uint8) for _ in range(LAYERS)]


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    suffix = next(_names)
    holder_name = f"holder-{suffix}"
    holder = Side(_agent(holder_name), _caches(1))
    records: list[PullRecord] = []
    reader = PullCoalescer(
        _agent(f"reader-{suffix}"), enabled=True, reader_role="test", on_pull=records.append
    )
    local = Side(reader, _caches(2))
    for side in (holder, local):
        agent = side.agent
        ranges = [(c.ctypes.data, c.nbytes, 0, "") for c in side.caches]
        agent.register_memory(agent.get_reg_descs(ranges, "DRAM"))  # type: ignore[attr-defined]
    remote_name = reader.add_remote_agent(holder.agent.get_agent_metadata())  # type: ignore[attr-defined]
    assert remote_name in (holder_name, holder_name.encode())
    yield Pair(reader, holder, local, records, {}, remote_name)


CASES = {
    "contiguous": (list(range(1, 21)), list(range(25, 45))),
    "reversed on both sides": (list(range(30, 10, -1)), list(range(40, 20, -1))),
    "fragmented": ([*range(1, 6), *range(10, 14), 20, 22, 24], [*range(30, 35), *range(3, 7), 40, 41, 47]),
    "reversed on one side": (list(range(1, 11)), list(range(40, 30, -1))),
    "scattered": ([3, 17, 8, 29, 11, 44, 2], [19, 5, 33, 7, 41, 12, 26]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_coalesced_pull_moves_the_same_bytes_with_fewer_descriptors(pair: Pair, case: str) -> None:
    local_ids, remote_ids = CASES[case]
    runs = block_runs(local_ids, remote_ids)
    plain = pair.pull(local_ids, remote_ids, coalesce=False)
    coalesced = pair.pull(local_ids, remote_ids)

    assert not plain.coalesced and plain.fallback_reason == "off"
    assert coalesced.coalesced and coalesced.fallback_reason is None
    assert coalesced.posted_descriptors == coalesced.nixl_descriptors == LAYERS * runs.runs_sorted
    # NIXL itself merges only runs that ascend on both sides in vLLM's order.
    assert plain.nixl_descriptors == LAYERS * runs.runs_as_listed
    assert plain.listed_descriptors == coalesced.listed_descriptors == LAYERS * len(local_ids)
    assert plain.total_bytes == coalesced.total_bytes == LAYERS * PAGE * len(local_ids)
    assert coalesced.received_digest is not None and coalesced.received_digest == plain.received_digest
    assert coalesced.runs == runs


def test_kv_halves_layout_merges_where_nixl_cannot(pair: Pair) -> None:
    local_ids, remote_ids = list(range(1, 21)), list(range(25, 45))
    plain = pair.pull(local_ids, remote_ids, layout="kv_halves", coalesce=False)
    coalesced = pair.pull(local_ids, remote_ids, layout="kv_halves")
    # vLLM 0.25's K-only and V-only descriptors are not dense: NIXL merges none of them.
    assert plain.nixl_descriptors == 2 * LAYERS * len(local_ids)
    # By bytes, K and V of consecutive blocks are one range per layer.
    assert coalesced.nixl_descriptors == LAYERS
    assert coalesced.received_digest == plain.received_digest


def test_engine_setting_off_posts_vllms_descriptors(pair: Pair) -> None:
    pair.reader.enabled = False
    try:
        record = pair.pull(list(range(30, 10, -1)), list(range(40, 20, -1)))
    finally:
        pair.reader.enabled = True
    assert not record.coalesced
    assert record.nixl_descriptors == record.listed_descriptors


def test_unknown_handles_fall_back_to_vllms_call(pair: Pair) -> None:
    # A list prepared behind the coalescer's back (e.g. by a vLLM path it does not watch).
    agent = pair.reader._agent
    local_h = agent.prep_xfer_dlist(
        "NIXL_INIT_AGENT", agent.get_xfer_descs(pair.local.rows("per_layer"), "DRAM")
    )
    remote_h = pair.handles.setdefault("per_layer", pair.prepare("per_layer"))[1]
    li = np.asarray([b for b in range(5, 9)], dtype=np.int64)
    handle = pair.reader.make_prepped_xfer("READ", local_h, li, remote_h, li, notif_msg=b"unknown:1")
    pair.finish(handle)
    record = pair.records[-1]
    assert not record.coalesced and record.fallback_reason == "descriptor lists not seen at preparation"
    assert np.array_equal(pair.local.caches[0][5:9], pair.holder.caches[0][5:9])
    pair._wait_notice("unknown")


def test_counters_add_up(pair: Pair) -> None:
    before = pair.reader.counters.pulls
    pair.pull([1, 2, 3], [4, 5, 6])
    counters = pair.reader.counters
    assert counters.pulls == before + 1
    assert counters.coalesced_pulls >= 1
    assert counters.posted_descriptors <= counters.listed_descriptors


# -- a holder's host pool (kvferry.connector.host_tier) ----------------------------------------------------

SLOTS = 16


@pytest.fixture(scope="module")
def holder_pool(pair: Pair) -> Iterator[HostPool]:
    """The holder's pool, its slots 0..9 holding its blocks 20..29, registered with its NIXL agent."""
    pool = HostPool(pair.holder.rows("per_layer"), [BLOCKS] * LAYERS, SLOTS)
    pool.copy_in(list(range(20, 30)), list(range(10)))[1].wait()
    agent = pair.holder.agent
    address, nbytes = pool.registration()
    agent.register_memory(agent.get_reg_descs([(address, nbytes, 0, "")], "DRAM"))  # type: ignore[attr-defined]
    pair.reader.add_remote_agent(agent.get_agent_metadata())  # type: ignore[attr-defined]
    yield pool


def pool_list(pair: Pair, pool: HostPool, *, mapped: bool, lists_pool: bool) -> PoolList:
    layout = pool.layout()
    _, remote_h = pair.prepare("per_layer")
    base = remote_h
    if lists_pool:
        extended, _ = extend_remote_rows(pair.holder.rows("per_layer"), [BLOCKS] * LAYERS, layout)
        base = pair.reader.prep_xfer_dlist(pair.holder_name, pair.reader.get_xfer_descs(extended, "DRAM"))
    opened = MappedHostPool.open(layout, HostCopier())[0] if mapped else None
    return PoolList(base, pair.holder_name, BLOCKS, layout, opened, lists_pool)


def read_through(
    pair: Pair, remote: PoolList, local_ids: list[int], remote_ids: list[int], **context: Any
) -> PullRecord:
    """A pull as vLLM posts it against a holder with a pool: indices run ``BLOCKS + SLOTS`` a region."""
    per_region = BLOCKS + SLOTS
    li = np.asarray([r * BLOCKS + b for r in range(LAYERS) for b in local_ids], dtype=np.int64)
    ri = np.asarray([r * per_region + b for r in range(LAYERS) for b in remote_ids], dtype=np.int64)
    for cache in pair.local.caches:
        cache[:] = 0xEE
    local_h, _ = pair.prepare("per_layer")
    pair.read(local_h, li, remote, ri, **context)
    return pair.records[-1]


def assert_pulled(pair: Pair, local_ids: list[int], holder_ids: list[int]) -> None:
    for local_cache, holder_cache in zip(pair.local.caches, pair.holder.caches, strict=True):
        assert np.array_equal(local_cache[local_ids], holder_cache[holder_ids])


def test_pool_slots_of_a_mapped_pool_are_copied_here_in_runs(pair: Pair, holder_pool: HostPool) -> None:
    remote = pool_list(pair, holder_pool, mapped=True, lists_pool=False)
    # Slots 2..7 hold the holder's blocks 22..27; local blocks 30..35 receive them.
    record = read_through(pair, remote, list(range(30, 36)), [BLOCKS + s for s in range(2, 8)])
    assert_pulled(pair, list(range(30, 36)), list(range(22, 28)))
    assert record.read == "mapped" and record.coalesced
    assert record.posted_descriptors == LAYERS  # one run a region
    assert record.total_bytes == LAYERS * PAGE * 6


def test_kv_cache_blocks_of_a_holder_with_a_pool_are_read_over_nixl(
    pair: Pair, holder_pool: HostPool
) -> None:
    remote = pool_list(pair, holder_pool, mapped=True, lists_pool=False)
    record = read_through(pair, remote, [1, 2, 3], [40, 41, 42])
    assert_pulled(pair, [1, 2, 3], [40, 41, 42])
    assert record.read == "nixl" and record.nixl_descriptors == LAYERS


def test_an_unmapped_pool_is_read_over_nixl_where_the_holders_list_holds_it(
    pair: Pair, holder_pool: HostPool
) -> None:
    remote = pool_list(pair, holder_pool, mapped=True, lists_pool=True)
    record = read_through(pair, remote, [5, 6], [BLOCKS + 0, BLOCKS + 1], mapped=False)
    assert_pulled(pair, [5, 6], [20, 21])
    assert record.read == "nixl"


def test_a_pool_neither_mapped_nor_listed_is_refused(pair: Pair, holder_pool: HostPool) -> None:
    remote = pool_list(pair, holder_pool, mapped=False, lists_pool=False)
    local_h, _ = pair.prepare("per_layer")
    with pytest.raises(RuntimeError, match="cannot read the holder's host pool"):
        pair.reader.make_prepped_xfer(
            "READ", local_h, np.asarray([0]), remote, np.asarray([BLOCKS]), notif_msg=b"x:1"
        )


def test_a_mapped_pool_checks_the_files_identity(holder_pool: HostPool) -> None:
    layout = holder_pool.layout()
    mapped, why = MappedHostPool.open(layout, HostCopier())
    assert mapped is not None and why == ""
    other = MappedHostPool.open(dataclasses.replace(layout, identity=layout.identity + 2), HostCopier())
    assert other[0] is None and "identity differs" in other[1]
    gone = MappedHostPool.open(dataclasses.replace(layout, fd=10_000), HostCopier())
    assert gone[0] is None and "/proc/" in gone[1]


@pytest.mark.parametrize("layout", ["per_layer", "kv_halves"])
def test_warm_reads_each_region_s_block_0_into_block_0_only_and_notifies_nobody(
    pair: Pair, layout: str
) -> None:
    """PullCoalescer.warm (the connector's reads warmed ahead of a peer's first pull): block 0 of every layer
    comes from the holder's block 0, no other byte changes, the holder gets no notice, and it is no pull."""
    pair.prepare(layout)
    for cache in pair.local.caches:
        cache[:] = 0xEE
    pulls = len(pair.records)
    warmed = pair.reader.warm(pair.holder_name)
    assert warmed.descriptors == LAYERS
    length = warmed.bytes // LAYERS
    assert length in (PAGE, PAGE // 2)
    for local_cache, holder_cache in zip(pair.local.caches, pair.holder.caches, strict=True):
        assert np.array_equal(local_cache[0, :length], holder_cache[0, :length])
        assert (local_cache[0, length:] == 0xEE).all() and (local_cache[1:] == 0xEE).all()
    assert len(pair.records) == pulls
    time.sleep(0.2)
    assert not any(pair.holder.agent.get_new_notifs().values())  # type: ignore[attr-defined]


def test_warm_refuses_a_peer_without_a_prepared_list(pair: Pair) -> None:
    with pytest.raises(PlanError, match="no descriptor list of that peer"):
        pair.reader.warm("no-such-peer")
