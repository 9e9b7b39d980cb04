"""The router's domain logic as plain Python: prefix matching, the cost model, engine selection,
API keys. No servers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvferry.pd.digest import block_digests
from kvferry.router.calibration import CostProfile
from kvferry.router.cost import CostSettings, RateInputs, Reuse, choose_reuse
from kvferry.router.engines import (
    EngineInfo,
    EngineStats,
    EngineTable,
    LoadTracker,
    pick_decode_engine,
    pick_prefill_engine,
)
from kvferry.router.prefix import PrefixMatch, PromptDigestCache, match_retained_prefix
from kvferry.router.tenants import ApiKeys, TenantConfigError, key_digest, load_tenants, parse_key_pairs
from kvferry.runtime.errors import ErrorKind, ServiceError
from kvferry.v1 import resources_pb2

BS = 16
SALT = "kv-hash-a"


def matched(
    prompt: list[int],
    history: list[int],
    *,
    salt: str = SALT,
    num_tokens: int | None = None,
    num_blocks: int | None = None,
) -> PrefixMatch:
    """Matches ``prompt`` against a retention of ``history`` published with salt SALT."""
    return match_retained_prefix(
        prompt,
        retained_digests=block_digests(history, BS, salt=SALT),
        retained_num_tokens=len(history) if num_tokens is None else num_tokens,
        retained_num_blocks=-(-len(history) // BS) if num_blocks is None else num_blocks,
        block_size=BS,
        salt=salt,
    )


# -- prefix ---------------------------------------------------------------------------------------


def test_prefix_extending_history_matches_every_full_retained_block() -> None:
    history = list(range(100))
    match = matched([*history, 7, 8, 9], history)
    assert match.blocks == 6 and match.tokens == 96


def test_prefix_edit_keeps_only_blocks_before_it() -> None:
    history = list(range(100))
    edited = history.copy()
    edited[40] = 9999  # inside block 2 (tokens 32..47)
    assert matched([*edited, 1, 2], history).tokens == 32


def test_prefix_edit_in_first_block_or_other_salt_matches_nothing() -> None:
    history = list(range(100))
    assert matched([5, *history[1:]], history).tokens == 0
    assert matched([*history, 1], history, salt="kv-hash-b").tokens == 0


def test_prefix_leaves_at_least_one_token_to_compute() -> None:
    history = list(range(64))
    # Same prompt as retained: the last block is given up so prefill has a token to compute.
    assert matched(history, history).tokens == 48
    assert matched([*history, 1], history).tokens == 64


def test_prefix_never_exceeds_retained_tokens_or_blocks() -> None:
    history = list(range(100))
    # The engine says fewer tokens (or blocks) than the digests cover.
    assert matched([*history, 1], history, num_tokens=40).tokens == 32
    assert matched([*history, 1], history, num_blocks=2).tokens == 32


def test_a_conversation_s_next_prompt_hashes_only_its_new_blocks(chained_blocks: list[int]) -> None:
    cache = PromptDigestCache(max_bytes=1 << 20)
    conversation = ("acme", "c1")
    history = list(range(1000, 1100))  # 6 full blocks
    assert list(cache.digests(conversation, history, block_size=BS, salt=SALT)) == block_digests(
        history, BS, salt=SALT
    )
    grown = [*history, *range(5000, 5040)]  # 8 full blocks: 2 new
    assert list(cache.digests(conversation, grown, block_size=BS, salt=SALT)) == block_digests(
        grown, BS, salt=SALT
    )
    # The same prompt again (a retried turn) hashes nothing new; another conversation starts afresh.
    assert list(cache.digests(conversation, grown, block_size=BS, salt=SALT)) == block_digests(
        grown, BS, salt=SALT
    )
    assert cache.digests(("acme", "c2"), grown, block_size=BS, salt=SALT) == block_digests(
        grown, BS, salt=SALT
    )
    assert chained_blocks == [6, 2, 0, 8]


def test_a_prompt_that_does_not_begin_with_the_last_one_is_hashed_whole() -> None:
    cache = PromptDigestCache(max_bytes=1 << 20)
    conversation = ("acme", "c1")
    history = list(range(1000, 1100))
    cache.digests(conversation, history, block_size=BS, salt=SALT)
    edited = history.copy()
    edited[40] = 9  # block 2
    for prompt, block_size, salt in [
        ([*edited, 1, 2, 3], BS, SALT),  # an edited history
        (history[:50], BS, SALT),  # a shorter prompt
        (history, BS, "kv-hash-b"),  # another KV layout
        (history, 8, SALT),  # another block size
        (history, BS, SALT),
    ]:
        assert list(cache.digests(conversation, prompt, block_size=block_size, salt=salt)) == block_digests(
            prompt, block_size, salt=salt
        )


def test_the_digest_cache_drops_its_least_recently_used_conversations_past_its_bytes() -> None:
    prompt = list(range(160))  # 10 blocks: 160 bytes of digests, plus the entry's overhead
    cache = PromptDigestCache(max_bytes=2 * (160 + 400))
    for name in ("a", "b", "a", "c"):
        cache.digests(("acme", name), prompt, block_size=BS, salt=SALT)
    assert len(cache) == 2 and cache.held_bytes <= 2 * (160 + 400)
    # "b" went first: "a" was used after it.
    assert set(cache._entries) == {("acme", "a"), ("acme", "c")}
    # A prompt whose digests alone are over the budget is hashed, not kept.
    assert cache.digests(("acme", "d"), list(range(4000)), block_size=BS, salt=SALT) == block_digests(
        list(range(4000)), BS, salt=SALT
    )
    assert len(cache) == 2


_TURN_CHANGES = st.lists(
    st.tuples(
        st.sampled_from(["c1", "c2"]),
        st.sampled_from(["grow", "edit", "cut", "salt"]),
        st.lists(st.integers(0, 2**31 - 1), min_size=0, max_size=40),
        st.integers(0, 200),
    ),
    max_size=12,
)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(_TURN_CHANGES)
def test_whatever_a_conversation_sends_its_cached_digests_are_its_prompt_s_chain(
    changes: list[tuple[str, str, list[int], int]],
) -> None:
    cache = PromptDigestCache(max_bytes=1 << 20)
    prompts: dict[str, list[int]] = {"c1": [], "c2": []}
    for name, change, tokens, where in changes:
        prompt, salt = prompts[name], SALT
        if change == "grow":
            prompt = [*prompt, *tokens]
        elif change == "edit" and prompt:
            prompt = [*prompt[: where % len(prompt)], *tokens, *prompt[where % len(prompt) + 1 :]]
        elif change == "cut":
            prompt = prompt[: where % (len(prompt) + 1)]
        else:
            salt = "kv-hash-b"
        prompts[name] = prompt
        got = cache.digests(("acme", name), prompt, block_size=4, salt=salt)
        assert list(got) == block_digests(prompt, 4, salt=salt)


# -- cost model -----------------------------------------------------------------------------------

PROFILE = CostProfile(
    prefill_tokens_per_second=1000.0, transfer_bytes_per_second=1e8, transfer_setup_seconds=0.02
)
SETTINGS = CostSettings(profile=PROFILE, kv_recompute_threshold=64, lease_margin_seconds=2.0)
NO_RATES = RateInputs(0.0, 0.0, 0)


def test_cost_no_match_is_none_and_below_threshold_recomputes() -> None:
    assert choose_reuse(0, lease_seconds_left=100, rates=NO_RATES, settings=SETTINGS).reuse is Reuse.NONE
    small = choose_reuse(48, lease_seconds_left=100, rates=NO_RATES, settings=SETTINGS)
    assert small.reuse is Reuse.RECOMPUTE and "threshold" in small.reason


def test_cost_pull_when_cheaper_than_recompute() -> None:
    # 1000 tokens: recompute 1 s; pull 0.02 + 1000 * 10 kB / 100 MB/s = 0.12 s.
    choice = choose_reuse(1000, lease_seconds_left=100, rates=RateInputs(0.0, 0.0, 10_000), settings=SETTINGS)
    assert choice.reuse is Reuse.PULL and choice.pull_tokens == 1000
    assert choice.estimated_pull_seconds == pytest.approx(0.12)
    assert choice.estimated_recompute_seconds == pytest.approx(1.0)


def test_cost_engine_rates_override_the_profile() -> None:
    # The engine reports a slow link: 1000 tokens * 10 kB at 1 MB/s = 10 s > 1 s recompute.
    slow_link = RateInputs(
        prefill_tokens_per_second=0.0, pull_bytes_per_second=1e6, kv_bytes_per_token=10_000
    )
    choice = choose_reuse(1000, lease_seconds_left=100, rates=slow_link, settings=SETTINGS)
    assert choice.reuse is Reuse.RECOMPUTE and "cheaper" in choice.reason
    # A fast prefill engine makes recompute win too.
    fast_prefill = RateInputs(
        prefill_tokens_per_second=1e6, pull_bytes_per_second=0.0, kv_bytes_per_token=10_000
    )
    assert (
        choose_reuse(1000, lease_seconds_left=100, rates=fast_prefill, settings=SETTINGS).reuse
        is Reuse.RECOMPUTE
    )


def test_cost_lease_too_short_recomputes() -> None:
    choice = choose_reuse(1000, lease_seconds_left=1.5, rates=RateInputs(0, 0, 10_000), settings=SETTINGS)
    assert choice.reuse is Reuse.RECOMPUTE and "lease" in choice.reason
    assert (
        choose_reuse(1000, lease_seconds_left=2.5, rates=RateInputs(0, 0, 10_000), settings=SETTINGS).reuse
        is Reuse.PULL
    )


# -- engines --------------------------------------------------------------------------------------


def engine(engine_id: str, role: int, *, model: str = "m", kv_hash: str = SALT, **stats: int) -> EngineInfo:
    return EngineInfo(
        engine_id=engine_id,
        role=role,
        http_endpoint=f"http://{engine_id}",
        nixl_host="127.0.0.1",
        nixl_port=1,
        model=model,
        kv_compatibility_hash=kv_hash,
        block_size=BS,
        max_model_len=4096,
        stats=EngineStats(**stats),  # type: ignore[arg-type]
    )


P, D, BOTH = (
    resources_pb2.ENGINE_ROLE_PREFILL,
    resources_pb2.ENGINE_ROLE_DECODE,
    resources_pb2.ENGINE_ROLE_BOTH,
)


def test_engine_table_roles_and_models() -> None:
    table = EngineTable(
        [engine("p1", P), engine("d1", D), engine("b1", BOTH), engine("p2", P, model="other")]
    )
    assert {e.engine_id for e in table.prefill_engines("m")} == {"p1", "b1"}
    assert {e.engine_id for e in table.decode_engines("m")} == {"d1", "b1"}
    assert table.models() == ["m", "other"]
    table.remove("b1")
    assert {e.engine_id for e in table.decode_engines("m")} == {"d1"}


def test_prefill_choice_balances_inflight_tokens_and_respects_kv_layout() -> None:
    load = LoadTracker()
    engines = [
        engine("p1", P, inflight_prefill_tokens=100),
        engine("p2", P),
        engine("p3", P, kv_hash="other"),
    ]
    load.add_prefill("p2", 500)
    assert pick_prefill_engine(engines, load).engine_id == "p3"  # type: ignore[union-attr]
    assert pick_prefill_engine(engines, load, kv_compatibility_hash=SALT).engine_id == "p1"  # type: ignore[union-attr]
    assert pick_prefill_engine(engines, load, exclude=frozenset({"p1", "p3"})).engine_id == "p2"  # type: ignore[union-attr]
    load.add_prefill("p2", -500)
    assert pick_prefill_engine(engines, load, kv_compatibility_hash=SALT).engine_id == "p2"  # type: ignore[union-attr]
    assert pick_prefill_engine(engines, load, exclude=frozenset({"p1", "p2", "p3"})) is None


def test_decode_choice_prefers_the_holder_else_least_loaded() -> None:
    load = LoadTracker()
    engines = [engine("d1", D, running_requests=5), engine("d2", D, running_requests=1)]
    assert pick_decode_engine(engines, load, holder_id="d1").engine_id == "d1"  # type: ignore[union-attr]
    assert pick_decode_engine(engines, load).engine_id == "d2"  # type: ignore[union-attr]
    load.add_decode("d2", 10)
    assert pick_decode_engine(engines, load, holder_id="gone").engine_id == "d1"  # type: ignore[union-attr]
    assert pick_decode_engine(engines, load, holder_id="d1", exclude=frozenset({"d1"})).engine_id == "d2"  # type: ignore[union-attr]


# -- API keys -------------------------------------------------------------------------------------


def test_api_keys_from_toml_and_json(tmp_path: Path) -> None:
    toml = tmp_path / "tenants.toml"
    toml.write_text(
        '[[tenants]]\nname = "acme"\napi_keys = ["k1", "k2"]\n\n'
        f'[[tenants]]\nname = "globex"\napi_key_sha256 = ["{key_digest("k3")}"]\nmodels = ["m"]\n'
    )
    keys = load_tenants(toml)
    assert keys.authenticate("Bearer k1").name == "acme"
    assert keys.authenticate("bearer k2").name == "acme"
    globex = keys.authenticate("Bearer k3")
    assert globex.name == "globex" and globex.models == frozenset({"m"})
    globex.check_model("m")
    with pytest.raises(ServiceError) as denied:
        globex.check_model("other")
    assert denied.value.kind is ErrorKind.PERMISSION_DENIED
    as_json = tmp_path / "tenants.json"
    as_json.write_text(json.dumps({"tenants": [{"name": "acme", "api_keys": ["k1"]}]}))
    assert load_tenants(as_json).authenticate("Bearer k1").name == "acme"


@pytest.mark.parametrize(
    ("header", "fragment"),
    [
        (None, "missing API key"),
        ("", "missing API key"),
        ("Token k1", "Bearer"),
        ("Bearer nope", "unknown API key"),
    ],
)
def test_api_key_failures_are_unauthenticated(header: str | None, fragment: str) -> None:
    keys = ApiKeys.from_pairs([("k1", "acme")])
    with pytest.raises(ServiceError) as failed:
        keys.authenticate(header)
    assert failed.value.kind is ErrorKind.UNAUTHENTICATED and fragment in failed.value.message


@pytest.mark.parametrize(
    ("document", "fragment"),
    [
        ("{}", "non-empty `tenants`"),
        ('{"tenants": [{"name": "a b", "api_keys": ["k"]}]}', "outside"),
        ('{"tenants": [{"name": "a"}]}', "has no api_keys"),
        ('{"tenants": [{"name": "a", "api_keys": "k"}]}', "list of non-empty strings"),
        ('{"tenants": [{"name": "a", "api_key_sha256": ["abc"]}]}', "not a hex SHA-256"),
        ('{"tenants": [{"name": "a", "api_keys": ["k"], "colour": 1}]}', "unknown fields"),
        ('{"tenants": [{"name": "a", "api_keys": ["k"]}, {"name": "b", "api_keys": ["k"]}]}', "also 'a'"),
        (
            '{"tenants": [{"name": "a", "api_keys": ["k1"]}, {"name": "a", "api_keys": ["k2"]}]}',
            "tenants[1]: tenant 'a' is already defined by tenants[0]",
        ),
        ("not json", "not valid JSON"),
    ],
)
def test_bad_tenant_files_say_what_is_wrong(tmp_path: Path, document: str, fragment: str) -> None:
    path = tmp_path / "tenants.json"
    path.write_text(document)
    with pytest.raises(TenantConfigError) as bad:
        load_tenants(path)
    assert fragment in str(bad.value) and str(path) in str(bad.value)


def test_a_tenant_named_by_two_entries_is_refused_naming_both_lines(tmp_path: Path) -> None:
    """Limits are kept per tenant name: two entries of one tenant would share its token bucket, each
    resetting it to its own rate."""
    path = tmp_path / "tenants.toml"
    path.write_text(
        '# tenants\n[[tenants]]\nname = "acme"\napi_keys = ["k1"]\ntokens_per_second = 100\n\n'
        '[[tenants]]\nname = "globex"\napi_keys = ["k2"]\n\n'
        '  [[tenants]]\nname = "acme"\napi_keys = ["k3"]\ntokens_per_second = 5000\n'
    )
    with pytest.raises(TenantConfigError) as bad:
        load_tenants(path)
    assert str(bad.value) == (
        f"{path}: tenants[2] (line 11): tenant 'acme' is already defined by tenants[0] (line 2); give each "
        "tenant one entry and list all its keys there"
    )


def test_the_tenants_file_and_the_key_flag_agree_on_each_tenant(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text('[[tenants]]\nname = "acme"\napi_keys = ["k1"]\ntokens_per_second = 100\n')
    from_file = load_tenants(path)
    with pytest.raises(TenantConfigError, match="tenant 'acme' is given by both"):
        from_file.merged(parse_key_pairs("k2=acme"))
    another_tenants_key = r"an API key of tenant 'globex' \(--api-keys\) is tenant 'acme'"
    with pytest.raises(TenantConfigError, match=another_tenants_key):
        from_file.merged(parse_key_pairs("k1=globex"))
    plain = ApiKeys.from_pairs([("k1", "globex")]).merged(parse_key_pairs("k2=globex"))
    assert plain.authenticate("Bearer k2").name == "globex" and len(plain) == 2


def test_key_pairs_flag_form() -> None:
    keys = parse_key_pairs("k1=acme, k2=globex")
    assert keys.authenticate("Bearer k2").name == "globex"
    with pytest.raises(TenantConfigError):
        parse_key_pairs("k1")


def test_cost_policies_always_and_never() -> None:
    slow_link = RateInputs(
        prefill_tokens_per_second=1e6, pull_bytes_per_second=1e6, kv_bytes_per_token=10_000
    )
    always = CostSettings(profile=PROFILE, policy="always")
    assert choose_reuse(1000, lease_seconds_left=100, rates=slow_link, settings=always).reuse is Reuse.PULL
    assert (
        choose_reuse(1000, lease_seconds_left=100, rates=slow_link, settings=SETTINGS).reuse
        is Reuse.RECOMPUTE
    )
    cheap = RateInputs(prefill_tokens_per_second=1e9, pull_bytes_per_second=1e9, kv_bytes_per_token=1)
    assert choose_reuse(1000, lease_seconds_left=100, rates=cheap, settings=always).reuse is Reuse.PULL
    # "always" still keeps the threshold and the lease rule.
    assert choose_reuse(10, lease_seconds_left=100, rates=cheap, settings=always).reuse is Reuse.RECOMPUTE
    assert choose_reuse(1000, lease_seconds_left=0.5, rates=cheap, settings=always).reuse is Reuse.RECOMPUTE
    never = CostSettings(profile=PROFILE, policy="never")
    assert choose_reuse(1000, lease_seconds_left=100, rates=cheap, settings=never).reuse is Reuse.RECOMPUTE


def test_cost_uses_the_calibrated_curves_quadratic_prefill_and_fragmented_pulls() -> None:
    from kvferry.router.calibration import GPU_PROFILES

    calibrated = CostSettings(profile=GPU_PROFILES["qwen3-8b"], kv_recompute_threshold=64)
    unknown_rates = RateInputs(0.0, 0.0, 0)
    long_prefix = choose_reuse(24_576, lease_seconds_left=100, rates=unknown_rates, settings=calibrated)
    # Quadratic attention: recomputing 24k tokens costs more than 24x one thousand tokens.
    short_prefix = choose_reuse(1_024, lease_seconds_left=100, rates=unknown_rates, settings=calibrated)
    assert long_prefix.estimated_recompute_seconds > 24 * short_prefix.estimated_recompute_seconds
    assert long_prefix.reuse is Reuse.PULL
    # The same prefix in one-block runs posts a descriptor per block per layer: slower to pull.
    scattered = RateInputs(0.0, 0.0, 0, run_blocks=1.0)
    fragmented = choose_reuse(24_576, lease_seconds_left=100, rates=scattered, settings=calibrated)
    assert fragmented.estimated_pull_seconds > 5 * long_prefix.estimated_pull_seconds
