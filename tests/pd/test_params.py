"""The P/D contract's wire forms: vLLM's kv_transfer_params, kvferry's own keys, the reuse rules. Pure."""

from __future__ import annotations

import dataclasses

import pytest
from kvferry.pd import kvferry_params, vllm_params
from kvferry.pd.engine_api import (
    DecodeRequest,
    PrefillRequest,
    decode_transfer_params,
    prefill_transfer_params,
)
from kvferry.pd.kvferry_params import (
    LEASE_EXPIRE_KEY,
    MARK_KEY,
    PULL_OPTIONS_KEY,
    READ_MS_KEY,
    ConversationMark,
    PullOptions,
    ReleaseMark,
    lease_expire_time_from_params,
    parse_mark,
    read_ms_from_params,
    read_ms_params,
)
from kvferry.pd.reuse import (
    MEMORY_TIER_HOST,
    ReadWindow,
    RetainedKv,
    max_read_window,
    max_reusable_tokens,
    read_window_fits,
)
from kvferry.pd.vllm_params import KvHandoff, RemoteBlocks
from kvferry.v1 import resources_pb2

MARK = ConversationMark("acme", "c-1", 3)
P_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[4, 5, 6]],
    "remote_engine_id": "prefill-0",
    "remote_request_id": "cmpl-x-0-abcd",
    "remote_host": "127.0.0.1",
    "remote_port": 5601,
    "tp_size": 1,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 70,
    "remote_blocks_expiry_time": None,
    "transfer_mode": "pull",
}


def test_a_prefill_handoff_round_trips_into_the_decode_params() -> None:
    handoff = KvHandoff.from_params(P_PARAMS)
    assert handoff is not None and handoff.do_remote_prefill and handoff.blocks is not None
    assert handoff.blocks.block_ids == ((4, 5, 6),)
    params = decode_transfer_params(handoff, MARK)
    assert params["kvferry"] == {"tenant": "acme", "conversation_id": "c-1", "turn": 3}
    assert {k: v for k, v in params.items() if k != "kvferry"} == {
        k: v for k, v in P_PARAMS.items() if v is not None
    }


