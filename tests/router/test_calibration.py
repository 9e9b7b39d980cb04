"""The cost model's arithmetic, and that the H200 profiles say what docs/calibration.md measured."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from kvferry.router.calibration import (
    CPU_DEFAULT,
    GPU_PROFILES,
    CostProfile,
    crossover_tokens,
    prefill_seconds,
    pull_seconds,
    pull_wins,
    recompute_seconds,
    ttft_saving_seconds,
)

from tools.gpu.model_shapes import SHAPES

LINEAR = CostProfile(
    prefill_tokens_per_second=1_000.0,
    transfer_bytes_per_second=1e8,
    transfer_setup_seconds=0.02,
    kv_bytes_per_token=10_000,
)


def test_cpu_default_is_kept_linear_for_cpu_engines() -> None:
    assert CPU_DEFAULT.prefill_tokens_per_second == 2_000.0
    assert CPU_DEFAULT.transfer_bytes_per_second == 300e6
    assert CPU_DEFAULT.transfer_setup_seconds == 0.02
    assert CPU_DEFAULT.prefill_seconds_per_token_squared == 0.0
    assert CPU_DEFAULT.transfer_seconds_per_descriptor == 0.0


@pytest.mark.parametrize("name", ["qwen3-8b", "qwen3-32b"])
def test_gpu_profiles_match_the_model_shapes(name: str) -> None:
    profile = GPU_PROFILES[name]
    shape = SHAPES[name]
    assert profile.kv_bytes_per_token == shape.kv_bytes_per_token
    assert profile.descriptors_per_block == 2 * shape.num_layers
    assert profile.block_size_tokens == 16


@pytest.mark.parametrize(
    ("name", "tokens", "measured_prefill_ms", "measured_pull_ms"),
    [
        # docs/calibration.md: full prefill (median) and contiguous NIXL pull (both runs).
        ("qwen3-8b", 2_048, 59.8, 2.1),
        ("qwen3-8b", 32_768, 1_435.3, 16.3),
        ("qwen3-32b", 2_048, 249.3, 3.4),
        ("qwen3-32b", 32_768, 5_625.9, 26.6),
    ],
)
def test_gpu_profiles_reproduce_the_measurements(
    name: str, tokens: int, measured_prefill_ms: float, measured_pull_ms: float
) -> None:
    profile = GPU_PROFILES[name]
    assert prefill_seconds(profile, tokens) * 1e3 == pytest.approx(measured_prefill_ms, rel=0.03)
    assert pull_seconds(profile, tokens) * 1e3 == pytest.approx(measured_pull_ms, rel=0.25)


def test_prefill_with_cache_plus_recompute_of_the_cache_is_the_full_prefill() -> None:
    for profile in GPU_PROFILES.values():
        for cached, new in [(0, 512), (2_048, 2_048), (30_720, 2_048)]:
            whole = prefill_seconds(profile, cached + new)
            split = prefill_seconds(profile, new, cached) + recompute_seconds(profile, cached)
            assert split == pytest.approx(whole, rel=1e-12)


def test_crossover_is_where_pull_and_recompute_cost_the_same() -> None:
    for profile in [LINEAR, *GPU_PROFILES.values()]:
        k = crossover_tokens(profile)
        assert 0 < k < math.inf
        # Equal at k, within the cost of the token that rounding k up adds.
        one_token = 1 / profile.prefill_tokens_per_second
        assert pull_seconds(profile, math.ceil(k)) == pytest.approx(
            recompute_seconds(profile, math.ceil(k)), abs=2 * one_token
        )
        assert not pull_wins(profile, math.floor(k * 0.5))
        assert pull_wins(profile, math.ceil(k * 2))


def test_linear_crossover_has_the_closed_form() -> None:
    # setup / (1/rate - bytes/bandwidth) = 0.02 / (1e-3 - 1e-4)
    assert crossover_tokens(LINEAR) == pytest.approx(0.02 / 0.0009)


def test_measured_crossovers_are_a_few_blocks() -> None:
    # Contiguous block ids: pulling wins from 40 tokens (8B) and 7 tokens (32B) on the H200s,
    # below vLLM's default kv_recompute_threshold of 64.
    assert 16 < crossover_tokens(GPU_PROFILES["qwen3-8b"]) < 64
    assert crossover_tokens(GPU_PROFILES["qwen3-32b"]) < 16


def test_fragmented_block_ids_raise_the_crossover() -> None:
    for profile in GPU_PROFILES.values():
        crossovers = [crossover_tokens(profile, run_blocks=r) for r in (math.inf, 64, 8, 2, 1)]
        assert crossovers == sorted(crossovers)
    # One descriptor per block costs the 8B shape about as much per token as recomputing it: pulling
    # only wins once attention's quadratic cost has grown.
    assert crossover_tokens(GPU_PROFILES["qwen3-8b"], run_blocks=1) > 4_000


def test_pull_never_wins_over_a_link_slower_than_prefill() -> None:
    slow_link = replace(LINEAR, transfer_bytes_per_second=1e6)
    assert crossover_tokens(slow_link) == math.inf
    assert not pull_wins(slow_link, 1_000_000)


def test_free_setup_crosses_at_zero() -> None:
    assert crossover_tokens(replace(LINEAR, transfer_setup_seconds=0.0)) == 0.0


def test_pull_seconds_counts_the_extra_descriptors_of_fragmented_runs() -> None:
    profile = GPU_PROFILES["qwen3-8b"]
    tokens = 8_192  # 512 blocks
    extra = pull_seconds(profile, tokens, run_blocks=1) - pull_seconds(profile, tokens)
    assert extra == pytest.approx(511 * 72 * profile.transfer_seconds_per_descriptor)
    runs_of_8 = pull_seconds(profile, tokens, run_blocks=8) - pull_seconds(profile, tokens)
    assert runs_of_8 == pytest.approx(63 * 72 * profile.transfer_seconds_per_descriptor)
    assert pull_seconds(profile, 0) == 0.0


def test_engine_kv_bytes_override_the_profile() -> None:
    doubled = pull_seconds(LINEAR, 1_000, kv_bytes_per_token=20_000)
    assert doubled == pytest.approx(0.02 + 1_000 * 20_000 / 1e8)


def test_unknown_kv_bytes_and_bad_arguments_are_refused() -> None:
    unknown = replace(LINEAR, kv_bytes_per_token=0)
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        pull_seconds(unknown, 100)
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        crossover_tokens(unknown)
    assert pull_seconds(unknown, 100, kv_bytes_per_token=10_000) > 0
    with pytest.raises(ValueError):
        pull_seconds(LINEAR, -1)
    with pytest.raises(ValueError):
        pull_seconds(LINEAR, 10, run_blocks=0.5)
    with pytest.raises(ValueError):
        prefill_seconds(LINEAR, 10, -1)


def test_ttft_saving_grows_with_the_reused_history() -> None:
    profile = GPU_PROFILES["qwen3-8b"]
    new = 2_048
    savings = [ttft_saving_seconds(profile, cached, new) for cached in (2_048, 6_144, 14_336, 30_720)]
    assert savings == sorted(savings)
    assert savings[0] > 0
    # Measured at 30,720 cached + 2,048 new: 1,435 ms recompute against 143 ms with the pull.
    recompute = prefill_seconds(profile, 30_720 + new)
    assert recompute / (recompute - savings[-1]) > 8
    # Below the crossover the pull's setup is a loss.
    assert ttft_saving_seconds(profile, 16, new) < 0
