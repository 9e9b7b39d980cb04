"""Pull the retained prefix from the decode engine, or recompute it on the prefill engine?

Pulling costs a fixed setup plus the KV bytes over the link; recomputing costs the prefix's tokens at
the prefill engine's rate. Rates come from what the engines measured themselves (EngineStats) and
fall back to a :class:`~kvferry.router.calibration.CostProfile`. Below ``kv_recompute_threshold``
tokens the engines themselves recompute, so the router does too; a lease that may end before the
pull finishes (plus a safety margin) also means recompute (rule 3 of docs/design.md).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Literal

from kvferry.router.calibration import CostProfile, pull_seconds, recompute_seconds


class Reuse(enum.Enum):
    NONE = "none"  # nothing usable retained
    PULL = "pull"  # pull the retained prefix
    RECOMPUTE = "recompute"  # a prefix matched, but recomputing it is the better (or only safe) choice


@dataclass(frozen=True)
class CostSettings:
    profile: CostProfile
    # Fewest matched tokens worth a pull (the engines' own kv_recompute_threshold).
    kv_recompute_threshold: int = 64
    # Lease time that must remain after the estimated pull, seconds.
    lease_margin_seconds: float = 2.0
    # KV bytes per token when neither the engines nor the profile know it.
    fallback_kv_bytes_per_token: int = 0
    # "cost": pull when cheaper; "always": pull whenever the threshold and the lease allow (A/B runs,
    # tests); "never": always recompute.
    policy: Literal["cost", "always", "never"] = "cost"


@dataclass(frozen=True)
class RateInputs:
    """Rates of the prefill engine that would pull or recompute (0: not measured yet)."""

    prefill_tokens_per_second: float
    transfer_bytes_per_second: float
    kv_bytes_per_token: int
    # Mean length of the runs of consecutive retained block ids (inf: one run); fragmented ids
    # make a pull post more NIXL descriptors (see docs/calibration.md).
    run_blocks: float = math.inf


@dataclass(frozen=True)
class ReuseChoice:
    reuse: Reuse
    # Tokens to pull (0 unless PULL).
    pull_tokens: int
    # Why, for logs and traces.
    reason: str
    estimated_pull_seconds: float = 0.0
    estimated_recompute_seconds: float = 0.0


def choose_reuse(
    matched_tokens: int, *, lease_seconds_left: float, rates: RateInputs, settings: CostSettings
) -> ReuseChoice:
    if matched_tokens <= 0:
        return ReuseChoice(Reuse.NONE, 0, "no retained block matches the prompt")
    if settings.policy == "never":
        return ReuseChoice(Reuse.RECOMPUTE, 0, "reuse policy is 'never'")
    if matched_tokens < settings.kv_recompute_threshold:
        return ReuseChoice(
            Reuse.RECOMPUTE,
            0,
            f"{matched_tokens} matched tokens < kv_recompute_threshold {settings.kv_recompute_threshold}",
        )
    # The calibrated profile (quadratic prefill, per-descriptor pull cost), with the rates the
    # engines measured themselves in place of the profile's linear rates.
    base = settings.profile
    profile = dataclasses.replace(
        base,
        prefill_tokens_per_second=rates.prefill_tokens_per_second or base.prefill_tokens_per_second,
        transfer_bytes_per_second=rates.transfer_bytes_per_second or base.transfer_bytes_per_second,
    )
    bytes_per_token = (
        rates.kv_bytes_per_token or profile.kv_bytes_per_token or settings.fallback_kv_bytes_per_token
    )
    recompute_s = recompute_seconds(profile, matched_tokens)
    pull_s = (
        pull_seconds(profile, matched_tokens, bytes_per_token, run_blocks=max(1.0, rates.run_blocks))
        if bytes_per_token
        # Nobody reported the KV size yet (an engine's first seconds): count the fixed cost only.
        else profile.transfer_setup_seconds
    )
    if lease_seconds_left < pull_s + settings.lease_margin_seconds:
        return ReuseChoice(
            Reuse.RECOMPUTE,
            0,
            f"lease ends in {lease_seconds_left:.2f} s, too soon for a {pull_s * 1000:.0f} ms pull",
            pull_s,
            recompute_s,
        )
    if pull_s >= recompute_s and settings.policy == "cost":
        return ReuseChoice(
            Reuse.RECOMPUTE,
            0,
            f"recompute ({recompute_s * 1000:.1f} ms) is cheaper than a pull ({pull_s * 1000:.1f} ms)",
            pull_s,
            recompute_s,
        )
    return ReuseChoice(
        Reuse.PULL,
        matched_tokens,
        f"pull ({pull_s * 1000:.1f} ms) beats recompute ({recompute_s * 1000:.1f} ms)"
        if settings.policy == "cost"
        else "reuse policy is 'always'",
        pull_s,
        recompute_s,
    )