def test_a_release_mark_rides_in_the_decode_params_and_parses_back() -> None:
    handoff = KvHandoff.from_params(P_PARAMS)
    assert handoff is not None
    params = decode_transfer_params(handoff, ReleaseMark())
    assert params["kvferry"] == {"retain": False}
    assert parse_mark(params) == ReleaseMark()
    # Not a conversation: nothing to retain for it.
    assert ConversationMark.from_params(params) is None
    assert parse_mark(decode_transfer_params(handoff, MARK)) == MARK
    assert parse_mark(decode_transfer_params(handoff, None)) is None


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        ({"retain": True}, "may only be false"),
        ({"retain": 0}, "may only be false"),
        ("c-1", "must be an object"),
        ({"tenant": "acme", "turn": 1}, "lacks 'conversation_id'"),
        ({"tenant": "acme", "conversation_id": "c-1", "turn": "1"}, "wrong type"),
    ],
)
def test_malformed_marks_are_refused_with_the_reason(raw: object, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_mark({"kvferry": raw})


def test_a_decode_answer_offers_its_blocks_for_the_next_turn() -> None:
    d_params = {**P_PARAMS, "do_remote_prefill": False, "do_remote_decode": True, "remote_engine_id": "d-0"}
    retained = RetainedKv.from_decode_answer(
        KvHandoff.from_params(d_params), block_size=32, lease_expire_time=5.0
    )
    assert retained == RetainedKv("d-0", "cmpl-x-0-abcd", (4, 5, 6), 70, "127.0.0.1", 5601, 32, 5.0)
    assert RetainedKv.from_decode_answer(None, block_size=32, lease_expire_time=5.0) is None


def test_decode_params_need_a_prefill_handoff() -> None:
    with pytest.raises(ValueError, match="do_remote_prefill"):
        decode_transfer_params(KvHandoff(False, True, None), MARK)


def test_reuse_pulls_exactly_the_blocks_of_the_reused_prefix() -> None:
    retained = RetainedKv("decode-0", "cmpl-y", (7, 8, 9, 10), 120, "127.0.0.1", 5602, 32, 1e12)
    reuse = retained.prefix(64)
    params = prefill_transfer_params(MARK, reuse, read_ms=8_500)
    assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
    assert params["remote_block_ids"] == [[7, 8]]
    assert params["remote_num_tokens"] == 64
    assert params["remote_engine_id"] == "decode-0" and params["remote_request_id"] == "cmpl-y"
    assert read_ms_from_params(params) == 8_500
    for bad in (0, 48, 128):
        with pytest.raises(ValueError):
            retained.prefix(bad)


def test_a_fresh_prefill_carries_no_remote_blocks_and_no_read_window() -> None:
    params = prefill_transfer_params(MARK, None, read_ms=5)
    assert params == {"do_remote_decode": True, "do_remote_prefill": False, **MARK.to_params()}
    assert read_ms_from_params(params) is None


def test_a_marked_pull_needs_its_read_window() -> None:
    reuse = RetainedKv("decode-0", "cmpl-y", (7, 8), 64, "h", 1, 32, 1e12).prefix(32)
    with pytest.raises(ValueError, match="read_ms"):
        PrefillRequest((1,) * 40, mark=MARK, reuse=reuse).transfer_params()
    # An unmarked pull of a retention (retain=false) carries it all the same.
    params = PrefillRequest((1,) * 40, reuse=reuse, read_ms=700).transfer_params()
    assert params[READ_MS_KEY] == 700 and MARK_KEY not in params
    # Blocks vLLM holds on its own (no mark) need none.
    assert PrefillRequest((1,) * 40, reuse=reuse).transfer_params()["remote_num_tokens"] == 32


def test_pull_options_ride_beside_the_mark() -> None:
    options = PullOptions(coalesce=False, digest=True)
    params = PrefillRequest((1, 2), mark=MARK, pull_options=options).transfer_params()
    assert params[PULL_OPTIONS_KEY] == {"coalesce": False, "digest": True}
    handoff = KvHandoff.from_params(P_PARAMS)
    assert handoff is not None
    decode = decode_transfer_params(handoff, MARK, pull_options=options)
    assert PullOptions.from_params(decode) == options
    assert PULL_OPTIONS_KEY not in DecodeRequest((1, 2), handoff, MARK).transfer_params()


def test_per_request_pull_options() -> None:
    assert PullOptions.from_params(None) is None
    assert PullOptions.from_params({"do_remote_decode": True}) is None
    options = PullOptions(coalesce=False, digest=True)
    assert PullOptions.from_params(options.to_params()) == options
    assert PullOptions.from_params({PULL_OPTIONS_KEY: {"digest": True}}) == PullOptions(None, True)
    for bad in ({"coalesce": "no"}, {"speed": 1}, ["digest"], {"digest": 1}):
        with pytest.raises(ValueError, match=PULL_OPTIONS_KEY):
            PullOptions.from_params({PULL_OPTIONS_KEY: bad})


def test_reusable_tokens_are_block_aligned_and_leave_a_token_to_compute() -> None:
    assert max_reusable_tokens(prompt_len=100, matched_tokens=90, block_size=32) == 64
    assert max_reusable_tokens(prompt_len=65, matched_tokens=200, block_size=32) == 64
    assert max_reusable_tokens(prompt_len=64, matched_tokens=64, block_size=32) == 32
    assert max_reusable_tokens(prompt_len=10, matched_tokens=10, block_size=32) == 0


def test_a_read_window_opens_at_the_lookup_and_never_outlives_the_lease() -> None:
    assert ReadWindow.opened(50.0, 10.0, lease_seconds_left=100.0) == ReadWindow(60.0)
    assert ReadWindow.opened(50.0, 10.0, lease_seconds_left=5.0) == ReadWindow(55.0)
    assert ReadWindow.opened(50.0, 10.0, lease_seconds_left=-3.0) == ReadWindow(50.0)
    window = ReadWindow(60.0)
    assert window.seconds_left(52.5) == 7.5 and window.ms_left(52.5) == 7_500
    # Rounded down (never promises time it has not), never negative.
    assert window.ms_left(59.9996) == 0 and window.ms_left(61.0) == 0
    retained = RetainedKv("d", "r", (1,), 32, "h", 1, 32, lease_expire_time=1_000.0)
    assert retained.read_window(50.0, 10.0, now_wall=995.0) == ReadWindow(55.0)


def test_the_read_window_s_time_left_on_the_wire() -> None:
    assert read_ms_params(8_500) == {READ_MS_KEY: 8_500}
    assert read_ms_from_params(read_ms_params(0)) == 0
    assert read_ms_from_params(None) is None and read_ms_from_params({"kvferry": {}}) is None
    for bad in (-1, 1.5, "100", True):
        with pytest.raises(ValueError, match=READ_MS_KEY):
            read_ms_from_params({READ_MS_KEY: bad})
    with pytest.raises(ValueError):
        read_ms_params(-1)
    # Version 2's wall-clock deadline is still read (older clients).
    legacy = {MARK_KEY: {**MARK.to_params()[MARK_KEY], LEASE_EXPIRE_KEY: 5.0}}
    assert lease_expire_time_from_params(legacy) == 5.0


@pytest.mark.parametrize(
    ("window", "grace", "fits"),
    [(10.0, 30.0, True), (15.0, 30.0, True), (15.01, 30.0, False), (10.0, 4.0, False), (1.0, 0.0, False)],
)
def test_a_read_window_fits_under_half_the_release_grace(window: float, grace: float, fits: bool) -> None:
    assert read_window_fits(window, grace) is fits
    assert max_read_window(30.0) == 15.0 and max_read_window(0.0) == 0.0


def test_the_connector_s_in_place_edits_of_vllm_params() -> None:
    params = {**P_PARAMS, "do_remote_prefill": False, "do_remote_decode": True, "kvferry": {"retain": False}}
    assert vllm_params.wants_remote_decode(params) and vllm_params.names_remote_blocks(params)
    assert vllm_params.block_id_groups(params) == ((4, 5, 6),)
    assert vllm_params.block_id_groups({"remote_block_ids": [1, 2]}) == ((1, 2),)
    assert vllm_params.remote_num_tokens(params) == 70
    vllm_params.set_blocks_expiry_time(params, 12.5)
    assert RemoteBlocks.from_params(params) == RemoteBlocks(
        "prefill-0", "cmpl-x-0-abcd", ((4, 5, 6),), "127.0.0.1", 5601, num_tokens=70, expiry_time=12.5
    )
    vllm_params.strip_remote_blocks(params)
    assert not vllm_params.names_remote_blocks(params) and RemoteBlocks.from_params(params) is None
    # What is not about remote blocks stays: the request is still a prefill, still marked.
    assert params["do_remote_decode"] is True and params["kvferry"] == {"retain": False}
    with pytest.raises(ValueError, match="malformed remote blocks"):
        RemoteBlocks.from_params({"remote_block_ids": [[1]], "remote_engine_id": "d"})


def test_every_kvferry_key_is_in_the_versioned_module() -> None:
    """A new kvferry key means a new version and a line of history (kvferry_params.py)."""
    keys = {
        kvferry_params.MARK_KEY,
        kvferry_params.PULL_OPTIONS_KEY,
        kvferry_params.READ_MS_KEY,
        kvferry_params.GENERATIONS_KEY,
        kvferry_params.TIER_KEY,
        kvferry_params.PEER_KEY,
    }
    assert keys == {
        "kvferry",
        "kvferry_pull",
        "kvferry_read_ms",
        "kvferry_generations",
        "kvferry_tier",
        "kvferry_peer",
    }
    assert kvferry_params.KVFERRY_PARAMS_VERSION == 8
    # kvferry's top-level keys never collide with vLLM's.
    assert not keys & {
        *vllm_params.REMOTE_BLOCK_KEYS,
        vllm_params.DO_REMOTE_DECODE,
        vllm_params.DO_REMOTE_PREFILL,
    }


def test_block_generations_round_trip_and_refuse_what_json_cannot_carry() -> None:
    generations = kvferry_params.BlockGenerations((7, 2**52 + 3))
    params = generations.to_params()
    assert params == {"kvferry_generations": [7, 2**52 + 3]}
    assert kvferry_params.BlockGenerations.from_params(params) == generations
    assert kvferry_params.BlockGenerations.from_params({}) is None
    for bad in ([1.5], [-1], [2**53], [True], "7", {"a": 1}):
        with pytest.raises(ValueError, match="kvferry_generations"):
            kvferry_params.BlockGenerations.from_params({"kvferry_generations": bad})


def test_retained_kv_hands_out_the_generations_of_the_pulled_prefix() -> None:
    retained = RetainedKv(
        engine_id="d",
        engine_request_id="r",
        block_ids=(7, 8, 9),
        num_tokens=80,
        nixl_host="h",
        nixl_port=1,
        block_size=32,
        lease_expire_time=0.0,
        block_generations=(50, 51, 52),
    )
    assert retained.prefix_generations(64) == kvferry_params.BlockGenerations((50, 51))
    assert dataclasses.replace(retained, block_generations=()).prefix_generations(64) is None
    with pytest.raises(ValueError, match="2 block generations for 3 block ids"):
        dataclasses.replace(retained, block_generations=(1, 2))
    params = prefill_transfer_params(
        None,
        retained.prefix(64),
        read_ms=None,
        generations=retained.prefix_generations(64),
    )
    assert params["kvferry_generations"] == [50, 51]
    assert params["remote_block_ids"] == [[7, 8]]
    # Without a pull there is nothing to check.
    assert "kvferry_generations" not in prefill_transfer_params(
        None, None, read_ms=None, generations=kvferry_params.BlockGenerations((1,))
    )


def test_a_pull_from_the_host_pool_says_so_and_a_kv_cache_pull_adds_nothing() -> None:
    """P keeps a pull rate per holder and tier (version 7); a pull from the KV cache sends the params engines
    before version 7 know."""
    retained = RetainedKv(
        engine_id="d",
        engine_request_id="r",
        block_ids=(7, 8),
        num_tokens=64,
        nixl_host="h",
        nixl_port=1,
        block_size=32,
        lease_expire_time=0.0,
        tier=MEMORY_TIER_HOST,
    )
    assert MEMORY_TIER_HOST == resources_pb2.MEMORY_TIER_HOST
    assert retained.pull_tier == kvferry_params.HOST_TIER
    params = prefill_transfer_params(None, retained.prefix(64), read_ms=None, tier=retained.pull_tier)
    assert params["kvferry_tier"] == "host"
    assert kvferry_params.tier_from_params(params) == kvferry_params.HOST_TIER
    in_kv_cache = dataclasses.replace(retained, tier=0)
    assert "kvferry_tier" not in prefill_transfer_params(
        None, in_kv_cache.prefix(64), read_ms=None, tier=in_kv_cache.pull_tier
    )
    assert kvferry_params.tier_from_params({}) == kvferry_params.DEVICE_TIER
    # Without a pull there is no tier to say.
    assert "kvferry_tier" not in prefill_transfer_params(None, None, read_ms=None, tier="host")
    for bad in ("gpu", 2, None):
        with pytest.raises(ValueError, match="kvferry_tier must be one of"):
            kvferry_params.tier_from_params({"kvferry_tier": bad})
    with pytest.raises(ValueError, match="kvferry_tier must be one of"):
        kvferry_params.tier_params("disk")


def test_a_prefill_names_the_engine_it_will_pull_from_next() -> None:
    """Version 8: P handshakes with the turn's decode engine ahead of the next turn's pull from it."""
    peer = kvferry_params.PeerAddress(engine_id="decode-0", host="10.0.0.7", port=5600)
    params = PrefillRequest(token_ids=(1, 2, 3), peer=peer).transfer_params()
    assert params["kvferry_peer"] == {"engine_id": "decode-0", "host": "10.0.0.7", "port": 5600}
    assert kvferry_params.PeerAddress.from_params(params) == peer
    assert kvferry_params.PeerAddress.from_params({}) is None
    assert "kvferry_peer" not in PrefillRequest(token_ids=(1, 2, 3)).transfer_params()


@pytest.mark.parametrize(
    "raw",
    [
        "decode-0",
        {"engine_id": "d", "host": "h"},
        {"engine_id": "d", "host": "h", "port": 1, "extra": 2},
        {"engine_id": "", "host": "h", "port": 1},
        {"engine_id": "d", "host": "", "port": 1},
        {"engine_id": "d", "host": "h", "port": "5600"},
        {"engine_id": "d", "host": "h", "port": True},
        {"engine_id": "d", "host": "h", "port": 0},
        {"engine_id": "d", "host": "h", "port": 65536},
        {"engine_id": 7, "host": "h", "port": 1},
    ],
)
def test_a_malformed_peer_is_refused_with_the_key(raw: object) -> None:
    with pytest.raises(ValueError, match="kvferry_peer"):
        kvferry_params.PeerAddress.from_params({"kvferry_peer": raw})
